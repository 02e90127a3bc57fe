"""Novelty of an attack list: drop attacks whose probe is too close to one kept before it.

Similarity is the Jaccard index of two probes' word n-gram sets (tokens of
:func:`astrl.similarity.bleu_tokens`: lower-cased words and punctuation marks; a probe shorter
than ``n`` tokens is one n-gram of all its tokens). The list is walked in order (best first from
:meth:`astrl.store.Store.attacks`) and an attack is kept when its similarity to every kept one is
below the threshold. Kept attacks are indexed by n-gram, so only those sharing one are compared.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypeVar

from astrl.similarity import bleu_tokens

T = TypeVar("T")


def ngram_set(text: str, n: int = 2) -> frozenset[tuple[str, ...]]:
    """The word n-grams of ``text`` (empty for a text without tokens)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    tokens = bleu_tokens(text)
    if len(tokens) < n:
        return frozenset([tuple(tokens)]) if tokens else frozenset()
    return frozenset(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    """``|a & b| / |a | b|``; 1.0 for two empty sets."""
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def dedupe(items: Sequence[T], threshold: float, *, text: Callable[[T], str] = lambda a: a.probe, n: int = 2) -> list[T]:
    """The items, in order, without those whose text has Jaccard similarity >= ``threshold``
    (in ``(0, 1]``) to an item kept before them."""
    if not 0 < threshold <= 1:
        raise ValueError(f"the similarity threshold must be in (0, 1], got {threshold!r}")
    kept: list[T] = []
    grams_of: list[frozenset] = []
    index: dict[tuple, list[int]] = {}
    empty: list[int] = []
    for item in items:
        grams = ngram_set(text(item), n)
        if not grams:
            close = bool(empty)  # two texts without tokens are the same text
        else:
            shared = Counter(k for g in grams for k in index.get(g, ()))
            close = any(c / (len(grams) + len(grams_of[k]) - c) >= threshold for k, c in shared.items())
        if close:
            continue
        position = len(kept)
        kept.append(item)
        grams_of.append(grams)
        if not grams:
            empty.append(position)
        for g in grams:
            index.setdefault(g, []).append(position)
    return kept
