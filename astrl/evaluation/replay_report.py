"""The ``astrl replay`` report: a target x judge heat map, ``report.md`` and a self-contained ``report.html``."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from astrl.evaluation.report import (
    _CSS,
    _clip,
    _figure,
    _md_cell,
    _table,
    agreement_html,
    agreement_markdown,
    fmt,
    fmt_ci,
)

HEATMAP_FILE = "transfer_heatmap.png"
TABLE_HEADER = [
    "target",
    "judge",
    "success rate (toxic replies)",
    "attacks with a toxic reply",
    "elicited success rate",
    "toxic probe rate",
    "mean toxicity delta",
]


def plot_transfer_heatmap(result: dict, path: Path) -> Path:
    """Success rate per target (rows) and judge (columns), each cell annotated with its interval."""
    targets = [t["label"] for t in result["targets"]]
    judges = result["judges"]
    values = np.array([[result["transfer"][t][j]["success_rate"] for j in judges] for t in targets], dtype=np.float64)
    labels = [_clip(t)[:48] for t in targets]
    width = 2.5 + 0.075 * max(len(label) for label in labels) + 1.8 * len(judges)
    fig, (ax,) = _figure(1, width=width, height=1.6 + 0.8 * len(targets))
    image = ax.imshow(values, cmap="Reds", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(judges)), labels=judges, rotation=20, ha="right")
    ax.set_yticks(range(len(targets)), labels=labels)
    for row, target in enumerate(targets):
        for column, judge in enumerate(judges):
            cell = result["transfer"][target][judge]
            ci = cell["success_rate_ci"]
            text = f"{cell['success_rate']:.2f}" + (f"\n[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
            color = "white" if values[row, column] > 0.5 else "black"
            ax.text(column, row, text, ha="center", va="center", fontsize=8, color=color)
    ax.set_title("Attack success rate per target and judge")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def table_rows(result: dict) -> list[list[str]]:
    """One row per target and judge: the transfer rates with their intervals."""
    rows = []
    for target in result["targets"]:
        for judge in result["judges"]:
            cell = result["transfer"][target["label"]][judge]

            def rate(key: str, cell: dict = cell) -> str:
                return f"{fmt(cell[key])} {fmt_ci(cell[key + '_ci'])}".strip()

            rows.append(
                [
                    target["label"],
                    judge,
                    rate("success_rate"),
                    f"{cell['n_successful_attacks']} of {cell['n_attacks']}",
                    rate("elicited_success_rate"),
                    fmt(cell["toxic_probe_rate"]),
                    fmt(cell["mean_toxicity_delta"]),
                ]
            )
    return rows


def setting_rows(result: dict) -> list[tuple[str, str]]:
    decoding = "greedy" if result["greedy"] else f"sampled, {result['samples']} sample(s) per attack"
    gen = result["generation"]
    targets = []
    for t in result["targets"]:
        extra = []
        if t["hardened_run"]:
            extra.append(f"hardened target of {t['hardened_run']}")
        if t["system_prompt"]:
            extra.append(f"system prompt {t['system_prompt']!r}")
        targets.append(t["label"] + (f" ({'; '.join(extra)})" if extra else ""))
    return [
        ("archive", f"{result['archive']} ({result['n_attacks']} attacks)"),
        ("targets", "; ".join(targets)),
        ("judges", ", ".join(result["judges"])),
        ("training scorer", ", ".join(result["training_scorers"]) or "n/a"),
        ("decoding", f"{decoding}; {gen['max_new_tokens']} new tokens, {result['mode']} mode"),
        ("threshold", fmt(result["threshold"])),
        ("intervals", f"95% bootstrap over attacks, {result['bootstrap']['resamples']} resamples"),
    ]


def set_rows(result: dict, attacks: Sequence, judge: str, which: str, limit: int) -> list[list[str]]:
    """Rows (attack index, probe) of the first ``limit`` attacks of one transfer set."""
    indices = result["transfer_sets"][judge][which][:limit]
    return [[str(i), attacks[i].probe] for i in indices]


SET_TITLES = {"every_target": "Attacks that succeed on every target", "no_target": "Attacks that succeed on no target"}


def set_note(result: dict, judge: str, which: str, limit: int) -> str:
    count = len(result["transfer_sets"][judge][which])
    shown = f" (first {limit} shown)" if count > limit else ""
    return f"{count} of {result['n_attacks']} attacks under {judge}{shown}; success = some reply above the threshold."


NOTE = (
    "Success rate: toxic replies / replies; elicited: the reply is toxic while the probe alone is not; "
    "intervals are 95% bootstrap intervals over attacks."
)


def render_markdown(result: dict, attacks: Sequence, limit: int) -> str:
    lines = ["# astrl replay report", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| {k} | {_md_cell(v)} |" for k, v in setting_rows(result)]
    lines += ["", "## Transfer", "", "| " + " | ".join(TABLE_HEADER) + " |", "|---" * len(TABLE_HEADER) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table_rows(result)]
    lines += ["", NOTE, "", f"![Attack success rate per target and judge]({HEATMAP_FILE})", ""]
    for judge in result["judges"]:
        for which, title in SET_TITLES.items():
            lines += [f"## {title} ({_md_cell(judge)})", "", set_note(result, judge, which, limit), ""]
            rows = set_rows(result, attacks, judge, which, limit)
            if rows:
                lines += ["| attack | probe |", "| --- | --- |"]
                lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
                lines.append("")
    lines += agreement_markdown(result.get("judge_agreement"))
    if result.get("warnings"):
        lines += ["## Warnings", ""] + [f"- {_md_cell(w)}" for w in result["warnings"]]
    return "\n".join(lines).rstrip() + "\n"


def render_html(result: dict, attacks: Sequence, limit: int, heatmap: Path) -> str:
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', "<title>astrl replay report</title>"]
    parts += [f"<style>{_CSS}</style></head><body>", "<h1>astrl replay report</h1>"]
    parts.append(_table(["setting", "value"], setting_rows(result)))
    parts += ["<h2>Transfer</h2>", _table(TABLE_HEADER, table_rows(result)), f"<p>{html.escape(NOTE)}</p>"]
    data = base64.b64encode(heatmap.read_bytes()).decode("ascii")
    parts.append(f'<img alt="Attack success rate per target and judge" src="data:image/png;base64,{data}">')
    for judge in result["judges"]:
        for which, title in SET_TITLES.items():
            parts.append(f"<h2>{html.escape(title)} ({html.escape(judge)})</h2>")
            parts.append(f"<p>{html.escape(set_note(result, judge, which, limit))}</p>")
            rows = [[i, _clip(probe)] for i, probe in set_rows(result, attacks, judge, which, limit)]
            if rows:
                parts.append(_table(["attack", "probe"], rows))
    parts.append(agreement_html(result.get("judge_agreement")))
    if result.get("warnings"):
        items = "".join(f'<li class="warn">{html.escape(w)}</li>' for w in result["warnings"])
        parts.append(f"<h2>Warnings</h2><ul>{items}</ul>")
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p) + "\n"


def write_replay_report(out: Path, result: dict, attacks: Sequence, limit: int = 10) -> None:
    """Write ``transfer_heatmap.png``, ``report.md`` and ``report.html`` into ``out``."""
    heatmap = plot_transfer_heatmap(result, Path(out) / HEATMAP_FILE)
    (Path(out) / "report.md").write_text(render_markdown(result, attacks, limit), encoding="utf-8")
    (Path(out) / "report.html").write_text(render_html(result, attacks, limit, heatmap), encoding="utf-8")
