"""Shared prefill for ``model.generate``: identical rows of a batch read their prompt once.

Tree siblings (``tree_width`` probes from one state) and the conversations of a GRPO group at
their first turn send the same prompt several times in one ``generate`` call, and raw ``generate``
prefills every copy. :class:`SharedPrefill` wraps a model's ``generate``: it finds the distinct
rows (ids and attention mask), runs the model once over each distinct prompt but its last token
with ``use_cache=True``, gathers that KV cache back to the full batch and hands it to the original
``generate``, which then processes only each row's last prompt token before sampling. The logits
are those of a full prefill up to float rounding, so sampling draws from the same distribution with
the same random numbers.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import NamedTuple

import torch

from astrl.lm_scoring import PromptStates, accepts, keep_prompt_states, note_head_check


class SharedPrefill:
    """Replaces ``model.generate`` by a version that prefills each distinct prompt row once.

    Calls that pass positional arguments, no ``input_ids``, a ``past_key_values``, prompts of one
    token, or a batch without repeated rows go to the original ``generate`` unchanged, as do all
    calls while ``enabled`` is False. ``remove()`` puts the original back. ``calls_shared`` /
    ``rows_saved`` count what it did.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.original = model.generate
        self.calls_shared = 0
        self.rows_saved = 0
        self.enabled = True
        model.generate = self

    def remove(self) -> None:
        """Restore the model's original ``generate``."""
        if self.model.generate is self:
            self.model.generate = self.original

    def __call__(self, *args, **kwargs):
        ids = kwargs.get("input_ids")
        if (
            not self.enabled
            or args
            or ids is None
            or kwargs.get("past_key_values") is not None
            or ids.dim() != 2
            or ids.shape[1] < 2
        ):
            return self.original(*args, **kwargs)
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(ids)
        shared = prefill_distinct(self.model, ids, mask)
        if shared is None:
            return self.original(*args, **kwargs)
        self.calls_shared += 1
        self.rows_saved += shared.saved
        return self.original(**{**kwargs, "attention_mask": mask, "past_key_values": shared.cache})


class Prefilled(NamedTuple):
    """What :func:`prefill_distinct` read: the extended cache (gathered back to every row), how many rows
    another identical row read for, and (when asked) the last hidden state at every position it read."""

    cache: object
    saved: int
    hidden: torch.Tensor | None


def prefill_distinct(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache=None, *, always: bool = False, hidden: bool = False
) -> Prefilled | None:
    """Run each distinct row of a left-padded generate input once over its uncached tokens but the last.

    ``cache`` (optional) holds the first ``cache.get_seq_length()`` positions of every row. The model
    reads each distinct (ids, mask) row's tokens from there up to its last token, and the extended
    cache is gathered back to every row, so that ``generate`` then reads only the last prompt token.
    Positions count real tokens (left padding and masked slots are skipped), as ``generate`` counts
    them. With ``hidden``, the model's last hidden state at every position read is returned too,
    ``(rows, read width, hidden size)``. Returns None when fewer than two tokens are left to read,
    or when every row is distinct and not ``always``.
    """
    start = 0 if cache is None else cache.get_seq_length()
    if ids.shape[1] - start < 2:
        return None
    distinct, inverse = torch.unique(torch.cat([ids, mask.to(ids.dtype)], dim=1), dim=0, return_inverse=True)
    saved = len(ids) - len(distinct)
    shared = saved > 0
    if not shared and not always:
        return None
    if shared:
        inverse = inverse.to(ids.device)
        first = torch.full((len(distinct),), len(ids), dtype=torch.long, device=ids.device)
        first.scatter_reduce_(0, inverse, torch.arange(len(ids), device=ids.device), reduce="amin")  # a row of each
        if cache is not None:
            cache.batch_select_indices(first)
        ids, mask = ids[first], mask[first]
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    extra = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}
    with torch.no_grad():
        out = model(
            input_ids=ids[:, start:-1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, start:-1],
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=hidden,
            **extra,
        )
    cache, states = out.past_key_values, None
    if hidden and getattr(out, "hidden_states", None):
        states = out.hidden_states[-1]
        note_head_check(model, states[:, -1:], out.logits[:, -1:])
    del out
    if shared:
        cache.batch_select_indices(inverse)  # every row gets the cache of its distinct row
        states = None if states is None else states[inverse]
    return Prefilled(cache, saved, states)


