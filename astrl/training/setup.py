"""Build the models, policies and environment of a training run from its config.

With ``lora: true`` and the same base for tester and target, one copy of the base weights
serves all three roles: the tester (adapters on), the reference and the target (adapters off).
With target hardening (``harden_every > 0``) the target is its own model with its own LoRA
adapter (a second copy of the base when it shares the tester's), and ``original_target`` is that
model with its adapter off.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from astrl.envs import make_redteam_env
from astrl.envs.redteam import conversation_options
from astrl.models import LoadedModel, add_lora, load_model
from astrl.policies import GenerationSettings, input_mode, make_policy, vllm_share
from astrl.prompts import PromptStream, load_prompts, split_prompts
from astrl.rewards import make_reference
from astrl.rewards.reference import AdaptersDisabled
from astrl.scorers import make_scorers
from astrl.training.config import TrainConfig


@dataclass
class RunModels:
    """The tester (trainable), its frozen reference and the target, plus their tokenizers."""

    tester: LoadedModel
    reference: torch.nn.Module
    target: LoadedModel
    shared_base: bool
    original_target: torch.nn.Module | None = None  # the target before hardening (adapter off), with harden_every > 0


def lora_settings(config: TrainConfig) -> dict:
    """The config's LoRA settings as :func:`astrl.models.add_lora` keywords."""
    return {"rank": config.lora_rank, "alpha": config.lora_alpha, "dropout": config.lora_dropout, "targets": config.lora_targets}


def build_models(config: TrainConfig, tester_lm: LoadedModel | None = None) -> RunModels:
    """Load (or take) the tester, wrap it with LoRA, and derive the reference and the target."""
    from astrl.backends import check_backend

    check_backend(config.backend, config.device)
    check_backend(config.target_backend, config.device)
    tester_lm = tester_lm or load_model(config.tester, dtype=config.dtype, device=config.device)
    base = tester_lm.model
    same_base = config.target == config.tester
    if config.harden_every > 0 and same_base:  # a target of its own, copied before the tester's adapter goes in
        target_lm = LoadedModel(tester_lm.name, copy.deepcopy(base), tester_lm.tokenizer, tester_lm.context_window)
    elif config.harden_every > 0:
        target_lm = load_model(config.target, dtype=config.dtype, device=config.device)
    model = add_lora(base, **lora_settings(config)) if config.lora else base
    model.eval()  # no dropout: behaviour and training log-probs must agree
    tester = LoadedModel(tester_lm.name, model, tester_lm.tokenizer, tester_lm.context_window)
    reference = make_reference(model)
    if config.harden_every > 0:
        target_model = add_lora(target_lm.model, **lora_settings(config)).eval()
        target = LoadedModel(target_lm.name, target_model, target_lm.tokenizer, target_lm.context_window)
        return RunModels(tester, reference, target, shared_base=False, original_target=AdaptersDisabled(target_model))
    if same_base and config.lora:
        target = LoadedModel(tester_lm.name, AdaptersDisabled(model), tester_lm.tokenizer, tester_lm.context_window)
    elif same_base:
        target = LoadedModel(tester_lm.name, reference, tester_lm.tokenizer, tester_lm.context_window)
    else:
        target = load_model(config.target, dtype=config.dtype, device=config.device)
        target.model.requires_grad_(False)
    return RunModels(tester, reference, target, shared_base=same_base)


def generation(config: TrainConfig, target: bool = False) -> GenerationSettings:
    max_new = (config.target_max_new_tokens or config.max_new_tokens) if target else config.max_new_tokens
    return GenerationSettings(max_new, config.temperature, config.top_p, config.top_k, do_sample=True)


def build_stream(config: TrainConfig) -> PromptStream:
    prompts = split_prompts(load_prompts(config.prompts), config.split, seed=config.seed)
    return PromptStream(prompts, config.batch_size, seed=config.seed, group_size=config.group_size)


def conversation_parts(config: TrainConfig, models: RunModels) -> tuple:
    """Tester and target policies, scorers, and the conversation settings that the red-team env
    and the tree sampler share: ``(tester, target, scorers, settings)``."""
    mode, memory = input_mode(config.mode), vllm_share(config.vllm_memory, config.backend, config.target_backend)
    engine = {"vllm_memory": memory, "vllm_options": {"seed": config.seed}}  # vLLM reseeds the process at start
    tester = make_policy(models.tester, generation(config), input_mode=mode, backend=config.backend, **engine)
    target = make_policy(models.target, generation(config, target=True), input_mode=mode, backend=config.target_backend, **engine)
    scorers = make_scorers([config.scorer, *config.judges], device=config.device)
    settings = {"mode": config.mode, **conversation_options(config), "novelty": config.novelty_options(), "seed": config.seed}
    return tester, target, scorers, settings


def worker_spec(config: TrainConfig, stream_state: dict | None = None):
    """The recipe from which each Ray worker builds the env and tester policy of this run."""
    from astrl.distributed import WorkerSpec

    options = conversation_options(config)
    lora = lora_settings(config) if config.lora else None
    return WorkerSpec(
        tester=config.tester,
        target=config.target,
        scorers=[config.scorer, *config.judges],
        prompts=config.prompts,
        split=config.split,
        mode=config.mode,
        batch_size=config.batch_size,
        group_size=config.group_size,
        turns=config.turns,
        tester_generation=generation(config),
        target_generation=generation(config, target=True),
        env_options=options,
        lora=lora,
        backend=config.backend,
        target_backend=config.target_backend,
        seed=config.seed,
        dtype=config.dtype,
        device=config.device,
        threads=max(1, int(config.collector_cpus)),
        stream_state=stream_state,
        num_workers=config.num_collectors,
    )


def build_env(config: TrainConfig, models: RunModels, stream: PromptStream):
    """The red-team env and the tester policy that acts in it."""
    tester, target, scorers, settings = conversation_parts(config, models)
    env = make_redteam_env(tester, target, scorers, stream, batch_size=config.batch_size, max_turns=config.turns, **settings)
    return env, tester
