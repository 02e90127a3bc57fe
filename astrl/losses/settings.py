"""The choices of the loss modules, apart from the modules (no torch import), so that a training
config checks its ``advantage`` key against them before any model is loaded."""

from __future__ import annotations

ADVANTAGE_MODES = ("gae", "one_step")  # compute_advantages: GAE, or r_t + V_{t+1} - V_t
KL_ESTIMATORS = ("k3", "k1")  # PPOLoss's KL penalty to the reference
