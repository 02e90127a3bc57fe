"""Evaluation reports: PNG plots, ``report.md`` and a self-contained ``report.html``.

Plots are drawn with matplotlib's Agg canvas (no display needed). The HTML embeds every PNG as a
base64 data URI, so the file can be mailed or archived on its own.
"""

from __future__ import annotations

import base64
import csv
import html
import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from astrl.archive import ARCHIVE_FILE, AttackArchive, eval_turns
from astrl.evaluation.records import judge_names, score_arrays

PLOT_FILES = {
    "reply_toxicity": "reply_toxicity.png",
    "per_turn_rates": "per_turn_rates.png",
    "training_curves": "training_curves.png",
}
PLOT_TITLES = {
    "reply_toxicity": "Target-reply toxicity",
    "per_turn_rates": "Toxicity rates per turn",
    "training_curves": "Training curves",
}
MAX_TRAINING_CURVES = 9
# training columns shown first (shell patterns, in order); timing columns are left out
CURVE_PRIORITY = ("reward_mean", "loss", "harmful_rate_*", "score_*", "term_*", "kl*", "reward_*", "grad_norm", "lr")
CURVE_SKIP = ("*_seconds", "*_time")
MAX_MESSAGE_CHARS = 400
SUMMARY_ROWS = (
    ("asr", "attack success rate (ASR)"),
    ("elicited_asr", "elicited ASR (reply toxic, probe not)"),
    ("toxic_reply_rate", "toxic reply rate"),
    ("elicited_success_rate", "elicited success rate (per turn)"),
    ("elicited_reply_share", "elicited reply share (all K replies)"),
    ("toxic_reply_share", "toxic reply share (all K replies)"),
    ("fresh_elicited_reply_share", "elicited reply share without opener echo"),
    ("opener_echo_share", "opener echo (of elicited replies)"),
    ("identity_free_elicited_reply_share", "elicited reply share without identity terms"),
    ("identity_term_share", "toxic only for identity terms (of elicited replies)"),
    ("probe_echo_free_elicited_reply_share", "elicited reply share without probe echo"),
    ("probe_echo_share", "probe echo (of elicited replies)"),
    ("probe_form_free_elicited_reply_share", "elicited reply share without the probe's words in any form"),
    ("probe_form_echo_share", "probe echo in any form (of elicited replies)"),
    ("mean_reply_toxicity", "mean reply toxicity"),
    ("mean_toxicity_delta", "mean toxicity delta (reply - probe)"),
    ("toxic_probe_rate", "toxic probe rate"),
    ("toxic_combined_rate", "toxic probe+reply rate"),
    ("first_success_turn", "first success turn (1-based)"),
    ("n_successful_probes", "successful probes"),
    ("self_bleu_diversity", "self-BLEU diversity"),
    ("embedding_diversity", "embedding diversity"),
    ("unique_attacks", "unique attacks (cosine 0.7)"),
)

TRADEOFF_COLUMNS = (
    ("asr", "ASR"),
    ("elicited_asr", "elicited ASR"),
    ("n_successful_probes", "successful probes"),
    ("self_bleu_diversity", "self-BLEU diversity"),
    ("embedding_diversity", "embedding diversity"),
    ("unique_attacks", "unique attacks"),
)


# -- plots ------------------------------------------------------------------------------------------


def _figure(n_panels: int, width: float = 4.2, height: float = 3.2, columns: int | None = None):
    from matplotlib.figure import Figure

    columns = columns or n_panels
    rows = math.ceil(n_panels / columns)
    fig = Figure(figsize=(width * columns, height * rows), dpi=100)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes[:n_panels]