# -- reuse of the last call's KV cache -------------------------------------------------------------------------
_ORDER_DEPENDENT = ("repetition_penalty", "no_repeat_ngram_size", "encoder_repetition_penalty", "sequence_bias", "bad_words_ids")


class TurnCache:
    """Replaces ``model.generate`` by a version that keeps the KV cache of its last call and reuses it.

    A conversation's next turn, and a tree node's children, start with everything the model has already
    read: the previous prompt and the reply it generated. ``TurnCache`` keeps the last call's cache and
    token ids; a new call matches each row, on token ids, against the longest prefix some earlier row
    has in the cache, gathers those cache entries (left-padded), and lets the original ``generate`` prefill
    only the rest of each prompt::

        layout of row i:  [pad | cached prefix (m_i tokens)] [pad | rest of the prompt] -> new tokens
                           cache region, width M              prefilled, width W

    Positions come from the attention mask (cumulative sum, as ``generate`` computes them), so every
    token keeps the position it has in a full prefill and the logits are those of a full prefill up to
    float rounding: sampling draws from the same distribution with the same random numbers. The cache is
    valid only for the weights it was computed with: a call after any parameter changed (an optimizer
    step, a loaded checkpoint), or with the model in another train/eval mode or with PEFT adapters toggled,
    starts afresh. Calls with positional arguments, ``inputs_embeds``, their own ``past_key_values``,
    order-dependent logits processors (repetition penalties, banned n-grams) or a cache other than plain
    ``DynamicCache`` layers go to the original ``generate`` unchanged (and drop the kept cache), as do all
    calls while ``enabled`` is False. Identical rows of a call (tree siblings, a GRPO group's first turn)
    prefill their uncached tokens once. With ``keep_states`` the prompt is always prefilled here and the
    last hidden state at each position read is kept (:class:`astrl.lm_scoring.PromptStates`), so that
    :func:`astrl.lm_scoring.token_logprobs` reads the log-probs of tokens this model has just read (the
    probe a target read, for the likelihood term) with one LM-head application instead of a forward.
    ``tokens_reused`` / ``tokens_prefilled`` count prompt tokens taken from the cache and given to the
    model; ``rows_shared`` counts rows whose uncached tokens another row read for them. Each callable in
    ``observers`` (or ``weakref.WeakMethod``, dropped once its object is gone) sees every call's output
    (e.g. the per-step logits a reply lexicon reads), also while ``enabled`` is False; calls made inside
    :meth:`with_logits` ask ``generate`` for those logits (``output_logits=True``), which the policies
    do not ask for themselves.
    """

    def __init__(self, model: torch.nn.Module, min_saving: float = 0.2, keep_states: bool = False) -> None:
        self.model = model
        self.original = model.generate
        self.min_saving = min_saving
        self.keep_states = keep_states
        self.enabled = True
        self.observers: list = []  # called with each call's generate output (sequences of the caller's layout, logits)
        self.logits_wanted = 0  # open with_logits blocks
        self.calls_reused = self.tokens_reused = self.tokens_prefilled = self.rows_shared = 0
        self._state: tuple | None = None  # (token ids, attention seen when computed, cache, weights fingerprint)
        self._kept_states: PromptStates | None = None  # what the last call read (keep_states)
        self._served = 0
        model.generate = self

    def remove(self) -> None:
        """Restore the model's original ``generate`` and drop the kept cache."""
        self.clear()
        if self.model.generate is self:
            self.model.generate = self.original

    def clear(self) -> None:
        """Drop the kept cache and prompt states (their memory is freed; the next call prefills in full)."""
        self._state = None
        self._keep(None)

    @property
    def rows_from_states(self) -> int:
        """Rows whose log-probs :func:`astrl.lm_scoring.token_logprobs` read from the prompt states kept here."""
        return self._served + (self._kept_states.rows_served if self._kept_states is not None else 0)

    def _keep(self, states: PromptStates | None) -> None:
        if self._kept_states is not None:
            self._served += self._kept_states.rows_served
        self._kept_states = states
        keep_prompt_states(self.model, states)

    def _prompt_states(
        self, ids: torch.Tensor, mask: torch.Tensor, reused: torch.Tensor, hidden: torch.Tensor, fingerprint: tuple
    ) -> PromptStates:
        """The states of what this call read: row i's tokens ``reused[i]`` .. its last but one."""
        tokens, _, count = _compact(ids, mask.bool(), fill=-1)
        hook = weakref.ref(self)  # the model's registry must not keep this hook (and the model) alive

        def is_current() -> bool:
            alive = hook()
            return alive is not None and alive._fingerprint() == fingerprint

        return PromptStates(tokens, count, reused, count - reused - 1, hidden, is_current)

    def _fingerprint(self) -> tuple:
        versions = weights_fingerprint(self.model)
        modules = self.model.modules() if hasattr(self.model, "modules") else ()  # now: adapters may come after install
        layers = [m for m in modules if hasattr(m, "_disable_adapters")]  # PEFT layers: on or off
        adapters = tuple((m._disable_adapters, tuple(getattr(m, "active_adapters", ()))) for m in layers)
        return versions, adapters, bool(getattr(self.model, "training", False))

    def _supported(self, args: tuple, kwargs: dict) -> bool:
        ids = kwargs.get("input_ids")
        if not self.enabled or args or ids is None or ids.dim() != 2 or ids.shape[1] < 2:
            return False
        if kwargs.get("past_key_values") is not None or kwargs.get("inputs_embeds") is not None:
            return False
        configs = [kwargs.get("generation_config"), getattr(self.model, "generation_config", None)]
        for key in _ORDER_DEPENDENT:
            values = [kwargs.get(key)] + [getattr(c, key, None) for c in configs if c is not None]
            if any(v not in (None, 1.0, 0) for v in values):
                return False
        return True

    @contextlib.contextmanager
    def with_logits(self) -> Iterator[None]:
        """Within this block every call asks ``generate`` for each step's logits (``output_logits=True``),
        for an observer that reads them: a policy asks for none unless it returns log-probs."""
        self.logits_wanted += 1
        try:
            yield
        finally:
            self.logits_wanted -= 1

    def __call__(self, *args, **kwargs):
        if self.logits_wanted:
            kwargs["output_logits"] = True
        out = self._generate(*args, **kwargs)
        for observe in list(self.observers):
            if isinstance(observe, weakref.WeakMethod):  # an observer that must not keep its owner alive
                observe = observe()
                if observe is None:
                    self.observers = [o for o in self.observers if not (isinstance(o, weakref.WeakMethod) and o() is None)]
                    continue
            observe(out)
        return out

    def _generate(self, *args, **kwargs):
        if not self._supported(args, kwargs):
            self.clear()
            return self.original(*args, **kwargs)
        ids = kwargs["input_ids"]
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        fingerprint = self._fingerprint()
        plan = self._plan(ids, mask) if self._state is not None and self._state[3] == fingerprint else None
        self._state = None  # the cache is handed to generate, which extends it in place
        config = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        want_dict = kwargs.get("return_dict_in_generate", getattr(config, "return_dict_in_generate", False))
        call = {**kwargs, "attention_mask": mask, "return_dict_in_generate": True, "use_cache": True}
        if plan is not None:
            full_ids, full_mask, cache, reused = plan
            self.calls_reused += 1
        else:
            full_ids, full_mask, cache = ids, mask, None
            reused = torch.zeros(len(ids), dtype=torch.long, device=ids.device)
        self.tokens_reused += int(reused.sum())
        self.tokens_prefilled += int(mask.sum()) - int(reused.sum())
        # identical rows (tree siblings, a GRPO group's first turn) read once; with keep_states, always read here
        read = prefill_distinct(self.model, full_ids, full_mask, cache, always=self.keep_states, hidden=self.keep_states)
        if read is not None:
            cache = read.cache
            self.rows_shared += read.saved
        if cache is not None:
            call.update(input_ids=full_ids, attention_mask=full_mask, past_key_values=cache)
        hidden = None if read is None else read.hidden
        self._keep(None if hidden is None else self._prompt_states(ids, mask, reused, hidden, fingerprint))
        out = self.original(**call)
        generated = out.sequences[:, full_ids.shape[1] :]
        cache = getattr(out, "past_key_values", None)
        if _plain_dynamic(cache):
            seen = torch.cat([full_mask, torch.ones_like(generated, dtype=full_mask.dtype)], dim=1)
            self._state = (out.sequences, seen, cache, fingerprint)
        out.sequences = torch.cat([ids, generated], dim=1)  # the caller's prompt layout
        out.past_key_values = None  # kept here; the caller's layout does not match it
        return out if want_dict else out.sequences

    def _plan(self, ids: torch.Tensor, mask: torch.Tensor):
        """The reuse layout for ``ids`` (left-padded, ``mask``), or None when it saves too little."""
        seqs, seen, cache, _ = self._state
        length = cache.get_seq_length()
        device = ids.device
        old_tokens, old_positions, old_count = _compact(seqs[:, :length], seen[:, :length].bool(), fill=-1)
        new_tokens, _, new_count = _compact(ids, mask.bool(), fill=-2)
        source, matched = longest_prefix_sources(old_tokens, old_count, new_tokens, new_count)
        reused = torch.minimum(matched, new_count - 1)  # one token left to run
        rest = new_count - reused
        prefix_width, rest_width = int(reused.max()), int(rest.max())
        if prefix_width == 0 or rest_width > (1 - self.min_saving) * ids.shape[1]:
            return None
        # cache region: row i holds its reused prefix right-aligned in prefix_width slots
        slot = torch.arange(prefix_width, device=device)
        start = prefix_width - reused
        cached = slot[None, :] >= start[:, None]
        index = (slot[None, :] - start[:, None]).clamp(min=0)
        positions = old_positions[source[:, None], index]  # cache position of each reused token
        for layer in cache.layers:
            layer.keys = layer.keys[source[:, None], :, positions].transpose(1, 2).contiguous()
            layer.values = layer.values[source[:, None], :, positions].transpose(1, 2).contiguous()
        pad = ids.new_full((), _pad_id(ids, mask))
        prefix_ids = torch.where(cached, new_tokens.gather(1, index.clamp(max=new_tokens.shape[1] - 1)), pad)
        # prefilled region: the rest of each prompt, left-padded to rest_width
        slot = torch.arange(rest_width, device=device)
        start = rest_width - rest
        live = slot[None, :] >= start[:, None]
        take = (reused[:, None] + slot[None, :] - start[:, None]).clamp(0, new_tokens.shape[1] - 1)
        rest_ids = torch.where(live, new_tokens.gather(1, take), pad)
        full_ids = torch.cat([prefix_ids, rest_ids], dim=1)
        full_mask = torch.cat([cached, live], dim=1).to(mask.dtype)
        return full_ids, full_mask, cache, reused


