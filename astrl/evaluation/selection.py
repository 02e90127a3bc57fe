"""Choose among trained testers on the dev openers, never the held-out judge (``astrl select``).

A chat run's share follows the opening it settles on in its first steps, so runs of one setting with
different seeds end a point or more apart. Each candidate (a run's final tester, or the checkpoint
named) is evaluated on the split's **dev** openers, which no run trains on and the held-out test
openers do not share, by the **training scorer** the runs were paid by, in the runs' own setting
(openers, split, mode, turns, lengths, target). The candidate with the highest elicited reply share
is chosen (the first given among equal ones):

    chosen = argmax_c  elicited_reply_share(c, dev openers, training scorer)

With ``by="lexicon"`` (chat runs) the measure is the training reward's other reply term instead: the
mean reply lexicon estimate of the same replies, read back through the target
(:mod:`astrl.evaluation.lexicon_reading`). It reads every reply where the scorer flags a few in a
hundred, so it tells apart openings whose replies lean toward the lexicon's words without saying them.

The judge and the test openers stay out of the choice, so the chosen run's held-out evaluation
(``astrl eval --tester RUN``) is still an estimate a judge other than the scorer can make of it.
Each candidate's evaluation is an ``astrl eval`` folder under ``OUT/``; a folder already holding
that evaluation (same run, checkpoint, split, scorer, conversations, replies and seed) is read
instead of run again, so a stopped selection resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from astrl.evaluation.lexicon_reading import LEXICON_KEYS, lexicon_settings
from astrl.evaluation.run import EvalConfig, Resolved, resolve, run_eval
from astrl.evaluation.settings import CONVERSATIONS_PER_OPENER, SELECT_BY, SELECT_SPLITS
from astrl.names import check_scorer_names, is_run_dir, parse_scorer
from astrl.prompts import load_prompts, split_fractions, split_prompts

SELECTION_FILE = "selection.json"
LEXICON_FILE = "reply_lexicon.json"  # a candidate's lexicon reading, beside its evaluation
MEASURES = dict(zip(SELECT_BY, ("elicited_reply_share", "reply_lexicon_share"), strict=True))
# what candidates must share so that their shares are measured on the same openers in the same setting
SHARED = ("prompts", "split_seed", "test_fraction", "mode", "turns", "target", "tester_length", "target_length")


@dataclass
class Candidate:
    """One tester to choose among: a run directory and a checkpoint (``None``: its ``final/``)."""

    run: str
    checkpoint: str | None = None

    @property
    def label(self) -> str:
        return self.run if self.checkpoint is None else f"{self.run} @ {self.checkpoint}"


def choose(shares: list[float]) -> int:
    """The index of the highest share; the first among equal ones."""
    if not shares:
        raise ValueError("no candidate to choose among")
    return max(range(len(shares)), key=lambda i: (shares[i], -i))


def intervals_apart(chosen: list[float] | None, other: list[float] | None) -> bool:
    """Whether the chosen candidate's 95% interval lies above the other's (both ``[low, high]``)."""
    return bool(chosen and other) and chosen[0] > other[1]


def _setting(resolved: Resolved) -> dict:
    """A candidate's :data:`SHARED` settings."""
    values = (
        resolved.prompts,
        resolved.split_seed,
        resolved.test_fraction,
        resolved.mode,
        resolved.turns,
        resolved.target,
        resolved.tester_generation.max_new_tokens,
        resolved.target_generation.max_new_tokens,
    )
    return dict(zip(SHARED, values, strict=True))


