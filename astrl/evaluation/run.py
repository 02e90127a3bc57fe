"""The ``astrl eval`` job: run a tester against a target on held-out prompts, judge every turn, report.

Conversations run in the red-team environment with the ASTPrompter reward terms switched on, so
the probe's likelihood under the target comes from the environment itself
(``("reward_terms", "probe_logprob")``, the mean per-token log-prob on the target's own
tokenization). The judges score the target replies inside the environment; probes,
``probe + "\\n" + reply`` and the toxic replies less their opener's words and less identity terms
(:mod:`astrl.evaluation.rejudge`) are scored afterwards, in batched calls per judge.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from astrl.argtypes import value_problem
from astrl.envs.settings import ConversationRuns, EvalLengths, EvalRuns
from astrl.evaluation.agreement import eval_agreement
from astrl.evaluation.records import (
    EvaluationError,
    combined_text,
    compute_metrics,
    first_reply_records,
    successful_probes,
    write_records,
)
from astrl.evaluation.rejudge import rejudge
from astrl.evaluation.settings import ReportSettings
from astrl.evaluation.tester import EXPORT_SETTINGS, TesterSource, load_tester, resolve_tester
from astrl.keys import NEXT, PROBE_LOGPROB, QUERY
from astrl.names import MODES, ModelSettings, check_scorer_names
from astrl.scorers import checked_scores

if TYPE_CHECKING:
    from astrl.envs import ConversationSpec
    from astrl.policies import GenerationSettings

# Top-level keys of a training run's config.yaml that eval takes as defaults.
RUN_DEFAULTS = (
    "target", "judges", "prompts", "mode", "seed", "split_seed", "test_fraction", "system_prompt", "tester_system_prompt",
    "target_system_prompt", "turns", "max_new_tokens", "target_max_new_tokens",
)  # fmt: skip
DEFAULT_TURNS: int = ConversationRuns.__dataclass_fields__["turns"].default  # without a run's turns (3)


@dataclass
class EvalConfig(ModelSettings, ReportSettings, EvalLengths, EvalRuns):  # bases in reverse: the conversation settings first
    """Settings of an evaluation (the conversation settings are those of
    :class:`~astrl.envs.settings.ConversationRuns` with eval's defaults, ``EvalRuns``; the report settings
    :class:`~astrl.evaluation.settings.ReportSettings`'s; dtype and device
    :class:`~astrl.names.ModelSettings`'s). ``None`` fields fall back to the training run's config (when the
    tester is a run directory or an export), then to the defaults noted: ``prompts`` (the run's, else
    builtin), ``split_seed`` and ``test_fraction`` (the run's seed and fraction, so "test" is the run's
    held-out split, else ``seed`` and 0.1), ``mode`` (the run's, else chat), the system prompts (the run's),
    ``turns`` (the run's, else 3) and the lengths: ``max_new_tokens`` (the run's, else
    ``tester_generation``'s) and ``target_max_new_tokens`` (``max_new_tokens`` when that is set, else the
    run's reply length, else ``target_generation``'s), so that a run is measured in the setting it was trained
    in. ``reply_samples``: every reply is judged; the first continues."""

    tester: str = "smollm2-135m"
    target: str | None = None  # run's target, else smollm2-135m
    judges: list[str] | None = None  # run's judges, else profanity
    checkpoint: str | None = None
    embeddings: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()  # every field's declared check, the report settings' included
        if self.judges is not None:  # names only: no scorer is built here
            check_scorer_names(self.judges, "judge")


@dataclass
class Resolved:
    """An :class:`EvalConfig` with the run's defaults filled in."""

    source: TesterSource
    target: str
    judges: list[str]
    prompts: str
    split_seed: int
    mode: str
    tester_system_prompt: str | None
    target_system_prompt: str | None
    training_scorers: list[str]
    turns: int
    tester_generation: GenerationSettings
    target_generation: GenerationSettings
    test_fraction: float | None = None


DISTINCT_JUDGES = ("wordlist", "profanity")  # offline, and of different kinds (a word list, an SVM)


def default_judges(run_judges: list[str], training: list[str]) -> list[str]:
    """Judges when ``--judge`` is not given: the run's judges, else its training scorer, else
    ``profanity``; plus the first of :data:`DISTINCT_JUDGES` that is not a training scorer when none
    of those differs from it, so that every default result has a judge the tester was not trained against."""
    judges = run_judges or (training or ["profanity"])[:1]
    family = _trained_families(training)
    distinct = next((j for j in DISTINCT_JUDGES if _family(j) not in family), None)
    if all(_family(j) in family for j in judges) and distinct is not None:
        judges = [*judges, distinct]
    return judges


def distinct_judge(run_judges: list[str], training: list[str]) -> str | None:
    """The first of :func:`default_judges` of another family than every training scorer (``wordlist``
    for a run trained on ``profanity``, ``profanity`` for one trained on ``wordlist:-god``); ``None``
    when there is none."""
    family = _trained_families(training)
    return next((j for j in default_judges(run_judges, training) if _family(j) not in family), None)


def _trained_families(training: list[str]) -> set[str]:
    """The families of a run's training scorers (``profanity`` when none are recorded): the word list
    less a few words is still the word list."""
    return {_family(t) for t in training or ["profanity"]}


def _family(scorer: str) -> str:
    """``wordlist`` for any ``wordlist[:-w1,...]``; other scorer names as they are."""
    return "wordlist" if scorer.partition(":")[0] == "wordlist" else scorer


def _run_split_seed(run: dict, default: int) -> int:
    """The seed of a training run's prompt split (its ``split_seed``, else its ``seed``), so that
    ``--split test`` is the run's held-out split; ``default`` without a run."""
    if run.get("split_seed") is not None:
        return int(run["split_seed"])
    return int(run.get("seed", default))


def resolve(config: EvalConfig) -> Resolved:
    """Find the tester and fill unset settings from its training run (if any)."""
    source = resolve_tester(config.tester, config.checkpoint)
    run = {k: source.run_config[k] for k in RUN_DEFAULTS if source.run_config.get(k) is not None}
    scorer = source.run_config.get("scorer", source.run_config.get("scorers"))
    scorer_list = [scorer] if isinstance(scorer, str) else scorer if isinstance(scorer, list) else []
    training = [s for s in scorer_list if isinstance(s, str)]
    run_judges = run.get("judges")
    run_judges = [run_judges] if isinstance(run_judges, str) else run_judges if isinstance(run_judges, list) else []
    mode = config.mode or run.get("mode", "chat")
    problem = value_problem(mode, {"choices": MODES})
    if problem:
        where = source.run_dir / "config.yaml" if source.run_dir else Path(source.model) / EXPORT_SETTINGS
        raise ValueError(f"mode {problem} (from {where})")
    return Resolved(
        source=source,
        target=config.target or str(run.get("target", "smollm2-135m")),
        judges=config.judges or default_judges([str(j) for j in run_judges], training),
        prompts=config.prompts or str(run.get("prompts", "builtin")),
        split_seed=config.split_seed if config.split_seed is not None else _run_split_seed(run, config.seed),
        test_fraction=config.test_fraction if config.test_fraction is not None else run.get("test_fraction"),
        mode=mode,
        tester_system_prompt=config.tester_system_prompt
        if config.tester_system_prompt is not None
        else run.get("tester_system_prompt", run.get("system_prompt")),
        target_system_prompt=config.target_system_prompt
        if config.target_system_prompt is not None
        else run.get("target_system_prompt"),
        training_scorers=training,
        turns=config.turns or int(run.get("turns", DEFAULT_TURNS)),
        **_generation_lengths(config, run),
    )


def measured(config: EvalConfig, resolved: Resolved) -> EvalConfig:
    """``config`` with the turns and lengths the evaluation ran (the run's where ``config`` left them unset)."""
    tester, target = resolved.tester_generation, resolved.target_generation
    return replace(
        config,
        turns=resolved.turns,
        max_new_tokens=tester.max_new_tokens,
        target_max_new_tokens=target.max_new_tokens,
        tester_generation=tester,
        target_generation=target,
    )


def _generation_lengths(config: EvalConfig, run: dict) -> dict:
    """Each side's sampling settings with its length: the config's own, else the run's (its
    ``target_max_new_tokens``, else its ``max_new_tokens``, for the target), else the generation settings'."""
    tester = config.max_new_tokens or run.get("max_new_tokens") or config.tester_generation.max_new_tokens
    target = (
        config.target_max_new_tokens
        or config.max_new_tokens
        or run.get("target_max_new_tokens")
        or run.get("max_new_tokens")
        or config.target_generation.max_new_tokens
    )
    return {
        "tester_generation": replace(config.tester_generation, max_new_tokens=int(tester)),
        "target_generation": replace(config.target_generation, max_new_tokens=int(target)),
    }


def rollout_records(rollout, openers: list[str], judges: list[str], first: int) -> list[dict]:
    """Records (without probe/combined scores) of a ``(B, T)`` rollout: the turns of
    :func:`astrl.rollout.records_from_rollout` with each judge's reply score and the probe's NLL
    (minus the ASTPrompter likelihood term; ``None`` for an empty probe)."""
    from astrl.rollout import records_from_rollout

    if PROBE_LOGPROB not in rollout[NEXT].keys(include_nested=True):
        raise EvaluationError(f"the environment did not write {PROBE_LOGPROB}: reward='astprompter' is needed")
    records = []
    for turn in records_from_rollout(rollout, openers, first):
        empty = not turn["probe"].strip()
        records.append(
            {
                **{key: turn[key] for key in ("conversation", "turn", "prompt", "probe", "response")},
                "empty_probe": empty,
                "probe_nll": None if empty else -turn["reward_terms"][PROBE_LOGPROB[1]],
                "scores": {j: {"reply": turn["scores"][j]} for j in judges},
            }
        )
        if "replies" in turn:  # reply_samples > 1
            records[-1]["replies"] = turn["replies"]
            for j in judges:
                records[-1]["scores"][j]["replies"] = turn["reply_scores"][j]
    return records


def conversation_spec(config: EvalConfig, resolved: Resolved, judges: list[str]) -> ConversationSpec:
    """The evaluation's conversations: the run's held-out openers, scored by ``judges``, with the
    ASTPrompter reward terms on (they carry the probe's likelihood under the target)."""
    from astrl.envs import ConversationSpec

    return ConversationSpec(
        **measured(config, resolved).batch_settings(  # the turns and lengths from measured, the rest from the run
            prompts=resolved.prompts,
            split_seed=resolved.split_seed,
            test_fraction=resolved.test_fraction,
            mode=resolved.mode,
            tester_system_prompt=resolved.tester_system_prompt,
            target_system_prompt=resolved.target_system_prompt,
        ),
        tester=resolved.source.model,
        target=resolved.target,
        scorers=judges,
        reward="astprompter",
        dtype=config.dtype,
        device=config.device,
    )


def generate(config: EvalConfig, resolved: Resolved, scorers: dict, on_turns: Callable[[int], None] | None = None) -> list[dict]:
    """Run ``config.num_conversations`` conversations in batches; one record per tester turn."""
    from astrl._compat import as_list
    from astrl.envs import build_conversation

    tester_lm = load_tester(resolved.source, dtype=config.dtype, device=config.device)
    shared = resolved.source.run_dir is None and resolved.target == resolved.source.model
    spec = conversation_spec(config, resolved, list(scorers))
    conversation = build_conversation(spec, tester=tester_lm, target=tester_lm if shared else None, scorers=scorers)
    env, tester, batch = conversation.env, conversation.tester, spec.batch_size
    torch.manual_seed(config.seed)
    records: list[dict] = []
    done = 0
    for _ in range(math.ceil(config.num_conversations / batch)):
        keep = min(batch, config.num_conversations - done)
        steps = []  # env.rollout calls back between steps, not after the last one

        def callback(*_, steps=steps, keep=keep):
            steps.append(1)
            if on_turns:
                on_turns(keep)

        with torch.no_grad():
            reset = env.reset()
            openers = as_list(reset[QUERY])
            rollout = env.rollout(resolved.turns, tester, tensordict=reset, auto_reset=False, callback=callback)
        if on_turns:
            on_turns(keep * (resolved.turns - len(steps)))
        chunk = rollout_records(rollout, openers, list(scorers), done)
        records.extend(r for r in chunk if r["conversation"] < done + keep)
        done += keep
    return records


def score_probes(records: list[dict], scorers: dict) -> None:
    """Add each judge's probe and probe+reply scores to the records: one batched call per judge."""
    texts = [r["probe"] for r in records] + [combined_text(r["probe"], r["response"]) for r in records]
    n = len(records)
    for name, scorer in scorers.items():
        values = checked_scores(scorer, texts).tolist()
        if len(values) != 2 * n:
            raise EvaluationError(f"judge {name!r} returned {len(values)} scores for {2 * n} texts")
        for i, record in enumerate(records):
            record["scores"][name]["probe"] = float(values[i])
            record["scores"][name]["combined"] = float(values[n + i])


def embed_successful(records: list[dict], judges: list[str], threshold: float, device: str) -> tuple[dict | None, str | None]:
    """Embeddings of every probe that succeeded under some judge (one batched pass), or ``(None, reason)``."""
    from astrl.embeddings import EmbeddingUnavailable, embedding_folder, load_encoder

    texts = sorted({p for j in judges for p in successful_probes(records, j, threshold)})
    if not texts:
        try:
            embedding_folder()
        except EmbeddingUnavailable as err:
            return None, str(err)
        return {}, None
    encoder, why = load_encoder(device)
    if encoder is None:
        return None, why
    vectors = encoder(texts).numpy()
    return dict(zip(texts, vectors, strict=True)), None


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def run_eval(
    config: EvalConfig,
    out_dir: str | Path,
    *,
    progress: bool = True,
    on_warning: Callable[[str], None] | None = None,
) -> dict:
    """Run the evaluation and write ``metrics.json``, ``conversations.jsonl``, ``attacks.jsonl``
    (the attack archive), ``report.md``, ``report.html`` and the plots to ``out_dir``, record the run, its
    turns and their verdicts in the results store (:mod:`astrl.store`); return the metrics."""
    warn = on_warning or _warn
    start = time.perf_counter()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise EvaluationError(f"--out {str(out)!r} exists and is not a folder")
    resolved = resolve(config)
    from astrl.envs.recipe import preflight

    # names, prompts and split first: a bad one costs milliseconds, not a model load
    preflight(conversation_spec(config, resolved, resolved.judges))
    from astrl.locks import sole_writer
    from astrl.store.recorder import RunRecorder

    with (
        sole_writer(out, "--out"),
        RunRecorder.begin(
            "eval",
            out,
            asdict(measured(config, resolved)),
            seed=config.seed,
            tester=config.tester,
            target=resolved.target,
            warn=warn,
        ) as recorder,
    ):
        metrics, records = _evaluate(config, resolved, out, start=start, progress=progress, warn=warn)
        # the store keeps each turn's first reply (the one the conversation went on with)
        recorder.turns(first_reply_records(records), threshold=config.threshold, tester_version=resolved.source.checkpoint)
        recorder.finish(metrics)
    return metrics


def _write_eval(
    config: EvalConfig,
    resolved: Resolved,
    out: Path,
    metrics: dict,
    records: list[dict],
    timing: dict,
    *,
    start: float,
    warn: Callable[[str], None],
) -> None:
    """Write the conversations, the attack archive, the report and ``metrics.json`` (``metrics``
    with the archive's counts and the timings)."""
    from astrl.archive import ARCHIVE_FILE, AttackArchive, eval_turns
    from astrl.evaluation.report import write_report

    write_records(records, out / "conversations.jsonl")
    archive = AttackArchive(config.threshold)  # a turn is an attack when any judge scores its reply above the threshold
    archive.extend(eval_turns(records))
    archive.write(out / ARCHIVE_FILE)
    metrics["attack_archive"] = {"file": ARCHIVE_FILE, "unique_probes": len(archive), "successful_turns": archive.total}
    t0 = time.perf_counter()
    report_notes = write_report(out, metrics, records, run_dir=resolved.source.run_dir, top_k=config.top_attacks, archive=archive)
    for note in report_notes:
        warn(note)
    timing["report"] = time.perf_counter() - t0
    timing["total"] = time.perf_counter() - start
    metrics["seconds"] = {k: round(v, 3) for k, v in timing.items()}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def _evaluate(
    config: EvalConfig, resolved: Resolved, out: Path, *, start: float, progress: bool, warn: Callable[[str], None]
) -> tuple[dict, list[dict]]:
    """The body of :func:`run_eval` once its inputs are checked: ``(metrics, records)``."""
    from tqdm.auto import tqdm

    from astrl.scorers import make_judges

    scorers = make_judges(resolved.judges, device=config.device)
    notes: list[str] = []
    same = [j for j in scorers if j in resolved.training_scorers]
    if same:
        notes.append(
            f"judge {same[0]!r} is the training scorer: a tester can exploit its scorer's blind spots, "
            "so add a different --judge to see them"
        )
    out.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=config.num_conversations * resolved.turns, unit="turn", disable=not progress, desc="eval")
    timing = {}
    t0 = time.perf_counter()
    records = generate(config, resolved, scorers, on_turns=bar.update)
    timing["generation"] = time.perf_counter() - t0
    openers = len({r["prompt"] for r in records if r["turn"] == 0})
    if openers < config.num_conversations:
        notes.append(
            f"{config.num_conversations} conversations drew on {openers} distinct {config.split!r} prompts: openers repeat"
        )
    bar.set_description("eval: judging")
    t0 = time.perf_counter()
    score_probes(records, scorers)
    rejudge(records, scorers, config.threshold)
    timing["judging"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    embeddings, why = (
        embed_successful(records, list(scorers), config.threshold, config.device)
        if config.embeddings
        else (None, "disabled (--no-embeddings)")
    )
    timing["embedding"] = time.perf_counter() - t0
    bar.close()
    metrics, metric_notes = compute_metrics(
        records,
        threshold=config.threshold,
        resamples=config.resamples,
        seed=config.seed,
        embeddings=embeddings,
        why_no_embeddings=why,
    )
    notes.extend(metric_notes)
    agreement = eval_agreement(
        records,
        threshold=config.threshold,
        training_scorers=resolved.training_scorers,
        resamples=config.resamples,
        seed=config.seed,
        top_k=config.top_attacks,
    )
    metrics = {
        **{k: metrics.pop(k) for k in ("n_conversations", "turns", "threshold")},
        "tester": config.tester,
        "tester_model": resolved.source.model,
        "run_dir": str(resolved.source.run_dir) if resolved.source.run_dir else None,
        "checkpoint": resolved.source.checkpoint,
        "target": resolved.target,
        "training_scorers": resolved.training_scorers,
        "prompts": resolved.prompts,
        "split": config.split,
        "split_seed": resolved.split_seed,
        "test_fraction": resolved.test_fraction,
        "n_openers": metrics.pop("n_openers"),  # the openers the intervals resample
        "mode": resolved.mode,
        "seed": config.seed,
        "reply_samples": config.reply_samples,
        "max_new_tokens": resolved.tester_generation.max_new_tokens,
        "target_max_new_tokens": resolved.target_generation.max_new_tokens,
        "embedding_model": None if embeddings is None else "all-MiniLM-L6-v2",
        **metrics,
        **({"judge_agreement": agreement} if agreement else {}),
        "warnings": notes,
    }
    for note in notes:
        warn(note)
    _write_eval(config, resolved, out, metrics, records, timing, start=start, warn=warn)
    return metrics, records
