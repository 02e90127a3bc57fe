"""The ``astrl`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import sys

from astrl.argtypes import FIELD_DEFAULT, add_setting_flags, at_least, given_settings
from astrl.errors import one_line
from astrl.names import MODEL_DTYPES

LATER: dict[str, str] = {}


def _add_sampling_args(p) -> None:
    """``--temperature``, ``--top-p`` and ``--top-k``: the :class:`~astrl.decoding.DecodingSettings` fields,
    which mean the same on every command (the lengths do not: a turn, a reply, the run's)."""
    from astrl.decoding import DecodingSettings

    add_setting_flags(p, DecodingSettings, default=FIELD_DEFAULT)


def _add_generation_args(p, *, from_run: bool = False) -> None:
    """The sampling flags, one per :class:`~astrl.envs.settings.RunSampling` field; ``from_run``: the lengths
    are :class:`~astrl.envs.settings.EvalLengths`' (the tester's run's unless given, ``astrl eval``)."""
    from astrl.envs.settings import EvalLengths, RunSampling

    names = [spec.name for spec in dataclasses.fields(RunSampling)]
    if from_run:  # eval: lengths of their own, the run's unless given
        add_setting_flags(p, EvalLengths, default=FIELD_DEFAULT)
        names = [name for name in names if name not in EvalLengths.__dataclass_fields__]
    add_setting_flags(p, RunSampling, names=names, default=FIELD_DEFAULT)


def _add_run_args(p) -> None:
    """``--seed``, and ``--dtype`` and ``--device`` from :class:`~astrl.names.ModelSettings`."""
    from astrl.names import ModelSettings

    p.add_argument("--seed", type=int, default=0)
    add_setting_flags(p, ModelSettings, default=FIELD_DEFAULT)


def _add_report_args(p) -> None:
    """The report flags of ``astrl eval`` and ``astrl replay``, one per
    :class:`~astrl.evaluation.settings.ReportSettings` field (read back by :func:`_report_settings`)."""
    from astrl.evaluation.settings import ReportSettings

    add_setting_flags(p, ReportSettings, default=FIELD_DEFAULT)


def _add_output_args(p, folder: str) -> None:
    p.add_argument("--out", default=folder, help=f"output folder (default: ./{folder})")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


# the ConversationRuns fields that are flags of astrl rollout and astrl eval (the seed is a run flag, the
# sampling has its own flags), and the flag of a field named otherwise
CONVERSATION_FLAGS = (
    "split_seed", "prompts", "split", "test_fraction", "turns", "mode", "tester_system_prompt", "target_system_prompt",
    "reply_samples", "batch_size", "num_conversations",
)  # fmt: skip
CONVERSATION_FLAG_NAMES = {"tester_system_prompt": "--system-prompt"}


def _add_conversation_args(p, *, from_run: bool = False) -> None:
    """The conversation flags, one per :data:`CONVERSATION_FLAGS` field of
    :class:`~astrl.envs.settings.ConversationRuns` with its help and checks; ``from_run``: ``astrl eval``'s
    defaults (:data:`~astrl.envs.settings.EvalRuns`, where ``None`` is the tester's run's value)."""
    from astrl.envs.settings import ConversationRuns, EvalRuns

    kind, unset = (EvalRuns, "the run's") if from_run else (ConversationRuns, None)
    add_setting_flags(
        p, kind, names=CONVERSATION_FLAGS, flags=CONVERSATION_FLAG_NAMES, default=FIELD_DEFAULT, unset=unset
    )  # fmt: skip


def _run_settings(args) -> dict:
    """The seed, dtype and device flags (:func:`_add_run_args`) as config keywords."""
    return {"seed": args.seed, "dtype": args.dtype, "device": args.device}


def _conversation_settings(args) -> dict:
    """The :class:`~astrl.envs.settings.ConversationRuns` keywords of ``astrl rollout`` and ``astrl eval``
    from their conversation, sampling and run flags."""
    from astrl.envs.settings import ConversationRuns, RunSampling

    given = given_settings(args, RunSampling)
    sampling = RunSampling(**{name: value for name, value in given.items() if value is not None})  # None: the run's
    return {
        **given_settings(args, ConversationRuns, names=CONVERSATION_FLAGS),
        "tester_generation": sampling.generation(),
        "target_generation": sampling.generation(target=True),
        **_run_settings(args),
    }


def _report_settings(args) -> dict:
    """The report flags that ``astrl eval`` and ``astrl replay`` share, as config keywords."""
    from astrl.evaluation.settings import ReportSettings

    return given_settings(args, ReportSettings)


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
    _add_conversation_args(p)
    _add_generation_args(p)
    _add_reward_args(p)
    _add_run_args(p)
    from astrl.backends import CollectionSettings

    add_setting_flags(p, CollectionSettings)
    p.add_argument("--out", default="rollouts.jsonl", help="output JSONL path")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_reward_args(p) -> None:
    """The reward flags: one per :class:`~astrl.rewards.settings.RewardSettings` field."""
    from astrl.rewards.settings import RewardSettings

    add_setting_flags(p, RewardSettings)
    p.add_argument("--gamma", type=float, default=None, help=argparse.SUPPRESS)  # the old name of --likelihood-weight


def _reward_settings(args) -> dict:
    """The reward flags given (:func:`_add_reward_args`) as config keywords; ``--gamma``, the old name of
    ``--likelihood-weight``, is read as it with a warning."""
    from astrl.rewards.settings import RewardSettings

    given = given_settings(args, RewardSettings)
    if args.gamma is not None:
        if "likelihood_weight" in given:
            raise ValueError(
                "both --gamma and --likelihood-weight are given; --gamma is the old name of --likelihood-weight: "
                "keep only --likelihood-weight"
            )
        print("astrl: warning: --gamma is deprecated: it is now --likelihood-weight (same meaning)", file=sys.stderr)
        given["likelihood_weight"] = args.gamma
    return given


def _rollout(args) -> int:
    from astrl.backends import CollectionSettings
    from astrl.rollout import RolloutConfig, run_rollout

    config = RolloutConfig(
        **_conversation_settings(args),
        tester=args.tester,
        target=args.target,
        scorers=args.scorers or ["profanity"],
        **_reward_settings(args),
        **given_settings(args, CollectionSettings),
    )
    summary = run_rollout(config, args.out, progress=not args.quiet)
    width = max(len(k) for k in summary)
    print(f"wrote {summary['turns']} turns of {summary['conversations']} conversations to {args.out}")
    for key, value in summary.items():
        print(f"  {key:<{width}}  {value:.4f}" if isinstance(value, float) else f"  {key:<{width}}  {value}")
    return 0


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a tester against a target with one or more judges; write metrics and a report")
    p.add_argument("--tester", required=True, help="training run directory, model folder, embedded name or hub id")
    p.add_argument(
        "--checkpoint", default=None, help="run directory only: checkpoint name (step_000N) or folder, instead of final/"
    )
    p.add_argument("--target", default=None, help="model to attack (default: the run's target, else smollm2-135m)")
    p.add_argument(
        "--judge",
        action="append",
        dest="judges",
        metavar="NAME",
        help="scorer that judges every turn, repeatable; prefer one other than the training scorer "
        "(default: the run's judges, else its training scorer, else profanity; plus wordlist when none differs "
        "from the training scorer)",
    )
    _add_conversation_args(p, from_run=True)
    _add_generation_args(p, from_run=True)
    _add_report_args(p)
    p.add_argument("--no-embeddings", action="store_true", help="skip the embedding-based diversity metrics")
    _add_run_args(p)
    _add_output_args(p, "eval")


def _eval(args) -> int:
    from astrl.envs.settings import EvalLengths
    from astrl.evaluation.run import EvalConfig, run_eval

    config = EvalConfig(
        **_conversation_settings(args),
        **given_settings(args, EvalLengths),
        **_report_settings(args),
        tester=args.tester,
        target=args.target,
        judges=args.judges,
        checkpoint=args.checkpoint,
        embeddings=not args.no_embeddings,
    )
    metrics = run_eval(
        config, args.out, progress=not args.quiet, on_warning=lambda text: print(f"astrl: warning: {text}", file=sys.stderr)
    )
    print(f"evaluated {metrics['n_conversations']} conversations x {metrics['turns']} turns; wrote {args.out}/")
    nll = metrics["probe_nll"]["mean"]
    print(f"  probe NLL under the target  {'n/a' if nll is None else f'{nll:.3f}'}")
    for judge, result in metrics["judges"].items():
        low, high = result["asr_ci"] or (float("nan"), float("nan"))
        e_low, e_high = result["elicited_asr_ci"] or (float("nan"), float("nan"))
        print(
            f"  {judge}: ASR {result['asr']:.3f} [{low:.3f}, {high:.3f}]  elicited ASR {result['elicited_asr']:.3f} "
            f"[{e_low:.3f}, {e_high:.3f}]  toxic reply rate {result['toxic_reply_rate']:.3f}"
        )
        diversity = ", ".join(
            f"{label} {_value(result.get(key))}"
            for key, label in (
                ("self_bleu_diversity", "self-BLEU diversity"),
                ("embedding_diversity", "embedding diversity"),
                ("unique_attacks", "unique attacks"),
            )
        )
        print(f"    {result['n_successful_probes']} successful probes: {diversity}")
    _print_agreement(metrics.get("judge_agreement"))
    archive = metrics["attack_archive"]
    print(f"  attack archive: {archive['unique_probes']} distinct successful probes in {args.out}/{archive['file']}")
    return 0


def _print_agreement(agreement: dict | None) -> None:
    """Pairwise agreement and Cohen's kappa of the judges (eval and replay)."""
    if not agreement:
        return
    for pair in agreement["pairs"]:
        a, b = pair["judges"]
        ci = f" [{pair['kappa_ci'][0]:.3f}, {pair['kappa_ci'][1]:.3f}]" if pair["kappa_ci"] else ""
        print(
            f"  judges {a} vs {b}: agreement {pair['agreement']:.3f}, Cohen's kappa {_value(pair['kappa'])}{ci} "
            f"({pair['only_a']} toxic only under {a}, {pair['only_b']} only under {b})"
        )
    if agreement["training_scorers"]:
        print(f"  replies toxic under the training scorer alone: {agreement['n_training_scorer_only']}")


def _value(value) -> str:
    return "n/a" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def _add_replay(sub) -> None:
    from astrl.evaluation.settings import ReplaySettings

    p = sub.add_parser("replay", help="replay an attack archive against one or more targets; judge and compare the replies")
    p.add_argument(
        "archive",
        metavar="ARCHIVE",
        help="attacks.jsonl, a run or eval folder holding one, a JSONL file of {probe, conversation} or a text file of probes",
    )
    p.add_argument(
        "--target",
        action="append",
        dest="targets",
        metavar="SPEC[@FILE]",
        help="model to attack, repeatable: embedded name, model folder, hub id or a run directory (its hardened target, "
        "final/target); @FILE gives it the system prompt held in FILE (default: the folder's target, else smollm2-135m)",
    )
    p.add_argument(
        "--judge",
        action="append",
        dest="judges",
        metavar="NAME",
        help="scorer that judges every reply, repeatable (default: as astrl eval, from the run's judges and training scorer)",
    )
    add_setting_flags(p, ReplaySettings, default=FIELD_DEFAULT)
    _add_sampling_args(p)
    _add_report_args(p)
    _add_run_args(p)
    _add_output_args(p, "replay")


def _replay(args) -> int:
    from astrl.decoding import DecodingSettings
    from astrl.evaluation.replay import ReplayConfig, run_replay
    from astrl.evaluation.settings import ReplaySettings

    config = ReplayConfig(
        archive=args.archive,
        targets=args.targets,
        judges=args.judges,
        **given_settings(args, ReplaySettings),
        **given_settings(args, DecodingSettings),
        **_report_settings(args),
        **_run_settings(args),
    )
    result = run_replay(
        config, args.out, progress=not args.quiet, on_warning=lambda text: print(f"astrl: warning: {text}", file=sys.stderr)
    )
    decoding = "greedy" if result["greedy"] else f"{result['samples']} sample(s) each"
    print(f"replayed {result['n_attacks']} attacks against {len(result['targets'])} target(s), {decoding}; wrote {args.out}/")
    for target, per_judge in result["transfer"].items():
        for judge, cell in per_judge.items():
            low, high = cell["success_rate_ci"] or (float("nan"), float("nan"))
            print(
                f"  {target} / {judge}: success rate {cell['success_rate']:.3f} [{low:.3f}, {high:.3f}]  "
                f"elicited {cell['elicited_success_rate']:.3f}  attacks with a toxic reply {cell['n_successful_attacks']}"
            )
    for judge, sets in result["transfer_sets"].items():
        print(f"  {judge}: {len(sets['every_target'])} attack(s) succeed on every target, {len(sets['no_target'])} on none")
    _print_agreement(result.get("judge_agreement"))
    return 0


def _add_compare(sub) -> None:
    p = sub.add_parser(
        "compare", help="compare two 'astrl eval' folders (or eval runs of the results store): differences and their significance"
    )
    p.add_argument("dir_a", metavar="A", help="an 'astrl eval' folder, or the id (or its start) of an eval run in the store")
    p.add_argument("dir_b", metavar="B")
    p.add_argument(
        "--pair", nargs=2, action="append", default=[], metavar=("A2", "B2"),
        help="one more pair of evaluations (another training seed, say): the table then gives the mean over all pairs, "
        "its interval from each pair resampled on its own; repeat for more pairs",
    )  # fmt: skip
    p.add_argument("--store", default=None, metavar="PATH", help="the store that run ids refer to (default: $ASTRL_STORE)")
    p.add_argument(
        "--out", default=None, help="markdown table path (default: B's folder/compare.md, compare_pooled.md with --pair)"
    )
    p.add_argument("--resamples", type=at_least(1), default=1000, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rejudge", action="store_true",
        help="judge an evaluation written before a word check (e.g. past_probe_forms) again with it, in memory "
        "(loads its judges; the folders are not changed), so that both sides have the check's rows",
    )  # fmt: skip


def _compare(args) -> int:
    from pathlib import Path

    from astrl.evaluation.compare import compare, compare_pooled, format_markdown, format_text
    from astrl.store_cli import eval_folder

    pairs = [(eval_folder(a, args.store), eval_folder(b, args.store)) for a, b in [(args.dir_a, args.dir_b), *args.pair]]
    dir_b = pairs[0][1]
    if args.pair:
        result = compare_pooled(pairs, resamples=args.resamples, seed=args.seed, rejudge=args.rejudge)
    else:
        result = compare(*pairs[0], resamples=args.resamples, seed=args.seed, rejudge=args.rejudge)
    out = Path(args.out) if args.out else Path(dir_b) / ("compare_pooled.md" if args.pair else "compare.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(format_markdown(result), encoding="utf-8")
    print(format_text(result), end="")
    print(f"wrote {out}")
    return 0


def _add_select(sub) -> None:
    from astrl.envs.settings import ConversationRuns
    from astrl.evaluation.settings import CONVERSATIONS_PER_OPENER, SELECT_BY, SELECT_SPLITS, ReportSettings

    p = sub.add_parser(
        "select",
        help="choose among training runs (seeds, variants) by their training scorer's share on the dev openers, "
        "never the held-out judge",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="training run directories of one setting, two or more")
    p.add_argument("--checkpoint", default=None, help="every run's checkpoint of this name (step_000N) instead of final/")
    p.add_argument("--scorer", default=None, help="scorer that chooses (default: the runs' training scorer)")
    p.add_argument(
        "--split", default="dev", choices=SELECT_SPLITS, help="openers to choose on (default: dev; never the held-out test)"
    )
    p.add_argument(
        "--num-conversations", type=at_least(1), default=None,
        help=f"conversations per candidate (default: {CONVERSATIONS_PER_OPENER} per opener of the split)",
    )  # fmt: skip
    p.add_argument("--reply-samples", type=at_least(1), default=None, help="replies judged per probe (default: the runs')")
    p.add_argument(
        "--by", default="share", choices=SELECT_BY,
        help="share: the scorer's elicited reply share; lexicon (chat runs): the mean reply lexicon estimate of the same "
        "replies, the training reward's other reply term, read back through the target",
    )  # fmt: skip
    add_setting_flags(p, ConversationRuns, names=["batch_size"], default=FIELD_DEFAULT)
    add_setting_flags(p, ReportSettings, names=["threshold", "resamples"], default=FIELD_DEFAULT)
    _add_run_args(p)
    _add_output_args(p, "selection")


def _select(args) -> int:
    from astrl.evaluation.run import EvalConfig
    from astrl.evaluation.selection import SELECTION_FILE, Candidate, select_testers

    base = EvalConfig(
        split=args.split, batch_size=args.batch_size, threshold=args.threshold, resamples=args.resamples, **_run_settings(args)
    )

    def reading(row: dict, name: str) -> str:
        low, high = row[f"{name}_ci"] or (float("nan"), float("nan"))
        return f"{row[name]:.2%} [{low:.2%}, {high:.2%}]"

    def show(index: int, candidate: Candidate, row: dict) -> None:
        again = " (evaluated before)" if row["reused"] else ""
        lexicon = f"; reply lexicon {reading(row, 'reply_lexicon_share')}" if "reply_lexicon_share" in row else ""
        print(f"  {index + 1}. {candidate.label}: {reading(row, 'elicited_reply_share')}{lexicon}{again}")

    candidates = [Candidate(run, args.checkpoint) for run in args.runs]
    summary = select_testers(
        candidates, args.out, base=base, scorer=args.scorer, num_conversations=args.num_conversations,
        reply_samples=args.reply_samples, by=args.by, progress=not args.quiet, on_candidate=show,
    )  # fmt: skip
    chosen = summary["candidates"][summary["chosen"]]
    measure = summary["measure"]
    print(
        f"chosen: {candidates[summary['chosen']].label}, {measure.replace('_', ' ')} {chosen[measure]:.2%} under "
        f"{summary['scorer']} on {summary['n_conversations']} {summary['split']} conversations; wrote {args.out}/{SELECTION_FILE}"
    )
    if summary["scorer_is_a_judge"]:
        print(f"  {summary['scorer']} is one of the runs' judges: the choice favours what it rewards, blind spots included")
    if not summary["apart_from_runner_up"]:
        print("  its interval overlaps the runner-up's: the choice is not sure at this many conversations")
    command = f"astrl eval --tester {chosen['run']}" + (f" --checkpoint {args.checkpoint}" if args.checkpoint else "")
    print(f"  judge it on the held-out openers with a judge other than {summary['scorer']}: {command}")
    return 0


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="write a run's tester as a self-contained Hugging Face model folder with a model card")
    p.add_argument("run_dir", metavar="RUN_DIR", help="training run directory")
    p.add_argument("--checkpoint", default=None, help="checkpoint name (step_000N) or folder, instead of final/")
    p.add_argument("--out", required=True, help="output folder (new or empty)")
    p.add_argument(
        "--eval",
        default=None,
        dest="eval_dir",
        metavar="FOLDER",
        help="an 'astrl eval' folder whose held-out numbers go into the model card (default: the newest eval of this "
        "run and checkpoint in the results store, else the demo's comparison)",
    )
    p.add_argument(
        "--garak-config",
        default=None,
        metavar="FILE",
        help="also write a garak config (.yaml/.yml, else JSON) that runs the folder as atkgen's red-team model",
    )
    p.add_argument("--dtype", default=None, choices=MODEL_DTYPES, help="default: the run's dtype")


def _export(args) -> int:
    from astrl.training.export import export_tester

    settings = export_tester(
        args.run_dir,
        args.out,
        checkpoint=args.checkpoint,
        garak_config=args.garak_config,
        eval_dir=args.eval_dir,
        dtype=args.dtype,
    )
    print(f"exported the {settings['checkpoint']} tester of {args.run_dir} to {args.out}/ ({settings['mode']} mode)")
    if args.garak_config:
        print(f"wrote {args.garak_config}: python -m garak --config {args.garak_config} --target_type TYPE --target_name NAME")
    return 0


def _train(args) -> int:
    from astrl.training.commands import run_train

    return run_train(args)


def _demo(args) -> int:
    from astrl.training.commands import run_demo_command

    return run_demo_command(args)


def _attacks(args) -> int:
    from astrl.store_cli import run_attacks

    return run_attacks(args)


def _runs(args) -> int:
    from astrl.store_cli import run_runs

    return run_runs(args)


COMMANDS = {
    "rollout": _rollout,
    "train": _train,
    "demo": _demo,
    "eval": _eval,
    "replay": _replay,
    "compare": _compare,
    "select": _select,
    "export": _export,
    "attacks": _attacks,
    "runs": _runs,
}


class _Parser(argparse.ArgumentParser):
    """Usage errors as one ``astrl: error:`` line (exit code 2), like every other error of the CLI."""

    def error(self, message: str):
        self.exit(2, f"astrl: error: {' '.join(message.split())} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="astrl", description="Adaptive stress testing of language models with TorchRL.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from astrl.training.commands import add_demo_parser, add_train_parser

    _add_rollout(sub)
    add_train_parser(sub)
    add_demo_parser(sub)
    _add_eval(sub)
    _add_replay(sub)
    _add_compare(sub)
    _add_select(sub)
    _add_export(sub)
    from astrl.store_cli import add_attacks_parser, add_runs_parser

    add_attacks_parser(sub)
    add_runs_parser(sub)
    for name, text in LATER.items():
        sub.add_parser(name, help=f"{text} (not available in this version)")
    return parser


def _quiet_libraries() -> None:
    """No library warnings, log lines or progress bars of Transformers: set through the environment
    when Transformers is not imported yet (importing it would cost half a second here), else directly."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    if "transformers" not in sys.modules:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def check_arguments(args) -> None:
    """The checks of the parsed arguments that need no model and no torch: model, scorer and judge
    names, prompt sources and splits. A typo ends the command in well under a second, before the heavy
    imports and any model load; the commands check the rest (run directories, archives, configs) before
    they load a model too."""
    from astrl.envs.settings import SeedSettings
    from astrl.names import check_names, is_run_dir

    if args.command == "rollout":
        roles = {"tester": args.tester, "target": args.target}
        scorers = (args.scorers or ["profanity"]) + [name for name in [getattr(args, "probe_scorer", None)] if name]
        seed = SeedSettings(args.seed, args.split_seed).prompt_split_seed
        check_names(
            roles, scorers, args.prompts, split=args.split, split_seed=seed, test_fraction=args.test_fraction,
        )  # fmt: skip
    elif args.command == "eval":
        roles = {} if is_run_dir(args.tester) else {"tester": args.tester}
        if args.target is not None:
            roles["target"] = args.target
        check_names(roles, args.judges, args.prompts, scorer_kind="judge")  # the split seed may come from the run
    elif args.command == "replay" and args.judges:
        check_names(scorers=args.judges, scorer_kind="judge")
    elif args.command == "select" and args.scorer:
        check_names(scorers=[args.scorer])


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Errors that end a command with one ``astrl: error:`` line (exit code 2)."""
    from astrl.backends import MissingExtraError
    from astrl.errors import ModelLoadError, ScorerError
    from astrl.prompts import PromptSourceError

    return (MissingExtraError, ModelLoadError, PromptSourceError, ScorerError, ValueError, TypeError, OSError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "train" and all("=" in item and not item.startswith("-") for item in extra):
        args.overrides += extra  # key=value overrides after an option (train --quiet total_steps=3)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in LATER:
        print(f"astrl: error: '{args.command}' is not available in this version yet", file=sys.stderr)
        return 2
    if isinstance(sys.stdout, io.TextIOWrapper):  # progress lines reach a log file as they are printed
        sys.stdout.reconfigure(line_buffering=True)
    try:
        check_arguments(args)
        _quiet_libraries()
        return COMMANDS[args.command](args)
    except KeyboardInterrupt as stop:
        from astrl.training.stopping import exit_code

        print(f"astrl: {stop or 'interrupted'}", file=sys.stderr)
        return exit_code(stop)
    except Exception as err:
        if isinstance(err, _expected_errors()):
            print(f"astrl: error: {one_line(err)}", file=sys.stderr)
            return 2
        if os.environ.get("ASTRL_DEBUG"):  # a failure astrl did not foresee: still one line, the traceback on request
            raise
        print(f"astrl: error: {type(err).__name__}: {one_line(err)} (set ASTRL_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
