"""How long `astrl demo` (`make run`) takes, phase by phase, and what it shows.

Runs :func:`astrl.training.demo.run_demo` exactly as `astrl demo` does (``--full``: the longer recipe,
configs/demo_full.yaml) in a new run directory, with the embedded model already cached, and prints the
minutes in all, the warm start's seconds (per round), the median GRPO step, the rest (model loads and
the before/after comparison) and the comparison's elicited reply share under the wordlist judge with
its interval, for each side. The goal: at most 5 minutes on 2 CPU cores, the intervals apart.

    python benchmarks/demo_time.py            # the demo (about 4.5 minutes on 2 cores)
    python benchmarks/demo_time.py --full     # the longer recipe (about 12)
"""

from __future__ import annotations

import csv
import json
import statistics
import tempfile
import time
from pathlib import Path

from _common import base_parser, emit, r, setup

from astrl.training.demo import demo_judge, run_demo


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the longer recipe (configs/demo_full.yaml)")
    args = parser.parse_args()
    info = setup(args)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        result = run_demo({"run_dir": folder}, progress=False, full=args.full)
        seconds = time.perf_counter() - start
        warm = json.loads((Path(folder) / "warm_start.json").read_text())
        steps = [float(row["step_seconds"]) for row in csv.DictReader((Path(folder) / "metrics.csv").open())]
    judge = demo_judge(result["config"])
    share = {
        side: {
            "rate": r(values["judges"][judge]["elicited_reply_share"]),
            "ci": [r(v) for v in values["judges"][judge]["elicited_reply_share_ci"]],
        }
        for side, values in result["comparison"].items()
    }
    emit(
        {
            "benchmark": "demo_time",
            **info,
            "recipe": "demo_full" if args.full else "demo",
            "minutes": r(seconds / 60),
            "seconds": r(seconds),
            "warm_start_seconds": warm["seconds"],
            "warm_start_rounds": [{"kept": x["kept"], "seconds": x["seconds"]} for x in warm["rounds"]],
            "grpo_steps": len(steps),
            "grpo_step_median_seconds": r(statistics.median(steps)) if steps else None,
            "other_seconds": r(seconds - warm["seconds"] - sum(steps)),
            "conversations": result["conversations"],
            "elicited_reply_share_wordlist": share,
            "intervals_apart": share["after"]["ci"][0] > share["before"]["ci"][1],
            "goal_minutes": 5.0,
        }
    )


if __name__ == "__main__":
    main()
