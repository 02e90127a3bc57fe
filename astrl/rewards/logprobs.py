"""Reward-side token log-probs: :class:`TokenLogProbs`, a transform that scores the policy's response
tokens under a model, and :class:`StepTransform`, the base of astrl's data transforms.

The scoring itself is :mod:`astrl.lm_scoring` (re-exported here: ``token_logprobs``,
``shared_prefix_logprobs``, ``response_mask``, ``stop_ids``, ...); ragged rows are :mod:`astrl.ragged`.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torchrl.envs import Transform

from astrl.keys import NEXT, REF_LOG_PROBS, RESPONSE_MASK, TOKENS_PROMPT, TOKENS_RESPONSE
from astrl.lm_scoring import (
    accepts,
    logits_at,
    nested_token_logprobs,
    response_mask,
    shared_prefix_logprobs,
    stop_ids,
    token_logprobs,
)
from astrl.ragged import as_rows, nested

__all__ = [
    "NestedKey",
    "StepTransform",
    "TokenLogProbs",
    "accepts",
    "as_rows",
    "logits_at",
    "nested",
    "response_mask",
    "shared_prefix_logprobs",
    "stop_ids",
    "token_logprobs",
]

NestedKey = str | tuple[str, ...]


def _get(root: TensorDictBase, nxt: TensorDictBase, key: NestedKey):
    """A key from the step output if it is there, else from the root (the policy's output)."""
    value = nxt.get(key, None, as_list=True)
    if value is None:
        value = root.get(key, None, as_list=True)
    if value is None:
        raise KeyError(f"key {key!r} not found in the data (needed by a reward transform)")
    return value


class StepTransform(Transform):
    """Base of astrl's data transforms: the same code runs on the env and on collected data.

    Subclasses implement :meth:`compute`, which reads a 1-D batch and returns the values to
    write to the step output: a tensor with the batch as leading dimension, or a list of
    per-sample rows for ragged (per-token) values, stored as nested tensors.

    On a ``TransformedEnv`` it runs in ``step`` (reads the policy output, writes the step
    output). Called on a tensordict (a replay-buffer transform, a collector's batch) it writes to
    ``td["next"]`` when present, else into ``td`` itself. A ``(B, T)`` lazy stack of rollouts (as
    ``env.rollout`` returns) is read flat, in one batched computation, and written back to its members.
    """

    def compute(self, root: TensorDictBase, nxt: TensorDictBase) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def apply(self, root: TensorDictBase, nxt: TensorDictBase) -> TensorDictBase:
        return _write(nxt, self.compute(root, nxt))

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        return self.apply(tensordict, next_tensordict)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        if tensordict.batch_dims == 1:
            if NEXT in tensordict.keys():
                tensordict.set(NEXT, self.apply(tensordict, tensordict.get(NEXT)))
                return tensordict
            return self.apply(tensordict, tensordict)
        if tensordict.batch_dims != 2 or not _is_lazy(tensordict):
            raise ValueError(
                f"{type(self).__name__} works on a 1-D batch or a 2-D lazy stack of them, got "
                f"{type(tensordict).__name__} with batch_size {tuple(tensordict.batch_size)}; flatten it first"
            )
        flat = tensordict.reshape(-1)  # row-major: sample (i, j) is row i * T + j
        has_next = NEXT in flat.keys()
        outputs = self.compute(flat, flat.get(NEXT) if has_next else flat)
        n_rows, n_cols = tensordict.batch_size
        for k, member in enumerate(tensordict.tensordicts):
            rows = range(k * n_cols, (k + 1) * n_cols) if tensordict.stack_dim == 0 else range(k, n_rows * n_cols, n_cols)
            target = member.get(NEXT) if has_next else member
            _write(target, {key: _take(value, rows) for key, value in outputs.items()})
            if has_next:
                member.set(NEXT, target)
        return tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return tensordict_reset


def _take(value, rows: range):
    return [value[i] for i in rows] if isinstance(value, list) else value[torch.as_tensor(list(rows))]


def _write(td: TensorDictBase, outputs: dict) -> TensorDictBase:
    for key, value in outputs.items():
        td.set(key, nested(value) if isinstance(value, list) else value)
    return td


def _is_lazy(td: TensorDictBase) -> bool:
    from tensordict import LazyStackedTensorDict

    return isinstance(td, LazyStackedTensorDict)


class TokenLogProbs(StepTransform):
    """Score the policy's response tokens under a model and write their exact log-probs.

    Reads ``("tokens", "prompt")`` and ``("tokens", "response")`` (the ids the tester read and
    wrote) and writes ``out_key`` (ragged, one value per response token, ``0.0`` on tokens after
    the first EOS) and ``mask_key`` (True on the response tokens up to and including EOS).

    With ``frozen=True`` (a reference model) the forward runs under ``torch.inference_mode``;
    otherwise under ``torch.no_grad`` (behaviour log-probs for the loss's importance ratio).
    Build a reference with :func:`astrl.rewards.reference.make_reference`. ``nested=True`` reads rows
    that begin longer rows (earlier turns of a conversation) from the longer row's forward
    (:func:`astrl.lm_scoring.nested_token_logprobs`; equal up to float rounding); ``share_prefix`` reads
    a prompt that several rows begin with (a group's system prompt and opener) once
    (:func:`astrl.lm_scoring.score_tokens`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        out_key: NestedKey = REF_LOG_PROBS,
        mask_key: NestedKey | None = RESPONSE_MASK,
        prompt_key: NestedKey = TOKENS_PROMPT,
        response_key: NestedKey = TOKENS_RESPONSE,
        frozen: bool = True,
        max_length: int | None = None,
        nested: bool = False,
        share_prefix: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.nested, self.share_prefix = nested, share_prefix
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.stop_token_ids = stop_ids(tokenizer, model)
        self.out_key, self.mask_key = out_key, mask_key
        self.prompt_key, self.response_key = prompt_key, response_key
        self.frozen = frozen
        self.max_length = max_length

    def compute(self, root: TensorDictBase, nxt: TensorDictBase) -> dict:
        prompts = as_rows(_get(root, nxt, self.prompt_key))
        responses = as_rows(_get(root, nxt, self.response_key))
        masks = [response_mask(r, self.stop_token_ids) for r in responses]
        context = torch.inference_mode() if self.frozen else torch.no_grad()
        with context:
            score = nested_token_logprobs if self.nested else token_logprobs
            options = dict(pad_token_id=self.pad_token_id, max_length=self.max_length, share_prefix=self.share_prefix)
            rows = score(self.model, prompts, responses, **options)
        rows = [torch.where(m.to(r.device), r, torch.zeros_like(r)).clone().cpu() for r, m in zip(rows, masks, strict=True)]
        outputs = {self.out_key: rows}
        if self.mask_key is not None:
            outputs[self.mask_key] = masks
        return outputs
