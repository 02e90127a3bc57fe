"""Ragged rows: per-sample 1-D tensors of different lengths, and the padded batches made of them.

Token ids, log-probs, masks and rewards of a batch of tester turns have one value per token, so
their rows differ in length. TensorDicts hold them as lists, strided nested tensors or padded
``(B, T)`` tensors; the models and the losses read them right-padded (absolute positions stay
right) or, where TorchRL expects it, left-padded. These helpers convert between the forms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from astrl._compat import as_list
from astrl.argtypes import require

SIDES = ("right", "left")


def as_rows(value) -> list[torch.Tensor]:
    """A list of 1-D tensors from a padded tensor (every leading dimension flattened), a nested tensor or a list."""
    if isinstance(value, torch.Tensor) and not value.is_nested:
        return list(value.reshape(-1, value.shape[-1]).unbind(0)) if value.ndim > 1 else [value]
    return [torch.as_tensor(v) for v in (value.unbind(0) if isinstance(value, torch.Tensor) else as_list(value))]


def sample_rows(value, key, batch: int) -> list[torch.Tensor]:
    """Exactly one 1-D tensor per sample of a batch of ``batch``, read strictly (errors name ``key``).

    Takes a padded ``(B, T)`` / ``(B, T, 1)`` tensor, a ``(B,)`` tensor (one value per sample), a
    nested tensor or a list. A trailing feature dimension of size 1 (TorchRL's reward convention)
    is dropped and a scalar row becomes a row of one value.
    """
    if isinstance(value, torch.Tensor) and not value.is_nested:
        if value.ndim == 3 and value.shape[-1] == 1:
            value = value.squeeze(-1)
        if value.ndim == 1:
            value = value[:, None]
        if value.ndim != 2:
            raise ValueError(f"{key!r}: expected a (batch, tokens) tensor, got shape {tuple(value.shape)}")
        rows = list(value.unbind(0))
    else:
        rows = list(value.unbind(0)) if isinstance(value, torch.Tensor) else [torch.as_tensor(v) for v in value]
        rows = [r.squeeze(-1) if r.ndim == 2 and r.shape[-1] == 1 else r.reshape(1) if r.ndim == 0 else r for r in rows]
    if len(rows) != batch:
        raise ValueError(f"{key!r} has {len(rows)} rows for a batch of {batch}")
    for i, r in enumerate(rows):
        if r.ndim != 1:
            raise ValueError(f"{key!r}: sample {i} has shape {tuple(r.shape)}, expected one value per token")
    return rows


def nested(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Ragged rows as a strided nested tensor (how TorchRL's LLM transforms store per-token data)."""
    return torch.nested.as_nested_tensor(list(rows), layout=torch.strided)


def pad_rows(
    rows: Sequence[torch.Tensor],
    *,
    value: float = 0,
    side: str = "right",
    width: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``(B, width)`` from ragged rows, filled with ``value``: the rows start at column 0 (``side="right"``
    padding) or end at the last column (``"left"``). ``width`` defaults to the longest row; gradients
    flow to the rows."""
    require("side", side, choices=SIDES)
    rows = [r if dtype is None else r.to(dtype) for r in rows]
    out = pad_sequence(rows, batch_first=True, padding_value=value, padding_side=side)
    if width is not None and width > out.shape[1]:
        extra = (0, width - out.shape[1]) if side == "right" else (width - out.shape[1], 0)
        out = torch.nn.functional.pad(out, extra, value=value)
    return out if device is None else out.to(device)


def pad_ids(
    rows: Sequence[torch.Tensor], pad_token_id: int, *, side: str = "right", device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded token ids and their attention mask (``1`` on the rows' tokens, ``0`` on padding), as a model reads them."""
    ids = pad_rows(rows, value=pad_token_id, side=side, device=device)
    mask = pad_rows([torch.ones(len(r), dtype=torch.long) for r in rows], side=side, device=device)
    return ids, mask


def unpad(padded: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """The first ``lengths[i]`` entries of each row of a right-padded ``(B, T, ...)`` tensor."""
    return [padded[i, :n] for i, n in enumerate(lengths)]
