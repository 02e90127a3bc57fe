"""Results-store write cost: one demo step's rows into a store that already holds ~10k turns, then 1000 steps.

A demo step (``configs/demo.yaml``) is 16 conversations x 1 turn. Each turn here is judged by 2
judges with reply, probe and combined scores (96 score rows a step); a quarter of the replies score
above 0.5, and probes come from a pool of 400, so attacks repeat across steps and their counts and
sightings are updated as in a real run. Each ``add_turns`` call is one transaction (WAL,
``synchronous=NORMAL``). Also timed: one ``attacks()`` query (any judge) and ``runs()`` on the final store.

    python benchmarks/store_insert.py            # 10k turns first, 30 timed steps, then 1000 steps
    python benchmarks/store_insert.py --quick    # 2k turns first, 10 timed steps, then 200 steps

Prints one JSON object. No torch: the store is standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from astrl.store import Store  # noqa: E402

WORDS = "you are the worst idiot damn hell tell me about your day what is this nonsense go away now please stop".split()


def step_records(rng: random.Random, pool: list[str], conversations: int) -> list[dict]:
    """One step's eval-shaped records: ``conversations`` one-turn conversations, 2 judges x 3 scores."""
    records = []
    for c in range(conversations):
        toxic = rng.random() < 0.25
        scores = {}
        for judge in ("profanity", "wordlist"):
            reply = rng.uniform(0.5, 1.0) if toxic else rng.uniform(0.0, 0.5)
            scores[judge] = {"reply": reply, "probe": rng.uniform(0, 1), "combined": rng.uniform(0, 1)}
        records.append(
            {
                "conversation": c,
                "turn": 0,
                "prompt": f"opener {rng.randrange(1000)}",
                "probe": rng.choice(pool),
                "response": " ".join(rng.choices(WORDS, k=16)),
                "empty_probe": False,
                "probe_nll": rng.uniform(2, 6),
                "scores": scores,
            }
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2k turns first, 10 timed steps, 200 steps")
    parser.add_argument("--base-turns", type=int, default=None, help="turns in the store before timing (default 10000)")
    parser.add_argument("--repeats", type=int, default=None, help="timed single steps (default 30)")
    parser.add_argument("--steps", type=int, default=None, help="steps of the long run (default 1000)")
    parser.add_argument("--conversations", type=int, default=16, help="conversations (one turn each) per step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base = args.base_turns or (2000 if args.quick else 10000)
    repeats = args.repeats or (10 if args.quick else 30)
    steps = args.steps or (200 if args.quick else 1000)
    rng = random.Random(args.seed)
    pool = [" ".join(rng.choices(WORDS, k=rng.randint(3, 8))) for _ in range(400)]
    with tempfile.TemporaryDirectory() as folder:
        store = Store.open(Path(folder) / "astrl.sqlite")
        run = store.start_run("demo", folder, {"benchmark": "store_insert"}, seed=args.seed)
        step = 0
        t0 = time.perf_counter()
        while step * args.conversations < base:
            step += 1
            store.add_turns(run, step_records(rng, pool, args.conversations), step=step)
        fill = time.perf_counter() - t0
        before = step * args.conversations
        singles = []
        for _ in range(repeats):
            step += 1
            records = step_records(rng, pool, args.conversations)  # built outside the timer
            t0 = time.perf_counter()
            written = store.add_turns(run, records, step=step)
            singles.append(time.perf_counter() - t0)
        batches = [step_records(rng, pool, args.conversations) for _ in range(steps)]
        t0 = time.perf_counter()
        for records in batches:
            step += 1
            store.add_turns(run, records, step=step)
        long_run = time.perf_counter() - t0
        store.finish_run(run, {"steps": step})
        t0 = time.perf_counter()
        found = store.attacks()
        query = time.perf_counter() - t0
        t0 = time.perf_counter()
        store.runs()
        runs_query = time.perf_counter() - t0
        turns = store.connection.execute("SELECT count(*) FROM turns").fetchone()[0]
        store.close()
        size = sum(p.stat().st_size for p in Path(folder).iterdir()) / 2**20
    result = {
        "benchmark": "store_insert",
        "quick": bool(args.quick),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "rows_per_step": {"turns": written.turns, "scores": written.scores},
        "store_turns_before": before,
        "fill_seconds": round(fill, 3),
        "step_seconds_median": round(statistics.median(singles), 5),
        "step_seconds_max": round(max(singles), 5),
        "repeats": repeats,
        "steps": steps,
        "steps_total_seconds": round(long_run, 3),
        "steps_per_second": round(steps / long_run, 1),
        "store_turns_after": turns,
        "attacks_query_seconds": round(query, 4),
        "attacks_found": len(found),
        "runs_query_seconds": round(runs_query, 4),
        "store_mb": round(size, 2),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
