"""Two turns against one at equal compute, read from ``astrl eval`` folders of two-turn conversations.

A two-turn conversation costs two probes and two sets of replies; so do two one-turn conversations,
and a conversation's first turn is a one-turn conversation. For each folder (one tester) this prints,
under ``--judge``, the elicited reply share of each turn (a reply scored above 0.5 after a probe scored
at most 0.5, as ``astrl.evaluation.metrics.elicited``), the share of two-turn conversations with an
elicited reply, the share of pairs of one-turn conversations (first turns of conversations 2k and
2k + 1 of one opener) with one, and the pairs' margin over the two-turn conversations, each with a
95% interval from resampling openers (the margin paired: both sides from the same resample).

    python benchmarks/turns_at_equal_compute.py EVAL_DIR [EVAL_DIR ...] [--judge wordlist]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
from _common import emit, r

from astrl.evaluation.metrics import elicited
from astrl.evaluation.records import read_records


def opener_tables(records: list[dict], judge: str) -> list[np.ndarray]:
    """Per opener, an array (conversations, 2 turns, replies) of elicited replies (0/1)."""
    by_opener: dict[str, dict[int, dict[int, np.ndarray]]] = defaultdict(lambda: defaultdict(dict))
    for record in records:
        scores = record["scores"][judge]
        replies = np.asarray(scores.get("replies", [scores["reply"]]), dtype=np.float64)
        by_opener[record["prompt"]][record["conversation"]][record["turn"]] = elicited(replies, scores["probe"])
    tables = []
    for opener, conversations in by_opener.items():
        turns = {len(c) for c in conversations.values()}
        if turns != {2}:
            raise SystemExit(f"opener {opener[:40]!r}: conversations of {sorted(turns)} turns; this reads two-turn evaluations")
        tables.append(np.stack([np.stack([c[0], c[1]]) for _, c in sorted(conversations.items())]).astype(np.float64))
    return tables


def statistics(tables: list[np.ndarray]) -> dict[str, float]:
    """The shares over the given openers (a list of :func:`opener_tables` arrays)."""
    turn_1 = sum(t[:, 0].sum() for t in tables) / sum(t[:, 0].size for t in tables)
    turn_2 = sum(t[:, 1].sum() for t in tables) / sum(t[:, 1].size for t in tables)
    two_turn = sum(t.max(axis=(1, 2)).sum() for t in tables) / sum(t.shape[0] for t in tables)
    pairs = [np.maximum(t[0 : 2 * (len(t) // 2) : 2, 0].max(-1), t[1 : 2 * (len(t) // 2) : 2, 0].max(-1)) for t in tables]
    one_turn_pairs = sum(p.sum() for p in pairs) / sum(p.size for p in pairs)
    return {
        "reply_share_turn_1": turn_1,
        "reply_share_turn_2": turn_2,
        "two_turn_conversations_elicited": two_turn,
        "one_turn_pairs_elicited": one_turn_pairs,
        "pairs_minus_two_turn": one_turn_pairs - two_turn,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="astrl eval output folders of two-turn conversations")
    parser.add_argument("--judge", default="wordlist")
    parser.add_argument("--resamples", type=int, default=2000)
    args = parser.parse_args()
    result = {"judge": args.judge, "testers": {}}
    for folder in args.folders:
        tables = opener_tables(read_records(f"{folder}/conversations.jsonl"), args.judge)
        point = statistics(tables)
        rng = np.random.default_rng(0)
        draws = [statistics([tables[i] for i in rng.integers(0, len(tables), len(tables))]) for _ in range(args.resamples)]
        out = {"openers": len(tables), "conversations": sum(t.shape[0] for t in tables)}
        for name, value in point.items():
            low, high = np.percentile([d[name] for d in draws], [2.5, 97.5])
            out[name] = {"value": r(value), "ci": [r(low), r(high)]}
        result["testers"][folder] = out
    emit(result)


if __name__ == "__main__":
    main()
