"""Scoring token ids under a causal LM: exact per-token log-probs of continuations, in one batched forward.

Everything that needs log-probs (the losses, the KL to the reference, the ASTPrompter likelihood
term, the System API) scores **token ids**, never re-tokenized text, and gets a value for every
scored token, the first one included (TorchRL's generate-time log-probs set it to 0.0).
:func:`score_tokens` is the one implementation: it runs the model over right-padded
``prefix + continuation`` rows and reads every continuation token at the position that predicts
it, optionally with the full-vocabulary entropy and the last hidden state there (a value head's
input). :func:`token_logprobs` and :func:`shared_prefix_logprobs` are built on it.

The LM head runs on the gathered positions only, so full-vocabulary logits are never built for the
prefix, when it reproduces the model's logits; this is checked once per model (a model that
soft-caps or rescales its logits, or has no output embeddings, gets the full logits, gathered).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from astrl.ragged import pad_ids, unpad

# per model: does its LM head applied to the last hidden state give its logits (no soft-capping or scaling)?
_HEAD_GIVES_LOGITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def accepts(model: torch.nn.Module, name: str) -> bool:
    """Whether the (base) model's ``forward`` takes the keyword ``name``."""
    while isinstance(getattr(model, "viewed", None), torch.nn.Module):  # AdaptersDisabled, PinnedReference
        model = model.viewed  # the signature of the model they stand for
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return name in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False


def head_gives_logits(model: torch.nn.Module) -> bool | None:
    """Whether ``model``'s LM head on gathered last hidden states reproduced its logits (``None``: not checked yet)."""
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        return False
    return _HEAD_GIVES_LOGITS.get(model)


def _record_head_check(model: torch.nn.Module, from_head: torch.Tensor, logits: torch.Tensor) -> bool:
    """Keep (and return) whether the LM head applied to the last hidden states gave the model's logits (within 1e-4)."""
    same = torch.allclose(from_head.detach().float(), logits.detach().float(), rtol=1e-4, atol=1e-4)
    _HEAD_GIVES_LOGITS[model] = same
    return same


