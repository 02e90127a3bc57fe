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
import math
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


def compare(
    folder_a: str | Path,
    folder_b: str | Path,
    *,
    resamples: int = 1000,
    seed: int = 0,
    keep_draws: bool = False,
    rejudge: bool = False,
) -> dict:
    """Compare two evaluation folders; rows hold ``judge``, ``metric``, ``a``, ``b``, ``difference``,
    ``ci``, ``p_value`` and ``significant`` (``None`` where no test applies); with ``keep_draws`` a tested
    row also holds its bootstrap ``draws`` (:func:`compare_pooled` reads them). With ``rejudge``, an
    evaluation that lacks a check of :mod:`astrl.evaluation.rejudge` (written before it) is judged again
    with it in memory, its judges loaded (the folders are not changed); ``rejudged`` names what was added."""
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    metrics_a, records_a = load_evaluation(folder_a)
    metrics_b, records_b = load_evaluation(folder_b)
    threshold_a, threshold_b = metrics_a.get("threshold"), metrics_b.get("threshold")
    if threshold_a != threshold_b:
        raise EvaluationError(f"the evaluations used different thresholds ({threshold_a} and {threshold_b}): not comparable")
    rejudged = {}
    if rejudge:
        from astrl.evaluation.rejudge import rejudge_missing

        rejudged = {str(f): rejudge_missing(r, threshold_a) for f, r in ((folder_a, records_a), (folder_b, records_b))}
    judges = [j for j in judge_names(records_a) if j in judge_names(records_b)]
    if not judges:
        raise EvaluationError(
            f"no judge in common: {folder_a} has {judge_names(records_a)}, {folder_b} has {judge_names(records_b)}"
        )
    groups = (opener_groups(records_a), opener_groups(records_b))
    rows = []
    for offset, judge in enumerate(judges):
        sampling = {"resamples": resamples, "seed": seed + 97 * offset, "keep_draws": keep_draws}
        scores_a, scores_b = score_arrays(records_a, judge), score_arrays(records_b, judge)
        ratios_a = _grouped(m.conversation_ratios(*scores_a, threshold_a), groups[0])
        ratios_b = _grouped(m.conversation_ratios(*scores_b, threshold_a), groups[1])
        for name in TESTED:  # seeds follow INTERVAL_METRICS, not the table order
            test = m.bootstrap_difference(ratios_a[name], ratios_b[name], **_seeded(sampling, name))
            rows.append(_row(judge, name, m.ratio(*ratios_a[name]), m.ratio(*ratios_b[name]), test))
        probes, sides = (scores_a[1], scores_b[1]), (records_a, records_b)
        rows.extend(_reply_sample_rows(judge, sides, probes, groups, threshold_a, sampling))
        rows.extend(_rejudged_rows(judge, sides, probes, groups, threshold_a, sampling))
        for name in UNTESTED:
            a, b = metrics_a["judges"].get(judge, {}).get(name), metrics_b["judges"].get(judge, {}).get(name)
            rows.append(_row(judge, name, a, b, None))
    nll_a, nll_b = (m.grouped(*m.nll_ratio(nll_array(r)), g) for r, g in zip((records_a, records_b), groups, strict=True))
    test = m.bootstrap_difference(nll_a, nll_b, resamples=resamples, seed=seed + 7919, keep_draws=keep_draws)
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
        **({"rejudged": rejudged} if rejudge else {}),
    }


def compare_pooled(
    pairs: list[tuple[str | Path, str | Path]], *, resamples: int = 1000, seed: int = 0, rejudge: bool = False
) -> dict:
    """The mean over several ``(A, B)`` pairs (one per training seed, say) of each :func:`compare` row:
    ``a`` and ``b`` are the pairs' mean rates, ``difference`` the mean of their differences, tested by
    :func:`astrl.evaluation.metrics.pooled_difference` (each pair resampled on its own: seed
    ``seed + 1009 * i``). A row is kept where every pair has it; all evaluations need one threshold.
    ``rejudge`` as in :func:`compare`."""
    if len(pairs) < 2:
        raise ValueError(f"a pooled comparison needs at least two pairs of evaluations, got {len(pairs)}")
    results = [
        compare(a, b, resamples=resamples, seed=seed + 1009 * i, keep_draws=True, rejudge=rejudge)
        for i, (a, b) in enumerate(pairs)
    ]
    thresholds = sorted({r["threshold"] for r in results})
    if len(thresholds) > 1:
        raise EvaluationError(f"the pairs used different thresholds ({', '.join(map(str, thresholds))}): not comparable")
    by_key = [{(row["judge"], row["metric"]): row for row in r["rows"]} for r in results]
    rows = []
    for key in (k for k in by_key[0] if all(k in rows_of for rows_of in by_key)):
        same = [rows_of[key] for rows_of in by_key]
        a, b = (_mean([row[side] for row in same]) for side in ("a", "b"))
        test = m.pooled_difference(same) if all("draws" in row for row in same) else None
        rows.append({**_row(*key, a, b, test), **_over_pairs(same)})
    return {
        "a": [str(a) for a, _ in pairs],
        "b": [str(b) for _, b in pairs],
        "settings_differ": sorted({d for r in results for d in r["settings_differ"]}),
        "threshold": thresholds[0],
        "n_conversations": [[r["n_conversations"][side] for r in results] for side in (0, 1)],
        "n_openers": [[r["n_openers"][side] for r in results] for side in (0, 1)],
        "bootstrap": {**results[0]["bootstrap"], "pooled": len(pairs)},
        "rows": rows,
        **({"rejudged": {f: c for r in results for f, c in r["rejudged"].items()}} if rejudge else {}),
    }


