"""What the generated tokens' log-probs cost: one conversation step with the policies returning them
(``make_policy(..., return_log_probs=True)``: ``generate`` keeps a vocabulary's logits per token and
row, the wrapper stacks them and runs a cross-entropy over them) against the same step without (the
default; a reply lexicon still asks the target's ``generate`` for its logits).

Two steps: ``demo`` (the demo's conversations: text mode, 16 conversations of one turn, tester 6 and
target 16 new tokens, 4 replies a probe, the elicitation reward with its reply lexicon and likelihood
term) and ``chat`` (chat mode, 8 conversations of 3 turns, 32 new tokens each side, the score reward).
One model serves tester and target, as in the README's example. The two sides alternate (ABAB..., the
order swapped every other pair), each step seeded alike with the turn caches dropped before it; the
JSON gives per side the median seconds a step and the median peak memory above the step's start (RSS
polled every 5 ms on CPU; ``max_memory_allocated`` on CUDA), the median over pairs of the seconds saved,
and whether both sides sampled the same tokens. On CPU the script re-runs itself with
``MALLOC_MMAP_THRESHOLD_`` fixed, so that freed large tensors leave the RSS and each step's peak is
its own. ``--quick``: the chat step at 4 conversations of 2 turns, 16 new tokens; 4 repeats.

    python benchmarks/generation_logits.py --quick
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import replace

import torch
from _common import PeakMemory, base_parser, emit, r, setup, sync

from astrl._compat import as_list
from astrl.envs import ConversationSpec, make_redteam_env
from astrl.envs.recipe import opener_stream
from astrl.keys import NEXT, PROBE, TARGET_TOKENS
from astrl.models import load_model
from astrl.policies import GenerationSettings, input_mode, make_policy
from astrl.prefill import clear_turn_caches
from astrl.rewards.weights import LIKELIHOOD_REWARDS
from astrl.scorers import make_scorers
from astrl.training.demo import demo_config
from astrl.training.setup import conversation_spec

MMAP_THRESHOLD = "131072"  # glibc's default start, kept fixed: large blocks are mapped and unmapped


def _specs(args) -> dict[str, ConversationSpec]:
    demo = conversation_spec(demo_config({"tester": args.model, "target": args.model}))
    demo = replace(demo, lora=None, scorers=demo.scorers[:1], device=args.device, dtype=args.dtype, seed=args.seed)
    chat = ConversationSpec(
        tester=args.model,
        target=args.model,
        batch_size=4 if args.quick else 8,
        turns=2 if args.quick else 3,
        tester_generation=GenerationSettings(16 if args.quick else 32),
        target_generation=GenerationSettings(16 if args.quick else 32),
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
    )
    return {name: spec for name, spec in (("demo", demo), ("chat", chat)) if name in args.steps}


def _env(spec: ConversationSpec, lm, scorers, return_log_probs: bool):
    """The spec's env over policies of ``lm`` that return log-probs or not."""
    mode = input_mode(spec.mode)
    tester = make_policy(lm, spec.tester_generation, input_mode=mode, return_log_probs=return_log_probs)
    target = make_policy(
        lm,
        spec.target_generation,
        input_mode=mode,
        return_log_probs=return_log_probs,
        keep_prompt_states=spec.reward in LIKELIHOOD_REWARDS,
    )
    env = make_redteam_env(
        tester,
        target,
        scorers,
        opener_stream(spec),
        batch_size=spec.batch_size,
        max_turns=spec.turns,
        seed=spec.seed,
        **spec.env_options(),
    )
    return env, tester


def _step(env, tester, lm, turns: int, seed: int, device: str) -> tuple[float, float, list]:
    """One rollout of the env's turns: seconds, peak memory (MiB) above its start, what it sampled."""
    clear_turn_caches(lm.model)
    torch.manual_seed(seed)
    with PeakMemory(device) as peak, torch.no_grad():
        sync(device)
        start = time.perf_counter()
        rollout = env.rollout(turns, tester)
        sync(device)
        seconds = time.perf_counter() - start
    rollout = rollout.reshape(-1)
    sampled = [rollout[NEXT, TARGET_TOKENS].cpu(), as_list(rollout[NEXT, PROBE])]
    return seconds, peak.peak_mb, sampled


def _compare(spec: ConversationSpec, lm, scorers, args) -> dict:
    envs = {side: _env(spec, lm, scorers, side == "with") for side in ("with", "without")}
    for env, tester in envs.values():  # untimed warm-up of each side
        _step(env, tester, lm, spec.turns, args.seed, args.device)
    seconds, memory, same = {"with": [], "without": []}, {"with": [], "without": []}, True
    for i in range(args.repeats):
        order = ("with", "without") if i % 2 == 0 else ("without", "with")
        sampled = {}
        for side in order:
            env, tester = envs[side]
            s, m, sampled[side] = _step(env, tester, lm, spec.turns, args.seed + 1 + i, args.device)
            seconds[side].append(s)
            memory[side].append(m)
        a, b = sampled["with"], sampled["without"]
        same = same and torch.equal(a[0], b[0]) and a[1] == b[1]
    med = {side: (statistics.median(seconds[side]), statistics.median(memory[side])) for side in seconds}
    return {
        "mode": spec.mode,
        "conversations": spec.batch_size,
        "turns": spec.turns,
        "tester_new_tokens": spec.tester_generation.max_new_tokens,
        "target_new_tokens": spec.target_generation.max_new_tokens,
        "reply_samples": spec.reply_samples,
        "reward": spec.reward,
        "reply_lexicon": bool((spec.reward_options or {}).get("lexicon")),
        "with_log_probs_s": r(med["with"][0]),
        "without_s": r(med["without"][0]),
        "time_saved": r(1 - med["without"][0] / med["with"][0], 3),
        "time_saved_paired_s": r(statistics.median(a - b for a, b in zip(seconds["with"], seconds["without"], strict=True))),
        "with_log_probs_peak_mb": r(med["with"][1], 1),
        "without_peak_mb": r(med["without"][1], 1),
        "peak_saved_mb": r(med["with"][1] - med["without"][1], 1),
        "same_tokens": same,
        "per_step_s": {side: [r(s, 3) for s in v] for side, v in seconds.items()},
        "per_step_peak_mb": {side: [r(m, 1) for m in v] for side, v in memory.items()},
    }


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--steps", nargs="+", default=["demo", "chat"], choices=["demo", "chat"])
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per side (default 7, quick 4)")
    args = parser.parse_args()
    if args.device == "cpu" and os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
        os.execv(sys.executable, [sys.executable, *sys.argv])
    if args.backend != "transformers":
        parser.error("only the transformers backend returns logits through generate")
    args.repeats = args.repeats or (4 if args.quick else 7)
    info = setup(args)
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    results = {}
    for name, spec in _specs(args).items():
        scorers = make_scorers(spec.scorers, device=args.device)
        results[name] = _compare(spec, lm, scorers, args)
    emit({**info, "repeats": args.repeats, "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"), **results})


if __name__ == "__main__":
    main()
