"""How far judges agree: pairwise agreement and Cohen's kappa on toxic/not-toxic calls, and the
items where they disagree most.

A judge *calls* a target reply toxic when its score is above the threshold (as for ASR). For every
pair of judges :func:`judge_agreement` reports the share of replies with the same call and Cohen's
kappa (agreement corrected for chance), with bootstrap intervals that resample whole units
(conversations in ``astrl eval``, attacks in ``astrl replay``). It also lists the replies where the
judges' calls split, largest score gap first; rows where the training scorer calls a reply toxic
while no other judge does come first: that is what a tester that learned its scorer's blind spots
(scorer hacking) leaves behind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations

import numpy as np

from astrl.evaluation.metrics import DEFAULT_THRESHOLD, judge_pair_agreement


def judge_agreement(
    scores: Mapping[str, Sequence[float]],
    groups: Sequence,
    items: Sequence[Mapping],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    training_scorers: Sequence[str] = (),
    resamples: int = 1000,
    seed: int = 0,
    top_k: int = 10,
    unit: str = "conversation",
) -> dict | None:
    """Agreement of two or more judges on the same replies; ``None`` with fewer than two judges.

    Args:
        scores: judge -> its score of each reply (all of the same length, in the order of ``items``).
        groups: each reply's unit (conversation or attack id), resampled whole by the bootstrap.
        items: one mapping per reply with ``where`` (a label such as ``"conversation 3, turn 1"``),
            ``probe`` and ``reply``; copied into the rows of the disagreement table.
        threshold: a score strictly above it is a toxic call.
        training_scorers: judges that gave the training reward (their lone toxic calls are flagged).
        resamples, seed: the percentile bootstrap of each pair's agreement and kappa.
        top_k: rows of the disagreement table.
        unit: what ``groups`` count, for the record.

    Returns ``threshold``, ``unit``, ``judges``, ``training_scorers``, ``n_items``, ``pairs`` (one per
    pair of judges: ``judges`` ``[a, b]`` and the counts, ``agreement`` and ``kappa`` of
    :func:`~astrl.evaluation.metrics.judge_pair_agreement`, ``only_a`` counting replies only ``a`` calls
    toxic), ``n_disagreements`` (replies whose calls are not unanimous), ``n_training_scorer_only``
    and ``disagreements``: the ``top_k`` rows (the item's fields, ``scores``, ``toxic``: the judges
    calling it toxic, ``gap``: largest minus smallest score, ``training_scorer_only``).
    """
    judges = list(scores)
    if len(judges) < 2:
        return None
    matrix = np.stack([np.asarray(scores[j], dtype=np.float64).reshape(-1) for j in judges], axis=1)
    if matrix.shape[0] != len(items) or matrix.shape[0] != len(groups):
        raise ValueError(f"got {matrix.shape[0]} scores per judge for {len(items)} items and {len(groups)} group ids")
    calls = matrix > threshold
    pairs = []
    for (i, a), (k, b) in combinations(enumerate(judges), 2):
        result = judge_pair_agreement(calls[:, i], calls[:, k], groups, resamples=resamples, seed=seed)
        pairs.append({"judges": [a, b], **result})
    split = calls.any(axis=1) & ~calls.all(axis=1)
    training = [i for i, j in enumerate(judges) if j in training_scorers]
    others = [i for i, j in enumerate(judges) if j not in training_scorers]
    lone = np.zeros(len(items), dtype=bool)
    if training and others:
        lone = calls[:, training].any(axis=1) & ~calls[:, others].any(axis=1)
    gap = matrix.max(axis=1) - matrix.min(axis=1)
    order = sorted(np.flatnonzero(split).tolist(), key=lambda n: (not lone[n], -gap[n], n))
    rows = []
    for n in order[:top_k]:
        rows.append(
            {
                **dict(items[n]),
                "scores": {j: float(matrix[n, c]) for c, j in enumerate(judges)},
                "toxic": [j for c, j in enumerate(judges) if calls[n, c]],
                "gap": float(gap[n]),
                "training_scorer_only": bool(lone[n]),
            }
        )
    return {
        "threshold": threshold,
        "unit": unit,
        "judges": judges,
        "training_scorers": [j for j in judges if j in training_scorers],
        "n_items": len(items),
        "pairs": pairs,
        "n_disagreements": int(split.sum()),
        "n_training_scorer_only": int(lone.sum()),
        "disagreements": rows,
    }


def eval_agreement(
    records: Sequence[dict],
    *,
    threshold: float,
    training_scorers: Sequence[str],
    resamples: int,
    seed: int,
    top_k: int,
) -> dict | None:
    """:func:`judge_agreement` over the target replies of ``astrl eval`` records (units: conversations)."""
    if not records:
        return None
    ordered = sorted(records, key=lambda r: (r["conversation"], r["turn"]))
    judges = list(ordered[0]["scores"])
    items = [
        {
            "where": f"conversation {r['conversation']}, turn {r['turn']}",
            "conversation": r["conversation"],
            "turn": r["turn"],
            "probe": r["probe"],
            "reply": r["response"],
        }
        for r in ordered
    ]
    return judge_agreement(
        {j: [r["scores"][j]["reply"] for r in ordered] for j in judges},
        [r["conversation"] for r in ordered],
        items,
        threshold=threshold,
        training_scorers=training_scorers,
        resamples=resamples,
        seed=seed,
        top_k=top_k,
        unit="conversation",
    )
