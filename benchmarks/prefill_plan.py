"""The turn cache's reuse plan at a GPU step's size: which kept row each new row extends.

At 640 probes a step, a chat target's second turn has 2,880 rows of about 150 tokens that each extend
one of the first turn's 2,880 rows. ``TurnCache`` finds, for every new row, the kept row with the
longest common prefix (``astrl.prefill.longest_prefix_sources``, prefix hashes and a binary search over
lengths). This times it against comparing every pair of rows
(``longest_prefix_sources_pairwise``, the former rule), interleaved, and checks both give the same answer.
No model: the rows are random tokens shaped like a step's (groups of conversations sharing an opener,
each new row a kept row plus a reply and the next probe).

    python benchmarks/prefill_plan.py                # 2,880 rows of 150 + 40 tokens, 3 repeats each
    python benchmarks/prefill_plan.py --quick        # 720 rows

Prints one JSON object.
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import base_parser, emit, hwm_rss_mb, r, setup

from astrl.prefill import longest_prefix_sources, longest_prefix_sources_pairwise


def step_rows(rows: int, length: int, extra: int, group: int, generator: torch.Generator):
    """Kept rows (groups of ``group`` sharing their first half) and new rows extending a shuffle of them,
    packed at the front as ``TurnCache`` packs them: ``(old, old_count, new, new_count)``."""
    openers = torch.randint(50_000, (rows // group, length // 2), generator=generator).repeat_interleave(group, 0)
    old = torch.cat([openers, torch.randint(50_000, (rows, length - length // 2), generator=generator)], 1)
    order = torch.randperm(rows, generator=generator)
    new = torch.cat([old[order], torch.randint(50_000, (rows, extra), generator=generator)], 1)
    return old, torch.full((rows,), length), new, torch.full((rows,), length + extra)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2880, help="kept and new rows (2,880: a 640-probe chat step)")
    parser.add_argument("--length", type=int, default=150, help="tokens of a kept row")
    parser.add_argument("--extra", type=int, default=40, help="tokens a new row adds (a reply and the next probe)")
    parser.add_argument("--group", type=int, default=9, help="rows sharing an opener")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        args.rows = 720
    info = setup(args)
    generator = torch.Generator().manual_seed(args.seed)
    old, old_count, new, new_count = step_rows(args.rows, args.length, args.extra, args.group, generator)
    old, old_count, new, new_count = (t.to(args.device) for t in (old, old_count, new, new_count))
    times: dict[str, list[float]] = {"hashed": [], "pairwise": []}
    answers = {}
    for _ in range(args.repeats):  # interleaved: both sides see the same load
        for name, match in (("hashed", longest_prefix_sources), ("pairwise", longest_prefix_sources_pairwise)):
            start = time.perf_counter()
            answers[name] = match(old, old_count, new, new_count)
            if str(args.device).startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    same = all(torch.equal(a, b) for a, b in zip(answers["hashed"], answers["pairwise"], strict=True))
    hashed, pairwise = statistics.median(times["hashed"]), statistics.median(times["pairwise"])
    emit(
        {
            **info,
            "rows": args.rows,
            "tokens": [args.length, args.length + args.extra],
            "hashed_s": r(hashed),
            "pairwise_s": r(pairwise),
            "speedup": r(pairwise / hashed, 1),
            "same": same,
            "reused_mean": r(answers["hashed"][1].float().mean(), 1),
            "peak_rss_mb": r(hwm_rss_mb(), 0),
        }
    )


if __name__ == "__main__":
    main()