def _over_pairs(rows: list[dict]) -> dict:
    """``over_pairs``: B's value and B - A, each as :func:`astrl.evaluation.metrics.between_pairs` over the
    pairs' rows; empty where a pair lacks a value (diversity without one side, say). B's interval stays in
    ``[0, 1]`` where every pair's A and B are, else at or above 0 where they are (a rate, an NLL, a count)."""
    a, b, difference = ([r[key] for r in rows] for key in ("a", "b", "difference"))
    if any(v is None for v in (*a, *b, *difference)):
        return {}
    both = [*a, *b]
    bounds = None if min(both) < 0 else (0.0, 1.0) if max(both) <= 1 else (0.0, math.inf)
    return {"over_pairs": {"b": m.between_pairs(b, bounds=bounds), "difference": m.between_pairs(difference)}}


def _mean(values: list):
    """The mean of ``values``, ``None`` when any is missing."""
    return None if any(v is None for v in values) else sum(values) / len(values)


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
    notes = [f"note: the evaluations ran in different settings ({'; '.join(differ)})"] if differ else []
    added = {folder: checks for folder, checks in (result.get("rejudged") or {}).items() if checks}
    notes += [f"note: {folder} judged again here with {', '.join(checks)}" for folder, checks in added.items()]
    return notes


def _grouped(ratios: dict, groups) -> dict:
    """Each metric's per-conversation ``(num, den)`` summed per opener (:func:`astrl.evaluation.metrics.grouped`)."""
    return {name: m.grouped(num, den, groups) for name, (num, den) in ratios.items()}


def _seeded(sampling: dict, name: str) -> dict:
    """``sampling`` (``resamples``, ``seed``, ``keep_draws``) with the seed of metric ``name``."""
    return {**sampling, "seed": m.metric_seed(sampling["seed"], name)}


def _reply_sample_rows(
    judge: str, records: tuple[list[dict], list[dict]], probes: tuple, groups: tuple, threshold: float, sampling: dict
) -> list[dict]:
    """The reply-share rows, when both evaluations (``records``, with the judge's ``probes`` score
    grids and their conversations' ``groups``) judged several replies per probe (``--reply-samples``);
    with as many turns (more than one) on both sides, also ``elicited_reply_share_turn_T`` for each turn T."""
    replies_a, replies_b = (reply_sample_array(r, judge) for r in records)
    if replies_a is None or replies_b is None:
        return []
    ratios_a = _grouped(m.reply_sample_ratios(replies_a, probes[0], threshold), groups[0])
    ratios_b = _grouped(m.reply_sample_ratios(replies_b, probes[1], threshold), groups[1])
    rows = []
    for name in m.REPLY_SAMPLE_METRICS:
        test = m.bootstrap_difference(ratios_a[name], ratios_b[name], **_seeded(sampling, name))
        rows.append(_row(judge, name, m.ratio(*ratios_a[name]), m.ratio(*ratios_b[name]), test))
    turns = replies_a.shape[1]
    if turns > 1 and replies_b.shape[1] == turns:  # the elicited reply share turn by turn, paired over openers
        name = "elicited_reply_share"
        per_turn_a, per_turn_b = (
            [_grouped(ratios, group)[name] for ratios in m.per_turn_reply_sample_ratios(replies, probe, threshold)]
            for replies, probe, group in zip((replies_a, replies_b), probes, groups, strict=True)
        )
        for t, (a, b) in enumerate(zip(per_turn_a, per_turn_b, strict=True)):
            test = m.bootstrap_difference(a, b, **{**sampling, "seed": m.metric_seed(sampling["seed"], name) + t + 1})
            rows.append(_row(judge, f"{name}_turn_{t + 1}", m.ratio(*a), m.ratio(*b), test))
    return rows


