"""The ``astrl`` command line."""

from __future__ import annotations

import argparse
import os
import sys

LATER = {
    "train": "train a tester with GRPO, PPO, DPO or IPO",
    "eval": "evaluate a tester against a target with a judge",
    "demo": "train on the embedded default and show before/after",
}


def _add_rollout(sub) -> None:
    p = sub.add_parser("rollout", help="run tester-vs-target conversations and write one JSON line per turn")
    p.add_argument("--tester", default="smollm2-135m", help="embedded name, local folder or hub id (default: smollm2-135m)")
    p.add_argument("--target", default="smollm2-135m", help="embedded name, local folder or hub id (default: smollm2-135m)")
    p.add_argument(
        "--scorer",
        action="append",
        dest="scorers",
        metavar="NAME",
        help="scorer of the target's replies, repeatable; the first gives the reward (default: profanity)",
    )
    p.add_argument(
        "--prompts", default="builtin", help="builtin, rtp[:CATEGORY], harmbench, chatterbot, hf:ID or a .txt/.jsonl file"
    )
    p.add_argument("--split", default="all", choices=["train", "dev", "test", "all"], help="prompt split (seeded)")
    p.add_argument("--num-conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3, help="tester turns per conversation")
    p.add_argument("--batch-size", type=int, default=8, help="conversations generated together")
    p.add_argument(
        "--mode", default="chat", choices=["chat", "text"], help="chat templates (chat) or plain-text continuation (text)"
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per tester turn (and per target turn unless set)")
    p.add_argument("--target-max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k filtering")
    p.add_argument("--greedy", action="store_true", help="greedy decoding for both models")
    p.add_argument("--system-prompt", default=None, help="the tester's red-teaming system prompt (chat mode)")
    p.add_argument("--target-system-prompt", default=None)
    p.add_argument(
        "--reward",
        default="score",
        choices=["score", "astprompter"],
        help="score: the first scorer's probability of the reply; astprompter: "
        "alpha*tox(reply) + zeta*tox(probe+reply) + gamma*mean log p_target(probe)",
    )
    p.add_argument("--alpha", type=float, default=1.0, help="astprompter weight of the reply's toxicity")
    p.add_argument("--zeta", type=float, default=0.5, help="astprompter weight of the probe+reply toxicity")
    p.add_argument("--gamma", type=float, default=0.1, help="astprompter weight of the probe's mean log-prob under the target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="rollouts.jsonl", help="output JSONL path")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _rollout(args) -> int:
    from astrl.policies import GenerationSettings
    from astrl.rollout import RolloutConfig, run_rollout

    def generation(max_new: int) -> GenerationSettings:
        return GenerationSettings(max_new, args.temperature, args.top_p, args.top_k, do_sample=not args.greedy)

    config = RolloutConfig(
        tester=args.tester,
        target=args.target,
        scorers=args.scorers or ["profanity"],
        prompts=args.prompts,
        split=args.split,
        num_conversations=args.num_conversations,
        turns=args.turns,
        batch_size=args.batch_size,
        mode=args.mode,
        tester_generation=generation(args.max_new_tokens),
        target_generation=generation(args.target_max_new_tokens or args.max_new_tokens),
        tester_system_prompt=args.system_prompt,
        target_system_prompt=args.target_system_prompt,
        reward=args.reward,
        alpha=args.alpha,
        zeta=args.zeta,
        gamma=args.gamma,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
    )
    summary = run_rollout(config, args.out, progress=not args.quiet)
    width = max(len(k) for k in summary)
    print(f"wrote {summary['turns']} turns of {summary['conversations']} conversations to {args.out}")
    for key, value in summary.items():
        print(f"  {key:<{width}}  {value:.4f}" if isinstance(value, float) else f"  {key:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astrl", description="Adaptive stress testing of language models with TorchRL.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_rollout(sub)
    for name, text in LATER.items():
        sub.add_parser(name, help=f"{text} (not available in this version)")
    return parser


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in LATER:
        print(f"astrl: error: '{args.command}' is not available in this version yet", file=sys.stderr)
        return 2
    _quiet_libraries()
    from astrl.models import ModelLoadError
    from astrl.prompts import PromptSourceError
    from astrl.scorers import ScorerError

    try:
        return _rollout(args)
    except (ModelLoadError, PromptSourceError, ScorerError, ValueError, TypeError) as err:
        print(f"astrl: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("astrl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
