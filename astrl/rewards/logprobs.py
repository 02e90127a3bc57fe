"""Exact per-token log-probabilities of token ids under a causal LM, in one batched forward.

Everything that needs log-probs (the ASTPrompter likelihood term, the KL to the reference, the
losses) scores **token ids**, never re-tokenized text, and gets a value for every scored token,
the first one included (TorchRL's generate-time log-probs set the first one to 0.0).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable, Sequence

import torch
from tensordict import TensorDictBase
from torch.nn.utils.rnn import pad_sequence
from torchrl.envs import Transform

from astrl._compat import as_list

NestedKey = str | tuple[str, ...]

# per model: does its LM head applied to the last hidden state give its logits (no soft-capping or scaling)?
_HEAD_GIVES_LOGITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def accepts(model: torch.nn.Module, name: str) -> bool:
    """Whether the (base) model's ``forward`` takes the keyword ``name``."""
    model = getattr(model, "peft_model", model)  # AdaptersDisabled: the wrapped PEFT model's signature
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return name in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False


def logits_at(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, **forward_kwargs
) -> torch.Tensor:
    """The model's logits at ``positions`` (``(B, T)`` indices into the sequence) from one forward.

    When the LM head on the last hidden state reproduces the model's logits (checked on the first
    call for each model), only the gathered positions go through the head: full-vocabulary logits
    are never built for the prompt. Otherwise the full logits are computed and gathered.
    ``forward_kwargs`` (e.g. ``past_key_values``, ``position_ids``) go to the model's forward.
    """
    return _logits_and_output(model, ids, mask, positions, **forward_kwargs)[0]