def _rejudged_rows(
    judge: str, records: tuple[list[dict], list[dict]], probes: tuple, groups: tuple, threshold: float, sampling: dict
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
            test = m.bootstrap_difference(ratios[0][name], ratios[1][name], **_seeded(sampling, name))
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
        **({"draws": test["draws"]} if test and "draws" in test else {}),
    }


def _num(value) -> str:
    if value is None:
        return "n/a"
    return str(value) if isinstance(value, int) else f"{value:.3f}"


def _interval(value: dict | None, sign: str = "+") -> str:
    """``value["ci"]`` as ``[lo, hi]`` (signed: a difference's), ``-`` where there is none."""
    return f"[{value['ci'][0]:{sign}.3f}, {value['ci'][1]:{sign}.3f}]" if value and value["ci"] else "-"


def table_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    header = ["judge", "metric", "A", "B", "B - A", "95% CI of B - A", "p", "significant"]
    pooled = bool(result["bootstrap"].get("pooled"))
    if pooled:
        header += ["B over pairs (t, 95%)", "B - A over pairs (t, 95%)"]
    body = []
    for r in result["rows"]:
        diff = (
            "n/a"
            if r["difference"] is None
            else f"{r['difference']:+d}"
            if isinstance(r["difference"], int)
            else f"{r['difference']:+.3f}"
        )
        ci = _interval(r)
        p = "-" if r["p_value"] is None else f"{r['p_value']:.3f}"
        sig = (
            f"n<{m.MIN_TEST_UNITS}"
            if r["too_few"]
            else "-"
            if r["significant"] is None
            else ("yes" if r["significant"] else "no")
        )
        body.append([r["judge"], r["metric"], _num(r["a"]), _num(r["b"]), diff, ci, p, sig])
        if pooled:
            spread = r.get("over_pairs") or {}
            body[-1] += [_interval(spread.get("b"), sign=""), _interval(spread.get("difference"))]
    return header, body


def _per_pair(value) -> list:
    """A side's field as one entry per pair: a single comparison's scalar is a list of one."""
    return value if isinstance(value, list) else [value]


def _sizes(result: dict, side: int) -> str:
    """``"256 conversations, 62 openers"`` for side 0 (A) or 1 (B); a pooled comparison's sizes joined by ``" + "``."""
    conversations = _per_pair(result["n_conversations"][side])
    openers = _per_pair((result.get("n_openers") or (None, None))[side])
    if openers == [None]:  # written before openers were counted
        openers = [None] * len(conversations)
    pairs = zip(conversations, openers, strict=True)
    sizes = [f"{n} conversations" + (f", {o} openers" if o is not None else "") for n, o in pairs]
    return f"{len(sizes)} x {sizes[0]}" if len(sizes) > 1 and len(set(sizes)) == 1 else " + ".join(sizes)


def _side_lines(result: dict, markdown: bool) -> list[str]:
    """The header line of side A and of side B: its folder (a pooled comparison's: the mean over its folders) and sizes."""
    lines = []
    for i, side in enumerate("AB"):
        folders = result[side.lower()]
        shown = [f"`{f}`" if markdown else f for f in _per_pair(folders)]
        mean = f"the mean of {len(shown)}: " if len(shown) > 1 else ""
        lines.append(f"{'- ' if markdown else ''}{side}: {mean}{', '.join(shown)} ({_sizes(result, i)})")
    return lines


def format_text(result: dict) -> str:
    """An aligned plain-text table."""
    header, body = table_cells(result)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = _side_lines(result, markdown=False) + _settings_note(result)
    for row in [header, ["-" * w for w in widths], *body]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines) + "\n"


def format_markdown(result: dict) -> str:
    header, body = table_cells(result)
    esc = [[c.replace("|", "\\|") for c in row] for row in [header, *body]]
    lines = ["# astrl comparison", ""]
    lines += _side_lines(result, markdown=True)
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
    if pooled := result["bootstrap"].get("pooled"):
        lines[-1] += (
            f" Pooled over {pooled} pairs: each row is the mean of the pairs' rates and differences, its interval that of"
            " the mean of their resampled differences, each pair resampled on its own. The last two columns are"
            " Student-t intervals over the pairs, one value per pair: the spread between seeds is in them."
        )
    return "\n".join(lines) + "\n"