def _gather(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x[b, positions[b, t]]`` for a ``(B, S, D)`` tensor and ``(B, T)`` positions."""
    return x.gather(1, positions[..., None].expand(-1, -1, x.shape[-1]))


def forward_at(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    *,
    hidden: bool = False,
    **forward_kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None, object]:
    """One forward: the model's logits at ``positions`` (``(B, T)`` indices into the sequence), its last
    hidden state there (with ``hidden``, else ``None`` when not computed) and the model's output.

    When the LM head on the last hidden state reproduces the model's logits, only the gathered
    positions go through the head (with ``logits_to_keep=1`` where the model takes it). The first
    call for each model checks it against the full logits (within ``1e-4``) and keeps the answer;
    otherwise the full logits are computed and gathered. ``forward_kwargs`` (e.g.
    ``past_key_values``, ``position_ids``, ``use_cache``) go to the model's forward.
    """
    known = head_gives_logits(model)
    if known is False:
        extra = {"output_hidden_states": True} if hidden else {}
        out = model(input_ids=ids, attention_mask=mask, **extra, **forward_kwargs)
        return _gather(out.logits, positions), _gather(out.hidden_states[-1], positions) if hidden else None, out
    keep_one = known and accepts(model, "logits_to_keep")
    extra = {"logits_to_keep": 1} if keep_one else {}
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **extra, **forward_kwargs)
    last = _gather(out.hidden_states[-1], positions)
    logits = model.get_output_embeddings()(last)
    if known is None:
        full = _gather(out.logits, positions)
        if not _record_head_check(model, logits, full):
            return full, last, out
    return logits, last, out


def logits_at(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, **forward_kwargs
) -> torch.Tensor:
    """The model's logits at ``positions`` from one forward (:func:`forward_at`)."""
    return forward_at(model, ids, mask, positions, **forward_kwargs)[0]


@dataclass
class TokenScores:
    """Per-continuation-token outputs of one forward, right-padded to ``(B, T)``, ``T`` the longest continuation.

    ``valid`` marks the positions that exist (``t < lengths[i]``); what lies beyond is junk.
    ``log_probs`` is ``nan`` for a first token that had no prefix to be predicted from.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    hidden: torch.Tensor | None
    valid: torch.Tensor
    lengths: list[int]

    def rows(self) -> list[torch.Tensor]:
        """The log-probs as one 1-D tensor per sample, of its continuation's length."""
        return unpad(self.log_probs, self.lengths)


def _joined(
    prefixes: Sequence[torch.Tensor], continuations: Sequence[torch.Tensor], max_length: int | None
) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """``prefix + continuation`` rows (each prefix clipped from the left to fit ``max_length``) and their two lengths."""
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
    return rows, starts, lengths


def score_tokens(
    model: torch.nn.Module,
    prefixes: Sequence[torch.Tensor],
    continuations: Sequence[torch.Tensor],
    *,
    pad_token_id: int = 0,
    max_length: int | None = None,
    entropy: bool = False,
    entropy_grad: bool = True,
    hidden: bool = False,
    share_prefix: bool = False,
    nested: bool = False,
    **forward_kwargs,
) -> TokenScores:
    """``log p(continuation_t | prefix, continuation_<t)`` of every continuation token, from one forward.

    The ``prefix + continuation`` rows are right-padded (so absolute position ids stay correct);
    token ``t`` of row ``i`` is read at position ``len(prefix_i) + t - 1``, the one that predicts
    it. ``max_length`` clips each prefix from the left so that prefix + continuation fits the
    model's window. With ``entropy``, the full-vocabulary entropy ``-sum_v p_v log p_v`` there
    (without a graph when ``entropy_grad`` is False); with ``hidden``, the last hidden state there.
    Gradients follow the caller's grad mode. ``forward_kwargs`` go to the model's forward.

    With ``share_prefix`` (and no ``forward_kwargs`` but ``use_cache``), rows whose prefixes are
    identical (a GRPO group's conversations: system prompt and opener) read that prefix once: one
    forward over each distinct prefix but its last token, whose KV cache every row of the group
    goes on from (gradients flow back through it), then one forward over the rows' tails. The
    log-probs are those of the row-by-row forward up to float rounding; when no two prefixes are
    identical, the row-by-row forward runs.

    With ``nested``, rows contained in longer rows are read from the longer row's forward, as
    :func:`nested_token_logprobs` reads them (a conversation's earlier turns inside its later ones): the
    same outputs, hidden states included, up to float rounding, from a forward over the longest rows only.
    """
    if len(prefixes) != len(continuations):
        raise ValueError(f"got {len(prefixes)} prefixes but {len(continuations)} continuations")
    if not len(prefixes):
        raise ValueError("nothing to score: no prefixes and continuations")
    if nested:
        nesting = Nesting.of(prefixes, continuations, max_length)
        options = dict(pad_token_id=pad_token_id, max_length=max_length, entropy=entropy, entropy_grad=entropy_grad)
        options.update(hidden=hidden, share_prefix=share_prefix, **forward_kwargs)
        return nesting.scores(score_tokens(model, nesting.root_prefixes(), nesting.root_continuations(), **options))
    device = next(model.parameters()).device
    rows, starts, lengths = _joined(prefixes, continuations, max_length)
    steps = torch.arange(max(max(lengths), 1), device=device)
    other_kwargs = {key: value for key, value in forward_kwargs.items() if key != "use_cache"}
    heads = _shared_heads(rows, starts) if share_prefix and not other_kwargs else None
    if heads is None:
        ids, mask = pad_ids(rows, pad_token_id, device=device)
        starts_t = torch.tensor(starts, device=device)
        # token start + t is predicted at position start + t - 1 (a token with no prefix gets nan)
        positions = (starts_t[:, None] - 1 + steps[None]).clamp(0, ids.shape[1] - 1)
        logits, last, _ = forward_at(model, ids, mask, positions, hidden=hidden, **forward_kwargs)
    else:  # each distinct head read once; the rows go on from its KV cache with their own tails
        ids, starts_t, logits, last = _tails_after_heads(model, rows, starts, heads, steps, pad_token_id, device, hidden)
    log_softmax = torch.log_softmax(logits.float(), dim=-1)  # (B, T, vocab), continuation positions only
    targets = ids.gather(1, (starts_t[:, None] + steps[None]).clamp(max=ids.shape[1] - 1))
    log_probs = log_softmax.gather(-1, targets[..., None]).squeeze(-1)
    log_probs = torch.where((starts_t[:, None] + steps[None]) > 0, log_probs, torch.full_like(log_probs, float("nan")))
    entropies = None
    if entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            entropies = -(log_softmax.exp() * log_softmax).sum(-1)
    valid = steps[None] < torch.tensor(lengths, device=device)[:, None]
    return TokenScores(log_probs, entropies, last if hidden else None, valid, lengths)


def _shared_heads(rows: Sequence[torch.Tensor], starts: Sequence[int]) -> list[int] | None:
    """For each row, the index of its head (its prefix but the last token) among the distinct heads, in
    first-seen order; None when no two rows share a head, or a prefix is shorter than two tokens."""
    if min(starts) < 2:
        return None
    index: dict[tuple[int, ...], int] = {}
    heads = [index.setdefault(tuple(row[: start - 1].tolist()), len(index)) for row, start in zip(rows, starts, strict=True)]
    return heads if len(index) < len(heads) else None


def select_cache_rows(cache, index: torch.Tensor) -> None:
    """Make row ``i`` of a KV cache's batch its row ``index[i]``, in place, as ``cache.batch_select_indices``
    does, but with ``index_select``: its backward adds a shared row's gradients in a fixed order. The
    cache's own method indexes (``keys[index]``), whose backward on CPU adds with parallel atomics once a
    layer's cache is large, so a training step's gradients (and a resumed run's numbers) differed between
    two runs in the last bits. Layers with more state than keys and values keep their own method."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None:
        cache.batch_select_indices(index)
        return
    for layer in layers:
        plain = type(layer).batch_select_indices is DynamicLayer.batch_select_indices
        if plain and isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.numel():
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        else:
            layer.batch_select_indices(index)


def _tails_after_heads(
    model: torch.nn.Module,
    rows: Sequence[torch.Tensor],
    starts: Sequence[int],
    heads: list[int],
    steps: torch.Tensor,
    pad_token_id: int,
    device: torch.device,
    hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each row's tail (its prefix's last token and its continuation) read after its head's KV cache.

    One forward over the distinct heads (right-padded), their cache gathered to the rows, one forward
    over the tails at their true positions. Returns the tails' ids (right-padded), each continuation's
    start within its tail (1), the logits at the positions predicting continuation token ``t``
    (``(B, T, vocab)``), as :func:`score_tokens` reads them, and with ``hidden`` the last hidden states there."""
    first = {}
    for row, head in enumerate(heads):
        first.setdefault(head, row)
    head_ids, head_mask = pad_ids([rows[r][: starts[r] - 1] for r in first.values()], pad_token_id, device=device)
    extra = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}
    cache = model(input_ids=head_ids, attention_mask=head_mask, use_cache=True, **extra).past_key_values
    inverse = torch.tensor(heads, device=device)
    select_cache_rows(cache, inverse)  # every row goes on from its head's cache
    ids, tail_mask = pad_ids([row[start - 1 :] for row, start in zip(rows, starts, strict=True)], pad_token_id, device=device)
    begin = torch.tensor(starts, device=device) - 1  # the tail's first position
    position_ids = begin[:, None] + torch.arange(ids.shape[1], device=device)[None]
    mask = torch.cat([head_mask[inverse], tail_mask], dim=1)
    starts_t = torch.ones(len(rows), dtype=torch.long, device=device)
    positions = (starts_t[:, None] - 1 + steps[None]).clamp(0, ids.shape[1] - 1)
    logits, last, _ = forward_at(model, ids, mask, positions, hidden=hidden, past_key_values=cache, position_ids=position_ids)
    return ids, starts_t, logits, last


