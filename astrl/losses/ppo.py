"""PPO with a value head for a causal-LM tester (token-level actions, one tester turn = one episode).

Conventions, for a tester turn with response tokens ``a_0 .. a_T`` (``T`` = its last token,
the first EOS included; padding after it never counts):

* the state ``s_t`` is the prompt followed by ``a_<t``; ``log pi(a_t | s_t)`` and the value
  ``V(s_t)`` are both read at the position that predicts ``a_t`` (the last prompt token for
  ``t = 0``), from ONE forward of the tester with ``output_hidden_states=True``;
* the state after ``a_T`` is terminal: ``V(s_{T+1}) = 0`` (a turn's reward is credited to that
  turn only; the next tester turn of the conversation is another episode);
* every mean is a token mean over the response tokens of the whole batch:
  ``masked_mean(x) = sum(x * mask) / sum(mask)``.

Pieces: :class:`ValueHead`, :func:`compute_advantages` (GAE or one-step TD), :class:`PPOLoss`
(clipped surrogate + value loss + entropy bonus + optional KL penalty to the reference).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from tensordict import LazyStackedTensorDict, NestedKey, TensorDict, TensorDictBase
from torch import nn
from torchrl.objectives import LossModule
from torchrl.objectives.value.functional import generalized_advantage_estimate

from astrl.argtypes import require
from astrl.keys import (
    ACTOR_LOG_PROBS,
    ADVANTAGE,
    REF_LOG_PROBS,
    RESPONSE_MASK,
    REWARD,
    STATE_VALUE,
    TOKENS_PROMPT,
    TOKENS_RESPONSE,
    VALUE_TARGET,
)
from astrl.lm_scoring import score_tokens
from astrl.losses.kl import KL_TOKEN_CAP, checked_cap, k3
from astrl.losses.settings import ADVANTAGE_MODES, KL_ESTIMATORS
from astrl.ragged import nested, pad_rows, sample_rows, unpad


# -- value head ----------------------------------------------------------------------------------------
class ValueHead(nn.Module):
    """``V(s) = head(h)``: a linear layer (or a one-hidden-layer ReLU MLP when ``hidden_dim`` is set) on
    the tester's last hidden state (after the final norm, as the LM head sees it), in float32.

    The output layer starts at zero, so untrained values are 0 (the mean of normalised rewards).
    """

    def __init__(self, hidden_size: int, hidden_dim: int | None = None) -> None:
        super().__init__()
        if hidden_size <= 0 or (hidden_dim is not None and hidden_dim <= 0):
            raise ValueError(f"hidden_size and hidden_dim must be > 0, got {hidden_size} and {hidden_dim}")
        self.hidden_size = int(hidden_size)
        out = nn.Linear(hidden_dim or hidden_size, 1)
        nn.init.zeros_(out.weight)
        nn.init.zeros_(out.bias)
        self.net = out if hidden_dim is None else nn.Sequential(nn.Linear(hidden_size, hidden_dim), nn.ReLU(), out)

    @classmethod
    def for_model(cls, model: nn.Module, hidden_dim: int | None = None) -> ValueHead:
        """A head sized for ``model`` (HF causal LM or PEFT model), on its device."""
        lm_head = model.get_output_embeddings()
        hidden_size = getattr(lm_head, "in_features", None) or model.config.hidden_size
        return cls(hidden_size, hidden_dim).to(next(model.parameters()).device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., hidden_size)`` hidden states -> ``(...)`` float32 values."""
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"the value head expects hidden states of size {self.hidden_size}, got {hidden.shape[-1]}")
        return self.net(hidden.float()).squeeze(-1)


# -- reading ragged per-sample data ------------------------------------------------------------------------
def _get(td: TensorDictBase, key: NestedKey, purpose: str):
    value = td.get(key, None, as_list=True)
    if value is None:
        raise KeyError(f"key {key!r} not found in the data ({purpose})")
    return value