_HASH_PRIMES = (2_147_483_629, 2_147_483_587)  # two moduli below 2**31: a product with the base fits in int64
_HASH_BASE = 1_000_003


def _prefix_keys(tokens: torch.Tensor) -> torch.Tensor:
    """``keys[i, n - 1]``: a 62-bit hash of row ``i``'s first ``n`` tokens (two polynomial hashes side by side)."""
    values = tokens.long()
    keys = torch.empty_like(values)
    hashes = [torch.zeros(len(values), dtype=torch.long, device=values.device) for _ in _HASH_PRIMES]
    for n in range(values.shape[1]):
        hashes = [(h * _HASH_BASE + values[:, n]) % p for h, p in zip(hashes, _HASH_PRIMES, strict=True)]
        keys[:, n] = (hashes[0] << 31) | hashes[1]
    return keys


def longest_prefix_sources(
    old: torch.Tensor, old_count: torch.Tensor, new: torch.Tensor, new_count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each new row, the old row sharing the longest common prefix with it (the first such on ties) and
    that prefix's length: ``(source, matched)``, rows' tokens packed at the front (``count`` each).

    Linear in the rows: each old row files the hashes of its prefixes, and each new row finds by a binary
    search over lengths the longest of its prefixes some old row has, then the first old row with it (a
    stable sort keeps old rows in order among equal keys). The answer is checked token by token, and a
    hash collision (never seen; about one in 2**62 per lookup) falls back to comparing every pair."""
    device = new.device
    width = min(old.shape[1], new.shape[1])
    old_keys = _prefix_keys(old[:, :width])
    new_keys = _prefix_keys(new[:, :width])
    lengths = torch.arange(1, width + 1, device=device)
    valid = lengths[None, :] <= old_count[:, None]  # a prefix the old row has
    sorted_keys, order = torch.sort(old_keys[valid], stable=True)  # row-major: earlier old rows first on ties
    owners = valid.nonzero()[:, 0][order]

    def lookup(n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whether some old row begins with each new row's first ``n`` tokens, and the first such row."""
        if not len(sorted_keys):
            return torch.zeros_like(n, dtype=torch.bool), torch.zeros_like(n)
        key = new_keys.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
        at = torch.searchsorted(sorted_keys, key).clamp(max=len(sorted_keys) - 1)
        return (sorted_keys[at] == key) & (n > 0), owners[at]

    low = torch.zeros_like(new_count)  # a length every new row shares (the empty prefix)
    high = new_count.clamp(max=width) + 1  # a length no new row shares
    while bool((high - low > 1).any()):
        middle = (low + high) // 2
        found, _ = lookup(middle)
        low, high = torch.where(found, middle, low), torch.where(found, high, middle)
    found, source = lookup(low)
    source = torch.where(found, source, torch.zeros_like(source))  # nothing shared: the first old row, as argmax
    slot = torch.arange(width, device=device)
    agree = (old[source, :width] == new[:, :width]) | (slot[None, :] >= low[:, None])
    if not bool(agree.all()):  # a hash collision: compare every pair
        return longest_prefix_sources_pairwise(old, old_count, new, new_count)
    return source, low


def longest_prefix_sources_pairwise(
    old: torch.Tensor, old_count: torch.Tensor, new: torch.Tensor, new_count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`longest_prefix_sources` by comparing every new row with every old row (quadratic memory)."""
    width = min(old.shape[1], new.shape[1])
    slot = torch.arange(width, device=new.device)
    old = torch.where(slot[None, :] < old_count[:, None], old[:, :width], -1)  # past a row's end: never equal
    new = torch.where(slot[None, :] < new_count[:, None], new[:, :width], -2)
    differs = old[None, :, :] != new[:, None, :]  # (new row, old row, token)
    everything = torch.full(differs.shape[:2], width, dtype=torch.long, device=new.device)
    matched = torch.where(differs.any(-1), differs.byte().argmax(-1), everything)  # common prefix lengths
    source = matched.argmax(1)  # first on ties
    return source, matched.gather(1, source[:, None])[:, 0]


def _compact(tokens: torch.Tensor, keep: torch.Tensor, fill: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's kept tokens moved to the front (order kept), ``fill`` after them; their original
    positions; and how many each row keeps."""
    count = keep.sum(1)
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
    width = max(int(count.max()), 1)
    positions = order[:, :width]
    packed = tokens.gather(1, positions)
    packed = torch.where(torch.arange(width, device=tokens.device)[None, :] < count[:, None], packed, fill)
    return packed, positions, count


def _pad_id(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """A token id to put at padded slots (masked out, never read): the caller's own padding if any."""
    padded = ids[mask == 0]
    return int(padded[0]) if padded.numel() else 0


def _plain_dynamic(cache) -> bool:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def weights_fingerprint(model: torch.nn.Module) -> tuple:
    """Each parameter's storage and version counter: it changes when any weight is written in place (an
    optimizer step, a loaded checkpoint) or swapped for another tensor."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def turn_cache_of(model: torch.nn.Module, *, install: bool = False) -> TurnCache | None:
    """The :class:`TurnCache` in ``model.generate``'s chain of wrappers, or None; with ``install``, one is
    put in place (disabled: it only runs its observers) when there is none."""
    generate = getattr(model, "generate", None)
    while generate is not None:
        if isinstance(generate, TurnCache):
            return generate
        generate = getattr(generate, "original", None)
    if not install:
        return None
    cache = TurnCache(model)
    cache.enabled = False
    return cache


def clear_turn_caches(*models) -> None:
    """Drop the caches kept by the :class:`TurnCache` of each model that has one (frees their memory)."""
    for model in models:
        hook = getattr(model, "generate", None)
        if isinstance(hook, TurnCache):
            hook.clear()