def mean_logprobs(rows: Sequence[torch.Tensor], empty_value: float) -> torch.Tensor:
    """Each row's mean (per-token log-probs of one continuation), ``empty_value`` for an empty row; a float32
    CPU tensor of shape ``(len(rows),)``. Means are taken in float32 on the rows' device, the empty value
    too: in a bf16 row's dtype it would round (-7.3 -> -7.3125)."""
    means = [row.float().mean() if row.numel() else row.new_tensor(float(empty_value), dtype=torch.float32) for row in rows]
    return torch.stack(means).cpu() if means else torch.zeros(0)


def token_logprobs(
    model: torch.nn.Module,
    prefixes: Sequence[torch.Tensor],
    continuations: Sequence[torch.Tensor],
    *,
    pad_token_id: int = 0,
    max_length: int | None = None,
    share_prefix: bool = False,
    entropy: bool = False,
):
    """:func:`score_tokens`' log-probs as one 1-D float tensor per sample, of the continuation's length.

    A prefix may be empty only if its continuation's first token is then not scored: in that case
    the returned row starts with ``nan`` for that token. Rows the model has just read as a prompt
    (:class:`PromptStates`, kept by a ``TurnCache``) are read from the kept hidden states, without
    gradients, instead of running the model again. ``share_prefix``: see :func:`score_tokens`.

    With ``entropy``, returns ``(log_probs, entropies)``: also the full-vocabulary entropy at each
    continuation position, one row per sample laid out as its log-probs (the LM head runs on the
    continuation positions only, as for the log-probs; gradients follow the caller's grad mode).
    """
    if len(prefixes) != len(continuations):
        raise ValueError(f"got {len(prefixes)} prefixes but {len(continuations)} continuations")
    if not len(prefixes):
        return ([], []) if entropy else []
    out = [None] * len(prefixes) if entropy else _served_from_states(model, prefixes, continuations, max_length)
    entropies: list[torch.Tensor | None] = [None] * len(prefixes)
    missing = [i for i, row in enumerate(out) if row is None]
    if missing:
        scores = score_tokens(
            model,
            [prefixes[i] for i in missing],
            [continuations[i] for i in missing],
            pad_token_id=pad_token_id,
            max_length=max_length,
            share_prefix=share_prefix,
            entropy=entropy,
        )
        for i, row in zip(missing, scores.rows(), strict=True):
            out[i] = row
        if entropy:
            for i, row in zip(missing, unpad(scores.entropy, scores.lengths), strict=True):
                entropies[i] = row
    return (out, entropies) if entropy else out  # type: ignore[return-value]


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
    ids, mask = pad_ids(heads, pad_token_id, device=device)
    # the prefix's last token predicts each continuation's first token
    first_logits, _, prefix_out = forward_at(model, ids, mask, (prefix_len - 1)[:, None], use_cache=True)
    first = torch.log_softmax(first_logits[:, 0].float(), dim=-1)
    cache = prefix_out.past_key_values
    cache.batch_repeat_interleave(groups)  # row i * groups + k holds prefix i for its k-th continuation
    tails = [conts[k][i] for i in shared for k in range(groups)]
    lengths = torch.tensor([len(t) for t in tails], device=device)
    cont_ids, cont_mask = pad_ids(tails, pad_token_id, device=device)
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


