"""One tester's elicited reply share as a multiple of another's on the same openers, with a paired interval.

Each side is an ``astrl eval`` folder or the ``--records`` JSONL of ``chat_search.py`` (one searched probe
per opener and turn) or of ``probe_search.py`` (one per opener), read at its ``--turn`` (default the
first, from 0; several, ``0,1``, or ``all``: those turns' replies pooled per opener, the conversation's
share). For each of ``--judges`` the elicited
reply share of both sides (a reply the judge scores above 0.5 after a probe it scores at most 0.5), read
as judged, without the opener's words and without the probe's words in any form (the ``past_opener`` and
``past_probe_forms`` readings of ``astrl eval``, computed again here the same way for both sides), and
without the words of anything said before the reply in its conversation (``past_conversation``: the
opener, earlier probes and replies, its probe); and the multiple B / A with a 95% interval from
resampling the shared openers once for both sides (:func:`astrl.evaluation.metrics.paired_ratio`), and
the fraction of resampled multiples at or above ``--goal``. Both sides must hold the same openers, and
the judges' scores (pass them to ``astrl eval --judge`` and ``chat_search.py --judges``). ``--openers
FILE`` reads both sides on those openers alone (one a line, as ``astrl eval --prompts`` reads them), each
of which both sides must hold. The share of conversations with an elicited reply in the turns read
(``conversations_elicited``; a search holds one conversation an opener) is compared the same way.

    python benchmarks/share_ratio.py UNTRAINED_EVAL_DIR SEARCH.jsonl --judges profanity,wordlist --goal 3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from _common import emit, r
from chat_search import readings

from astrl.errors import ScorerError
from astrl.evaluation.metrics import bootstrap_ratio, grouped, paired_ratio
from astrl.evaluation.records import read_records
from astrl.prompts import load_prompts
from astrl.scorers import make_scorer


def load_side(path: str | Path, turn: int | set[int] | None) -> list[dict]:
    """Rows ``{"opener", "probe", "replies", "scores"}`` of an eval folder's or a search's records' ``turn``
    (a set: those turns'; None: every turn's)."""
    turns = {turn} if isinstance(turn, int) else turn
    path = Path(path)
    if path.is_dir():
        records = read_records(path / "conversations.jsonl")
        said = {(x["conversation"], x["turn"]): [x["probe"], x["response"]] for x in records}  # a turn's probe, its reply
        rows = [
            {
                "conversation": x["conversation"],
                "opener": x["prompt"],
                "history": [text for t in range(x["turn"]) for text in said[x["conversation"], t]],
                "probe": x["probe"],
                "replies": x.get("replies", [x["response"]]),
                "scores": x["scores"],
            }
            for x in records
            if turns is None or x["turn"] in turns
        ]
    elif path.is_file():  # records of chat_search.py; those of one searched turn hold no "turn"
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        rows = [row for row in rows if turns is None or row.get("turn", 0) in turns]
    else:
        raise SystemExit(f"error: {path} is neither an astrl eval folder nor a records file of chat_search.py or probe_search.py")
    if not rows:
        raise SystemExit(f"error: {path} has no rows for turn {'all' if turns is None else ','.join(map(str, sorted(turns)))}")
    return rows


def restrict(rows: list[dict], openers: list[str], side: str) -> list[dict]:
    """The rows of ``openers`` alone; every one of them must be in ``rows``."""
    keep = set(openers)
    missing = keep - {row["opener"] for row in rows}
    if missing:
        raise SystemExit(f"error: {len(missing)} of the {len(keep)} openers are not in {side}, e.g. {min(missing)!r}")
    return [row for row in rows if row["opener"] in keep]


def opener_counts(rows: list[dict], judge: str, scorer, openers: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per reading, ``(elicited replies, replies)`` summed per opener in the order of ``openers``, and
    ``conversations_elicited``: ``(conversations with an elicited reply in the rows' turns, conversations)``."""
    if judge not in rows[0]["scores"]:
        raise SystemExit(f"error: no {judge!r} scores in these rows (they hold {sorted(rows[0]['scores'])})")
    sizes = {len(row["replies"]) for row in rows}
    if len(sizes) != 1:
        raise SystemExit(f"error: rows hold {sorted(sizes)} replies each; one count is needed")
    texts = [text for row in rows for text in row["replies"]]
    matrices = readings(
        scorer,
        [row["opener"] for row in rows],
        [row["probe"] for row in rows],
        texts,
        [row["scores"][judge]["replies"] for row in rows],
        [row["scores"][judge]["probe"] for row in rows],
        [row.get("history", ()) for row in rows],
    )
    position = {opener: i for i, opener in enumerate(openers)}
    labels = [position[row["opener"]] for row in rows]
    counts = {name: grouped(m.sum(1), np.full(len(rows), m.shape[1]), labels) for name, m in matrices.items()}
    # a conversation (an eval's, or a search's one per opener) counts once if a reply of a read turn is elicited
    elicited_in: dict[tuple, bool] = {}
    for row, hit in zip(rows, matrices["elicited_reply_share"].any(1), strict=True):
        key = (row["opener"], row.get("conversation"))
        elicited_in[key] = elicited_in.get(key, False) or bool(hit)
    hits = np.array(list(elicited_in.values()), dtype=np.float64)
    counts["conversations_elicited"] = grouped(hits, np.ones_like(hits), [position[o] for o, _ in elicited_in])
    return counts


