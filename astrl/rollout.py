"""Run red-team conversations and turn them into per-turn records (the ``astrl rollout`` job)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDictBase, lazy_stack

from astrl._compat import as_list
from astrl.backends import CollectionSettings
from astrl.envs.recipe import ConversationSpec, build_conversation, preflight
from astrl.envs.settings import ConversationRuns
from astrl.keys import NEXT, PROBE, QUERY, REPLY_SCORES, REWARD, REWARD_TERMS, SCORES, TARGET_RESPONSE, TARGET_RESPONSES
from astrl.names import ModelSettings
from astrl.rewards.settings import RewardSettings

if TYPE_CHECKING:
    from astrl.distributed import WorkerSpec


@dataclass
class RolloutConfig(ModelSettings, CollectionSettings, RewardSettings, ConversationRuns):  # bases in reverse: conversation first
    """Settings of a batch of red-team conversations: the conversation settings of
    :class:`~astrl.envs.settings.ConversationRuns`, the reward settings of
    :class:`~astrl.rewards.settings.RewardSettings` (the first scorer gives the reward), the backends and
    collector of :class:`~astrl.backends.CollectionSettings`, dtype and device (:class:`~astrl.names.ModelSettings`)
    and the models."""

    tester: str = "smollm2-135m"
    target: str = "smollm2-135m"
    scorers: list[str] = field(default_factory=lambda: ["profanity"])

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_collection()
        if self.collector == "ray" and self.batch % self.num_collectors:
            raise ValueError(
                f"batch_size {self.batch} must be a multiple of "
                f"num_collectors {self.num_collectors} (each worker runs an equal share)"
            )
        if not self.scorers:
            raise ValueError("at least one scorer is needed")
        problem = self.reward_problem(strict=True)  # the reward settings' own checks (astrl.rewards.settings)
        if problem:
            raise ValueError(problem)
        if self.reward == "elicit":
            from astrl.rewards.weights import reward_weights

            reward_weights("elicit", **self.reward_options())  # the weights' own checks, before any model loads


def records_from_rollout(rollout: TensorDictBase, openers: Sequence[str], first_conversation: int = 0) -> list[dict]:
    """One JSON-ready dict per tester turn from an ``env.rollout`` output of shape ``(B, T)``."""
    nxt = rollout[NEXT]
    probes, replies = as_list(nxt[PROBE]), as_list(nxt[TARGET_RESPONSE])
    rewards = nxt[REWARD].squeeze(-1).tolist()
    scores = {name: nxt[SCORES, name].tolist() for name in nxt[SCORES].keys()}
    terms = {name: nxt[REWARD_TERMS, name].tolist() for name in nxt[REWARD_TERMS].keys()} if REWARD_TERMS in nxt.keys() else {}
    samples = as_list(nxt[TARGET_RESPONSES]) if TARGET_RESPONSES in nxt.keys() else None
    sample_scores = {name: nxt[REPLY_SCORES, name].tolist() for name in nxt[REPLY_SCORES].keys()} if samples else {}
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
            if samples:  # reply_samples > 1: every reply and its scores (the first is "response")
                records[-1]["replies"] = list(samples[b][t])
                records[-1]["reply_scores"] = {name: [float(v) for v in values[b][t]] for name, values in sample_scores.items()}
    return records


def conversation_spec(config: RolloutConfig) -> ConversationSpec:
    """The conversations of a rollout as a :class:`~astrl.envs.ConversationSpec` (one batch at a time)."""
    return ConversationSpec(
        **config.batch_settings(),
        tester=config.tester,
        target=config.target,
        scorers=list(config.scorers),
        reward=config.reward,
        reward_options=config.reward_options(),
        backend=config.backend,
        target_backend=config.target_backend,
        vllm_memory=config.vllm_memory,
        dtype=config.dtype,
        device=config.device,
    )


def worker_spec(config: RolloutConfig) -> WorkerSpec:
    """The recipe each Ray worker builds its env and policies from."""
    from astrl.distributed import WorkerSpec

    return WorkerSpec.for_collectors(conversation_spec(config), config)


def conversations(turns: TensorDictBase, num_turns: int) -> TensorDictBase:
    """Flat, conversation-contiguous turns ``(B*T,)`` -> a ``(B, T)`` stack, as ``env.rollout`` returns."""
    items = turns.unbind(0)
    if len(items) % num_turns:
        raise ValueError(f"{len(items)} turns do not split into conversations of {num_turns} turns")
    return lazy_stack([lazy_stack(list(items[i : i + num_turns])) for i in range(0, len(items), num_turns)])


def _iter_ray_rollouts(config: RolloutConfig, on_turn: Callable[[], None] | None) -> Iterator[list[dict]]:
    from astrl.distributed import RayCollectors

    batch = config.batch
    collectors = RayCollectors(
        worker_spec(config), num_cpus=config.collector_cpus, num_gpus=config.collector_gpus, ray_address=config.ray_address
    )
    try:
        done = 0
        for _ in range(math.ceil(config.num_conversations / batch)):
            rollout = conversations(collectors.next(), config.turns)
            openers = [row[0] for row in as_list(rollout[QUERY])]
            records = records_from_rollout(rollout, openers, done)
            if on_turn:
                for _ in range(config.turns):
                    on_turn()
            done += min(batch, config.num_conversations - done)
            yield [r for r in records if r["conversation"] < done]
    finally:
        collectors.shutdown()


def iter_rollouts(config: RolloutConfig, on_turn: Callable[[], None] | None = None) -> Iterator[list[dict]]:
    """Yield the records of each batch of conversations, seeded by ``config.seed``.

    With ``collector="ray"`` the batch is split over ``num_collectors`` Ray workers
    (:mod:`astrl.distributed`); the openers and the record layout are those of the local run.
    """
    if config.collector == "ray":
        preflight(conversation_spec(config))  # before Ray starts and its workers load models
        yield from _iter_ray_rollouts(config, on_turn)
        return
    conversation = build_conversation(conversation_spec(config))
    env, tester, batch = conversation.env, conversation.tester, conversation.spec.batch_size
    torch.manual_seed(config.seed)
    callback = (lambda *_: on_turn()) if on_turn else None
    done = 0
    for _ in range(math.ceil(config.num_conversations / batch)):
        with torch.no_grad():
            reset = env.reset()
            openers = as_list(reset[QUERY])
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
        if "reply_scores" in records[0]:  # over every sampled reply, not only the first
            every = [v for r in records for v in r["reply_scores"][name]]
            summary[f"harmful_rate_{name}_all_replies"] = sum(v > threshold for v in every) / len(every)
    for name in records[0].get("reward_terms", {}) if records else []:
        summary[f"mean_{name}"] = sum(r["reward_terms"][name] for r in records) / len(records)
    return summary


def run_rollout(config: RolloutConfig, out: str | Path, *, progress: bool = True) -> dict:
    """Run the conversations, write one JSON line per tester turn to ``out``, return a summary."""
    from tqdm.auto import tqdm

    preflight(conversation_spec(config))  # a bad name or prompt source fails here, before the progress bar and any model
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=config.num_conversations * config.turns, unit="turn", disable=not progress, desc="rollout")
    start = time.perf_counter()
    records: list[dict] = []
    batch = config.batch
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
