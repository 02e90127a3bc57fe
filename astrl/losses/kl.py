"""Per-token KL estimates between a policy and another distribution, from the log-probs of sampled tokens."""

from __future__ import annotations

import math

import torch
from torchrl.objectives.llm import k3_kl_token_estimate

from astrl.argtypes import require

KL_TOKEN_CAP = 10.0  # default cap on one token's k3 estimate (see k3)


def checked_cap(cap: float | None) -> float | None:
    """``cap`` itself, once it is a valid per-token cap (> 0) or None; else a ValueError naming it."""
    require("kl_token_cap", cap, above=0, nullable=True)
    return cap


def k3(log_ratio: torch.Tensor, cap: float | None = None) -> torch.Tensor:
    """``exp(x) - x - 1`` for ``x = log q(a) - log p(a)``, ``a ~ p``: the k3 estimate of KL(p || q) (>= 0).

    It grows like ``exp(x)``: one token that ``p`` samples although it finds it far less likely than
    ``q`` does (``x`` = 14: q/p = 10^6) gives 10^6 and outweighs a whole batch. With ``cap``, a token's
    estimate is at most ``cap`` and passes no gradient above it (``cap`` 10 is reached at ``x`` ~ 2.6).
    The estimate itself is TorchRL's ``k3_kl_token_estimate``; the cap is astrl's.

    With ``cap``, ``x`` is first cut at ``log(1 + cap) + 2``, above which the estimate exceeds the cap
    anyway (``(1 + cap) e^2 - log(1 + cap) - 3 > cap``): the value is the same, and ``exp(x)`` stays
    finite. Uncut, a token with ``x`` above ~88 (a replayed probe's token the policy now finds
    impossible) makes ``exp(x)`` infinite, and the clamp's zero gradient times it is ``nan``.
    """
    if cap is not None:
        log_ratio = log_ratio.clamp(max=math.log1p(cap) + 2.0)
    value = k3_kl_token_estimate(log_ratio, torch.zeros_like(log_ratio))  # d = log_ratio - 0
    return value if cap is None else value.clamp(max=cap)
