"""``astrl compare``: two evaluations side by side, with the difference and whether it is significant.

Rates are recomputed from each folder's ``conversations.jsonl``; the difference ``B - A`` gets a
95% bootstrap interval from resampling the openers of each evaluation independently (the
conversations that share an opener together: they are not independent draws), and
is called significant when that interval excludes 0 (the two-sided bootstrap p-value is shown
too); when both evaluations judged K replies per probe (``--reply-samples``) the reply shares are
tested too, and so are the shares of elicited replies judged again without their opener's words or
identity terms (:mod:`astrl.evaluation.rejudge`) when both evaluations hold them; with fewer than 5
openers contributing on a side no verdict is given. Diversity metrics are compared as numbers only:
they are not rates over conversations.
"""

from __future__ import annotations

import json
from pathlib import Path

from astrl.evaluation import metrics as m
from astrl.evaluation.records import (
    EvaluationError,
    judge_names,
    nll_array,
    opener_groups,
    read_records,
    rejudged_arrays,
    reply_sample_array,
    score_arrays,
)

# the rates tested, in table order (each elicitation metric beside its plain counterpart)
TESTED = (
    "asr",
    "elicited_asr",
    "toxic_reply_rate",
    "elicited_success_rate",
    "mean_reply_toxicity",
    "mean_toxicity_delta",
    "toxic_probe_rate",
    "toxic_combined_rate",
    "first_success_turn",
)
UNTESTED = ("self_bleu_diversity", "embedding_diversity", "unique_attacks")
# What two evaluations should share to be read side by side (recorded in metrics.json); the seed may differ.
SETTINGS = (
    "target", "prompts", "split", "split_seed", "test_fraction", "mode", "turns", "max_new_tokens", "target_max_new_tokens",
    "reply_samples",
)  # fmt: skip