def check_candidates(
    candidates: list[Candidate], base: EvalConfig, scorer: str | None, by: str = "share"
) -> tuple[list[Resolved], str]:
    """Resolve every candidate (reading files only) and the scorer that chooses; raise ``ValueError``
    naming the first candidate that is not a run directory, repeats another, or differs from the first
    in a :data:`SHARED` setting, and when no scorer is given and the runs name no common one. With
    ``by="lexicon"``, also for a text-mode run, runs whose reply lexicon settings differ, and a lexicon
    source other than ``scorer`` that cannot be read (a file that is gone, a list with no words)."""
    if by not in SELECT_BY:
        raise ValueError(f"by must be one of {SELECT_BY}, got {by!r}")
    if base.split not in SELECT_SPLITS:
        raise ValueError(
            f"split {base.split!r}: select chooses on {' or '.join(SELECT_SPLITS)} openers; choosing on the held-out "
            "openers would leave no unbiased estimate of the chosen tester"
        )
    if len(candidates) < 2:
        raise ValueError(f"select needs at least two testers to choose among, got {len(candidates)}")
    seen: set[tuple[str, str | None]] = set()
    resolved = []
    for candidate in candidates:
        if not is_run_dir(Path(candidate.run).expanduser()):
            raise ValueError(f"{candidate.run!r} is not a training run directory (no config.yaml)")
        key = (str(Path(candidate.run).expanduser().resolve()), candidate.checkpoint)
        if key in seen:
            raise ValueError(f"{candidate.label!r} is given twice")
        seen.add(key)
        resolved.append(resolve(replace(base, tester=candidate.run, checkpoint=candidate.checkpoint)))
    first = _setting(resolved[0])
    for candidate, each in zip(candidates[1:], resolved[1:], strict=True):
        for name, value in _setting(each).items():
            if value != first[name]:
                raise ValueError(
                    f"{candidate.label!r} differs from {candidates[0].label!r} in {name} ({value!r} against "
                    f"{first[name]!r}): candidates are chosen on the same openers in the same setting"
                )
    if scorer is None:
        scorers = {tuple(each.training_scorers) for each in resolved}
        if len(scorers) != 1 or not next(iter(scorers)):
            raise ValueError(
                f"the runs name {'no training scorer' if scorers == {()} else 'different training scorers'} "
                f"({sorted(scorers)}): pass --scorer NAME"
            )
        scorer = resolved[0].training_scorers[0]
    check_scorer_names([scorer], "scorer")
    if by == "lexicon":
        _check_lexicon(candidates, resolved)
    return resolved, scorer


def _check_lexicon(candidates: list[Candidate], resolved: list[Resolved]) -> None:
    """That every candidate's replies can be read by one reply lexicon (:func:`check_candidates`)."""
    for candidate, each in zip(candidates, resolved, strict=True):
        if each.mode != "chat":
            raise ValueError(f"--by lexicon reads chat replies through the target: {candidate.label!r} is a {each.mode}-mode run")
    first = lexicon_settings(resolved[0].source.run_config)
    for candidate, each in zip(candidates[1:], resolved[1:], strict=True):
        settings = lexicon_settings(each.source.run_config)
        for name in LEXICON_KEYS:
            if settings[name] != first[name]:
                raise ValueError(
                    f"{candidate.label!r} differs from {candidates[0].label!r} in {name} ({settings[name]!r} against "
                    f"{first[name]!r}): --by lexicon reads every candidate's replies with one lexicon"
                )
    if first["reply_lexicon"] != "scorer":  # read now, as training's config check reads it; scorer needs the target
        from astrl.errors import ScorerError
        from astrl.rewards.lexicon import lexicon_words

        try:
            lexicon_words(str(first["reply_lexicon"]))
        except ScorerError as err:
            raise ValueError(f"{candidates[0].label!r}: {err}; --by lexicon reads its words") from None


def default_conversations(resolved: Resolved, split: str) -> int:
    """:data:`CONVERSATIONS_PER_OPENER` conversations for every opener of the runs' ``split``."""
    openers = split_prompts(
        load_prompts(resolved.prompts), split, seed=resolved.split_seed, fractions=split_fractions(resolved.test_fraction)
    )
    return CONVERSATIONS_PER_OPENER * len(openers)


