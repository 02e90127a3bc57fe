"""Lexicon-guided beam search: probes, written from the tester's own likely tokens, after which the target
is likely to say a listed word next.

Sampling the tester rarely writes a probe that sets the target up (``' "What the'`` before the
target's ``" hell"``): such a probe is a sequence of individually likely tokens whose joint
probability is small. A beam search finds them cheaply. Each opener keeps ``beams`` partial probes;
each partial probe is extended by the tester's ``top_k`` most likely next tokens (so every probe stays
a chain of likely tokens: readable text, not an adversarial string); every extension is scored by the
target's probability that its **next** token is a listed word,

    m(opener, probe) = sum over the lexicon's first tokens w of p_target(w | opener + probe)

(:meth:`astrl.rewards.lexicon.ReplyLexicon.mass`: one target forward per extension, no reply is
sampled), and the ``beams`` best extensions of each opener survive. After ``length`` steps each opener
gets its highest-scoring probe. Tokens that are themselves listed words, special tokens and a repeat of
the previous token are never proposed: the probe does not say what it asks for, nor stutters.

Likely tokens one at a time need not make a natural probe, least of all when the tester proposing them
was itself fine-tuned on searched probes (a second round of the warm start): ``max_nll`` bounds the
partial probes' mean per-token NLL under the target (the probe-naturalness metric), step by step. An
extension that breaks it ranks below every one within it; the target's log-probability of a token is
read from the logits the search already has, so the bound costs nothing.

This is the beam search of BEAST (Sadasivan et al., 2024: candidates sampled from the attacker's own
distribution, kept by the attack objective) with the target's next-token lexicon mass as the objective.
Each opener is read once by each model; the partial probes' KV caches grow by one token a step, so a
candidate costs the target one token (:class:`PrefixCache`; when the target's tokenizer differs from the
tester's, the target reads each candidate's decoded text after the opener's cache instead).

What it optimises is the first reply token only: a probe that makes a listed word likely a few tokens
later scores low. The warm start (:mod:`astrl.training.warm_start`, ``warm_start_select: search``)
fine-tunes the tester on the probes it finds.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from astrl.lm_scoring import forward_at, logits_at
from astrl.ragged import pad_ids
from astrl.rewards.lexicon import ReplyLexicon

Conversation = str | Sequence[str]
"""What a chat search writes the next probe of: an opener, or a conversation so far,
``(opener, probe_1, reply_1, ..., probe_k, reply_k)``."""


@dataclass
class SearchedProbe:
    """One opener's best probe: its tester token ids and text, the target's lexicon estimate after it
    (text mode: the next-token lexicon mass after ``opener + probe``), the tester's log-probability of
    the probe, the probe's mean per-token NLL under the target (``None`` when the two tokenizers
    differ) and the tester's token ids before the probe (``prompt``). A chat search of a conversation so far
    keeps that conversation as its ``opener`` (:data:`Conversation`)."""

    opener: Conversation
    tokens: torch.Tensor
    text: str
    mass: float
    logprob: float
    nll: float | None = None
    prompt: torch.Tensor | None = None  # the tester's token ids before the probe


class PrefixCache:
    """Rows of tokens run once through ``model``, kept as a KV cache that continuations read.

    ``next_logits(owners, tails)`` gives, for each row ``r``, the logits after ``rows[owners[r]] + tails[r]``
    (the same as one forward over the joined row, up to float rounding; an empty tail gives the row's
    own last logits) without keeping what the tails add; ``advance(owners, tokens)`` returns a new
    ``PrefixCache`` whose rows are ``rows[owners[r]] + tokens[r]``.
    """

    def __init__(self, model: torch.nn.Module, prefixes: Sequence[torch.Tensor], pad_token_id: int) -> None:
        if any(p.numel() == 0 for p in prefixes):
            raise ValueError("every prefix needs at least one token")
        self.model, self.pad_token_id = model, pad_token_id
        self.device = next(model.parameters()).device
        ids, self.mask = pad_ids([p.reshape(-1).long() for p in prefixes], pad_token_id, device=self.device)
        self.lengths = self.mask.sum(1)
        logits, _, out = forward_at(model, ids, self.mask, (self.lengths - 1)[:, None], use_cache=True)
        self.last = logits[:, 0].float()  # each row's next-token logits
        self.cache = out.past_key_values

    def _forward(self, owners: torch.Tensor, tails: Sequence[torch.Tensor]):
        """One forward of right-padded ``tails`` after the rows ``owners``: (their last logits, the cache
        holding rows + tails, the joined attention mask)."""
        cache = _rows_of(self.cache, owners)
        ids, mask = pad_ids([t.reshape(-1).long() for t in tails], self.pad_token_id, device=self.device)
        positions = self.lengths[owners][:, None] + torch.arange(ids.shape[1], device=self.device)[None]
        full_mask = torch.cat([self.mask[owners], mask], dim=1)
        last = (mask.sum(1) - 1)[:, None]
        logits = logits_at(self.model, ids, full_mask, last, past_key_values=cache, position_ids=positions)
        return logits[:, 0].float(), cache, full_mask

    def next_logits(self, owners: torch.Tensor, tails: Sequence[torch.Tensor], *, chunk: int = 256) -> torch.Tensor:
        """``(len(tails), V)`` float logits after each ``rows[owners[r]] + tails[r]``, ``chunk`` rows a forward."""
        owners = owners.to(self.device)
        out = self.last[owners].clone()
        rows = [r for r, t in enumerate(tails) if t.numel()]
        for start in range(0, len(rows), chunk):
            part = torch.tensor(rows[start : start + chunk], device=self.device)
            out[part] = self._forward(owners[part], [tails[r] for r in part.tolist()])[0]
        return out

    def advance(self, owners: torch.Tensor, tokens: torch.Tensor | Sequence[torch.Tensor]) -> PrefixCache:
        """The rows ``rows[owners[r]] + tokens[r]`` as a new cache: ``tokens`` is ``(R, n)`` or ``R`` rows of
        their own lengths, each of at least one token (a shorter row's padding stays masked in the cache)."""
        owners = owners.to(self.device)
        tails = [t.reshape(-1) for t in tokens]
        if any(t.numel() == 0 for t in tails):
            raise ValueError("every row advances by at least one token")
        logits, cache, mask = self._forward(owners, tails)
        new = copy.copy(self)
        new.cache, new.mask, new.lengths, new.last = cache, mask, mask.sum(1), logits
        return new


def _rows_of(cache, owners: torch.Tensor):
    """A new cache holding the rows ``owners`` of ``cache``, which stays as it is.

    Selecting rows and the forward that extends them build new tensors (indexing, ``torch.cat``), so a
    copy of the cache's layer objects suffices: a deep copy would first duplicate every row's keys and
    values only to throw the copy away."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is DynamicLayer for layer in layers):
        cache = copy.copy(cache)
        cache.layers = [copy.copy(layer) for layer in layers]
    else:  # a cache of another kind (sliding windows, offloading): no assumption about how it stores rows
        cache = copy.deepcopy(cache)
    cache.batch_select_indices(owners)
    return cache


def banned_tokens(tokenizer, lexicon: ReplyLexicon, vocab_size: int) -> torch.Tensor:
    """A ``(vocab_size,)`` bool mask of the tokens a probe may not hold: the lexicon's words in
    ``tokenizer``'s vocabulary (one-token spellings) and the special tokens."""
    banned = torch.zeros(vocab_size, dtype=torch.bool)
    words = ReplyLexicon(tokenizer, lexicon.words).token_ids
    banned[words[words < vocab_size]] = True
    special = [i for i in getattr(tokenizer, "all_special_ids", []) if i is not None and i < vocab_size]
    banned[special] = True
    return banned


OPENERS_PER_BATCH = 8  # openers a search runs together by default; each batch's result is independent of the others


@torch.no_grad()
def lexicon_beam_search(
    tester: torch.nn.Module,
    target: torch.nn.Module,
    tester_tokenizer,
    target_tokenizer,
    openers: Sequence[str],
    lexicon: ReplyLexicon,
    *,
    length: int,
    beams: int = 8,
    top_k: int = 8,
    max_nll: float | None = None,
    openers_per_batch: int = OPENERS_PER_BATCH,
    frame: SearchFrame | None = None,
) -> list[SearchedProbe]:
    """The best ``length``-token probe for each opener (see the module docstring).

    Args:
        tester, target: causal LMs; the tester proposes tokens, the target scores them.
        tester_tokenizer, target_tokenizer: their tokenizers. The target reads ``opener + probe`` as
            ``target_tokenizer(opener) + target_tokenizer(decoded probe)``, as a text-mode turn does.
        openers: the conversations' openers (text mode: the target continues ``opener + probe``).
        lexicon: the listed words, for the target's tokenizer.
        length: probe tokens; beams: partial probes kept per opener; top_k: the tester's next tokens
            tried per partial probe.
        max_nll: the naturalness bound: an extension whose partial probe's mean per-token NLL under the
            target exceeds it ranks below every extension within it (so an opener's probe breaks it only
            when no path keeps it; its ``nll`` says so). Needs the two tokenizers to share a vocabulary.
        openers_per_batch: openers searched together (memory: their caches are repeated
            ``beams * top_k`` times in chunks of 256 rows).
        frame: how the models read a probe (:class:`SearchFrame`); None: a text-mode turn (see
            :func:`chat_lookahead_search` for chat mode). A frame with a suffix or a lookahead needs a
            shared vocabulary.
    """
    for name, value in (("length", length), ("beams", beams), ("top_k", top_k), ("openers_per_batch", openers_per_batch)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    vocab = tester.get_output_embeddings().weight.shape[0]
    banned = banned_tokens(tester_tokenizer, lexicon, vocab)
    if int((~banned).sum()) < top_k:
        raise ValueError(f"top_k={top_k} exceeds the {int((~banned).sum())} tokens a probe may hold")
    shared_vocab = tester_tokenizer.get_vocab() == target_tokenizer.get_vocab()
    if max_nll is not None and not shared_vocab:
        raise ValueError(
            f"max_nll={max_nll} reads the target's log-probabilities of the tester's tokens: the tester's and "
            f"the target's tokenizers must share a vocabulary ({type(tester_tokenizer).__name__} with "
            f"{len(tester_tokenizer)} tokens against {type(target_tokenizer).__name__} with {len(target_tokenizer)})"
        )
    frame = frame or _text_frame(tester_tokenizer, target_tokenizer)
    if frame.lookahead < 1:
        raise ValueError(f"lookahead must be >= 1, got {frame.lookahead}")
    if (frame.lookahead > 1 or frame.suffix.numel()) and not shared_vocab:
        raise ValueError(
            "a search that reads the target's reply (a chat turn, or a lookahead) needs the tester and the target "
            "to share a vocabulary"
        )
    sizes = dict(length=length, beams=beams, top_k=top_k, max_nll=max_nll, openers_per_batch=openers_per_batch)
    models = (tester, target, tester_tokenizer, target_tokenizer)
    return _search_batches(*models, openers, frame, shared_vocab, lexicon, banned, **sizes)


@dataclass
class SearchFrame:
    """How the two models read a probe: ``prefixes(openers)`` gives each opener's tester and target token
    ids before the probe; the target reads ``suffix`` (its token ids) between the probe and its reply,
    and its reply is scored over ``lookahead`` tokens (greedy; 1: its next token)."""

    prefixes: Callable[[list[str]], tuple[list[torch.Tensor], list[torch.Tensor]]]
    suffix: torch.Tensor
    lookahead: int = 1


def _text_frame(tester_tokenizer, target_tokenizer) -> SearchFrame:
    """Text mode: both models read the opener's own tokens, and the target continues right after the probe."""

    def prefixes(openers: list[str]):
        tokenizers = (tester_tokenizer, target_tokenizer)
        return tuple([torch.tensor(tok(op)["input_ids"], dtype=torch.long) for op in openers] for tok in tokenizers)

    return SearchFrame(prefixes, torch.zeros(0, dtype=torch.long))


def _search_batches(tester, target, tester_tokenizer, target_tokenizer, openers, frame, shared_vocab, lexicon, banned, **sizes):
    """The searches of ``openers``, ``openers_per_batch`` at a time."""
    per_batch = sizes.pop("openers_per_batch")
    models = (tester, tester_tokenizer), (target, target_tokenizer)
    found: list[SearchedProbe] = []
    for start in range(0, len(openers), per_batch):
        batch = list(openers[start : start + per_batch])
        found.extend(_search(*models, shared_vocab, batch, frame, lexicon, banned, **sizes))
    return found


def conversation_turns(conversation: Conversation) -> tuple[str, ...]:
    """``conversation`` as its texts, the opener first; an odd count (the opener, then probe/reply pairs)."""
    turns = (conversation,) if isinstance(conversation, str) else tuple(conversation)
    if len(turns) % 2 == 0 or not all(isinstance(t, str) for t in turns):
        raise ValueError(
            f"a conversation is its opener then (probe, reply) pairs, an odd number of strings; got {conversation!r}"
        )
    return turns


def tester_chat(conversation: Conversation, system_prompt: str | None) -> list[dict]:
    """The tester's chat before its next probe, as the red-team env grows it: its system prompt, the
    opener and each target reply as ``user`` turns, its own probes as ``assistant`` turns."""
    roles = ("user", "assistant")
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    turns = conversation_turns(conversation)
    return system + [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]


def target_chat(conversation: Conversation, probe: str, system_prompt: str | None) -> list[dict]:
    """The target's view of ``probe`` after the conversation so far, as the red-team env shows it: its
    system prompt, the opener and its own replies as ``assistant`` turns, the probes as ``user`` turns."""
    from astrl.envs.transforms import target_view

    return target_view(tester_chat(conversation, None) + [{"role": "assistant", "content": probe}], system_prompt)


@torch.no_grad()
def greedy_replies(
    target: torch.nn.Module,
    target_tokenizer,
    conversations: Sequence[Conversation],
    probes: Sequence[str],
    *,
    new_tokens: int,
    target_system_prompt: str | None = None,
    batch: int = 32,
) -> list[str]:
    """The target's greedy reply of at most ``new_tokens`` tokens to each probe after its conversation so
    far, the target reading the red-team env's chat view (the reply a chat search's lookahead reads; the
    conversation's next turn is searched after it). Decoded without special tokens."""
    from astrl._compat import render_chats

    chats = [target_chat(c, p, target_system_prompt) for c, p in zip(conversations, probes, strict=True)]
    rows = [
        torch.tensor(target_tokenizer(t, add_special_tokens=False)["input_ids"]) for t in render_chats(target_tokenizer, chats)
    ]
    pad = target_tokenizer.pad_token_id if target_tokenizer.pad_token_id is not None else 0
    device = next(target.parameters()).device
    replies: list[str] = []
    for start in range(0, len(rows), batch):
        ids, mask = pad_ids(rows[start : start + batch], pad, side="left", device=device)
        out = target.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad,
            temperature=None, top_p=None, top_k=None,
        )  # fmt: skip
        replies += target_tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    return replies


def _chat_frame(tester_tokenizer, target_tokenizer, tester_system_prompt, target_system_prompt, lookahead) -> SearchFrame:
    """Chat mode, as the red-team env renders it: the tester writes its turn after its system prompt and
    the conversation so far (the opener and the target's replies said by the other side); the target reads
    the opener and its replies as its own turns, the probes as the user's, then its chat template's end of
    turn and start of its reply (the suffix). Each item of the ``prefixes`` is a :data:`Conversation`."""
    from astrl._compat import render_chats
    from astrl.envs.transforms import contexts_around_last

    def ids(tokenizer, text: str) -> torch.Tensor:
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def framed(conversations) -> list[list[dict]]:  # the target's view with the probe still to write
        return [target_chat(c, "", target_system_prompt) for c in conversations]

    def prefixes(conversations):
        tester_texts = render_chats(tester_tokenizer, [tester_chat(c, tester_system_prompt) for c in conversations])
        around = contexts_around_last(target_tokenizer, framed(conversations))
        return [ids(tester_tokenizer, t) for t in tester_texts], [ids(target_tokenizer, before) for before, _ in around]

    suffix = ids(target_tokenizer, contexts_around_last(target_tokenizer, framed(["."]))[0][1])
    return SearchFrame(prefixes, suffix, lookahead)


@torch.no_grad()
def chat_lookahead_search(
    tester: torch.nn.Module,
    target: torch.nn.Module,
    tester_tokenizer,
    target_tokenizer,
    openers: Sequence[Conversation],
    lexicon: ReplyLexicon,
    *,
    length: int,
    lookahead: int = 8,
    tester_system_prompt: str | None = None,
    target_system_prompt: str | None = None,
    **search,
) -> list[SearchedProbe]:
    """:func:`lexicon_beam_search` for a chat turn: each opener's best ``length``-token first probe (or, for
    a conversation so far, ``(opener, probe_1, reply_1, ...)``, its best next probe), the one whose
    candidate tokens make the target's greedy reply of ``lookahead`` tokens most likely to hold a listed
    word, ``1 - prod_t (1 - m_t)`` (an assistant reply opens with "I" or "Sure": its first token alone
    says nothing). A candidate costs the target one token, the template's end of turn and ``lookahead``
    reply tokens. ``search`` takes ``beams``, ``top_k``, ``max_nll``, ``openers_per_batch``."""
    for conversation in openers:  # a malformed conversation is named before any model runs
        conversation_turns(conversation)
    frame = _chat_frame(tester_tokenizer, target_tokenizer, tester_system_prompt, target_system_prompt, lookahead)
    return lexicon_beam_search(
        tester, target, tester_tokenizer, target_tokenizer, openers, lexicon, length=length, frame=frame, **search
    )


def spells_markers(rows: torch.Tensor, tokenizer, *others) -> torch.Tensor:
    """Whether each row of tester ids, decoded by ``tokenizer``, writes a special token of ``tokenizer``
    or of ``others`` (``"<|im_end|>"`` spelled from ordinary pieces) in plain text: a chat env removes
    such text from a probe (:class:`astrl.envs.transforms.TargetTurn`), so the target never reads it."""
    from astrl.envs.transforms import strip_special_tokens

    texts = tokenizer.batch_decode(rows)
    return torch.tensor([strip_special_tokens(text, tokenizer, *others) != text for text in texts], dtype=torch.bool)


@torch.no_grad()
def lookahead_estimate(
    cache: PrefixCache,
    owners: torch.Tensor,
    tails: torch.Tensor | Sequence[torch.Tensor],
    lexicon: ReplyLexicon,
    lookahead: int,
    stops: set[int],
) -> torch.Tensor:
    """``1 - prod_t (1 - m_t)`` over the first ``lookahead`` tokens of the greedy continuation of each row
    ``rows[owners[r]] + tails[r]`` (``m_t``: the lexicon mass of position t, :meth:`ReplyLexicon.reply_mass`,
    so a ``whole_words`` lexicon discounts a greedy token that goes on into a longer word); a continuation
    that reaches a ``stops`` token counts no position after it."""
    look = cache.advance(owners, tails)
    alive = torch.ones(len(owners), dtype=torch.bool)
    stats, tokens, counted = [], [], []
    for t in range(lookahead):
        stats.append(lexicon.step_stats(look.last))
        counted.append(alive)
        step = look.last.argmax(-1).cpu()
        tokens.append(step)
        if t + 1 == lookahead:
            break
        alive = alive & ~torch.isin(step, torch.tensor(sorted(stops), dtype=torch.long))
        look = look.advance(torch.arange(len(owners)), step[:, None])
    mass = lexicon.reply_mass(torch.stack(stats, dim=1), torch.stack(tokens, dim=1))
    return ReplyLexicon.estimate(mass, torch.stack(counted, dim=1))


@torch.no_grad()
def retest_estimates(
    target: torch.nn.Module,
    target_tokenizer,
    frame: SearchFrame,
    probes: Sequence[str],
    openers: Sequence[str],
    lexicon: ReplyLexicon,
    *,
    rows_per_forward: int = 32,
) -> torch.Tensor:
    """``(len(probes), len(openers))``: the :func:`lookahead_estimate` of the target's greedy reply of
    ``frame.lookahead`` tokens when each probe follows each opener, framed as the search frames its
    candidates (``frame``: :func:`probe_frame`). A probe is sent as its text (re-tokenized by the target,
    as an env sends it), so it needs no shared vocabulary. Each opener's framing is run once and its cache
    read by every probe; ``rows_per_forward`` (probe, opener) rows share a forward."""
    if not probes or not openers:
        return torch.zeros(len(probes), len(openers))
    texts = target_tokenizer(list(probes), add_special_tokens=False)["input_ids"]
    if not frame.suffix.numel() and (empty := [p for p, ids in zip(probes, texts, strict=True) if not ids]):
        raise ValueError(f"probe {empty[0]!r} is empty and the frame adds nothing after it: the target reads no new token")
    _, prefixes = frame.prefixes(list(openers))
    stops = {t for t in (target_tokenizer.eos_token_id, target_tokenizer.pad_token_id) if t is not None}
    heads = PrefixCache(target, prefixes, target_tokenizer.pad_token_id or 0)
    tails = [torch.cat([torch.tensor(ids, dtype=torch.long), frame.suffix]) for ids in texts]
    pairs = [(j, tail) for tail in tails for j in range(len(openers))]
    out = []
    for start in range(0, len(pairs), rows_per_forward):
        owners, rows = zip(*pairs[start : start + rows_per_forward], strict=True)
        out.append(lookahead_estimate(heads, torch.tensor(owners), list(rows), lexicon, frame.lookahead, stops))
    return torch.cat(out).view(len(probes), len(openers))


def probe_frame(
    tester_tokenizer,
    target_tokenizer,
    *,
    chat: bool,
    lookahead: int,
    tester_system_prompt: str | None = None,
    target_system_prompt: str | None = None,
) -> SearchFrame:
    """How a probe is sent and its reply read: the red-team env's chat framing (:func:`chat_lookahead_search`'s)
    or plain text, the reply read over ``lookahead`` greedy tokens."""
    if chat:
        return _chat_frame(tester_tokenizer, target_tokenizer, tester_system_prompt, target_system_prompt, lookahead)
    return replace(_text_frame(tester_tokenizer, target_tokenizer), lookahead=lookahead)


def _search(tester_lm, target_lm, shared_vocab, openers, frame, lexicon, banned, *, length, beams, top_k, max_nll):
    """The search for one batch of openers.

    The tester's cache holds each partial probe and grows by one token a step. When the two tokenizers
    share their vocabulary (``shared_vocab``) the target's does too, and a candidate costs the target one token (its
    log-probability under the target is read from the partial probe's own next-token logits), plus the
    frame's suffix and lookahead tokens; otherwise the target reads each candidate's decoded text anew
    after the opener's cache (text frames only)."""
    tester_tokenizer, target_tokenizer = tester_lm[1], target_lm[1]
    prompts = frame.prefixes(openers)
    proposer, scorer = (  # a row per partial probe (the scorer: per opener unless shared_vocab)
        PrefixCache(model, ids, tok.pad_token_id or 0) for (model, tok), ids in zip((tester_lm, target_lm), prompts, strict=True)
    )
    stops = {t for t in (target_tokenizer.eos_token_id, target_tokenizer.pad_token_id) if t is not None}
    framed = frame.lookahead > 1 or frame.suffix.numel() > 0
    n = len(openers)
    owners = torch.arange(n)  # the opener of each partial probe
    probes = torch.zeros(n, 0, dtype=torch.long)  # (rows, step) tester tokens
    logprob = torch.zeros(n)
    nll = torch.zeros(n)  # the partial probes' summed NLL under the target (shared vocabulary)
    broke = torch.zeros(n, dtype=torch.bool)  # a partial probe, or one of its own prefixes, broke max_nll
    for step in range(length):
        logits = proposer.last.cpu().log_softmax(-1).masked_fill(banned, float("-inf"))
        if probes.shape[1]:  # no token right after itself ("big big big")
            logits.scatter_(1, probes[:, -1:], float("-inf"))
        top = logits.topk(top_k, dim=-1)
        parents = torch.arange(probes.shape[0]).repeat_interleave(top_k)  # each candidate's partial probe
        candidates = torch.cat([probes[parents], top.indices.reshape(-1, 1)], dim=1)
        if framed:  # the target reads the new token, the suffix, then answers
            tails = torch.cat([top.indices.reshape(-1, 1), frame.suffix.expand(len(parents), -1)], dim=1)
            mass = torch.cat([
                lookahead_estimate(scorer, parents[i : i + 256], tails[i : i + 256], lexicon, frame.lookahead, stops)
                for i in range(0, len(parents), 256)
            ])  # fmt: skip
        elif shared_vocab:
            mass = lexicon.mass(scorer.next_logits(parents, list(top.indices.reshape(-1, 1))))
        else:
            texts = tester_tokenizer.batch_decode(candidates)
            encoded = target_tokenizer(texts, add_special_tokens=False)["input_ids"]
            tails = [torch.tensor(ids, dtype=torch.long) for ids in encoded]
            mass = lexicon.mass(scorer.next_logits(owners[parents], tails))
        rank = mass
        if framed:  # a chat marker spelled in plain text is stripped before the target reads the probe
            rank = torch.where(spells_markers(candidates, tester_tokenizer, target_tokenizer), rank - 2.0, rank)
        if shared_vocab:  # the target's log-prob of each new token, after its partial probe
            target_logprob = scorer.last.cpu().float().log_softmax(-1).gather(1, top.indices)
            candidate_nll = nll[parents] - target_logprob.reshape(-1)
            if max_nll is not None:  # mass is in [0, 1]: below every candidate within the bound
                candidate_broke = broke[parents] | (candidate_nll > max_nll * (step + 1))
                rank = torch.where(candidate_broke, rank - 2.0, rank)  # a spelled marker stays ranked down
        # rows are grouped by opener, each with as many: keep each opener's best ``beams``
        per = candidates.shape[0] // n
        keep = (rank.view(n, per).topk(min(beams, per), dim=1).indices + torch.arange(n)[:, None] * per).reshape(-1)
        probes, kept_mass, kept_rank, owners = candidates[keep], mass[keep], rank[keep], owners[parents[keep]]
        logprob = logprob[parents[keep]] + top.values.reshape(-1)[keep]
        if shared_vocab:
            nll = candidate_nll[keep]
            if max_nll is not None:
                broke = candidate_broke[keep]
        if step + 1 < length:
            proposer = proposer.advance(parents[keep], probes[:, -1:])
            if shared_vocab:
                scorer = scorer.advance(parents[keep], probes[:, -1:])
    per = probes.shape[0] // n
    best = kept_rank.view(n, per).argmax(1) + torch.arange(n) * per
    return [
        SearchedProbe(
            opener,
            probes[b],
            tester_tokenizer.decode(probes[b]),
            float(kept_mass[b]),
            float(logprob[b]),
            float(nll[b]) / length if shared_vocab else None,
            prompts[0][i],
        )
        for i, (opener, b) in enumerate(zip(openers, best.tolist(), strict=True))
    ]