def _logits_and_output(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, **kwargs):
    """:func:`logits_at` and the model's output (for its ``past_key_values``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    known = _HEAD_GIVES_LOGITS.get(model) if head is not None else False
    if known is False:
        out = model(input_ids=ids, attention_mask=mask, **kwargs)
        logits = out.logits
        return logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1])), out
    keep_one = known and accepts(model, "logits_to_keep")
    extra = {"logits_to_keep": 1} if keep_one else {}
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **extra, **kwargs)
    last = out.hidden_states[-1]
    logits = head(last.gather(1, positions[..., None].expand(-1, -1, last.shape[-1])))
    if known is None:
        full = out.logits.gather(1, positions[..., None].expand(-1, -1, out.logits.shape[-1]))
        _HEAD_GIVES_LOGITS[model] = torch.allclose(logits.detach().float(), full.detach().float(), rtol=1e-4, atol=1e-4)
        if not _HEAD_GIVES_LOGITS[model]:
            return full, out
    return logits, out


def token_logprobs(
    model: torch.nn.Module,
    prefixes: Sequence[torch.Tensor],
    continuations: Sequence[torch.Tensor],
    *,
    pad_token_id: int = 0,
    max_length: int | None = None,
) -> list[torch.Tensor]:
    """``log p(continuation_t | prefix, continuation_<t)`` for every continuation token.

    The batch is right-padded (so absolute position ids stay correct) and scored in one forward.
    ``max_length`` clips each prefix from the left so that prefix + continuation fits the model's
    window. A prefix may be empty only if its continuation's first token is then not scored: in
    that case the returned row starts with ``nan`` for that token.

    Returns one 1-D float tensor per sample, of the continuation's length.
    """
    if len(prefixes) != len(continuations):
        raise ValueError(f"got {len(prefixes)} prefixes but {len(continuations)} continuations")
    if not len(prefixes):
        return []
    device = next(model.parameters()).device
    rows, starts, lengths = [], [], []
    for prefix, cont in zip(prefixes, continuations, strict=True):
        prefix, cont = prefix.reshape(-1).long(), cont.reshape(-1).long()
        if max_length is not None and prefix.numel() + cont.numel() > max_length:
            if cont.numel() > max_length:
                raise ValueError(f"a continuation of {cont.numel()} tokens does not fit max_length={max_length}")
            prefix = prefix[prefix.numel() + cont.numel() - max_length :]
        rows.append(torch.cat([prefix, cont]))
        starts.append(prefix.numel())
        lengths.append(cont.numel())
    ids = pad_sequence(rows, batch_first=True, padding_value=pad_token_id).to(device)
    mask = pad_sequence([torch.ones(len(r), dtype=torch.long) for r in rows], batch_first=True).to(device)
    width = max(max(lengths), 1)
    steps = torch.arange(width, device=device)
    starts_t = torch.tensor(starts, device=device)
    # token start + t is predicted at position start + t - 1 (a token with no prefix gets nan)
    positions = (starts_t[:, None] - 1 + steps[None]).clamp(0, ids.shape[1] - 1)
    logits = logits_at(model, ids, mask, positions).float()
    targets = ids.gather(1, (starts_t[:, None] + steps[None]).clamp(max=ids.shape[1] - 1))
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    logp = torch.where((starts_t[:, None] + steps[None]) > 0, logp, torch.full_like(logp, float("nan")))
    return [logp[b, :n] for b, n in enumerate(lengths)]


def shared_prefix_logprobs(
    model: torch.nn.Module,
    prefixes: Sequence[torch.Tensor],
    continuations: Sequence[Sequence[torch.Tensor]],
    *,
    pad_token_id: int = 0,
    max_length: int | None = None,
) -> list[list[torch.Tensor]]:
    """:func:`token_logprobs` of several continuations of each prefix, the prefix run once.

    ``continuations[k][i]`` is the ``k``-th continuation of ``prefixes[i]`` (e.g. ``k = 0`` chosen,
    ``k = 1`` rejected). The prefixes go through one right-padded forward with ``use_cache=True``;
    its KV cache is repeated for the continuations, which go through a second forward at their
    true positions (``position_ids``), attending to the prefix's real tokens only. This is the same
    computation as scoring every prefix + continuation row on its own (equal up to float rounding),
    with the prefix's cost paid once instead of once per continuation; gradients flow through the
    cache into the prefix's forward. A prefix that is empty, that ``max_length`` would clip, or
    whose continuations include an empty one is scored by :func:`token_logprobs` instead.

    Returns ``out[k][i]``, a 1-D float tensor of the length of ``continuations[k][i]``.
    """
    n, groups = len(prefixes), len(continuations)
    if any(len(conts) != n for conts in continuations):
        raise ValueError(f"got {n} prefixes but continuation groups of {[len(c) for c in continuations]}")
    out: list[list[torch.Tensor | None]] = [[None] * n for _ in range(groups)]
    if not n or not groups:
        return out  # type: ignore[return-value]
    prefixes = [p.reshape(-1).long() for p in prefixes]
    conts = [[c.reshape(-1).long() for c in group] for group in continuations]
    shared, alone = [], []
    for i, prefix in enumerate(prefixes):
        longest = max(conts[k][i].numel() for k in range(groups))
        shortest = min(conts[k][i].numel() for k in range(groups))
        fits = max_length is None or prefix.numel() + longest <= max_length
        (shared if prefix.numel() and shortest and fits else alone).append(i)
    if alone:
        rows = token_logprobs(
            model,
            [prefixes[i] for i in alone for _ in range(groups)],
            [conts[k][i] for i in alone for k in range(groups)],
            pad_token_id=pad_token_id,
            max_length=max_length,
        )
        for j, (i, k) in enumerate((i, k) for i in alone for k in range(groups)):
            out[k][i] = rows[j]
    if not shared:
        return out  # type: ignore[return-value]
    device = next(model.parameters()).device
    heads = [prefixes[i] for i in shared]
    prefix_len = torch.tensor([len(p) for p in heads], device=device)
    ids = pad_sequence(heads, batch_first=True, padding_value=pad_token_id).to(device)
    mask = pad_sequence([torch.ones(len(p), dtype=torch.long) for p in heads], batch_first=True).to(device)
    # the prefix's last token predicts each continuation's first token
    first_logits, prefix_out = _logits_and_output(model, ids, mask, (prefix_len - 1)[:, None], use_cache=True)
    first = torch.log_softmax(first_logits[:, 0].float(), dim=-1)
    cache = prefix_out.past_key_values
    cache.batch_repeat_interleave(groups)  # row i * groups + k holds prefix i for its k-th continuation
    tails = [conts[k][i] for i in shared for k in range(groups)]
    lengths = torch.tensor([len(t) for t in tails], device=device)
    cont_ids = pad_sequence(tails, batch_first=True, padding_value=pad_token_id).to(device)
    cont_mask = pad_sequence([torch.ones(len(t), dtype=torch.long) for t in tails], batch_first=True).to(device)
    steps = torch.arange(cont_ids.shape[1], device=device)
    rep_len = prefix_len.repeat_interleave(groups)
    position_ids = rep_len[:, None] + steps[None]
    full_mask = torch.cat([mask.repeat_interleave(groups, dim=0), cont_mask], dim=1)
    width = max(cont_ids.shape[1] - 1, 1)  # continuation token t + 1 is predicted at its position t
    positions = torch.arange(width, device=device)[None].expand(len(tails), -1).clamp(max=cont_ids.shape[1] - 1)
    logits = logits_at(model, cont_ids, full_mask, positions, past_key_values=cache, position_ids=position_ids).float()
    targets = cont_ids.gather(1, (positions + 1).clamp(max=cont_ids.shape[1] - 1))
    rest = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    first_ids = cont_ids[:, 0].view(len(shared), groups)
    first_logp = first.gather(1, first_ids)  # (shared, groups)
    for j, i in enumerate(shared):
        for k in range(groups):
            row = j * groups + k
            n_tok = int(lengths[row])
            out[k][i] = torch.cat([first_logp[j, k : k + 1], rest[row, : n_tok - 1]])
    return out  # type: ignore[return-value]


def response_mask(tokens: torch.Tensor, stop_token_ids: Iterable[int]) -> torch.Tensor:
    """Mask of the tokens that belong to a generated response: everything up to and including
    the first stop token (EOS); what follows it is padding. Works on ``(..., T)`` id tensors."""
    stops = torch.as_tensor(sorted(set(stop_token_ids)), device=tokens.device)
    is_stop = torch.isin(tokens, stops).long()
    stops_before = torch.cumsum(is_stop, dim=-1) - is_stop
    return stops_before == 0


def stop_ids(tokenizer, model: torch.nn.Module | None = None) -> set[int]:
    """EOS ids of a tokenizer and, when given, of the model's generation config."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    generation_config = getattr(model, "generation_config", None)
    extra = getattr(generation_config, "eos_token_id", None)
    if extra is not None:
        ids |= set(extra) if isinstance(extra, (list, tuple)) else {int(extra)}
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id: cannot tell where a response ends")
    return ids


