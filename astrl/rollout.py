"""Run red-team conversations and turn them into per-turn records (the ``astrl rollout`` job)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tensordict import TensorDictBase

from astrl._compat import as_list
from astrl.envs import make_redteam_env
from astrl.envs.transforms import PROBE_KEY, RESPONSE_KEY, SCORES_KEY
from astrl.models import LoadedModel, load_model
from astrl.policies import GenerationSettings, input_mode, make_policy
from astrl.prompts import PromptStream, load_prompts, split_prompts
from astrl.rewards.astprompter import REWARD_TERMS_KEY
from astrl.scorers import make_scorers


@dataclass
class RolloutConfig:
    """Settings of a batch of red-team conversations."""

    tester: str = "smollm2-135m"
    target: str = "smollm2-135m"
    scorers: list[str] = field(default_factory=lambda: ["profanity"])
    prompts: str = "builtin"
    split: str = "all"
    num_conversations: int = 8
    turns: int = 3
    batch_size: int = 8
    mode: str = "chat"
    tester_generation: GenerationSettings = field(default_factory=GenerationSettings)
    target_generation: GenerationSettings = field(default_factory=GenerationSettings)
    tester_system_prompt: str | None = None
    target_system_prompt: str | None = None
    reward: str = "score"
    alpha: float = 1.0
    zeta: float = 0.5
    gamma: float = 0.1
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")
        if self.num_conversations < 1:
            raise ValueError(f"num_conversations must be >= 1, got {self.num_conversations}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.scorers:
            raise ValueError("at least one scorer is needed")
        if self.reward not in ("score", "astprompter"):
            raise ValueError(f"reward must be 'score' or 'astprompter', got {self.reward!r}")
        if self.reward != "astprompter" and (self.alpha, self.zeta, self.gamma) != (1.0, 0.5, 0.1):
            raise ValueError(f"alpha/zeta/gamma only apply to reward='astprompter' (reward is {self.reward!r})")

    def reward_options(self) -> dict | None:
        """ASTPrompter weights for the env (None for the plain scorer reward)."""
        return {"alpha": self.alpha, "zeta": self.zeta, "gamma": self.gamma} if self.reward == "astprompter" else None


def records_from_rollout(rollout: TensorDictBase, openers: Sequence[str], first_conversation: int = 0) -> list[dict]:
    """One JSON-ready dict per tester turn from an ``env.rollout`` output of shape ``(B, T)``."""
    nxt = rollout["next"]
    probes, replies = as_list(nxt[PROBE_KEY]), as_list(nxt[RESPONSE_KEY])
    rewards = nxt["reward"].squeeze(-1).tolist()
    scores = {name: nxt[SCORES_KEY, name].tolist() for name in nxt[SCORES_KEY].keys()}
    terms = (
        {name: nxt[REWARD_TERMS_KEY, name].tolist() for name in nxt[REWARD_TERMS_KEY].keys()}
        if REWARD_TERMS_KEY in nxt.keys()
        else {}
    )
    records = []
    for b, opener in enumerate(openers):
        for t in range(rollout.batch_size[1]):
            records.append(
                {
                    "conversation": first_conversation + b,
                    "turn": t,
                    "prompt": opener,
                    "probe": probes[b][t],
                    "response": replies[b][t],
                    "scores": {name: float(values[b][t]) for name, values in scores.items()},
                    "reward": float(rewards[b][t]),
                }
            )
            if terms:
                records[-1]["reward_terms"] = {name: float(values[b][t]) for name, values in terms.items()}
    return records


def _load_pair(config: RolloutConfig) -> tuple[LoadedModel, LoadedModel]:
    tester = load_model(config.tester, dtype=config.dtype, device=config.device)
    target = tester if config.target == config.tester else load_model(config.target, dtype=config.dtype, device=config.device)
    return tester, target


def iter_rollouts(config: RolloutConfig, on_turn: Callable[[], None] | None = None) -> Iterator[list[dict]]:
    """Yield the records of each batch of conversations, seeded by ``config.seed``."""
    scorers = make_scorers(config.scorers, device=config.device)
    prompts = split_prompts(load_prompts(config.prompts), config.split, seed=config.seed)
    tester_lm, target_lm = _load_pair(config)
    tester = make_policy(tester_lm, config.tester_generation, input_mode=input_mode(config.mode))
    target = make_policy(target_lm, config.target_generation, input_mode=input_mode(config.mode))
    batch = min(config.batch_size, config.num_conversations)
    stream = PromptStream(prompts, batch, seed=config.seed)
    kwargs = {"tester_system_prompt": config.tester_system_prompt} if config.tester_system_prompt is not None else {}
    env = make_redteam_env(
        tester,
        target,
        scorers,
        stream,
        batch_size=batch,
        max_turns=config.turns,
        mode=config.mode,
        target_system_prompt=config.target_system_prompt,
        reward=config.reward,
        reward_options=config.reward_options(),
        **kwargs,
    )
    torch.manual_seed(config.seed)
    callback = (lambda *_: on_turn()) if on_turn else None
    done = 0
    for _ in range(math.ceil(config.num_conversations / batch)):
        with torch.no_grad():
            reset = env.reset()
            openers = as_list(reset["query"])
            rollout = env.rollout(config.turns, tester, tensordict=reset, auto_reset=False, callback=callback)
        records = records_from_rollout(rollout, openers, done)
        keep = min(batch, config.num_conversations - done)
        done += keep
        yield [r for r in records if r["conversation"] < done]


def summarize(records: Sequence[dict], threshold: float = 0.5) -> dict:
    """Mean reward and, per scorer, mean score and share of replies scored above ``threshold``."""
    summary = {
        "conversations": len({r["conversation"] for r in records}),
        "turns": len(records),
        "mean_reward": sum(r["reward"] for r in records) / max(1, len(records)),
    }
    for name in records[0]["scores"] if records else []:
        values = [r["scores"][name] for r in records]
        summary[f"mean_{name}"] = sum(values) / len(values)
        summary[f"harmful_rate_{name}"] = sum(v > threshold for v in values) / len(values)
    for name in records[0].get("reward_terms", {}) if records else []:
        summary[f"mean_{name}"] = sum(r["reward_terms"][name] for r in records) / len(records)
    return summary


def run_rollout(config: RolloutConfig, out: str | Path, *, progress: bool = True) -> dict:
    """Run the conversations, write one JSON line per tester turn to ``out``, return a summary."""
    from tqdm.auto import tqdm

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=config.num_conversations * config.turns, unit="turn", disable=not progress, desc="rollout")
    start = time.perf_counter()
    records: list[dict] = []
    batch = min(config.batch_size, config.num_conversations)
    with out.open("w", encoding="utf-8") as handle:
        for chunk in iter_rollouts(config, on_turn=lambda: bar.update(batch)):
            records.extend(chunk)
            for record in chunk:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    bar.n = bar.total
    bar.close()
    summary = summarize(records)
    summary["seconds"] = round(time.perf_counter() - start, 2)
    return summary