def compare_sides(a: list[dict], b: list[dict], judges: dict, goal: float, seed: int) -> dict:
    """Each judge's (``{name: scorer}``) readings of both sides and the multiple B / A, resampling the
    shared openers."""
    openers = sorted({row["opener"] for row in a})
    other = {row["opener"] for row in b}
    if set(openers) != other:
        raise SystemExit(
            f"error: the sides do not hold the same openers ({len(set(openers) - other)} only in A, "
            f"{len(other - set(openers))} only in B)"
        )
    out = {}
    for judge, scorer in judges.items():
        sides = [opener_counts(rows, judge, scorer, openers) for rows in (a, b)]
        out[judge] = {}
        for reading in sides[0]:
            (a_num, a_den), (b_num, b_den) = sides[0][reading], sides[1][reading]
            multiple = paired_ratio((a_num, a_den), (b_num, b_den), seed=seed, at_least=goal)
            out[judge][reading] = {
                "a": share(a_num, a_den, seed),
                "b": share(b_num, b_den, seed),
                "b_over_a": None
                if multiple is None
                else {
                    "ratio": r(multiple["ratio"]),
                    "ci": [r(v) for v in multiple["ci"]],
                    f"share_at_least_{goal:g}": r(multiple["share_at_least"]),
                },
            }
    return out


def share(num: np.ndarray, den: np.ndarray, seed: int) -> dict:
    ci = bootstrap_ratio(num, den, seed=seed)
    return {"rate": r(float(num.sum() / den.sum())), "ci": [r(v) for v in ci] if ci else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("a", help="the reference side: an astrl eval folder or chat_search.py / probe_search.py records")
    parser.add_argument("b", help="the side whose multiple of A is measured")
    parser.add_argument("--judges", default="profanity,wordlist", help="comma-separated judges both sides hold")
    parser.add_argument(
        "--turn",
        default="0",
        help="the turn read from both sides (0: the first; 0,1 or all: those turns' replies, pooled per opener)",
    )
    parser.add_argument("--goal", type=float, default=3.0, help="report the resampled multiples at or above this")
    parser.add_argument("--openers", default=None, help="a file of openers (one a line): read both sides on these alone")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:  # an unknown judge ends the run here, before any reading
        judges = {name.strip(): make_scorer(name.strip()) for name in args.judges.split(",") if name.strip()}
    except ScorerError as err:
        parser.error(str(err))
    picked = args.turn.split(",")
    if args.turn != "all" and not all(t.strip().isdigit() for t in picked):
        parser.error(f"--turn takes turns from 0 (0, or 0,1) or 'all', got {args.turn!r}")
    turn = None if args.turn == "all" else {int(t) for t in picked}
    a, b = load_side(args.a, turn), load_side(args.b, turn)
    if args.openers:
        subset = load_prompts(args.openers)
        a, b = restrict(a, subset, str(args.a)), restrict(b, subset, str(args.b))
    result = compare_sides(a, b, judges, args.goal, args.seed)
    openers = len({row["opener"] for row in a})
    emit(
        {
            "benchmark": "share_ratio",
            "a": str(args.a),
            "b": str(args.b),
            "turn": args.turn if turn is None else sorted(turn),
            "openers": openers,
            "judges": result,
        }
    )


if __name__ == "__main__":
    main()
