"""Is the demo's recipe still deterministic to the digit? Trains and compares a pinned recipe again.

`benchmarks/demo_digits.json` holds a recipe (configs/demo.yaml as it stood when the reference was
recorded: the check is pinned to that recipe, not to whatever `astrl demo` runs today) and every number
of its before/after comparison (training reward, probe NLL, and per judge each rate, count and interval).
This script trains that recipe in a new run directory with the code of this checkout, runs the same
comparison (:func:`astrl.training.demo.run_demo`, as `astrl demo` does) and prints the numbers that
differ. A refactor that is meant to change nothing must print ``"same": true``. Run it on torch's
default threads (as `make run` does; the reference was recorded on 2 cores): a different thread count
can change float reductions and, through the sampling, the numbers.

    python benchmarks/demo_digits.py              # about 5 minutes on 2 cores
    python benchmarks/demo_digits.py --rtol 1e-6  # floats within 1e-6 of the record count as the same
    python benchmarks/demo_digits.py --record     # write the current numbers as the new reference
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from _common import base_parser, emit, setup

from astrl.training.demo import SIDE_SUMMARY, run_demo

REFERENCE = Path(__file__).with_name("demo_digits.json")


def _equal(expected, got, rtol: float) -> bool:
    """Exact equality; two floats also within ``rtol`` of each other, relatively, when ``rtol`` > 0."""
    if rtol > 0 and all(isinstance(v, float) for v in (expected, got)):
        return math.isclose(expected, got, rel_tol=rtol, abs_tol=0.0)
    return expected == got


def differences(expected, got, path: str = "", rtol: float = 0.0) -> list[str]:
    """Every leaf where ``got`` differs from ``expected`` (exact equality, or floats within ``rtol``; lists
    and dicts walked)."""
    if isinstance(expected, dict) and isinstance(got, dict):
        keys = sorted(set(expected) | set(got))
        return [d for k in keys for d in differences(expected.get(k), got.get(k), f"{path}.{k}" if path else k, rtol)]
    if isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got):
        pairs = enumerate(zip(expected, got, strict=True))
        return [d for i, (e, g) in pairs for d in differences(e, g, f"{path}[{i}]", rtol)]
    return [] if _equal(expected, got, rtol) else [f"{path}: {expected!r} -> {got!r}"]


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="write this run's numbers as the reference")
    parser.add_argument(
        "--rtol",
        type=float,
        default=0.0,
        help="floats within this relative difference count as the same (default 0: exact; another machine's "
        "float kernels can move a mean in its seventh digit, 1e-6 allows that and nothing a changed draw gives)",
    )
    args = parser.parse_args()
    info = setup(args)
    reference = json.loads(REFERENCE.read_text())
    with tempfile.TemporaryDirectory() as folder:
        recipe = {**reference["recipe"], "run_dir": folder}
        result = run_demo(recipe, progress=False, conversations=reference["conversations"])
    # through JSON, as demo_summary.json keeps them (tuples become lists)
    got = json.loads(json.dumps({side: {k: v[k] for k in SIDE_SUMMARY} for side, v in result["comparison"].items()}))
    if args.record:
        REFERENCE.write_text(json.dumps({**reference, "summary": got}, indent=1) + "\n", encoding="utf-8")
    diff = differences(reference["summary"], got, rtol=args.rtol)
    emit(
        {
            "benchmark": "demo_digits",
            **info,
            "rtol": args.rtol,
            "same": not diff,
            "differences": diff[:20],
            "n_differences": len(diff),
        }
    )


if __name__ == "__main__":
    main()
