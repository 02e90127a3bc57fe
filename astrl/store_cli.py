"""The ``astrl attacks`` and ``astrl runs`` subcommands: the results store from the command line.

Both read the store only (``--store``, else ``$ASTRL_STORE``, else ``runs/astrl.sqlite``) and never
import torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from astrl.argtypes import at_least, fraction, threshold
from astrl.evaluation.settings import DEFAULT_THRESHOLD

FORMAT_NAMES = ("jsonl", "csv", "archive", "datasets")  # astrl.store.export.FORMATS, without importing the store here


def _add_store_arg(p) -> None:
    p.add_argument(
        "--store", default=None, metavar="PATH", help="store file or folder (default: $ASTRL_STORE, else runs/astrl.sqlite)"
    )


def add_attacks_parser(sub) -> None:
    """Register ``astrl attacks`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "attacks",
        help="list the attacks of the results store across runs, filtered; export them",
        description="Attacks (successful probes, one per normalised probe) found by every run written to the results "
        "store, best score first. See docs/store.md.",
    )
    _add_store_arg(p)
    p.add_argument("--judge", default=None, help="only this judge's scores (default: any judge)")
    p.add_argument(
        "--threshold",
        type=threshold,
        default=DEFAULT_THRESHOLD,
        help=f"a reply scored above this is toxic (default {DEFAULT_THRESHOLD})",
    )
    p.add_argument(
        "--elicited", action="store_true", help="only elicited attacks: the same judge scored the probe at most --threshold"
    )
    p.add_argument("--target", default=None, help="only turns of runs against this target, and replays against it")
    p.add_argument("--run", default=None, metavar="ID", help="only this run (an id, or the start of one)")
    p.add_argument("--search", default=None, metavar="TEXT", help="only probes containing TEXT (case and spacing ignored)")
    p.add_argument(
        "--novel",
        type=fraction,
        default=None,
        metavar="SIM",
        help="drop probes with word-bigram Jaccard similarity >= SIM to a better one",
    )
    p.add_argument("--limit", type=at_least(1), default=None, help="at most this many attacks")
    p.add_argument("--export", default=None, metavar="FILE", help="write the attacks to FILE instead of listing them")
    p.add_argument(
        "--format",
        default=None,
        choices=FORMAT_NAMES,
        help="export format (default: from FILE's suffix, .csv or .jsonl); archive: the attacks.jsonl that astrl replay reads; "
        "datasets: a Hugging Face datasets folder",
    )


def add_runs_parser(sub) -> None:
    """Register ``astrl runs`` on the subparsers ``sub``."""
    p = sub.add_parser("runs", help="list the runs of the results store with their headline numbers")
    _add_store_arg(p)
    p.add_argument("--json", action="store_true", help="every field of every run as JSON")


def _open(args):
    from astrl.store import Store

    return Store.open(args.store, create=False)


def _cut(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return repr(text if len(text) <= n else text[: n - 1] + "…")


def _filters(args) -> str:
    parts = [f"reply score > {args.threshold:g}" + (f" under {args.judge}" if args.judge else "")]
    if args.elicited:
        parts.append("elicited")
    for name, label in (("target", "target"), ("run", "run"), ("search", "probe contains")):
        if getattr(args, name) is not None:
            parts.append(f"{label} {getattr(args, name)!r}")
    if args.novel is not None:
        parts.append(f"novel at similarity < {args.novel:g}")
    return ", ".join(parts)


def run_attacks(args) -> int:
    """``astrl attacks``: list the matching attacks, or export them with ``--export``."""
    from astrl.store import export_attacks
    from astrl.store.export import guess_format

    fmt = args.format
    if args.export is not None and fmt is None:
        fmt = guess_format(args.export)
        if fmt is None:
            raise ValueError(f"--export {args.export!r}: give --format ({', '.join(FORMAT_NAMES)}); the suffix does not say")
    if args.format is not None and args.export is None:
        raise ValueError("--format applies to --export FILE")
    with _open(args) as store:
        run = None if args.run is None else store.resolve_run(args.run)
        found = store.attacks(
            judge=args.judge,
            threshold=args.threshold,
            elicited_only=args.elicited,
            target=args.target,
            run=run,
            text=args.search,
            limit=args.limit,
            novel=args.novel,
        )
        where = store.path
    if args.export is not None:
        path = export_attacks(found, args.export, fmt)
        print(f"wrote {len(found)} attack(s) ({_filters(args)}) from {where} to {path} ({fmt})")
        return 0
    if not found:
        print(f"no attacks in {where} match ({_filters(args)})")
        return 0
    print(f"{len(found)} attack(s) in {where} ({_filters(args)}):")
    print(f"  {'score':>5}  {'judge':<12} {'target':<16} {'runs':>4} {'count':>5}  probe -> reply")
    for a in found:
        target = "-" if a.target is None else a.target
        print(
            f"  {a.score:5.3f}  {a.judge[:12]:<12} {target[:16]:<16} {len(a.runs):>4} {a.count:>5}  "
            f"{_cut(a.probe, 60)} -> {_cut(a.reply, 60)}"
        )
    return 0


def _shown_folder(folder: str | None) -> str:
    if folder is None:
        return "-"
    try:
        return str(Path(folder).relative_to(Path.cwd()))
    except ValueError:
        return folder


def run_runs(args) -> int:
    """``astrl runs``: the runs as a table, or as JSON with ``--json``."""
    with _open(args) as store:
        runs = store.runs()
        where = store.path
    if args.json:
        print(json.dumps([r.to_dict() for r in runs], indent=2, ensure_ascii=False))
        return 0
    if not runs:
        print(f"no runs in {where}")
        return 0
    print(f"{len(runs)} run(s) in {where}:")
    width = max(len("folder"), *(len(_shown_folder(r.folder)) for r in runs))
    head = f"{'id':<12}  {'kind':<6} {'status':<8}  {'started (UTC)':<19} {'seconds':>8} {'steps':>5}  {'folder':<{width}}"
    print(f"  {head}  elicited ASR")
    for r in runs:
        seconds = "-" if r.seconds is None else f"{r.seconds:.1f}"
        steps = str(r.steps) if r.steps else "-"
        asr = ", ".join(f"{judge} {value:.3f}" for judge, value in r.elicited_asr.items()) or "-"
        started = r.started_at[:19].replace("T", " ")
        print(
            f"  {r.id[:12]:<12}  {r.kind:<6} {r.status:<8}  {started:<19} {seconds:>8} {steps:>5}  "
            f"{_shown_folder(r.folder):<{width}}  {asr}"
        )
    return 0


def eval_folder(text: str, store: str | None = None) -> str:
    """``text`` when it is a folder; else the folder of the eval run of the results store whose id
    it is (or uniquely begins): what ``astrl compare`` reads."""
    if Path(text).is_dir():
        return text
    from astrl.store import Store, StoreError, store_path

    if not store_path(store).is_file():
        raise StoreError(f"{text!r} is not a folder, and there is no results store at {store_path(store)} to look it up in")
    with Store.open(store, create=False) as opened:
        run = opened.runs(opened.resolve_run(text))[0]
    if run.kind != "eval" or not run.folder or not (Path(run.folder) / "conversations.jsonl").is_file():
        raise StoreError(f"run {run.id} is a {run.kind} run whose folder {run.folder!r} holds no evaluation to compare")
    return run.folder