def nest_rows(rows: Sequence[torch.Tensor], adopters: set[int]) -> tuple[list[int], list[int]]:
    """Which rows begin which: ``(roots, owner)``, ``owner[i]`` the root whose row begins with row ``i``.

    Rows are taken longest first; a row joins the first root so far (in that order) among ``adopters``
    whose row begins with it, and otherwise becomes a root itself. Roots come back in the rows' order.
    A root files every prefix of the lengths the rows have under its hash, so a row finds the roots that
    may begin with it in one lookup and is compared token by token only with those: linear in the rows,
    where comparing each row with every root is quadratic (a step of 640 conversations has about 700 roots)."""
    lengths = [len(row) for row in rows]
    flat = torch.cat([row.reshape(-1) for row in rows]).cpu() if rows else torch.zeros(0)  # one copy from a GPU
    tokens = [part.numpy() for part in flat.split(lengths)]
    sizes = sorted(set(lengths))
    filed: dict[tuple[int, int], list[int]] = {}  # (length, hash of a root's prefix of that length) -> roots
    roots: list[int] = []
    owner = [0] * len(rows)
    for i in sorted(range(len(rows)), key=lambda i: -lengths[i]):
        row = tokens[i]
        candidates = filed.get((lengths[i], hash(row.tobytes())), ())
        home = next((r for r in candidates if (tokens[r][: lengths[i]] == row).all()), None)
        if home is None:
            home = i
            roots.append(i)
            if i in adopters:
                for n in sizes:
                    if n > lengths[i]:
                        break
                    filed.setdefault((n, hash(tokens[i][:n].tobytes())), []).append(i)
        owner[i] = home
    roots.sort()  # scored in the callers' order: with nothing nested, exactly token_logprobs
    return roots, owner