def _get(root: TensorDictBase, nxt: TensorDictBase, key: NestedKey):
    """A key from the step output if it is there, else from the root (the policy's output)."""
    value = nxt.get(key, None, as_list=True)
    if value is None:
        value = root.get(key, None, as_list=True)
    if value is None:
        raise KeyError(f"key {key!r} not found in the data (needed by a reward transform)")
    return value


def as_rows(value) -> list[torch.Tensor]:
    """A list of 1-D tensors from a padded tensor, a nested tensor or a list."""
    if isinstance(value, torch.Tensor) and not value.is_nested:
        return list(value.reshape(-1, value.shape[-1]).unbind(0)) if value.ndim > 1 else [value]
    return [torch.as_tensor(v) for v in (value.unbind(0) if isinstance(value, torch.Tensor) else as_list(value))]


def nested(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Ragged rows as a strided nested tensor (how TorchRL's LLM transforms store per-token data)."""
    return torch.nested.as_nested_tensor(list(rows), layout=torch.strided)


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
            if "next" in tensordict.keys():
                tensordict.set("next", self.apply(tensordict, tensordict.get("next")))
                return tensordict
            return self.apply(tensordict, tensordict)
        if tensordict.batch_dims != 2 or not _is_lazy(tensordict):
            raise ValueError(
                f"{type(self).__name__} works on a 1-D batch or a 2-D lazy stack of them, got "
                f"{type(tensordict).__name__} with batch_size {tuple(tensordict.batch_size)}; flatten it first"
            )
        flat = tensordict.reshape(-1)  # row-major: sample (i, j) is row i * T + j
        has_next = "next" in flat.keys()
        outputs = self.compute(flat, flat.get("next") if has_next else flat)
        n_rows, n_cols = tensordict.batch_size
        for k, member in enumerate(tensordict.tensordicts):
            rows = range(k * n_cols, (k + 1) * n_cols) if tensordict.stack_dim == 0 else range(k, n_rows * n_cols, n_cols)
            target = member.get("next") if has_next else member
            _write(target, {key: _take(value, rows) for key, value in outputs.items()})
            if has_next:
                member.set("next", target)
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
    Build a reference with :func:`astrl.rewards.reference.make_reference`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        out_key: NestedKey = "ref_log_probs",
        mask_key: NestedKey | None = "response_mask",
        prompt_key: NestedKey = ("tokens", "prompt"),
        response_key: NestedKey = ("tokens", "response"),
        frozen: bool = True,
        max_length: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model
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
            rows = token_logprobs(self.model, prompts, responses, pad_token_id=self.pad_token_id, max_length=self.max_length)
        rows = [torch.where(m.to(r.device), r, torch.zeros_like(r)).clone().cpu() for r, m in zip(rows, masks, strict=True)]
        outputs = {self.out_key: rows}
        if self.mask_key is not None:
            outputs[self.mask_key] = masks
        return outputs