def _check_lengths(rows: Sequence[torch.Tensor], lengths: Sequence[int], key: NestedKey, ref: NestedKey) -> None:
    for i, (r, n) in enumerate(zip(rows, lengths, strict=True)):
        if r.numel() != n:
            raise ValueError(f"{key!r}: sample {i} has {r.numel()} values but {ref!r} has {n} tokens")


def _batch_size(td: TensorDictBase) -> int:
    if td.batch_dims != 1:
        raise ValueError(
            f"PPO expects a 1-D batch of tester turns, got batch_size {tuple(td.batch_size)}; flatten it with td.reshape(-1)"
        )
    return td.batch_size[0]


def _write(td: TensorDictBase, key: NestedKey, padded: torch.Tensor, lengths: Sequence[int]) -> None:
    """Per-token values as ``(B, T)`` when every row has the same length (and ``td`` is not a lazy
    stack), else as a ragged nested tensor (one row per sample, as the reward transforms store them)."""
    rows = [r.detach().cpu() for r in unpad(padded, lengths)]
    if len(set(lengths)) == 1 and not isinstance(td, LazyStackedTensorDict):
        td.set(key, torch.stack(rows))
    else:
        td.set(key, nested(rows))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(x * mask) / sum(mask)``; masked-out entries may hold anything (``nan`` included)."""
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1)


def _prefix_mask(mask: torch.Tensor, key: NestedKey) -> torch.Tensor:
    """Check that each row of ``mask`` is a non-empty prefix (tokens up to EOS); return row lengths."""
    n = mask.sum(-1)
    if (n == 0).any():
        raise ValueError(f"{key!r}: sample {int((n == 0).nonzero()[0])} has no response token")
    prefix = torch.arange(mask.shape[-1], device=mask.device) < n[:, None]
    if not torch.equal(prefix, mask):
        bad = int((prefix != mask).any(-1).nonzero()[0])
        raise ValueError(f"{key!r}: sample {bad} is not a prefix mask (True up to the first EOS, then False)")
    return n


# -- advantages --------------------------------------------------------------------------------------------
def per_token_rewards(reward_rows: Sequence[torch.Tensor], mask: torch.Tensor, key: NestedKey = REWARD) -> torch.Tensor:
    """``(B, T)`` rewards (zeros off the mask) from per-token rows, one per response token, or from one
    score per turn, put on the turn's last response token (as ``ClippedKLReward`` does)."""
    batch, width = mask.shape
    lengths = mask.sum(-1)
    if all(r.numel() == 1 for r in reward_rows):  # one score per turn (or one-token responses: the same thing)
        score = torch.stack([r.reshape(()) for r in reward_rows]).to(mask.device).float()
        reward = torch.zeros(batch, width, device=mask.device)
        reward[torch.arange(batch, device=mask.device), lengths - 1] = score
    else:
        reward = pad_rows(reward_rows, width=width, dtype=torch.float32, device=mask.device)
    reward = torch.where(mask, reward, torch.zeros_like(reward))
    if not torch.isfinite(reward).all():
        raise ValueError(f"{key!r} holds non-finite values on response tokens")
    return reward