def load_evaluation(folder: str | Path) -> tuple[dict, list[dict]]:
    """``(metrics, records)`` of an ``astrl eval`` output folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise EvaluationError(f"{str(folder)!r} is not a folder")
    path = folder / "metrics.json"
    if not path.is_file():
        raise EvaluationError(f"{str(path)!r} not found: is {str(folder)!r} an 'astrl eval' output folder?")
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise EvaluationError(f"{path} is not valid JSON: {err.msg}") from None
    return metrics, read_records(folder / "conversations.jsonl")


def compare(folder_a: str | Path, folder_b: str | Path, *, resamples: int = 1000, seed: int = 0) -> dict:
    """Compare two evaluation folders; rows hold ``judge``, ``metric``, ``a``, ``b``, ``difference``,
    ``ci``, ``p_value`` and ``significant`` (``None`` where no test applies)."""
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    metrics_a, records_a = load_evaluation(folder_a)
    metrics_b, records_b = load_evaluation(folder_b)
    threshold_a, threshold_b = metrics_a.get("threshold"), metrics_b.get("threshold")
    if threshold_a != threshold_b:
        raise EvaluationError(f"the evaluations used different thresholds ({threshold_a} and {threshold_b}): not comparable")
    judges = [j for j in judge_names(records_a) if j in judge_names(records_b)]
    if not judges:
        raise EvaluationError(
            f"no judge in common: {folder_a} has {judge_names(records_a)}, {folder_b} has {judge_names(records_b)}"
        )
    groups = (opener_groups(records_a), opener_groups(records_b))
    rows = []
    for offset, judge in enumerate(judges):
        scores_a, scores_b = score_arrays(records_a, judge), score_arrays(records_b, judge)
        ratios_a = _grouped(m.conversation_ratios(*scores_a, threshold_a), groups[0])
        ratios_b = _grouped(m.conversation_ratios(*scores_b, threshold_a), groups[1])
        for name in TESTED:
            # seeds follow INTERVAL_METRICS, not the table order
            test = m.bootstrap_difference(
                ratios_a[name], ratios_b[name], resamples=resamples, seed=m.metric_seed(seed + 97 * offset, name)
            )
            rows.append(_row(judge, name, m.ratio(*ratios_a[name]), m.ratio(*ratios_b[name]), test))
        probes = (scores_a[1], scores_b[1])
        rows.extend(_reply_sample_rows(judge, (records_a, records_b), probes, groups, threshold_a, resamples, seed + 97 * offset))
        rows.extend(_rejudged_rows(judge, (records_a, records_b), probes, groups, threshold_a, resamples, seed + 97 * offset))
        for name in UNTESTED:
            a, b = metrics_a["judges"].get(judge, {}).get(name), metrics_b["judges"].get(judge, {}).get(name)
            rows.append(_row(judge, name, a, b, None))
    nll_a, nll_b = (m.grouped(*m.nll_ratio(nll_array(r)), g) for r, g in zip((records_a, records_b), groups, strict=True))
    test = m.bootstrap_difference(nll_a, nll_b, resamples=resamples, seed=seed + 7919)
    rows.append(_row("(all)", "probe_nll_mean", m.ratio(*nll_a), m.ratio(*nll_b), test))
    return {
        "a": str(folder_a),
        "b": str(folder_b),
        "settings_differ": setting_differences(metrics_a, metrics_b),
        "threshold": threshold_a,
        "n_conversations": [len({r["conversation"] for r in records_a}), len({r["conversation"] for r in records_b})],
        "n_openers": [len(set(g.tolist())) for g in groups],
        "bootstrap": {"resamples": resamples, "confidence": 0.95, "unit": "opener", "seed": seed},
        "rows": rows,
    }


def setting_differences(metrics_a: dict, metrics_b: dict) -> list[str]:
    """``"turns: 3 (A) vs 2 (B)"`` for each of :data:`SETTINGS` both evaluations record with different values: a
    difference then measures the settings as much as the testers."""
    return [
        f"{key}: {metrics_a[key]} (A) vs {metrics_b[key]} (B)"
        for key in SETTINGS
        if key in metrics_a and key in metrics_b and metrics_a[key] != metrics_b[key]
    ]


def _settings_note(result: dict) -> list[str]:
    differ = result.get("settings_differ") or []
    return [f"note: the evaluations ran in different settings ({'; '.join(differ)})"] if differ else []


def _grouped(ratios: dict, groups) -> dict:
    """Each metric's per-conversation ``(num, den)`` summed per opener (:func:`astrl.evaluation.metrics.grouped`)."""
    return {name: m.grouped(num, den, groups) for name, (num, den) in ratios.items()}


def _reply_sample_rows(
    judge: str, records: tuple[list[dict], list[dict]], probes: tuple, groups: tuple, threshold: float, resamples: int, seed: int
) -> list[dict]:
    """The reply-share rows, when both evaluations (``records``, with the judge's ``probes`` score
    grids and their conversations' ``groups``) judged several replies per probe (``--reply-samples``)."""
    replies_a, replies_b = (reply_sample_array(r, judge) for r in records)
    if replies_a is None or replies_b is None:
        return []
    ratios_a = _grouped(m.reply_sample_ratios(replies_a, probes[0], threshold), groups[0])
    ratios_b = _grouped(m.reply_sample_ratios(replies_b, probes[1], threshold), groups[1])
    rows = []
    for name in m.REPLY_SAMPLE_METRICS:
        test = m.bootstrap_difference(ratios_a[name], ratios_b[name], resamples=resamples, seed=m.metric_seed(seed, name))
        rows.append(_row(judge, name, m.ratio(*ratios_a[name]), m.ratio(*ratios_b[name]), test))
    return rows


