"""Time and memory of sampling as tree width, tree depth, batch size and number of turns grow.

Tree width / depth: ``TreeSampler.sample`` (one tree per call in ``--quick``). Batch / turns:
``env.rollout`` of the red-team env. Memory is the peak above the start of each call (RSS polled
every 5 ms on CPU, ``max_memory_allocated`` on CUDA). The growth exponent is the slope of
``log(time)`` against ``log(size)`` (``numpy.polyfit``); for depth, the tree has ``sum_d width**d``
nodes, so the exponent is also fitted against the node count.

    python benchmarks/scaling.py --quick
"""

from __future__ import annotations

import time

import numpy as np
import torch
from _common import PeakMemory, base_parser, emit, r, setup, sync

from astrl.envs import make_redteam_env
from astrl.models import load_model
from astrl.policies import GenerationSettings, make_policy
from astrl.prompts import PromptStream, load_prompts
from astrl.sampling import TreeSampler
from astrl.scorers import make_scorer


def exponent(sizes: list[float], seconds: list[float]) -> float:
    """Slope of log(time) vs log(size)."""
    return float(np.polyfit(np.log(sizes), np.log(seconds), 1)[0])


def measure(device: str, fn) -> tuple[float, float]:
    sync(device)
    with PeakMemory(device) as memory:
        start = time.perf_counter()
        fn()
        sync(device)
        seconds = time.perf_counter() - start
    return seconds, memory.peak_mb


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--widths", default=None, help="comma-separated tree widths (depth 1)")
    parser.add_argument("--depths", default=None, help="comma-separated tree depths (width 2)")
    parser.add_argument("--batches", default=None, help="comma-separated env batch sizes (turns 1)")
    parser.add_argument("--turns", default=None, help="comma-separated turns (batch 2)")
    parser.add_argument("--trees", type=int, default=None, help="trees per sample call")
    args = parser.parse_args()
    info = setup(args)

    def sizes(text: str | None, quick: str, full: str) -> list[int]:
        return [int(x) for x in (text or (quick if args.quick else full)).split(",")]

    new_tokens = args.new_tokens or (8 if args.quick else 24)
    widths = sizes(args.widths, "2,4,8", "2,4,8,16")
    depths = sizes(args.depths, "1,2,3", "1,2,3,4")
    batches = sizes(args.batches, "1,4,16", "1,4,16,64")
    turn_counts = sizes(args.turns, "1,2,4", "1,2,4,8")
    trees = args.trees or (1 if args.quick else 2)

    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    settings = GenerationSettings(max_new_tokens=new_tokens)
    tester = make_policy(lm, settings, input_mode="history", backend=args.backend)
    target = make_policy(lm, settings, input_mode="history", backend=args.backend)
    scorer = make_scorer("profanity", device=args.device)
    scorers = {scorer.name: scorer}
    prompts = load_prompts("builtin")
    original_generate = lm.model.generate

    def generate(*a, **kw):  # fixed reply length: time depends on the sizes, not on early EOS
        kw.setdefault("min_new_tokens", new_tokens)
        return original_generate(*a, **kw)

    lm.model.generate = generate

    def tree(width: int, depth: int):
        sampler = TreeSampler(tester, target, scorers, prompts, num_trees=trees, tree_width=width, tree_depth=depth)
        return measure(args.device, sampler.sample), sampler.nodes_per_call

    def rollout(batch: int, turns: int):
        env = make_redteam_env(
            tester, target, scorers, PromptStream(prompts, batch, seed=args.seed), batch_size=batch, max_turns=turns
        )

        def run():
            with torch.no_grad():
                env.rollout(turns, tester, tensordict=env.reset(), auto_reset=False)

        return measure(args.device, run), batch * turns

    tree(2, 1)  # warm-up
    series: dict[str, dict] = {}
    for name, values, call in (
        ("tree_width", widths, lambda v: tree(v, 1)),
        ("tree_depth", depths, lambda v: tree(2, v)),
        ("batch", batches, lambda v: rollout(v, 1)),
        ("turns", turn_counts, lambda v: rollout(2, v)),
    ):
        points = []
        for value in values:
            (seconds, peak), units = call(value)
            points.append({"size": value, "tester_turns": units, "seconds": r(seconds), "peak_mb": r(peak, 1)})
        times = [p["seconds"] for p in points]
        row = {"points": points, "time_exponent": r(exponent(values, times), 3)}
        row["time_exponent_vs_tester_turns"] = r(exponent([p["tester_turns"] for p in points], times), 3)
        mems = [max(p["peak_mb"], 1.0) for p in points]
        row["memory_exponent"] = r(exponent(values, mems), 3)
        series[name] = row
    emit({"benchmark": "scaling", **info, "new_tokens": new_tokens, "trees": trees, **series})


if __name__ == "__main__":
    main()