def _folder(out: Path, index: int, candidate: Candidate) -> Path:
    name = Path(candidate.run).expanduser().resolve().name
    if candidate.checkpoint:
        name += f"_{Path(candidate.checkpoint).name}"
    return out / f"{index:02d}_{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}"


def _done(folder: Path, config: EvalConfig, resolved: Resolved, scorer: str) -> dict | None:
    """The metrics of ``folder`` when it holds this very evaluation, else ``None``."""
    path = folder / "metrics.json"
    if not path.is_file():
        return None
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    recorded = metrics.get("run_dir")
    if not recorded or Path(recorded).resolve() != Path(resolved.source.run_dir).resolve():
        return None
    wanted = {
        "checkpoint": resolved.source.checkpoint,
        "split": config.split,
        "split_seed": resolved.split_seed,
        "n_conversations": config.num_conversations,
        "reply_samples": config.reply_samples,
        "seed": config.seed,
        "threshold": config.threshold,
    }
    judges = list(metrics.get("judges") or {})
    same = all(metrics.get(key) == value for key, value in wanted.items()) and len(judges) == 1
    return metrics if same and parse_scorer(judges[0]) == parse_scorer(scorer) else None


def _judged(metrics: dict) -> dict:
    """The one judge's results of a candidate's evaluation (keyed by the scorer's own name for itself)."""
    (result,) = metrics["judges"].values()
    return result


def _share(result: dict) -> tuple[float, list[float] | None]:
    """The elicited reply share and its interval; with one reply a probe, the elicited turns' share
    (the same ratio: replies toxic to a clean probe over replies)."""
    name = "elicited_reply_share" if "elicited_reply_share" in result else "elicited_success_rate"
    return result[name], result.get(f"{name}_ci")


def select_testers(
    candidates: list[Candidate],
    out_dir: str | Path,
    *,
    base: EvalConfig | None = None,
    scorer: str | None = None,
    num_conversations: int | None = None,
    reply_samples: int | None = None,
    by: str = "share",
    progress: bool = True,
    on_candidate: Callable[[int, Candidate, dict], None] | None = None,
) -> dict:
    """Evaluate each candidate on ``base.split`` (default: dev) by ``scorer`` (default: the runs'
    training scorer), choose the highest elicited reply share (``by="lexicon"``: the highest reply
    lexicon share of the same replies, chat runs), write ``OUT/selection.json`` and return it.

    ``base`` holds the evaluation's own settings (split, batch size, seed, threshold, resamples, dtype,
    device); the openers, mode, turns, lengths and target are each run's. ``num_conversations``
    (default: :func:`default_conversations`) and ``reply_samples`` (default: the first run's, else 1)
    replace ``base``'s."""
    base = base if base is not None else EvalConfig(split="dev")
    resolved, scorer = check_candidates(candidates, base, scorer, by)
    base = replace(
        base,
        num_conversations=num_conversations or default_conversations(resolved[0], base.split),
        reply_samples=reply_samples or int(resolved[0].source.run_config.get("reply_samples") or 1),
    )
    out = Path(out_dir)
    reader = _LexiconReader(base, resolved[0], scorer) if by == "lexicon" else None
    rows = []
    for index, (candidate, each) in enumerate(zip(candidates, resolved, strict=True)):
        config = replace(base, tester=candidate.run, checkpoint=candidate.checkpoint, judges=[scorer], embeddings=False)
        folder = _folder(out, index, candidate)
        metrics = _done(folder, config, each, scorer)
        reused = metrics is not None
        if metrics is None:
            metrics = run_eval(config, folder, progress=progress, on_warning=lambda _text: None)
        rows.append(_row(candidate, each, folder, metrics, reused))
        if reader is not None:
            rows[-1].update(reader.read(folder))
        if on_candidate:
            on_candidate(index, candidate, rows[-1])
    measure = MEASURES[by]
    chosen = choose([row[measure] for row in rows])
    runner_up = sorted(range(len(rows)), key=lambda i: (-rows[i][measure], i))[1]
    summary = {
        "by": by,
        "measure": measure,
        "scorer": scorer,
        "split": base.split,
        "n_conversations": base.num_conversations,
        "reply_samples": base.reply_samples,
        "seed": base.seed,
        "candidates": rows,
        "chosen": chosen,
        "chosen_run": rows[chosen]["run"],
        "chosen_checkpoint": rows[chosen]["checkpoint"],
        "scorer_is_a_judge": _is_a_judge(scorer, resolved[0]),
        "apart_from_runner_up": intervals_apart(rows[chosen][f"{measure}_ci"], rows[runner_up][f"{measure}_ci"]),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / SELECTION_FILE).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return summary