def _rejudged_rows(
    judge: str, records: tuple[list[dict], list[dict]], probes: tuple, groups: tuple, threshold: float, resamples: int, seed: int
) -> list[dict]:
    """The rows of :data:`astrl.evaluation.metrics.REJUDGED_METRICS` for each check both evaluations
    hold (arguments as in :func:`_reply_sample_rows`)."""
    rescored = [rejudged_arrays(side, judge) for side in records]
    rows = []
    for check in (c for c in m.REJUDGED_METRICS if c in rescored[0] and c in rescored[1]):
        ratios = []
        for side, probe, group, scores in zip(records, probes, groups, rescored, strict=True):
            replies = reply_sample_array(side, judge)
            replies = replies if replies is not None else score_arrays(side, judge)[0][..., None]
            if replies.shape[2] != scores[check].shape[2]:
                return rows  # one reply judged again against K sampled: not the same rate
            ratios.append(_grouped(m.rejudged_ratios(replies, scores[check], probe, check, threshold), group))
        for name in m.REJUDGED_METRICS[check]:
            test = m.bootstrap_difference(ratios[0][name], ratios[1][name], resamples=resamples, seed=m.metric_seed(seed, name))
            rows.append(_row(judge, name, m.ratio(*ratios[0][name]), m.ratio(*ratios[1][name]), test))
    return rows


def _row(judge: str, metric: str, a, b, test: dict | None) -> dict:
    difference = test["difference"] if test else (b - a if a is not None and b is not None else None)
    too_few = test is not None and test["significant"] is None
    return {
        "judge": judge,
        "metric": metric,
        "a": a,
        "b": b,
        "difference": difference,
        "ci": test["ci"] if test else None,
        "p_value": test["p_value"] if test else None,
        "significant": test["significant"] if test else None,
        "too_few": too_few,
    }


def _num(value) -> str:
    if value is None:
        return "n/a"
    return str(value) if isinstance(value, int) else f"{value:.3f}"


def table_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    header = ["judge", "metric", "A", "B", "B - A", "95% CI of B - A", "p", "significant"]
    body = []
    for r in result["rows"]:
        diff = (
            "n/a"
            if r["difference"] is None
            else f"{r['difference']:+d}"
            if isinstance(r["difference"], int)
            else f"{r['difference']:+.3f}"
        )
        ci = f"[{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}]" if r["ci"] else "-"
        p = "-" if r["p_value"] is None else f"{r['p_value']:.3f}"
        sig = (
            f"n<{m.MIN_TEST_UNITS}"
            if r["too_few"]
            else "-"
            if r["significant"] is None
            else ("yes" if r["significant"] else "no")
        )
        body.append([r["judge"], r["metric"], _num(r["a"]), _num(r["b"]), diff, ci, p, sig])
    return header, body


def _sizes(result: dict, side: int) -> str:
    """``"256 conversations, 62 openers"`` for side 0 (A) or 1 (B)."""
    openers = result.get("n_openers")
    tail = f", {openers[side]} openers" if openers else ""
    return f"{result['n_conversations'][side]} conversations{tail}"


def format_text(result: dict) -> str:
    """An aligned plain-text table."""
    header, body = table_cells(result)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [f"{side}: {result[side.lower()]} ({_sizes(result, i)})" for i, side in enumerate("AB")]
    lines += _settings_note(result)
    for row in [header, ["-" * w for w in widths], *body]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines) + "\n"


def format_markdown(result: dict) -> str:
    header, body = table_cells(result)
    esc = [[c.replace("|", "\\|") for c in row] for row in [header, *body]]
    lines = ["# astrl comparison", ""]
    lines += [f"- {side}: `{result[side.lower()]}` ({_sizes(result, i)})" for i, side in enumerate("AB")]
    lines += [f"- {note}" for note in _settings_note(result)] + [""]
    lines += ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in esc[1:]]
    lines += [
        "",
        f"Differences are B - A. Intervals: 95% bootstrap over openers ({result['bootstrap']['resamples']} "
        "resamples of each evaluation; the conversations that share an opener are resampled together); "
        "significant when the interval excludes 0 "
        f"(no verdict with fewer than {m.MIN_TEST_UNITS} contributing openers on a side). "
        "Diversity metrics are not tested.",
    ]
    return "\n".join(lines) + "\n"
