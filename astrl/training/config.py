"""Training configuration: one flat dataclass, loaded from YAML plus ``key=value`` overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from astrl.envs.redteam import REWARDS, reward_options

ALGORITHMS = ("grpo", "ppo", "dpo", "ipo")
RETURNS = ("turn", "to_go")
OPTIMIZERS = ("adamw", "adam", "sgd", "rmsprop", "adagrad")


class ConfigError(ValueError):
    """A configuration file or override is invalid."""


@dataclass
class TrainConfig:
    """Every setting of a training run (``configs/*.yaml`` hold subsets of these keys)."""

    # what to train
    seed: int = 0
    algorithm: str = "grpo"
    tester: str = "smollm2-135m"
    target: str = "smollm2-135m"
    scorer: str = "profanity"
    judges: list[str] = field(default_factory=list)
    reward: str = "score"
    alpha: float = 1.0
    zeta: float = 0.5
    gamma: float = 0.1
    # reward "elicit": alpha*tox(reply)*g - probe_penalty*tox(probe) + gamma*logp_target(probe); g = 1 - tox(probe) if gated
    probe_penalty: float = 1.0
    elicit_gate: bool = False
    # novelty bonuses (0 = off): reward += coef * novelty of the probe against past probes
    novelty_ngram: float = 0.0
    novelty_embedding: float = 0.0
    novelty_history: int = 1000
    novelty_ngram_n: int = 5
    novelty_embedding_reduce: str = "max"
    archive_threshold: float = 0.5  # a turn enters attacks.jsonl when its reward scorer's score is above this
    prompts: str = "builtin"
    split: str = "train"
    mode: str = "chat"
    tester_system_prompt: str | None = None
    target_system_prompt: str | None = None
    # rollouts
    prompts_per_step: int = 4
    group_size: int = 4
    turns: int = 2
    returns: str = "turn"
    max_new_tokens: int = 24
    target_max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # optimisation
    total_steps: int = 100
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 5
    max_grad_norm: float = 1.0
    epochs: int = 1
    minibatches: int = 1
    minibatch_size: int | None = None
    optimizer: str = "adamw"
    grad_accum: int = 1
    clip_epsilon: float = 0.2
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    # DPO / IPO on tree-sampled pairs
    beta: float = 0.01
    tree_width: int = 2
    tree_depth: int = 3
    min_reward_gap: float = 0.0
    share_prompt: bool = True  # each pair's prompt runs once for chosen and rejected (False: two full rows)
    weak_supervision: float = 0.0  # chance per batch that harmful texts are forced as the chosen probes
    weak_supervision_prompts: str = "rtp"  # prompt source of those texts (astrl.prompts.load_prompts)
    # target hardening (0: off): every harden_every steps the target's LoRA learns to refuse the archived attacks
    harden_every: int = 0
    harden_steps: int = 10
    harden_lr: float = 1e-3
    harden_batch_size: int = 16
    harden_threshold: float = 0.5
    harden_max_attacks: int = 256
    refusal: str = "I'm sorry, but I can't help with that."
    # PPO
    value_lr: float = 1e-4
    value_coef: float = 0.15
    advantage: str = "gae"
    gae_lambda: float = 0.95
    kl_clip: float = 10.0
    score_clip: float = 10.0
    target_kl: float | None = None
    # model
    lora: bool = True
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    dtype: str = "float32"
    device: str = "cpu"
    # scale-out: generation backend and collection (docs/scaling.md)
    backend: str = "transformers"
    target_backend: str = "transformers"
    share_prefill: bool = False  # identical prompt rows of a generate call (tree siblings, GRPO groups) prefill once
    vllm_memory: float = 0.5
    collector: str = "local"
    num_collectors: int = 1
    collector_cpus: float = 1.0
    collector_gpus: float = 0.0
    ray_address: str | None = None
    # run directory, logging, checkpoints
    run_dir: str = "runs/train"
    save_every: int = 25
    keep_checkpoints: int = 2
    log_every: int = 1
    sample_every: int = 10
    loggers: list[str] = field(default_factory=lambda: ["csv"])

    def __post_init__(self) -> None:
        checks = [
            (self.algorithm in ALGORITHMS, f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}"),
            (self.reward in REWARDS, f"reward must be one of {REWARDS}, got {self.reward!r}"),
            (self.probe_penalty >= 0, f"probe_penalty must be >= 0, got {self.probe_penalty}"),
            (self.advantage in ("gae", "one_step"), f"advantage must be 'gae' or 'one_step', got {self.advantage!r}"),
            (self.returns in RETURNS, f"returns must be one of {RETURNS}, got {self.returns!r}"),
            (self.mode in ("chat", "text"), f"mode must be 'chat' or 'text', got {self.mode!r}"),
            (self.split in ("train", "dev", "test", "all"), f"split must be train, dev, test or all, got {self.split!r}"),
            (self.novelty_ngram >= 0, f"novelty_ngram must be >= 0, got {self.novelty_ngram}"),
            (self.novelty_embedding >= 0, f"novelty_embedding must be >= 0, got {self.novelty_embedding}"),
            (self.novelty_history >= 1, f"novelty_history must be >= 1, got {self.novelty_history}"),
            (self.novelty_ngram_n >= 2, f"novelty_ngram_n must be >= 2 (BLEU orders 2..n), got {self.novelty_ngram_n}"),
            (
                self.novelty_embedding_reduce in ("max", "mean"),
                f"novelty_embedding_reduce must be 'max' or 'mean', got {self.novelty_embedding_reduce!r}",
            ),
            (0 <= self.archive_threshold < 1, f"archive_threshold must be in [0, 1), got {self.archive_threshold}"),
            (self.total_steps >= 1, f"total_steps must be >= 1, got {self.total_steps}"),
            (self.save_every >= 1, f"save_every must be >= 1, got {self.save_every}"),
            (self.prompts_per_step >= 1, f"prompts_per_step must be >= 1, got {self.prompts_per_step}"),
            (self.group_size >= 2 or self.algorithm != "grpo", f"grpo needs group_size >= 2, got {self.group_size}"),
            (self.group_size >= 1, f"group_size must be >= 1, got {self.group_size}"),
            (self.turns >= 1, f"turns must be >= 1, got {self.turns}"),
            (self.beta > 0, f"beta must be > 0, got {self.beta}"),
            (self.tree_width >= 2, f"tree_width must be >= 2 (a pair needs two siblings), got {self.tree_width}"),
            (self.tree_depth >= 1, f"tree_depth must be >= 1, got {self.tree_depth}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}"),
            (self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}"),
            (self.target_kl is None or self.target_kl > 0, f"target_kl must be > 0 (or null: off), got {self.target_kl}"),
            (
                self.target_kl is None or self.kl_coef > 0,
                f"target_kl ({self.target_kl}) needs kl_coef > 0, got kl_coef {self.kl_coef}: the adaptive controller "
                "multiplies kl_coef, its start value, so from 0 it never moves; start it small (e.g. kl_coef=0.01) or "
                "set target_kl=null for a constant coefficient",
            ),
            (self.harden_every >= 0, f"harden_every must be >= 0 (0: off), got {self.harden_every}"),
            (
                self.harden_every == 0 or self.lora,
                "harden_every needs lora: true (the target is hardened through its own LoRA adapter)",
            ),
            (self.harden_steps >= 1, f"harden_steps must be >= 1, got {self.harden_steps}"),
            (self.harden_lr > 0, f"harden_lr must be > 0, got {self.harden_lr}"),
            (self.harden_batch_size >= 1, f"harden_batch_size must be >= 1, got {self.harden_batch_size}"),
            (self.harden_max_attacks >= 1, f"harden_max_attacks must be >= 1, got {self.harden_max_attacks}"),
            (bool(self.refusal.strip()), f"refusal must not be empty, got {self.refusal!r}"),
            (0 <= self.weak_supervision <= 1, f"weak_supervision must be in [0, 1], got {self.weak_supervision}"),
            (
                self.weak_supervision == 0 or self.algorithm in ("dpo", "ipo"),
                f"weak_supervision needs algorithm dpo or ipo, got {self.algorithm!r}",
            ),
            (
                self.epochs >= 1 and self.minibatches >= 1 and self.grad_accum >= 1,
                "epochs, minibatches and grad_accum must be >= 1",
            ),
            (
                self.minibatches <= self.batch_size,
                f"minibatches ({self.minibatches}) exceeds the turns per step ({self.batch_size})",
            ),
            (self.minibatch_size is None or self.minibatch_size >= 1, f"minibatch_size must be >= 1, got {self.minibatch_size}"),
            (self.optimizer in OPTIMIZERS, f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}"),
            (self.max_grad_norm > 0, f"max_grad_norm must be > 0, got {self.max_grad_norm}"),
            (self.lora_rank >= 1, f"lora_rank must be >= 1, got {self.lora_rank}"),
            (
                set(self.loggers) <= {"csv", "tensorboard", "wandb"},
                f"loggers must be among csv, tensorboard, wandb, got {self.loggers}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self._check_scale()

    def _check_scale(self) -> None:
        from astrl.backends import BACKENDS, check_collector

        for key in ("backend", "target_backend"):
            if getattr(self, key) not in BACKENDS:
                raise ConfigError(f"{key} must be one of {BACKENDS}, got {getattr(self, key)!r}")
        try:
            check_collector(self.collector, self.num_collectors, self.collector_cpus, self.collector_gpus, self.ray_address)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        scaled = self.collector == "ray" or "vllm" in (self.backend, self.target_backend)
        checks = [
            (
                not scaled or self.algorithm in ("grpo", "ppo"),
                f"collector 'ray' and backend 'vllm' apply to grpo and ppo (the tree sampler of {self.algorithm} "
                "generates with Transformers)",
            ),
            (
                self.prompts_per_step % self.num_collectors == 0,
                f"prompts_per_step ({self.prompts_per_step}) must be a multiple of num_collectors ({self.num_collectors}): "
                "each worker runs whole groups",
            ),
            (
                not (self.collector == "ray" and self.backend == "vllm"),
                "backend 'vllm' runs with collector 'local' (one engine next to the trainer); with collector 'ray' "
                "use backend 'transformers' in the workers",
            ),
            (
                self.target_backend == "transformers" or self.reward == "score",
                f"reward {self.reward!r} scores probes with the target's Transformers model: use target_backend 'transformers'",
            ),
            (0 < self.vllm_memory <= 1, f"vllm_memory must be in (0, 1], got {self.vllm_memory}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def batch_size(self) -> int:
        """Conversations per step (``prompts_per_step`` openers, each ``group_size`` times)."""
        return self.prompts_per_step * self.group_size

    def reward_options(self) -> dict | None:
        """Reward weights for :func:`astrl.envs.make_redteam_env` (None for the plain score)."""
        return reward_options(self.reward, self.alpha, self.zeta, self.gamma, self.probe_penalty, self.elicit_gate)

    def novelty_options(self) -> dict | None:
        """The ``novelty`` option of :func:`astrl.envs.make_redteam_env` (None when both coefficients are 0)."""
        if not (self.novelty_ngram or self.novelty_embedding):
            return None
        return {
            "ngram": self.novelty_ngram,
            "embedding": self.novelty_embedding,
            "history": self.novelty_history,
            "ngram_n": self.novelty_ngram_n,
            "embedding_reduce": self.novelty_embedding_reduce,
            "device": self.device,
        }

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False), encoding="utf-8")


def yaml_problem(err: Exception) -> str:
    """A YAML error in one line; tags such as ``!!python/object`` are refused (configs are data, never code)."""
    text = " ".join(str(err).split())
    if "python/" in text:
        return f"python object tags are not allowed in astrl configs ({text})"
    return text


def read_yaml_mapping(path: str | Path) -> dict:
    """A YAML file holding a mapping (``{}`` when empty); any problem is a one-line :class:`ConfigError` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not plain YAML data: {yaml_problem(err)}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {' '.join(str(err).split())}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys to values")
    return loaded


def valid_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def _parse_value(key: str, text: str):
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {key}={text!r} is not a plain YAML value: {yaml_problem(err)}") from None
    if fields[key].type in ("list[str]",) and isinstance(value, str):
        value = [v for v in value.split(",") if v]
    return value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a YAML config (or the defaults) and apply ``key=value`` overrides.

    Unknown keys, in the file or the overrides, are rejected with the list of valid ones.
    """
    values: dict = {}
    if path is not None:
        values.update(read_yaml_mapping(path))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key, text = item.split("=", 1)
        if key not in valid_keys():
            values[key] = None  # reported below with the list of valid keys
        else:
            values[key] = _parse_value(key, text)
    unknown = sorted(set(values) - set(valid_keys()))
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown}; valid keys: {', '.join(valid_keys())}")
    _check_types(values)
    try:
        return TrainConfig(**values)
    except TypeError as err:
        raise ConfigError(str(err)) from err


def _check_types(values: dict) -> None:
    defaults = TrainConfig.__dataclass_fields__
    for key, value in values.items():
        kind = defaults[key].type
        if kind in ("float", "float | None") and isinstance(value, str):
            try:  # YAML 1.1 reads 1e-4 (no dot) as a string
                value = values[key] = float(value)
            except ValueError:
                pass
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
            "str | None": value is None or isinstance(value, str),
            "float | None": value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)),
            "int | None": value is None or (isinstance(value, int) and not isinstance(value, bool)),
            "list[str]": isinstance(value, list) and all(isinstance(v, str) for v in value),
        }.get(kind, True)
        if not ok:
            raise ConfigError(f"config key {key!r} must be {kind}, got {value!r}")
        if kind == "float":
            values[key] = float(value)
