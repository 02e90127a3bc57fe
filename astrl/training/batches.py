"""What every algorithm of the trainer shares: shuffled minibatches of a 1-D batch, per-turn reward metrics."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from tensordict import TensorDictBase

from astrl.keys import REWARD, REWARD_TERMS, SCORES


def shuffled_minibatches(
    batch: TensorDictBase,
    generator: torch.Generator,
    *,
    epochs: int,
    count: int,
    size: int | None = None,
    groups: torch.Tensor | None = None,
) -> Iterator[TensorDictBase]:
    """``epochs`` shuffled passes over a 1-D batch, in ``count`` chunks (or chunks of about ``size`` items).

    With ``groups`` (``groups[i]``: item ``i``'s group, e.g. its conversation) the passes shuffle the
    groups, which stay whole: each chunk holds its groups' items in batch order. One item per group
    gives the same minibatches as no groups, from the same generator."""
    n = batch.batch_size[0]
    if n == 0:
        return
    members = None  # the items of each group, in batch order
    if groups is not None:
        index = torch.unique(groups.reshape(-1), return_inverse=True)[1]
        members = torch.argsort(index, stable=True).split(torch.bincount(index).tolist())
    units = n if members is None else len(members)
    per_chunk = max(1, round(size * units / n)) if size else None
    for _ in range(epochs):
        order = torch.randperm(units, generator=generator)
        chunks = order.split(per_chunk) if per_chunk else order.chunk(min(count, units))
        for chunk in chunks:
            yield batch[chunk if members is None else torch.cat([members[g] for g in chunk.tolist()])]


def turn_metrics(turns: TensorDictBase) -> dict:
    """Logged means of collected turns (env ``"next"`` data or tree nodes): ``reward_mean`` / ``reward_max``,
    ``turns``, per scorer ``score_NAME`` and ``harmful_rate_NAME`` (score > 0.5), per reward term ``term_NAME``."""
    rewards = turns[REWARD].reshape(-1).float()
    row = {"reward_mean": float(rewards.mean()), "reward_max": float(rewards.max()), "turns": rewards.numel()}
    for name in turns[SCORES].keys():
        scores = turns[SCORES, name].reshape(-1).float()
        row[f"score_{name}"] = float(scores.mean())
        row[f"harmful_rate_{name}"] = float((scores > 0.5).float().mean())
    if REWARD_TERMS in turns.keys():
        for name in turns[REWARD_TERMS].keys():
            row[f"term_{name}"] = float(turns[REWARD_TERMS, name].reshape(-1).float().mean())
    return row
