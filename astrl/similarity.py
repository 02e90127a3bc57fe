"""Text similarity on the ground floor: BLEU over word n-grams, for diversity metrics and novelty bonuses.

Texts are lower-cased and split into word and punctuation tokens (:func:`bleu_tokens`). BLEU of a
text against references uses clipped n-gram precisions of the given orders with epsilon
smoothing and the brevity penalty of the closest reference length.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

SELF_BLEU_ORDERS = (2, 3, 4, 5)
BLEU_SMOOTHING_EPSILON = 0.1
_TOKEN = re.compile(r"\w+|[^\w\s]")


def bleu_tokens(text: str) -> list[str]:
    """Lower-cased word and punctuation tokens."""
    return _TOKEN.findall(text.lower())


def _ngrams(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _closest_lengths(lengths: np.ndarray, ref_lengths: np.ndarray, exclude_self: bool) -> np.ndarray:
    """Per text, the reference length closest to its own (ties to the shorter one)."""
    gaps = np.abs(ref_lengths[None, :] - lengths[:, None]).astype(np.float64) * 2 + (ref_lengths[None, :] > lengths[:, None])
    if exclude_self:
        np.fill_diagonal(gaps, np.inf)  # never the text itself
    return ref_lengths[np.argmin(gaps, axis=1)]


def _bleu_matrix(
    counts: Sequence[Sequence[Counter]], lengths: np.ndarray, closest: np.ndarray, clipped, orders: Sequence[int]
) -> np.ndarray:
    """``(texts, len(orders))`` smoothed BLEU-N scores from per-text n-gram counts (orders ``1..max(orders)``).

    ``clipped(i, gram, count)`` is the matched count of ``gram`` in text ``i`` (its count clipped
    by the references'); ``closest`` is each text's closest reference length.
    """
    top = max(orders)
    log_precisions = np.full((len(counts), top), np.nan)
    for i, per_order in enumerate(counts):
        for k, counter in enumerate(per_order):
            total = sum(counter.values())
            if total == 0:
                continue
            matched = sum(clipped(i, gram, c) for gram, c in counter.items())
            log_precisions[i, k] = math.log((matched or BLEU_SMOOTHING_EPSILON) / total)
    with np.errstate(divide="ignore"):
        brevity = np.where(lengths > closest, 0.0, 1.0 - closest / np.maximum(lengths, 1))
    columns = []
    for n in orders:
        logs = log_precisions[:, :n]
        present = ~np.isnan(logs)
        mean_log = np.where(present, logs, 0.0).sum(axis=1) / np.maximum(present.sum(axis=1), 1)
        columns.append(np.where(lengths > 0, np.exp(mean_log + brevity), 0.0))
    return np.stack(columns, axis=1) if columns else np.zeros((len(counts), 0))


def _check_orders(orders: Sequence[int]) -> None:
    if not orders or any(not isinstance(n, (int, np.integer)) or n < 1 for n in orders):
        raise ValueError(f"orders must be positive integers, got {tuple(orders)}")


def ngram_counts(tokens: Sequence[str], top: int) -> list[Counter]:
    """The n-gram counts of a token list for ``n = 1..top``."""
    return [_ngrams(tokens, n) for n in range(1, top + 1)]


def self_bleu(texts: Sequence[str], orders: Sequence[int] = SELF_BLEU_ORDERS) -> dict[int, float]:
    """Self-BLEU of a set of texts for each maximum n-gram order in ``orders``.

    For each text, BLEU against all the *other* texts as references, averaged over texts.
    BLEU-N is the geometric mean of the modified n-gram precisions of orders ``1..N`` (uniform
    weights) times the brevity penalty ``exp(1 - r/c)`` for a text of ``c`` tokens shorter than
    the reference length ``r`` closest to it (ties to the shorter). Counts are clipped by the
    largest count of the n-gram in any single reference.

    Smoothing: a precision with no matching n-gram counts ``epsilon = 0.1`` matches instead of 0
    (Chen & Cherry's method 1), so one missing order does not zero the score. Orders longer than
    the text have no n-grams and are left out (a 3-token text's BLEU-5 equals its BLEU-3); an
    empty text scores 0. Tokens are lower-cased words and punctuation marks.

    Needs at least two texts.
    """
    if len(texts) < 2:
        raise ValueError(f"self-BLEU needs at least 2 texts, got {len(texts)}")
    _check_orders(orders)
    tokens = [bleu_tokens(t) for t in texts]
    lengths = np.array([len(t) for t in tokens])
    counts = [ngram_counts(t, max(orders)) for t in tokens]
    # For each n-gram: its two largest counts over texts and the text holding the largest, so the
    # clipping count "max over the other texts" costs O(1) per n-gram and text.
    best: dict[tuple, tuple[int, int, int]] = {}
    for i, per_order in enumerate(counts):
        for counter in per_order:
            for gram, c in counter.items():
                first, owner, second = best.get(gram, (0, -1, 0))
                if c > first:
                    best[gram] = (c, i, first)
                elif c > second:
                    best[gram] = (first, owner, c)

    def clipped(i: int, gram: tuple, c: int) -> int:
        first, owner, second = best[gram]
        return min(c, second if owner == i else first)

    scores = _bleu_matrix(counts, lengths, _closest_lengths(lengths, lengths, exclude_self=True), clipped, orders)
    return {n: float(scores[:, k].mean()) for k, n in enumerate(orders)}


def reference_counts(references: Sequence[Sequence[Counter]]) -> dict[tuple, int]:
    """Per n-gram, its largest count in any single reference (the BLEU clipping count)."""
    most: dict[tuple, int] = {}
    for per_order in references:
        for counter in per_order:
            for gram, c in counter.items():
                if c > most.get(gram, 0):
                    most[gram] = c
    return most


def bleu_against(texts: Sequence[str], references: Sequence[str], orders: Sequence[int] = SELF_BLEU_ORDERS) -> np.ndarray:
    """BLEU of each text against one shared set of references, scored as :func:`self_bleu` scores.

    Returns a ``(len(texts), len(orders))`` array (BLEU-N for each N in ``orders``): same tokens,
    clipping, brevity penalty and smoothing as :func:`self_bleu`. Needs at least one reference.
    """
    _check_orders(orders)
    ref_tokens = [bleu_tokens(t) for t in references]
    counts = [ngram_counts(t, max(orders)) for t in ref_tokens]
    return bleu_against_counts(texts, counts, [len(t) for t in ref_tokens], orders)


def bleu_against_counts(
    texts: Sequence[str], reference_ngrams: Sequence[Sequence[Counter]], reference_lengths: Sequence[int], orders: Sequence[int]
) -> np.ndarray:
    """:func:`bleu_against` with the references already counted (:func:`ngram_counts` up to at
    least ``max(orders)``, and their token lengths), for callers that keep them between calls."""
    _check_orders(orders)
    if not len(reference_ngrams):
        raise ValueError("BLEU needs at least one reference text")
    if len(reference_ngrams) != len(reference_lengths):
        raise ValueError(f"got {len(reference_ngrams)} reference n-gram counts but {len(reference_lengths)} lengths")
    top = max(orders)
    most = reference_counts([per_order[:top] for per_order in reference_ngrams])
    tokens = [bleu_tokens(t) for t in texts]
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    closest = _closest_lengths(lengths, np.asarray(reference_lengths, dtype=np.int64), exclude_self=False)
    counts = [ngram_counts(t, top) for t in tokens]
    return _bleu_matrix(counts, lengths, closest, lambda i, gram, c: min(c, most.get(gram, 0)), orders)


def self_bleu_diversity(texts: Sequence[str], orders: Sequence[int] = SELF_BLEU_ORDERS) -> float:
    """``1 - mean self-BLEU`` over ``orders`` (n = 2..5 by default); higher = more diverse."""
    scores = self_bleu(texts, orders)
    return 1.0 - sum(scores.values()) / len(scores)


def repeated_ngram_share(text: str, n: int = 2) -> float:
    """The share of a text's word n-grams that repeat an earlier one: 0 for text without repeats,
    approaching 1 for ``"clothes clothes clothes ..."``; 0 for texts of fewer than ``n + 1`` words."""
    grams = _ngrams(bleu_tokens(text), n)
    total = sum(grams.values())
    return 1.0 - len(grams) / total if total > 1 else 0.0
