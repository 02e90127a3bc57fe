"""Reward shaping: clip, whiten per batch, or normalise with running statistics.

Rewards in astrl follow one convention: **higher is more harmful** (a more successful attack).
Shaping changes scale and offset, never the order within a batch, so that convention holds
after it. Place it after the score transforms and before :class:`~astrl.rewards.ClippedKLReward`
(which then adds the KL penalty to the shaped score).
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torchrl.data import Composite, Unbounded

from astrl.argtypes import require
from astrl.keys import REWARD, REWARD_UNSHAPED
from astrl.rewards.logprobs import NestedKey, StepTransform

NORMALIZATIONS = (None, "batch", "running")


class RewardShaping(StepTransform):
    """Shape the per-turn reward ``in_key`` (shape ``(B, 1)``) in place.

    Args:
        clip: clip to ``[-clip, clip]`` first (None = off).
        normalize: ``None`` (off), ``"batch"`` (subtract the batch mean, divide by the batch std;
            a batch of one is only centred) or ``"running"`` (use the mean and std of every reward
            seen so far, this batch included; the statistics live in ``state_dict`` for resuming).
        eps: added to the std.
        keep_raw_key: where the reward before shaping is kept (None = not kept).
    """

    def __init__(
        self,
        *,
        clip: float | None = None,
        normalize: str | None = None,
        eps: float = 1e-6,
        in_key: NestedKey = REWARD,
        keep_raw_key: NestedKey | None = REWARD_UNSHAPED,
    ) -> None:
        super().__init__()
        require("normalize", normalize, choices=NORMALIZATIONS)
        require("clip", clip, above=0, nullable=True)
        self.clip, self.normalize, self.eps = clip, normalize, eps
        self.in_key, self.keep_raw_key = in_key, keep_raw_key
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros((), dtype=torch.float64))
        self.register_buffer("m2", torch.zeros((), dtype=torch.float64))

    def _update_running(self, values: torch.Tensor) -> None:
        """Chan et al.'s parallel update of count, mean and sum of squared deviations."""
        values = values.double().reshape(-1)
        n, mean = values.numel(), values.mean()
        delta = mean - self.mean
        total = self.count + n
        self.m2 += ((values - mean) ** 2).sum() + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.count.fill_(total)

    def running_std(self) -> torch.Tensor:
        return (self.m2 / (self.count - 1)).sqrt() if self.count > 1 else torch.ones((), dtype=torch.float64)

    def shape(self, reward: torch.Tensor) -> torch.Tensor:
        """Apply the configured clip and normalisation to a reward tensor."""
        out = reward.float()
        if self.clip is not None:
            out = out.clamp(-self.clip, self.clip)
        if self.normalize == "batch":
            out = out - out.mean()
            if out.numel() > 1:
                out = out / (out.std() + self.eps)
        elif self.normalize == "running":
            self._update_running(out)
            out = ((out - self.mean) / (self.running_std() + self.eps)).float()
        return out

    def compute(self, root: TensorDictBase, nxt: TensorDictBase) -> dict:
        reward = nxt.get(self.in_key)
        outputs = {self.in_key: self.shape(reward)}
        if self.keep_raw_key is not None:
            outputs[self.keep_raw_key] = reward.clone()
        return outputs

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        if self.keep_raw_key is not None:
            observation_spec[self.keep_raw_key] = Unbounded(shape=(*observation_spec.shape, 1))
        return observation_spec