def normalize_turn_returns(reward: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Whiten the per-turn returns ``R_i = sum_t r_{i,t}`` over the batch, keeping the per-token shape:
    every reward is divided by ``std(R) + eps`` and ``mean(R) / (std(R) + eps)`` is taken off each
    turn's last token, so the new returns are ``(R_i - mean(R)) / (std(R) + eps)``. A batch of one, or
    of equal returns, is only centred."""
    returns = reward.sum(-1)
    std = returns.std() if returns.numel() > 1 else torch.zeros((), device=reward.device)
    scale = 1.0 / (std + eps) if std > 0 else torch.ones((), device=reward.device)
    last = torch.nn.functional.one_hot(mask.sum(-1) - 1, num_classes=mask.shape[-1]).to(reward.dtype)
    return (reward - last * returns.mean()) * scale


def compute_advantages(
    td: TensorDictBase,
    critic: PPOLoss | None = None,
    *,
    mode: str = "gae",
    gamma: float = 1.0,
    lmbda: float = 0.95,
    normalize_rewards: bool = True,
    normalize_advantages: bool = False,
    eps: float = 1e-6,
    keys: Mapping[str, NestedKey] | None = None,
) -> TensorDictBase:
    """Write ``state_value`` (old values, no grad), ``advantage`` and ``value_target`` per response token.

    With ``V_t = V(s_t)`` and ``V_{T+1} = 0`` (each turn is an episode; zeros on padding)::

        delta_t   = r_t + gamma * V_{t+1} - V_t
        one_step:   A_t = delta_t                                   (the TD error: r_t + V_{t+1} - V_t at gamma = 1)
        gae:        A_t = delta_t + gamma * lmbda * A_{t+1}         (torchrl's generalized_advantage_estimate)
        value_target_t = A_t + V_t

    Args:
        td: 1-D batch of tester turns (lazily stacked / ragged is fine) with the response mask and
            ``reward`` (per token ``(B, T[, 1])`` from ``ClippedKLReward(reduction="token")``, or one
            score per turn ``(B, 1)``, put on the last response token).
        critic: a :class:`PPOLoss`: its tester + value head compute the old values in one no-grad
            forward (and its ``tensor_keys`` name the entries). Without it, ``state_value`` must be in ``td``.
        normalize_rewards: whiten the per-turn returns over the batch (:func:`normalize_turn_returns`).
        normalize_advantages: whiten the advantages over the batch's response tokens (after ``value_target``).
        keys: overrides of the entry names, with the field names of ``PPOLoss._AcceptedKeys``.
    """
    require("mode", mode, choices=ADVANTAGE_MODES)
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lmbda <= 1.0:
        raise ValueError(f"gamma and lmbda must lie in [0, 1], got {gamma} and {lmbda}")
    k = _advantage_keys(critic, keys)
    batch = _batch_size(td)
    mask_rows = [r.bool() for r in sample_rows(_get(td, k.response_mask, "the response mask"), k.response_mask, batch)]
    lengths = [r.numel() for r in mask_rows]
    width = max(lengths)
    values = _old_values(td, critic, k, mask_rows, batch)
    device = values.device
    mask = pad_rows(mask_rows, width=width, dtype=torch.bool, device=device)
    _prefix_mask(mask, k.response_mask)
    reward_rows = sample_rows(_get(td, k.reward, "the reward"), k.reward, batch)
    if not all(r.numel() == 1 for r in reward_rows):
        _check_lengths(reward_rows, lengths, k.reward, k.response_mask)
    reward = per_token_rewards(reward_rows, mask, k.reward)
    if normalize_rewards:
        reward = normalize_turn_returns(reward, mask, eps)
    values = torch.where(mask, values.detach().float(), torch.zeros_like(reward))
    advantage, value_target = _estimate(mode, gamma, lmbda, reward, values, mask)
    zeros = torch.zeros_like(advantage)
    advantage, value_target = torch.where(mask, advantage, zeros), torch.where(mask, value_target, zeros)
    if normalize_advantages:
        mean = masked_mean(advantage, mask)
        std = masked_mean((advantage - mean) ** 2, mask).sqrt()
        advantage = torch.where(mask, (advantage - mean) / (std + eps), zeros)
    _write(td, k.value, values, lengths)
    _write(td, k.advantage, advantage, lengths)
    _write(td, k.value_target, value_target, lengths)
    return td


def _advantage_keys(critic: PPOLoss | None, keys: Mapping[str, NestedKey] | None) -> PPOLoss._AcceptedKeys:
    """The entry names: the critic's ``tensor_keys`` (or the defaults) with ``keys`` replacing some,
    each of which must name a field of ``PPOLoss._AcceptedKeys``."""
    k = critic.tensor_keys if critic is not None else PPOLoss._AcceptedKeys()
    if keys:
        accepted = sorted(PPOLoss._AcceptedKeys.__dataclass_fields__)
        unknown = sorted(set(keys) - set(accepted))
        if unknown:
            raise ValueError(f"unknown key names {unknown}; accepted: {accepted}")
        k = dataclasses.replace(k, **keys)
    return k


def _old_values(
    td: TensorDictBase, critic: PPOLoss | None, k: PPOLoss._AcceptedKeys, mask_rows: list[torch.Tensor], batch: int
) -> torch.Tensor:
    """The old values ``(B, T)`` of ``td``'s response tokens, right-padded: the critic's (one no-grad
    forward), else ``td``'s own, checked against the response mask's row lengths."""
    lengths = [r.numel() for r in mask_rows]
    if critic is not None:
        with torch.no_grad():
            out = critic.evaluate(td, entropy=False)
        _check_lengths(mask_rows, out.lengths, k.response_mask, k.response)
        return out.values
    value_rows = sample_rows(_get(td, k.value, "old values: pass a critic to compute them"), k.value, batch)
    _check_lengths(value_rows, lengths, k.value, k.response_mask)
    device = value_rows[0].device
    return pad_rows(value_rows, width=max(lengths), dtype=torch.float32, device=device)


def _estimate(
    mode: str, gamma: float, lmbda: float, reward: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``advantage`` and ``value_target`` ``(B, T)`` by ``mode`` (the formulas of :func:`compute_advantages`);
    padding is not zeroed yet."""
    # V_{t+1}: the next position's value; 0 after each turn's last token (terminal) and on padding
    next_values = torch.nn.functional.pad(values[:, 1:], (0, 1))
    done = mask & ~torch.nn.functional.pad(mask[:, 1:], (0, 1))  # True on the last response token
    if mode == "one_step":
        advantage = reward + gamma * next_values - values
        return advantage, advantage + values
    advantage, value_target = generalized_advantage_estimate(
        gamma, lmbda, values[..., None], next_values[..., None], reward[..., None], done[..., None], done[..., None]
    )
    return advantage.squeeze(-1), value_target.squeeze(-1)


def clipped_surrogate(
    log_ratio: torch.Tensor, advantage: torch.Tensor, mask: torch.Tensor, clip_epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``-masked_mean(min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A))`` and the ratio ``exp(log_ratio)``.

    Works per token (``(B, T)`` with the response mask) and per sequence (``(B,)``, all ones)."""
    ratio = log_ratio.exp()
    surrogate = torch.min(ratio * advantage, ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon) * advantage)
    return -masked_mean(surrogate, mask), ratio


# -- one forward: log-probs, entropies and values of the response tokens ------------------------------------
@dataclass
class TokenOutputs:
    """Per-response-token outputs of one tester forward, right-padded to ``(B, T)``.

    ``valid`` marks the positions that exist (``t < len(response_i)``); the response mask is separate."""

    log_probs: torch.Tensor
    values: torch.Tensor
    entropy: torch.Tensor | None
    valid: torch.Tensor
    lengths: list[int]


class PPOLoss(LossModule):
    """Clipped PPO on the tester's response tokens, with a value head on its last hidden state.

    Per response token (``ratio_t = exp(log pi(a_t) - log pi_old(a_t))``, ``pi_old`` = the policy that
    generated the data, i.e. ``actor_log_probs``, never the reference)::

        loss_objective = -masked_mean(min(ratio_t * A_t, clip(ratio_t, 1 - eps, 1 + eps) * A_t))
        loss_critic    = value_coef * 0.5 * masked_mean((V_t - value_target_t) ** 2)
                         (with value_clip c: max of that and (V_old + clip(V_t - V_old, -c, c) - value_target_t) ** 2)
        loss_entropy   = -entropy_coef * masked_mean(H_t),  H_t = -sum_v p_v log p_v over the whole vocabulary
        loss_kl        = kl_coef * masked_mean(kl_t)   (only when kl_coef > 0)
                         k3: kl_t = min(exp(d_t) - 1 - d_t, kl_token_cap),  k1: kl_t = -d_t,
                         with d_t = log pi_ref(a_t) - log pi(a_t)

    The total loss is the sum of the ``loss_*`` entries. Detached metrics: ``clip_fraction``,
    ``approx_kl`` (k3 estimate of KL(old || new)), ``entropy``, ``value_mean``, ``explained_variance``
    (``1 - Var(target - V) / Var(target)``, ``nan`` when the targets do not vary) and ``kl_to_ref``
    (the ``kl_estimator`` mean; present when the reference log-probs are in the data).

    Args:
        model: the tester, a Hugging Face causal LM or a PEFT model. Keep dropout off (``eval()``)
            so that the first epoch's ratio is exactly 1.
        value_head: a :class:`ValueHead` (``ValueHead.for_model(model)``).
        detach_value_input: ``True`` trains the value head alone (the hidden state is detached before
            it); ``False`` (default) lets ``loss_critic`` also train the tester's trainable weights.
        max_length: clip each prompt from the left so that prompt + response fits, as ``TokenLogProbs`` does.
        kl_token_cap: the most one token's k3 term counts (default 10; None: no cap): it grows like
            ``exp(d_t)`` (:func:`astrl.losses.kl.k3`).
        share_prefix: rows whose prompts begin the same way (a group's system prompt and opener) read that
            prompt once in the forward and backward (:func:`astrl.lm_scoring.score_tokens`); the trainer sets
            it in chat mode. A conversation's earlier turns are always read inside its later ones.
    """

    @dataclass
    class _AcceptedKeys:
        """Entry names, changed with :meth:`set_keys`."""

        prompt: NestedKey = TOKENS_PROMPT
        response: NestedKey = TOKENS_RESPONSE
        response_mask: NestedKey = RESPONSE_MASK
        sample_log_prob: NestedKey = ACTOR_LOG_PROBS
        ref_log_probs: NestedKey = REF_LOG_PROBS
        reward: NestedKey = REWARD
        advantage: NestedKey = ADVANTAGE
        value_target: NestedKey = VALUE_TARGET
        value: NestedKey = STATE_VALUE

    default_keys = _AcceptedKeys

    def __init__(
        self,
        model: nn.Module,
        value_head: ValueHead,
        *,
        clip_epsilon: float = 0.2,
        value_coef: float = 0.15,
        entropy_coef: float = 0.001,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        value_clip: float | None = None,
        detach_value_input: bool = False,
        max_length: int | None = None,
        kl_token_cap: float | None = KL_TOKEN_CAP,
        share_prefix: bool = False,
    ) -> None:
        super().__init__()
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise TypeError(f"{type(model).__name__} has no output embeddings: not a causal LM")
        if not isinstance(value_head, ValueHead):
            raise TypeError(f"value_head must be a ValueHead, got {type(value_head).__name__}")
        require("clip_epsilon", clip_epsilon, above=0)
        for name, coef in (("value_coef", value_coef), ("entropy_coef", entropy_coef), ("kl_coef", kl_coef)):
            require(name, coef, at_least=0)
        require("value_clip", value_clip, above=0, nullable=True)
        require("kl_estimator", kl_estimator, choices=KL_ESTIMATORS)
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be >= 2 or None, got {max_length}")
        self.kl_token_cap = checked_cap(kl_token_cap)
        self.model, self.value_head = model, value_head
        self.clip_epsilon, self.value_coef, self.entropy_coef = float(clip_epsilon), float(value_coef), float(entropy_coef)
        self.kl_coef, self.kl_estimator, self.value_clip = float(kl_coef), kl_estimator, value_clip
        self.detach_value_input, self.max_length = detach_value_input, max_length
        self.share_prefix = share_prefix

    @property
    def functional(self) -> bool:
        return False

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        pass  # no torchrl value estimator: advantages come from compute_advantages

    @property
    def in_keys(self) -> list[NestedKey]:
        k = self.tensor_keys
        keys = [k.prompt, k.response, k.response_mask, k.sample_log_prob, k.advantage, k.value_target]
        return keys + ([k.value] if self.value_clip is not None else []) + ([k.ref_log_probs] if self.kl_coef > 0 else [])

    @property
    def out_keys(self) -> list[NestedKey]:
        losses = ["loss_objective", "loss_critic", "loss_entropy"] + (["loss_kl"] if self.kl_coef > 0 else [])
        return losses + ["clip_fraction", "approx_kl", "entropy", "value_mean", "explained_variance", "kl_to_ref"]

    def parameter_groups(self, lr_policy: float, lr_value: float) -> list[dict]:
        """AdamW groups: the tester's trainable weights (LoRA adapters for a PEFT model) and the value head."""
        head = list(self.value_head.parameters())
        head_ids = {id(p) for p in head}
        policy = [p for p in self.model.parameters() if p.requires_grad and id(p) not in head_ids]
        if not policy:
            raise ValueError("the tester has no trainable parameters (requires_grad=False everywhere)")
        return [{"params": policy, "lr": float(lr_policy)}, {"params": head, "lr": float(lr_value)}]

    # -- the forward ------------------------------------------------------------------------------------
    def _layout(self, td: TensorDictBase) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The prompt and response ids of each sample, checked: neither empty, the response within ``max_length``."""
        k = self.tensor_keys
        batch = _batch_size(td)
        prompts = [p.long() for p in sample_rows(_get(td, k.prompt, "the ids the tester read"), k.prompt, batch)]
        responses = [r.long() for r in sample_rows(_get(td, k.response, "the ids the tester generated"), k.response, batch)]
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            clipped = self.max_length is not None and p.numel() + r.numel() > self.max_length
            if clipped and r.numel() >= self.max_length:
                raise ValueError(f"{k.response!r}: sample {i} has {r.numel()} tokens, over max_length={self.max_length}")
            if p.numel() == 0:
                raise ValueError(f"{k.prompt!r}: sample {i} is empty; the first response token needs a context to be scored")
            if r.numel() == 0:
                raise ValueError(f"{k.response!r}: sample {i} is empty")
        return prompts, responses

    def evaluate(self, td: TensorDictBase, *, entropy: bool = True, entropy_grad: bool = True) -> TokenOutputs:
        """Log-probs, entropies and values of every response token, from ONE batched forward of the tester
        (:func:`astrl.lm_scoring.score_tokens` with ``nested``: a conversation's earlier turns begin its later
        ones, so they are read inside the later rows' forward; prompts clipped from the left to ``max_length``;
        with ``share_prefix``, the rows that begin with one prompt, a group's opener, read it once).

        Token ``t`` of sample ``i`` is read at the position that predicts it: the LM head and the value
        head both apply to the gathered last hidden states only, so the full-vocabulary logits exist for
        response positions alone. Gradients follow the caller's grad mode (``entropy_grad=False``
        computes the entropies without a graph)."""
        prompts, responses = self._layout(td)
        scores = score_tokens(
            self.model,
            prompts,
            responses,
            pad_token_id=getattr(self.model.config, "pad_token_id", None) or 0,
            max_length=self.max_length,
            entropy=entropy,
            entropy_grad=entropy_grad,
            hidden=True,
            nested=True,
            share_prefix=self.share_prefix,
            use_cache=False,
        )
        hidden = scores.hidden.detach() if self.detach_value_input else scores.hidden
        return TokenOutputs(scores.log_probs, self.value_head(hidden), scores.entropy, scores.valid, scores.lengths)

    def annotate(self, td: TensorDictBase, *, log_probs: bool = True) -> TensorDictBase:
        """One no-grad forward that writes the old values (``state_value``) and, with ``log_probs``, the
        behaviour log-probs (``actor_log_probs``, 0.0 after the response mask when it is present),
        saving the separate ``TokenLogProbs`` forward."""
        k = self.tensor_keys
        with torch.no_grad():
            out = self.evaluate(td, entropy=False)
        _write(td, k.value, torch.where(out.valid, out.values, torch.zeros_like(out.values)), out.lengths)
        if log_probs:
            keep = out.valid
            if td.get(k.response_mask, None, as_list=True) is not None:
                rows = sample_rows(_get(td, k.response_mask, "the response mask"), k.response_mask, len(out.lengths))
                _check_lengths(rows, out.lengths, k.response_mask, k.response)
                keep = keep & pad_rows(rows, width=keep.shape[1], dtype=torch.bool, device=keep.device)
            _write(td, k.sample_log_prob, torch.where(keep, out.log_probs, torch.zeros_like(out.log_probs)), out.lengths)
        return td

    def _token_data(self, td: TensorDictBase, key: NestedKey, purpose: str, lengths: list[int], device) -> torch.Tensor:
        rows = sample_rows(_get(td, key, purpose), key, len(lengths))
        _check_lengths(rows, lengths, key, self.tensor_keys.response)
        return pad_rows(rows, width=max(lengths), dtype=torch.float32, device=device)

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        k = self.tensor_keys
        # read and check every input before the (expensive) forward
        responses = sample_rows(_get(tensordict, k.response, "the generated ids"), k.response, _batch_size(tensordict))
        lengths = [r.numel() for r in responses]
        device = next(self.model.parameters()).device
        mask = self._token_data(tensordict, k.response_mask, "the response mask", lengths, device).bool()
        old_log_probs = self._token_data(tensordict, k.sample_log_prob, "behaviour log-probs", lengths, device)
        advantage = self._token_data(tensordict, k.advantage, "run compute_advantages first", lengths, device)
        value_target = self._token_data(tensordict, k.value_target, "run compute_advantages first", lengths, device)
        old_values = None
        if self.value_clip is not None:
            old_values = self._token_data(tensordict, k.value, "old values, needed by value_clip", lengths, device)
        ref_log_probs = None
        if self.kl_coef > 0 or tensordict.get(k.ref_log_probs, None, as_list=True) is not None:
            ref_log_probs = self._token_data(tensordict, k.ref_log_probs, "reference log-probs", lengths, device)
        if mask.sum() == 0:
            raise ValueError(f"{k.response_mask!r} selects no token in this batch")
        for key, value in ((k.sample_log_prob, old_log_probs), (k.advantage, advantage), (k.value_target, value_target)):
            if not torch.isfinite(value[mask]).all():
                raise ValueError(f"{key!r} holds non-finite values on response tokens")

        out = self.evaluate(tensordict, entropy=True, entropy_grad=self.entropy_coef > 0)
        log_probs, values = out.log_probs, out.values
        zeros = torch.zeros_like(log_probs)

        # clipped surrogate, against the OLD policy
        log_ratio = torch.where(mask, log_probs - old_log_probs, zeros)
        loss_objective, ratio = clipped_surrogate(log_ratio, advantage, mask, self.clip_epsilon)

        # value loss (optionally clipped around the old values)
        value_error = (values - value_target) ** 2
        if old_values is not None:
            clipped = old_values + (values - old_values).clamp(-self.value_clip, self.value_clip)
            value_error = torch.max(value_error, (clipped - value_target) ** 2)
        loss_critic = self.value_coef * 0.5 * masked_mean(value_error, mask)

        # entropy bonus over the full vocabulary
        entropy = masked_mean(out.entropy, mask)
        loss_entropy = -self.entropy_coef * entropy

        result = {"loss_objective": loss_objective, "loss_critic": loss_critic, "loss_entropy": loss_entropy}
        if ref_log_probs is not None:
            d = torch.where(mask, ref_log_probs - log_probs, zeros)  # log pi_ref - log pi
            kl = k3(d, self.kl_token_cap) if self.kl_estimator == "k3" else -d
            kl_to_ref = masked_mean(kl, mask)
            if self.kl_coef > 0:
                result["loss_kl"] = self.kl_coef * kl_to_ref
            result["kl_to_ref"] = kl_to_ref.detach()

        with torch.no_grad():
            target_var = masked_mean((value_target - masked_mean(value_target, mask)) ** 2, mask)
            residual = value_target - values
            residual_var = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
            explained = 1 - residual_var / target_var if target_var > 0 else torch.tensor(float("nan"), device=device)
            result.update(
                clip_fraction=masked_mean(((ratio - 1).abs() > self.clip_epsilon).float(), mask),
                approx_kl=masked_mean((ratio - 1) - log_ratio, mask),
                entropy=entropy.detach(),
                value_mean=masked_mean(values, mask),
                explained_variance=explained,
            )
        return TensorDict(result, batch_size=[])
