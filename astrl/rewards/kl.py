"""Per-token reward with a clipped KL penalty to a frozen reference (as TorchRL's ``RolloutFromModel``).

For each response token ``t`` of a tester turn (``T`` = its last token)::

    reward_t = -kl_coef * clip(log pi(a_t) - log pi_ref(a_t), -kl_clip, kl_clip)
               + [t == T] * clip(score, -score_clip, score_clip)

Prompt tokens and the padding after EOS never count. ``kl_coef`` is constant or follows the
adaptive controller of Ziegler et al. (``torchrl.data.AdaptiveKLController``).
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torchrl.data import Composite, Unbounded
from torchrl.data.llm import AdaptiveKLController, ConstantKLController
from torchrl.data.llm.utils import KLControllerBase
from torchrl.envs import Compose

from astrl.argtypes import require
from astrl.keys import ACTOR_LOG_PROBS, REF_LOG_PROBS, RESPONSE_MASK, REWARD, REWARD_KL, REWARD_RAW
from astrl.ragged import as_rows, pad_rows, unpad
from astrl.rewards.logprobs import NestedKey, StepTransform, TokenLogProbs, _get
from astrl.rewards.reference import make_reference

REDUCTIONS = ("token", "sum")


def clipped_kl_reward(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    score: torch.Tensor,
    *,
    kl_coef: float,
    kl_clip: float,
    score_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula on right-padded ``(B, T)`` tensors; ``mask`` marks response tokens (a prefix of each row).

    Returns ``(reward, reward_kl)``, both ``(B, T)``, zero where ``mask`` is False; the clipped
    ``score`` (shape ``(B,)``) is added on each row's last response token.
    """
    log_ratio = torch.nan_to_num(log_probs - ref_log_probs, nan=0.0)
    reward_kl = torch.where(mask, -kl_coef * log_ratio.clamp(-kl_clip, kl_clip), torch.zeros_like(log_ratio))
    lengths = mask.sum(-1)
    if (lengths == 0).any():
        raise ValueError("a response has no tokens to carry its score (empty response mask)")
    last = torch.nn.functional.one_hot(lengths - 1, num_classes=mask.shape[-1]).to(reward_kl.dtype)
    reward = reward_kl + last * score.clamp(-score_clip, score_clip).reshape(-1, 1)
    return reward, reward_kl


def make_kl_controller(kl_coef: float | KLControllerBase, target_kl: float | None = None, horizon: int = 10_000):
    """A TorchRL KL controller: constant, or adaptive (Ziegler et al.) when ``target_kl`` is given."""
    if isinstance(kl_coef, KLControllerBase):
        return kl_coef
    require("kl_coef", kl_coef, at_least=0)
    if target_kl is None:
        return ConstantKLController(kl_coef=float(kl_coef))
    require("target_kl", target_kl, above=0)
    require("horizon", horizon, above=0)
    if kl_coef == 0:  # Ziegler et al.'s update is multiplicative: from 0 it stays 0 (torchrl divides by it: NaN)
        raise ValueError(
            f"target_kl ({target_kl}) needs kl_coef > 0, got kl_coef 0: the adaptive controller multiplies its "
            "start value, so from 0 it never moves"
        )
    return AdaptiveKLController(init_kl_coef=float(kl_coef), target=float(target_kl), horizon=int(horizon))