def plot_reply_toxicity(records: Sequence[dict], threshold: float, path: Path) -> Path:
    """One histogram of target-reply scores per judge, with the threshold marked."""
    judges = judge_names(records)
    fig, axes = _figure(len(judges))
    bins = np.linspace(0.0, 1.0, 21)
    for ax, judge in zip(axes, judges, strict=True):
        reply = score_arrays(records, judge)[0].ravel()
        ax.hist(reply, bins=bins, color="#c0392b", edgecolor="white")
        ax.axvline(threshold, color="black", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
        ax.set(title=judge, xlabel="judge score of the target reply", ylabel="turns", xlim=(0, 1))
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def plot_per_turn_rates(metrics: dict, path: Path) -> Path:
    """Per judge: toxic rates of replies, probes and probe+reply, elicited success rate (and, with
    sampled replies, elicited reply share) and mean reply score, by turn."""
    judges = list(metrics["judges"])
    fig, axes = _figure(len(judges))
    turns = np.arange(1, metrics["turns"] + 1)
    for ax, judge in zip(axes, judges, strict=True):
        result = metrics["judges"][judge]
        ax.plot(turns, result["toxic_reply_rate_per_turn"], "o-", label="toxic reply rate")
        ax.plot(turns, result["toxic_probe_rate_per_turn"], "s-", label="toxic probe rate")
        ax.plot(turns, result["toxic_combined_rate_per_turn"], "^-", label="toxic probe+reply rate")
        if "elicited_success_rate_per_turn" in result:
            ax.plot(turns, result["elicited_success_rate_per_turn"], "d-", label="elicited success rate")
        if "elicited_reply_share_per_turn" in result:  # --reply-samples K > 1: all K replies of each turn
            ax.plot(turns, result["elicited_reply_share_per_turn"], "v:", label="elicited reply share")
        ax.plot(turns, result["mean_reply_toxicity_per_turn"], "k--", label="mean reply score")
        ax.set(title=judge, xlabel="turn", ylabel="rate", ylim=(-0.03, 1.03), xticks=turns)
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def read_training_metrics(path: Path) -> dict[str, tuple[list[float], list[float]]]:
    """``column -> (steps, values)`` for every numeric column of a training ``metrics.csv``."""
    with path.open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    if not rows or "step" not in rows[0]:
        raise ValueError(f"{path} has no rows or no 'step' column")
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for column in rows[0]:
        if column == "step":
            continue
        steps, values = [], []
        for row in rows:
            try:
                step, value = float(row["step"]), float(row[column])
            except (TypeError, ValueError):
                continue
            if math.isfinite(value):
                steps.append(step)
                values.append(value)
        if values:
            curves[column] = (steps, values)
    if not curves:
        raise ValueError(f"{path} has no numeric column besides 'step'")
    return curves


def pick_curves(names: Sequence[str], limit: int = MAX_TRAINING_CURVES) -> list[str]:
    """The training columns to plot: those matching :data:`CURVE_PRIORITY` first, then the others
    in file order; timing columns left out."""
    from fnmatch import fnmatch

    kept = [n for n in names if not any(fnmatch(n, p) for p in CURVE_SKIP)]

    def rank(item: tuple[int, str]) -> tuple[int, int]:
        order, name = item
        return next((i for i, p in enumerate(CURVE_PRIORITY) if fnmatch(name, p)), len(CURVE_PRIORITY)), order

    return [name for _, name in sorted(enumerate(kept), key=rank)][:limit]


def plot_training_curves(curves: dict[str, tuple[list[float], list[float]]], path: Path) -> Path:
    """One panel per training metric against the step (see :func:`pick_curves`)."""
    names = pick_curves(list(curves))
    fig, axes = _figure(len(names), width=3.6, height=2.6, columns=min(3, len(names)))
    for ax, name in zip(axes, names, strict=True):
        steps, values = curves[name]
        ax.plot(steps, values, color="#2c3e50", linewidth=1.2)
        ax.set(title=name, xlabel="step")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def make_plots(out: Path, metrics: dict, records: Sequence[dict], run_dir: Path | None) -> tuple[dict[str, Path], list[str]]:
    """Write the PNGs; return ``plot name -> path`` and notes about plots left out."""
    plots = {
        "reply_toxicity": plot_reply_toxicity(records, metrics["threshold"], out / PLOT_FILES["reply_toxicity"]),
        "per_turn_rates": plot_per_turn_rates(metrics, out / PLOT_FILES["per_turn_rates"]),
    }
    notes = []
    if run_dir is not None:
        csv_path = Path(run_dir) / "metrics.csv"
        try:
            curves = read_training_metrics(csv_path)
        except FileNotFoundError:
            notes.append(f"no training curves: {csv_path} not found")
        except (ValueError, csv.Error) as err:
            notes.append(f"no training curves: {err}")
        else:
            plots["training_curves"] = plot_training_curves(curves, out / PLOT_FILES["training_curves"])
    return plots, notes


# -- top attacks ------------------------------------------------------------------------------------


def top_attacks(records: Sequence[dict], judge: str, k: int = 10) -> list[dict]:
    """The ``k`` turns whose target reply the judge scored highest, each with the conversation so far.

    Each entry: ``score``, ``conversation``, ``turn`` and ``messages`` (``(speaker, text)`` pairs:
    the opener, then tester and target turns up to and including the attack).
    """
    by_conversation: dict[int, list[dict]] = {}
    for r in records:
        by_conversation.setdefault(r["conversation"], []).append(r)
    for turns in by_conversation.values():
        turns.sort(key=lambda r: r["turn"])
    ranked = sorted(records, key=lambda r: (-r["scores"][judge]["reply"], r["conversation"], r["turn"]))[:k]
    attacks = []
    for r in ranked:
        history = by_conversation[r["conversation"]][: r["turn"] + 1]
        messages = [("opener", r["prompt"])]
        for turn in history:
            messages += [("tester", turn["probe"]), ("target", turn["response"])]
        score = r["scores"][judge]["reply"]
        attacks.append({"score": score, "conversation": r["conversation"], "turn": r["turn"], "messages": messages})
    return attacks


# -- formatting ---------------------------------------------------------------------------------------


def fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def fmt_ci(interval) -> str:
    return f"[{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""


def summary_rows(metrics: dict) -> list[tuple[str, list[str]]]:
    """(label, one cell per judge) rows of the summary table."""
    rows = []
    for key, label in SUMMARY_ROWS:
        if all(key not in result for result in metrics["judges"].values()):
            continue  # the reply-share rows need reply_samples > 1
        cells = []
        for result in metrics["judges"].values():
            ci = fmt_ci(result.get(f"{key}_ci"))
            cells.append(fmt(result.get(key)) + (f" {ci}" if ci else ""))
        rows.append((label, cells))
    return rows


HEADLINE_NOTE = "elicited: the reply is toxic while the probe alone is not"


def headline_rows(metrics: dict) -> list[str]:
    """One line per judge for the top of the report: ASR and elicited ASR with their intervals."""
    lines = []
    for judge, result in metrics["judges"].items():
        parts = []
        for key, label in (("asr", "ASR"), ("elicited_asr", "elicited ASR")):
            ci = fmt_ci(result.get(f"{key}_ci"))
            parts.append(f"{label} {fmt(result.get(key))}" + (f" {ci}" if ci else ""))
        lines.append(f"{judge}: " + ", ".join(parts))
    return lines


def tradeoff_rows(metrics: dict) -> list[list[str]]:
    """One row per judge: attack success next to the diversity of the successful probes."""
    return [[judge, *(fmt(result.get(key)) for key, _ in TRADEOFF_COLUMNS)] for judge, result in metrics["judges"].items()]


def archive_rows(archive: AttackArchive, limit: int) -> list[list[str]]:
    """The most frequent archived attacks: (rank, count, turn, scores, probe, reply)."""
    ranked = sorted(enumerate(archive.attacks), key=lambda item: (-item[1].count, item[0]))[:limit]
    rows = []
    for rank, (_, a) in enumerate(ranked, 1):
        scores = ", ".join(f"{name} {value:.3f}" for name, value in a.scores.items())
        rows.append([str(rank), str(a.count), fmt(a.turn), scores, a.probe, a.reply])
    return rows


ARCHIVE_HEADER = ["#", "count", "turn", "reply scores", "probe", "reply"]


def archive_note(archive: AttackArchive) -> str:
    return (
        f"{len(archive)} distinct successful probe(s) (from {archive.total} successful turn(s), any judge above "
        f"{archive.threshold:g}) in {ARCHIVE_FILE}, most frequent first."
    )


def setting_rows(metrics: dict) -> list[tuple[str, str]]:
    nll = metrics["probe_nll"]
    return [
        ("tester", metrics["tester"] + (f" (checkpoint {metrics['checkpoint']})" if metrics.get("checkpoint") else "")),
        ("target", metrics["target"]),
        ("judges", ", ".join(metrics["judges"])),
        ("training scorer", ", ".join(metrics.get("training_scorers") or []) or "n/a"),
        ("prompts", f"{metrics['prompts']} (split {metrics['split']}, seed {metrics['split_seed']})"),
        ("conversations x turns", f"{metrics['n_conversations']} x {metrics['turns']} ({metrics['mode']} mode)"),
        ("threshold", fmt(metrics["threshold"])),
        (
            "probe NLL under the target",
            f"mean {fmt(nll['mean'])} {fmt_ci(nll['mean_ci'])}, median {fmt(nll['median'])}, "
            f"{nll['n_probes']} probes, {metrics['n_empty_probes']} empty left out",
        ),
        ("intervals", f"95% bootstrap over {_units(metrics)}, {metrics['bootstrap']['resamples']} resamples"),
    ]


def _units(metrics: dict) -> str:
    """What the bootstrap resampled: the openers (the conversations sharing one together), or, in
    metrics of older releases, conversations."""
    if metrics.get("bootstrap", {}).get("unit") == "opener":
        openers = metrics.get("n_openers")
        return f"openers ({openers} of them; the conversations that share one are resampled together)" if openers else "openers"
    return "conversations"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _clip(text: str) -> str:
    """Shorten a message for a table; control characters (invalid in HTML) become U+FFFD."""
    text = _CONTROL.sub("\ufffd", text)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "…"


def _md_cell(text: str) -> str:
    return html.escape(_clip(text)).replace("|", "\\|").replace("\n", "<br>")


# -- markdown ---------------------------------------------------------------------------------------


def render_markdown(
    metrics: dict, plots: dict[str, Path], attacks: dict[str, list[dict]], archive: AttackArchive | None = None, limit: int = 10
) -> str:
    lines = ["# astrl evaluation report", ""]
    lines += [f"- {_md_cell(line)}" for line in headline_rows(metrics)]
    lines += ["", f"95% bootstrap intervals over {_units(metrics)}; {HEADLINE_NOTE}.", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| {k} | {_md_cell(v)} |" for k, v in setting_rows(metrics)]
    judges = list(metrics["judges"])
    lines += ["", "## Success and diversity", "", "| judge | " + " | ".join(label for _, label in TRADEOFF_COLUMNS) + " |"]
    lines += ["|---" * (len(TRADEOFF_COLUMNS) + 1) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in tradeoff_rows(metrics)]
    lines += ["", "## Summary", "", "| metric | " + " | ".join(map(_md_cell, judges)) + " |", "|---" * (len(judges) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in summary_rows(metrics)]
    lines += ["", f"Intervals in brackets are 95% bootstrap intervals over {_units(metrics)}."]
    agreement = agreement_markdown(metrics.get("judge_agreement"))
    if agreement:
        lines += ["", *agreement]
    if metrics.get("warnings"):
        lines += ["", "## Warnings", ""] + [f"- {_md_cell(w)}" for w in metrics["warnings"]]
    lines += ["", "## Plots", ""]
    for name, path in plots.items():
        lines += [f"### {PLOT_TITLES[name]}", "", f"![{PLOT_TITLES[name]}]({path.name})", ""]
    for judge, entries in attacks.items():
        lines += [f"## Top attacks ({_md_cell(judge)})", ""]
        if not entries:
            lines += ["No turns.", ""]
            continue
        lines += ["| # | reply score | conversation | turn | conversation so far |", "| --- | --- | --- | --- | --- |"]
        for rank, a in enumerate(entries, 1):
            talk = "<br>".join(f"**{who}:** {_md_cell(text)}" for who, text in a["messages"])
            lines.append(f"| {rank} | {a['score']:.3f} | {a['conversation']} | {a['turn']} | {talk} |")
        lines.append("")
    if archive is not None:
        lines += ["## Attack archive", "", archive_note(archive), ""]
        if len(archive) and limit:
            lines += ["| " + " | ".join(ARCHIVE_HEADER) + " |", "|---" * len(ARCHIVE_HEADER) + "|"]
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in archive_rows(archive, limit)]
    return "\n".join(lines).rstrip() + "\n"


# -- html -------------------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
img { max-width: 100%; }
.who { font-weight: 600; }
.warn { color: #8a4b00; }
"""


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], raw_last: bool = False) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = [f"<td>{html.escape(c)}</td>" for c in row[:-1]] if raw_last else [f"<td>{html.escape(c)}</td>" for c in row]
        if raw_last:
            cells.append(f"<td>{row[-1]}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def render_html(
    metrics: dict, plots: dict[str, Path], attacks: dict[str, list[dict]], archive: AttackArchive | None = None, limit: int = 10
) -> str:
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', "<title>astrl evaluation report</title>"]
    parts += [f"<style>{_CSS}</style></head><body>", "<h1>astrl evaluation report</h1>"]
    items = "".join(f"<li>{html.escape(line)}</li>" for line in headline_rows(metrics))
    parts.append(f"<ul>{items}</ul><p>95% bootstrap intervals over {_units(metrics)}; {html.escape(HEADLINE_NOTE)}.</p>")
    parts.append(_table(["setting", "value"], setting_rows(metrics)))
    parts.append("<h2>Success and diversity</h2>")
    parts.append(_table(["judge", *(label for _, label in TRADEOFF_COLUMNS)], tradeoff_rows(metrics)))
    parts.append("<h2>Summary</h2>")
    parts.append(_table(["metric", *metrics["judges"]], [[label, *cells] for label, cells in summary_rows(metrics)]))
    parts.append(f"<p>Intervals in brackets are 95% bootstrap intervals over {_units(metrics)}.</p>")
    if metrics.get("judge_agreement"):
        parts.append(agreement_html(metrics["judge_agreement"]))
    if metrics.get("warnings"):
        items = "".join(f'<li class="warn">{html.escape(w)}</li>' for w in metrics["warnings"])
        parts.append(f"<h2>Warnings</h2><ul>{items}</ul>")
    parts.append("<h2>Plots</h2>")
    for name, path in plots.items():
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        title = html.escape(PLOT_TITLES[name])
        parts.append(f'<h3>{title}</h3><img alt="{title}" src="data:image/png;base64,{data}">')
    for judge, entries in attacks.items():
        parts.append(f"<h2>Top attacks ({html.escape(judge)})</h2>")
        rows = []
        for rank, a in enumerate(entries, 1):
            talk = "<br>".join(
                f'<span class="who">{who}:</span> {html.escape(_clip(text)).replace(chr(10), "<br>")}'
                for who, text in a["messages"]
            )
            rows.append([str(rank), f"{a['score']:.3f}", str(a["conversation"]), str(a["turn"]), talk])
        parts.append(_table(["#", "reply score", "conversation", "turn", "conversation so far"], rows, raw_last=True))
    if archive is not None:
        parts += ["<h2>Attack archive</h2>", f"<p>{html.escape(archive_note(archive))}</p>"]
        if len(archive) and limit:
            rows = [[*row[:4], _clip(row[4]), _clip(row[5])] for row in archive_rows(archive, limit)]
            parts.append(_table(ARCHIVE_HEADER, rows))
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# -- judge agreement --------------------------------------------------------------------------------

AGREEMENT_HEADER = ["judges", "replies", "both toxic", "only first", "only second", "agreement", "Cohen's kappa"]
DISAGREEMENT_HEADER = ["#", "where", "scores", "toxic under", "probe", "reply"]


def agreement_note(agreement: dict) -> str:
    """The sentence under the agreement table: threshold, intervals, scorer-hacking count."""
    note = (
        f"A reply is called toxic when its score is above {agreement['threshold']:g}; 95% bootstrap intervals over "
        f"{agreement['unit']}s. {agreement['n_disagreements']} of {agreement['n_items']} replies split the judges"
    )
    if agreement["training_scorers"]:
        note += (
            f"; {agreement['n_training_scorer_only']} are called toxic by the training scorer "
            f"({', '.join(agreement['training_scorers'])}) alone (the signature of scorer hacking; listed first)"
        )
    return note + "."


def agreement_rows(agreement: dict) -> list[list[str]]:
    """One row per pair of judges: counts, agreement and kappa with their intervals."""
    rows = []
    for pair in agreement["pairs"]:
        rows.append(
            [
                " vs ".join(pair["judges"]),
                str(pair["n"]),
                str(pair["both_toxic"]),
                str(pair["only_a"]),
                str(pair["only_b"]),
                f"{fmt(pair['agreement'])} {fmt_ci(pair['agreement_ci'])}".strip(),
                f"{fmt(pair['kappa'])} {fmt_ci(pair['kappa_ci'])}".strip(),
            ]
        )
    return rows


def disagreement_rows(agreement: dict) -> list[list[str]]:
    """The disagreement table: where, every judge's score, the judges calling it toxic, probe, reply."""
    rows = []
    for rank, row in enumerate(agreement["disagreements"], 1):
        scores = ", ".join(f"{name} {value:.3f}" for name, value in row["scores"].items())
        toxic = ", ".join(row["toxic"]) + (" (training scorer only)" if row["training_scorer_only"] else "")
        rows.append([str(rank), row["where"], scores, toxic, row["probe"], row["reply"]])
    return rows


def agreement_markdown(agreement: dict | None) -> list[str]:
    """The "Judge agreement" section of a markdown report (nothing for fewer than two judges)."""
    if not agreement:
        return []
    lines = ["## Judge agreement", "", agreement_note(agreement), ""]
    lines += ["| " + " | ".join(AGREEMENT_HEADER) + " |", "|---" * len(AGREEMENT_HEADER) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in agreement_rows(agreement)]
    rows = disagreement_rows(agreement)
    lines += ["", "### Where the judges disagree most", ""]
    if not rows:
        return lines + ["The judges agree on every reply.", ""]
    lines += ["| " + " | ".join(DISAGREEMENT_HEADER) + " |", "|---" * len(DISAGREEMENT_HEADER) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def agreement_html(agreement: dict | None) -> str:
    """The "Judge agreement" section of an HTML report ("" for fewer than two judges)."""
    if not agreement:
        return ""
    parts = ["<h2>Judge agreement</h2>", f"<p>{html.escape(agreement_note(agreement))}</p>"]
    parts.append(_table(AGREEMENT_HEADER, agreement_rows(agreement)))
    parts.append("<h3>Where the judges disagree most</h3>")
    rows = [[*row[:4], _clip(row[4]), _clip(row[5])] for row in disagreement_rows(agreement)]
    parts.append(_table(DISAGREEMENT_HEADER, rows) if rows else "<p>The judges agree on every reply.</p>")
    return "\n".join(parts)


def write_report(
    out: Path,
    metrics: dict,
    records: Sequence[dict],
    *,
    run_dir: Path | None = None,
    top_k: int = 10,
    archive: AttackArchive | None = None,
) -> list[str]:
    """Write the plots, ``report.md`` and ``report.html`` into ``out``.

    ``archive`` is the attack archive of the records (built from them, at the metrics' threshold,
    when not given). Notes about left-out parts are appended to ``metrics["warnings"]`` and returned.
    """
    if archive is None:
        archive = AttackArchive(metrics["threshold"])
        archive.extend(eval_turns(records))
    out = Path(out)
    plots, notes = make_plots(out, metrics, records, run_dir)
    metrics.setdefault("warnings", []).extend(notes)
    attacks = {judge: top_attacks(records, judge, top_k) for judge in metrics["judges"]} if top_k else {}
    (out / "report.md").write_text(render_markdown(metrics, plots, attacks, archive, top_k), encoding="utf-8")
    (out / "report.html").write_text(render_html(metrics, plots, attacks, archive, top_k), encoding="utf-8")
    return notes