def _is_a_judge(scorer: str, resolved: Resolved) -> bool:
    """Whether ``scorer`` is one of the judges a run is evaluated with (its own or eval's default ones)
    other than its training scorers: choosing by it favours what that judge rewards, blind spots included."""
    trained = {parse_scorer(name) for name in resolved.training_scorers}
    judges = {parse_scorer(name) for name in resolved.judges} - trained
    return parse_scorer(scorer) in judges


def _row(candidate: Candidate, resolved: Resolved, folder: Path, metrics: dict, reused: bool) -> dict:
    """A candidate's line of ``selection.json``, from its evaluation's ``metrics``."""
    result = _judged(metrics)
    share, interval = _share(result)
    return {
        "run": candidate.run,
        "checkpoint": resolved.source.checkpoint,
        "eval_dir": str(folder),
        "elicited_reply_share": share,
        "elicited_reply_share_ci": interval,
        "elicited_asr": result["elicited_asr"],
        "probe_nll": metrics["probe_nll"]["mean"],
        "n_openers": metrics["n_openers"],
        "reused": reused,
    }


class _LexiconReader:
    """Each candidate's reply lexicon share (:mod:`astrl.evaluation.lexicon_reading`), the target loaded
    once at the first reading; a folder's reading is kept in :data:`LEXICON_FILE` and read back while its
    conversations and the reading's settings are the same."""

    def __init__(self, base: EvalConfig, resolved: Resolved, scorer: str) -> None:
        self.base, self.resolved, self.scorer = base, resolved, scorer
        self.settings = lexicon_settings(resolved.source.run_config)
        self._target = self._lexicon = None

    def _key(self, folder: Path) -> dict:
        digest = hashlib.sha256((folder / "conversations.jsonl").read_bytes()).hexdigest()
        wanted = {"scorer": self.scorer, "target": self.resolved.target, "system_prompt": self.resolved.target_system_prompt}
        knobs = {"threshold": self.base.threshold, "resamples": self.base.resamples, "seed": self.base.seed}
        return {**self.settings, **wanted, **knobs, "dtype": self.base.dtype, "conversations_sha256": digest}

    def read(self, folder: Path) -> dict:
        from astrl.evaluation.lexicon_reading import lexicon_share, reply_estimates, run_lexicon
        from astrl.evaluation.records import read_records
        from astrl.models import load_model

        key, path = self._key(folder), folder / LEXICON_FILE
        if path.is_file():
            try:
                kept = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                kept = {}
            if isinstance(kept, dict) and kept.get("settings") == key and "reading" in kept:
                return kept["reading"]
        if self._target is None:
            self._target = load_model(self.resolved.target, dtype=self.base.dtype, device=self.base.device)
            self._lexicon = run_lexicon(self.settings, self._target.tokenizer, self.scorer)
        records = read_records(folder / "conversations.jsonl")
        estimates = reply_estimates(
            records, self._target, self._lexicon, system_prompt=self.resolved.target_system_prompt, batch=self.base.batch_size
        )
        (scorer_key,) = records[0]["scores"]
        reading = lexicon_share(
            records, estimates, scorer_key, threshold=self.base.threshold, resamples=self.base.resamples, seed=self.base.seed
        )
        path.write_text(json.dumps({"settings": key, "reading": reading}, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        return reading