@dataclass
class Nesting:
    """Rows read inside longer rows (:func:`nest_rows`): each root is scored from ``start[root]`` (the shortest
    prefix among the rows it holds), and row ``i``'s continuation is the ``span[i] = (offset, length)`` slice of
    its root's continuation."""

    rows: list[torch.Tensor]
    roots: list[int]
    owner: list[int]
    start: dict[int, int]
    span: list[tuple[int, int]]

    @classmethod
    def of(cls, prefixes: Sequence[torch.Tensor], continuations: Sequence[torch.Tensor], max_length: int | None) -> Nesting:
        if len(prefixes) != len(continuations):
            raise ValueError(f"got {len(prefixes)} prefixes but {len(continuations)} continuations")
        prefixes = [p.reshape(-1).long() for p in prefixes]
        rows = [torch.cat([p, c.reshape(-1).long()]) for p, c in zip(prefixes, continuations, strict=True)]
        whole = {i for i, row in enumerate(rows) if max_length is None or len(row) <= max_length}  # never clipped
        roots, owner = nest_rows(rows, whole)
        start = {r: min(len(prefixes[i]) for i in range(len(rows)) if owner[i] == r) for r in roots}
        span = [(len(prefixes[i]) - start[owner[i]], len(row) - len(prefixes[i])) for i, row in enumerate(rows)]
        return cls(rows, roots, owner, start, span)

    def root_prefixes(self) -> list[torch.Tensor]:
        return [self.rows[r][: self.start[r]] for r in self.roots]

    def root_continuations(self) -> list[torch.Tensor]:
        return [self.rows[r][self.start[r] :] for r in self.roots]

    def read(self, per_root: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each row's continuation entries, sliced from its root's (one 1-D or more tensor per root)."""
        by_root = dict(zip(self.roots, per_root, strict=True))
        return [by_root[self.owner[i]][offset : offset + n] for i, (offset, n) in enumerate(self.span)]

    def read_padded(self, padded: torch.Tensor) -> torch.Tensor:
        """Each row's continuation entries from the roots' right-padded ``(roots, T, ...)`` tensor, as one
        right-padded ``(rows, T', ...)`` tensor (one gather: gradients flow back to the roots' entries)."""
        index = {r: j for j, r in enumerate(self.roots)}
        width = max((n for _, n in self.span), default=0)
        device = padded.device
        steps = torch.arange(max(width, 1), device=device)
        roots = torch.tensor([index[self.owner[i]] for i in range(len(self.rows))], device=device)
        offsets = torch.tensor([offset for offset, _ in self.span], device=device)
        columns = (offsets[:, None] + steps[None]).clamp(max=padded.shape[1] - 1)
        return padded[roots[:, None], columns]

    def scores(self, roots: TokenScores) -> TokenScores:
        """Each row's :class:`TokenScores` read from its root's."""
        lengths = [n for _, n in self.span]
        steps = torch.arange(max(max(lengths), 1), device=roots.valid.device)
        return TokenScores(
            self.read_padded(roots.log_probs),
            None if roots.entropy is None else self.read_padded(roots.entropy),
            None if roots.hidden is None else self.read_padded(roots.hidden),
            steps[None] < torch.tensor(lengths, device=steps.device)[:, None],
            lengths,
        )


def nested_token_logprobs(
    model: torch.nn.Module,
    prefixes: Sequence[torch.Tensor],
    continuations: Sequence[torch.Tensor],
    *,
    pad_token_id: int = 0,
    max_length: int | None = None,
    share_prefix: bool = False,
    entropy: bool = False,
):
    """:func:`token_logprobs` where rows contained in longer rows are read from the longer row's forward.

    The turns of a conversation are nested: turn ``t + 1``'s prompt starts with turn ``t``'s prompt and
    response. A row whose ``prefix + continuation`` tokens begin a longer row is not run on its own:
    each longest row is run once, from the shortest prefix among the rows it contains, and every row
    reads its continuation's log-probs at its positions there (causal attention makes them the
    same, up to float rounding, as a forward of the row alone). Rows longer than ``max_length`` are
    not merged (clipping would change their context). With ``share_prefix``, the longest rows that begin
    with the same prefix (a GRPO group's system prompt and opener) read it once (:func:`score_tokens`).
    Returns what :func:`token_logprobs` returns (with ``entropy``, the entropies read the same way).
    """
    nesting = Nesting.of(prefixes, continuations, max_length)
    if not nesting.rows:
        return ([], []) if entropy else []
    scored = token_logprobs(
        model,
        nesting.root_prefixes(),
        nesting.root_continuations(),
        pad_token_id=pad_token_id,
        max_length=max_length,
        share_prefix=share_prefix,
        entropy=entropy,
    )
    return (nesting.read(scored[0]), nesting.read(scored[1])) if entropy else nesting.read(scored)


# -- hidden states a model kept from reading a prompt ---------------------------------------------------------
_PROMPT_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class PromptStates:
    """The last hidden state at the prompt positions a model read in its last ``generate`` call.

    Kept by :class:`astrl.prefill.TurnCache` (``keep_states``) so that log-probs of tokens the model
    has just read as a prompt (the ASTPrompter likelihood term scores the probe the target read;
    the reference scores what the target read when it is the target) come from one LM-head
    application instead of another forward. Row ``i`` holds ``lengths[i]`` real prompt tokens
    (``tokens[i, :lengths[i]]``, padding removed); the hidden state at its token position ``p``
    (the one that predicts token ``p + 1``) is ``hidden[i, p - first[i] + offset[i]]`` for
    ``first[i] <= p < first[i] + count[i]``, positions before ``first[i]`` having been read from a
    KV cache. ``is_current()`` says whether the model's weights (and mode) are still those the states
    were computed with.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    first: torch.Tensor
    count: torch.Tensor
    hidden: torch.Tensor
    is_current: Callable[[], bool]
    rows_served: int = 0  # rows whose log-probs were read from these states

    @property
    def offset(self) -> torch.Tensor:
        return self.hidden.shape[1] - self.count  # each row's states are right-aligned


def keep_prompt_states(model: torch.nn.Module, states: PromptStates | None) -> None:
    """Record (or, with None, forget) the prompt states ``model`` kept from its last read."""
    if states is None:
        _PROMPT_STATES.pop(model, None)
    else:
        _PROMPT_STATES[model] = states


def note_head_check(model: torch.nn.Module, hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """Record, if not known yet, whether ``model``'s LM head on ``hidden`` (its last hidden states) gave ``logits``."""
    if head_gives_logits(model) is None:
        with torch.no_grad():
            _record_head_check(model, model.get_output_embeddings()(hidden), logits)


def _served_from_states(
    model: torch.nn.Module,
    prefixes: Sequence[torch.Tensor],
    continuations: Sequence[torch.Tensor],
    max_length: int | None,
) -> list[torch.Tensor | None]:
    """Log-probs of each continuation read from the model's kept :class:`PromptStates`, None where not kept.

    A row (prefix + continuation) is served when it begins a kept prompt, is not clipped by
    ``max_length``, and the states of every position predicting its continuation were kept; only
    without gradients, and only when the model's head on its hidden states gives its logits."""
    served: list[torch.Tensor | None] = [None] * len(prefixes)
    states = _PROMPT_STATES.get(model)
    if states is None or torch.is_grad_enabled() or head_gives_logits(model) is not True or not states.is_current():
        return served
    device = states.tokens.device
    picks, columns, targets, sizes = [], [], [], []
    for i, (prefix, cont) in enumerate(zip(prefixes, continuations, strict=True)):
        row = torch.cat([prefix.reshape(-1).long().to(device), cont.reshape(-1).long().to(device)])
        start, length = prefix.numel(), row.numel()
        if start < 1 or length <= start or (max_length is not None and length > max_length):
            continue
        if length > states.tokens.shape[1]:
            continue
        begins = (states.tokens[:, :length] == row).all(1) & (states.lengths >= length)
        # every position start - 1 .. length - 2 must hold a kept state
        kept = begins & (states.first <= start - 1) & (states.first + states.count >= length - 1)
        if not bool(kept.any()):
            continue
        j = int(kept.nonzero()[0, 0])
        positions = torch.arange(start - 1, length - 1, device=device)
        picks.append(torch.full_like(positions, j))
        columns.append(positions - states.first[j] + states.offset[j])
        targets.append(row[start:])
        sizes.append((i, length - start))
    if not picks:
        return served
    with torch.no_grad():
        hidden = states.hidden[torch.cat(picks), torch.cat(columns)]
        log_probs = torch.log_softmax(model.get_output_embeddings()(hidden).float(), dim=-1)
        values = log_probs.gather(-1, torch.cat(targets)[:, None]).squeeze(-1)
    for (i, _), part in zip(sizes, values.split([n for _, n in sizes]), strict=True):
        served[i] = part
    states.rows_served += len(sizes)
    return served


def response_mask(tokens: torch.Tensor, stop_token_ids: Iterable[int]) -> torch.Tensor:
    """Mask of the tokens that belong to a generated response: everything up to and including
    the first stop token (EOS); what follows it is padding. Works on ``(..., T)`` id tensors."""
    stops = torch.as_tensor(sorted(set(stop_token_ids)), device=tokens.device)
    is_stop = torch.isin(tokens, stops).long()
    stops_before = torch.cumsum(is_stop, dim=-1) - is_stop
    return stops_before == 0


def until_stop(response: torch.Tensor, stop_token_ids: Iterable[int]) -> torch.Tensor:
    """A 1-D response's tokens up to and including its first stop token (all of it without one)."""
    return response[: int(response_mask(response, stop_token_ids).sum())]


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
