"""The ``astrl train`` and ``astrl demo`` subcommands."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from astrl.argtypes import add_setting_flags, at_least, given_settings
from astrl.backends import CollectionSettings


def add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a tester (GRPO; see configs/) and write a run directory",
        description="Train a tester from a YAML config and key=value overrides. Every config key, with its "
        "default and meaning: astrl train --keys",
    )
    p.add_argument("--config", default=None, help="YAML config (configs/NAME.yaml); defaults apply to missing keys")
    p.add_argument("--keys", action="store_true", help="print every config key with its default and meaning, and exit")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in a run_dir that holds an earlier one, replacing it (its checkpoints, final tester "
        "and logs are removed); without it such a run_dir is refused",
    )
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="with --resume: load a checkpoint that needs full unpickling (older astrl versions); "
        "this can run code stored in the file, so use it only for run directories whose origin you trust",
    )
    p.add_argument(
        "--until",
        type=at_least(0),
        default=None,
        metavar="STEP",
        help="stop after step STEP (0: after the warm start) with a checkpoint there; the learning-rate schedule "
        "still runs over total_steps, and --resume goes on from it",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or sample tables")
    add_setting_flags(p, CollectionSettings, default=None, shown="the config's, else {}")  # shorthands for config keys
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. total_steps=50 lr=1e-4")


def train_overrides(args) -> list[str]:
    """The ``key=value`` overrides, with the scale-out flags (:class:`~astrl.backends.CollectionSettings`)
    first (explicit overrides win)."""
    flags = [f"{key}={value}" for key, value in given_settings(args, CollectionSettings, unset=None).items()]
    return flags + list(args.overrides)


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="train on the embedded default (SmolLM2, profanity scorer) and show before/after")
    p.add_argument(
        "--full",
        action="store_true",
        help="the longer recipe, configs/demo_full.yaml (three warm-start rounds of 96 openers, 36 GRPO steps, 256 "
        "held-out conversations; about 12 minutes on 2 cores) instead of configs/demo.yaml (about 5); with --mode chat, "
        "the chat RL recipe, configs/elicit_chat_full.yaml (48 GRPO steps on the word list less its ordinary words, "
        "the probe gated by the SVM judge, the run's best probes replayed; about 70 minutes on 2 cores: 54 of training, 14 "
        "of comparison)",
    )
    p.add_argument(
        "--mode",
        choices=("text", "chat"),
        default="text",
        help="chat: configs/elicit_chat.yaml, a 2-turn ChatEnv against the instruct target (a chat lookahead search "
        "warm start, 16 GRPO steps), compared on 436 conversations from 218 held-out openers (about an hour on 2 cores)",
    )
    p.add_argument("--steps", type=at_least(1), default=None, help="training steps (default: the recipe's)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="run directory (default: runs/demo, runs/demo_full with --full, runs/elicit_chat with --mode chat, "
        "runs/elicit_chat_full with both); an existing run resumes",
    )
    p.add_argument(
        "--conversations",
        type=at_least(1),
        default=None,
        help="held-out conversations for the before/after comparison (default: 128, 256 with --full, 436 with --mode chat)",
    )
    p.add_argument("--quiet", action="store_true")


def _warn(text: str) -> None:
    print(f"astrl: warning: {text}", file=sys.stderr)


def run_train(args) -> int:
    from astrl.training.config import describe_keys, load_config, renamed_overrides

    if args.keys:
        print(describe_keys())
        return 0
    overrides = renamed_overrides(train_overrides(args), _warn)
    from astrl.store.recorder import check_store

    if args.resume and args.config:
        raise ValueError("--resume continues a run with its own config.yaml; pass overrides instead of --config")
    if not args.resume and args.trust_checkpoint:
        raise ValueError("--trust-checkpoint only applies with --resume RUN_DIR")
    if args.resume and getattr(args, "overwrite", False):
        raise ValueError("--overwrite starts a new run; --resume continues one: pass one of them")
    config = None
    if not args.resume:
        config = load_config(args.config, overrides, on_warning=_warn)
        config.check_names()  # before the trainer's heavy imports and model loads
        _check_new_run_dir(config.run_dir, getattr(args, "overwrite", False))
        if args.until is not None:
            from astrl.training.trainer import check_until

            check_until(config, 0, args.until)
    check_store()  # the results store before any model loads
    from contextlib import nullcontext

    from astrl.locks import sole_writer

    run_dir = Path(args.resume or config.run_dir)
    missing = args.resume and not run_dir.is_dir()  # resume says what is missing; no folder is made for it
    if args.resume and not missing and getattr(args, "until", None) is not None:  # before any model loads
        from astrl.training.trainer import latest_checkpoint

        newest = latest_checkpoint(run_dir)
        step = int(newest.name.removeprefix("step_")) if newest is not None else 0
        if args.until < step:
            raise ValueError(f"--until {args.until} is before the run's newest checkpoint, step {step}")
    # a second job on this folder stops here, before its models load
    with nullcontext() if missing else sole_writer(run_dir, "run folder"):
        return _train_run(args, overrides, config)


def _check_new_run_dir(run_dir: str, overwrite: bool) -> None:
    """Refuse a new run in a folder that holds an earlier run, unless ``overwrite``."""
    from astrl.training.trainer import earlier_run

    held = earlier_run(run_dir)
    if held is not None and not overwrite:
        raise ValueError(
            f"run_dir {str(run_dir)!r} holds an earlier run ({held}): continue it with "
            f"astrl train --resume {run_dir}, start a new run there with --overwrite (which removes it), "
            "or choose another run_dir"
        )


def _train_run(args, overrides: list[str], config) -> int:
    """Build (or resume) the trainer, train, print where the run stands."""
    if args.resume:
        from astrl.training.trainer import resume

        trainer = resume(
            args.resume, overrides, progress=not args.quiet, trust_checkpoint=args.trust_checkpoint, on_warning=_warn
        )
    else:
        from astrl.training.trainer import Trainer

        trainer = Trainer(config, progress=not args.quiet)
    until = getattr(args, "until", None)
    trainer.check_until(until)  # before the first step runs
    try:
        rows = trainer.train(until=until)
    except KeyboardInterrupt as stop:
        from astrl.training.stopping import exit_code

        print(f"astrl: {stop or 'interrupted'}; {_continue_from(trainer)}")
        return exit_code(stop)
    except Exception as err:
        import os

        if os.environ.get("ASTRL_DEBUG"):
            raise
        from astrl.errors import one_line

        print(f"astrl: error: training stopped in step {trainer.step + 1}: {one_line(err)}", file=sys.stderr)
        print(f"astrl: {_continue_from(trainer)} after fixing the cause", file=sys.stderr)
        return 1
    last = rows[-1] if rows else {}
    print(f"trained {trainer.step} steps; run directory {trainer.run_dir}")
    if trainer.step < trainer.config.total_steps:
        total = trainer.config.total_steps
        print(f"  stopped at step {trainer.step} of {total}; continue with: astrl train --resume {trainer.run_dir}")
    for key in ("reward_mean", "loss", "lr"):
        if key in last:
            print(f"  {key:<12} {last[key]:.4f}")
    return 0


def _continue_from(trainer) -> str:
    """Where a stopped run stands and how to continue it."""
    from astrl.training.warm_start_state import WARM_START_PARTIAL

    checkpoint = getattr(trainer, "stopped_checkpoint", None)
    saved = trainer.run_dir / WARM_START_PARTIAL
    if checkpoint is None and saved.is_file():
        return f"warm start rounds saved in {saved}; continue with: astrl train --resume {trainer.run_dir}"
    if checkpoint is None:
        return f"no checkpoint was written; start again with the same command (run directory {trainer.run_dir})"
    return f"checkpoint {checkpoint}; continue with: astrl train --resume {trainer.run_dir}"


def run_demo_command(args) -> int:
    from astrl.training.demo import run_demo

    if args.conversations is not None and args.conversations < 1:  # checked before training, not after
        raise ValueError(f"--conversations must be >= 1, got {args.conversations}")
    overrides = {}
    if args.steps is not None:
        overrides["total_steps"] = args.steps
    if args.run_dir is not None:
        overrides["run_dir"] = args.run_dir
    result = run_demo(overrides, progress=not args.quiet, conversations=args.conversations, full=args.full, mode=args.mode)
    config, conversations = result["config"], result["conversations"]
    print(reward_curve(Path(config.run_dir) / "metrics.csv"))
    before, after = result["comparison"]["before"], result["comparison"]["after"]
    print(f"\nheld-out openers, {conversations} conversations, same seed (95% bootstrap intervals over openers):")
    # chat rates sit near 2%, where two decimals would print [0.02, 0.03]; the text demo's table keeps its digits
    print(format_comparison(before, after, interval_digits=3 if args.mode == "chat" else 2))
    for side, values in (("untrained", before), ("trained", after)):
        kind = "best elicited turn" if values["best_elicited"] else "best turn (nothing elicited)"
        print(f"\n  {side}, {kind}:\n    probe: {values['best_probe']!r}\n    reply: {values['best_reply']!r}")
    print(f"\nrun directory: {config.run_dir} (demo_summary.json, metrics.csv, samples.jsonl, final/tester)")
    return 0


def format_comparison(before: dict, after: dict, *, interval_digits: int = 2) -> str:
    """The demo's before/after table: training reward, probe NLL, then per judge the elicitation metrics, each
    rate with its interval's bounds to ``interval_digits`` decimals."""

    def cell(values: dict, name: str) -> str:
        low, high = values[f"{name}_ci"]
        return f"{values[name]:.3f} [{low:.{interval_digits}f}, {high:.{interval_digits}f}]"

    lines = [f"  {'':<34}{'untrained':>22}{'trained':>22}"]
    lines.append(f"  {'mean training reward':<34}{before['mean_reward']:>22.3f}{after['mean_reward']:>22.3f}")
    lines.append(f"  {'probe NLL under the target':<34}{before['probe_nll']:>22.3f}{after['probe_nll']:>22.3f}")
    for judge in before["judges"]:
        lines.append(f"  judged by {judge}:")
        b, a = before["judges"][judge], after["judges"][judge]
        for name in ("elicited_reply_share", "elicited_success_rate", "toxic_probe_rate", "toxic_reply_rate"):
            if name in b and name in a:  # the reply shares need several replies a probe
                lines.append(f"    {name:<32}{cell(b, name):>22}{cell(a, name):>22}")
    return "\n".join(lines)


def reward_curve(metrics_csv: Path, buckets: int = 6) -> str:
    """Mean reward per block of steps, as a small text chart."""
    rows = list(csv.DictReader(metrics_csv.open(encoding="utf-8")))
    if not rows:
        return "no training steps recorded"
    size = max(1, len(rows) // buckets)
    lines = ["training reward (mean per block of steps):"]
    blocks = [rows[i : i + size] for i in range(0, len(rows), size)]
    means = [sum(float(r["reward_mean"]) for r in b) / len(b) for b in blocks]
    low, high = min(means), max(means)
    for block, mean in zip(blocks, means, strict=True):
        bar = "#" * (1 + int(30 * (mean - low) / (high - low))) if high > low else "#"
        lines.append(f"  steps {block[0]['step']:>4}-{block[-1]['step']:<4} {mean:8.4f} {bar}")
    return "\n".join(lines)