class ClippedKLReward(StepTransform):
    """Turn a per-turn score into the clipped-KL per-token reward (or its per-turn sum).

    Reads the tester's exact log-probs (``log_prob_key``), the reference's
    (``ref_log_prob_key``), the response mask and the scalar score (``score_key``, shape
    ``(B, 1)``) and writes:

    * ``reward``: per token, ragged ``(B, -1, 1)`` (``reduction="token"``), or
      ``clip(score) + sum_t reward_kl_t`` with shape ``(B, 1)`` (``reduction="sum"``);
    * ``reward_raw``: the score before clipping, ``(B, 1)``;
    * ``reward_kl``: the per-token penalty ``-kl_coef * clip(log-ratio)``, ragged ``(B, -1)``.

    Works on the env (after the score transforms) and on collected or replay-buffer data,
    including lazily stacked ragged batches. :meth:`update_kl_coef` feeds the mean per-turn
    KL seen since the last call to the controller (adaptive controllers move ``kl_coef`` toward
    ``target_kl``); the coefficient is saved in ``state_dict``.
    """

    def __init__(
        self,
        *,
        kl_coef: float | KLControllerBase = 0.1,
        kl_clip: float = 10.0,
        score_clip: float = 10.0,
        reduction: str = "token",
        target_kl: float | None = None,
        horizon: int = 10_000,
        log_prob_key: NestedKey = ACTOR_LOG_PROBS,
        ref_log_prob_key: NestedKey = REF_LOG_PROBS,
        mask_key: NestedKey = RESPONSE_MASK,
        score_key: NestedKey = REWARD,
    ) -> None:
        super().__init__()
        require("reduction", reduction, choices=REDUCTIONS)
        require("kl_clip", kl_clip, above=0)
        require("score_clip", score_clip, above=0)
        self.controller = make_kl_controller(kl_coef, target_kl, horizon)
        self.kl_clip, self.score_clip, self.reduction = float(kl_clip), float(score_clip), reduction
        self.log_prob_key, self.ref_log_prob_key = log_prob_key, ref_log_prob_key
        self.mask_key, self.score_key = mask_key, score_key
        self._kl_total, self._kl_count = 0.0, 0

    @property
    def kl_coef(self) -> float:
        return float(self.controller.coef)

    def compute(self, root: TensorDictBase, nxt: TensorDictBase) -> dict:
        lp_rows = as_rows(_get(root, nxt, self.log_prob_key))
        ref_rows = as_rows(_get(root, nxt, self.ref_log_prob_key))
        mask_rows = as_rows(_get(root, nxt, self.mask_key))
        for i, (a, b, m) in enumerate(zip(lp_rows, ref_rows, mask_rows, strict=True)):
            if not a.shape == b.shape == m.shape:
                raise ValueError(
                    f"sample {i}: log-probs {tuple(a.shape)}, reference {tuple(b.shape)}, mask {tuple(m.shape)} differ"
                )
        score = nxt.get(self.score_key).reshape(-1).float()
        if score.numel() != len(lp_rows):
            raise ValueError(
                f"{score.numel()} scores for {len(lp_rows)} responses: {self.score_key!r} must be one value per turn"
            )
        lengths = [len(r) for r in lp_rows]
        lp, ref = (pad_rows(rows, dtype=torch.float32) for rows in (lp_rows, ref_rows))
        mask = pad_rows(mask_rows, dtype=torch.bool)
        reward, reward_kl = clipped_kl_reward(
            lp, ref, mask, score, kl_coef=self.kl_coef, kl_clip=self.kl_clip, score_clip=self.score_clip
        )
        log_ratio = torch.where(mask, torch.nan_to_num(lp - ref, nan=0.0), torch.zeros_like(lp))
        self._kl_total += float(log_ratio.sum())
        self._kl_count += len(lp_rows)
        kl_rows = unpad(reward_kl, lengths)
        if self.reduction == "sum":
            total = score.clamp(-self.score_clip, self.score_clip) + reward_kl.sum(-1)
            out_reward = total.reshape(*nxt.batch_size, 1)
        else:
            out_reward = [r[:, None] for r in unpad(reward, lengths)]
        return {REWARD: out_reward, REWARD_RAW: score.reshape(*nxt.batch_size, 1), REWARD_KL: kl_rows}

    def mean_kl(self) -> float | None:
        """Mean per-turn KL estimate (sum of token log-ratios) since the last :meth:`update_kl_coef`."""
        return self._kl_total / self._kl_count if self._kl_count else None

    def update_kl_coef(self) -> float:
        """Feed the KL seen since the last call to the controller; returns the new ``kl_coef``."""
        kl, n = self.mean_kl(), self._kl_count
        self._kl_total, self._kl_count = 0.0, 0
        if kl is not None and isinstance(self.controller, AdaptiveKLController):
            # torchrl's update() takes the KL penalties (-coef * KL), one per sample
            self.controller.update([-self.kl_coef * kl] * n)
        return self.kl_coef

    def get_extra_state(self) -> dict:
        return {"kl_coef": self.kl_coef}

    def set_extra_state(self, state: dict) -> None:
        self.controller.coef = float(state["kl_coef"])

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        shape = observation_spec.shape
        observation_spec[REWARD_RAW] = Unbounded(shape=(*shape, 1))
        observation_spec[REWARD_KL] = Unbounded(shape=(*shape, -1))
        return observation_spec

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        shape = reward_spec.shape
        reward_spec[REWARD] = Unbounded(shape=(*shape, -1, 1) if self.reduction == "token" else (*shape, 1))
        return reward_spec


def kl_reward(
    tester: torch.nn.Module,
    tokenizer,
    *,
    reference: torch.nn.Module | None = None,
    max_length: int | None = None,
    **kwargs,
) -> Compose:
    """The three transforms of the clipped-KL reward, ready to append to the red-team env or a buffer:
    the tester's exact log-probs, the reference's (``make_reference(tester)`` by default, built
    now), and :class:`ClippedKLReward` (``kwargs``)."""
    reference = reference if reference is not None else make_reference(tester)
    return Compose(
        TokenLogProbs(tester, tokenizer, out_key=ACTOR_LOG_PROBS, mask_key=RESPONSE_MASK, frozen=False, max_length=max_length),
        TokenLogProbs(reference, tokenizer, out_key=REF_LOG_PROBS, mask_key=None, frozen=True, max_length=max_length),
        ClippedKLReward(**kwargs),
    )
