"""What every algorithm of the trainer shares: shuffled minibatches of a 1-D batch, per-turn reward metrics."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from tensordict import TensorDictBase

from astrl.keys import REWARD, REWARD_TERMS, SCORES


def shuffled_minibatches(
    batch: TensorDictBase, generator: torch.Generator, *, epochs: int, count: int, size: int | None = None
) -> Iterator[TensorDictBase]:
    """``epochs`` shuffled passes over a 1-D batch, in ``count`` chunks (or chunks of ``size`` items when set)."""
    n = batch.batch_size[0]
    if n == 0:
        return
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        chunks = order.split(size) if size else order.chunk(min(count, n))
        for chunk in chunks:
            yield batch[chunk]


def grouped_minibatches(
    batch: TensorDictBase,
    groups: torch.Tensor,
    generator: torch.Generator,
    *,
    epochs: int,
    count: int,
    size: int | None = None,
) -> Iterator[TensorDictBase]:
    """:func:`shuffled_minibatches` over groups of items (``groups[i]``: item ``i``'s group, e.g. its
    conversation) that stay whole: ``epochs`` shuffled passes over the groups, in ``count`` chunks (or
    chunks of about ``size`` items), each holding its groups' items in batch order. With one item per
    group, the same minibatches as :func:`shuffled_minibatches` with the same generator."""
    names, members = torch.unique(groups, return_inverse=True)
    rows = [torch.nonzero(members == g).flatten() for g in range(len(names))]
    n = len(rows)
    if n == 0:
        return
    per_chunk = max(1, round(size * n / batch.batch_size[0])) if size else None  # groups of about `size` items
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        chunks = order.split(per_chunk) if per_chunk else order.chunk(min(count, n))
        for chunk in chunks:
            yield batch[torch.cat([rows[g] for g in chunk.tolist()])]


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
