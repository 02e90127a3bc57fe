"""Shuffled minibatches of a 1-D batch, shared by every algorithm of the trainer."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from tensordict import TensorDictBase


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
