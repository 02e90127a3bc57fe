"""Writing a list of found attacks to a file: JSONL, CSV, a replay archive or a ``datasets`` folder.

* ``jsonl``: one :class:`~astrl.store.queries.FoundAttack` object per line (every field);
* ``csv``: the columns of :data:`CSV_COLUMNS`, lists and objects as JSON text;
* ``archive``: the ``attacks.jsonl`` format of :mod:`astrl.archive` (``probe``, ``reply``,
  ``conversation``, ``scores``, ``reward``, ``step``, ``turn``, ``count``), which ``astrl replay`` reads;
* ``datasets``: a Hugging Face ``datasets`` folder (``Dataset.save_to_disk``), when that package is installed.

Files are written through a temporary file renamed when complete. The text is what the models
wrote, unchanged: a spreadsheet may read a cell that begins with ``=`` as a formula.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from pathlib import Path

from astrl.archive import Attack
from astrl.argtypes import require
from astrl.store.database import StoreError
from astrl.store.queries import FoundAttack

FORMATS = ("jsonl", "csv", "archive", "datasets")
CSV_COLUMNS = (
    "key", "probe", "score", "judge", "probe_score", "reply", "target", "run", "source", "step", "turn", "reward",
    "matches", "count", "first_seen", "last_seen", "runs", "targets", "judges", "scores", "context",
)  # fmt: skip


def guess_format(path: str | Path) -> str | None:
    """``csv`` for a ``.csv`` file, ``jsonl`` for ``.jsonl`` / ``.json``, else None."""
    suffix = Path(path).suffix.lower()
    return {".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}.get(suffix)


def archive_record(attack: FoundAttack) -> dict:
    """The attack as a line of an ``attacks.jsonl`` archive (its count: the matching turns and replies)."""
    return Attack(
        probe=attack.probe,
        reply=attack.reply,
        conversation=[dict(m) for m in attack.context],
        scores=dict(attack.scores),
        reward=attack.reward,
        step=attack.step,
        turn=attack.turn,
        count=max(1, attack.matches),
    ).to_dict()


def _csv_row(attack: FoundAttack) -> dict:
    data = attack.to_dict()
    return {k: json.dumps(data[k], ensure_ascii=False) if isinstance(data[k], (list, dict)) else data[k] for k in CSV_COLUMNS}


def _replace(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8", newline="") as handle:
        write(handle)
    os.replace(tmp, path)


def _dataset_row(attack: FoundAttack) -> dict:
    """One row with the same columns for every attack (scores as a list of judge/value pairs)."""
    data = attack.to_dict()
    data["scores"] = [{"judge": j, "value": v} for j, v in sorted(attack.scores.items())]
    data["context"] = [{"role": m["role"], "content": m["content"]} for m in attack.context]
    return data


def export_attacks(attacks: Sequence[FoundAttack], path: str | Path, fmt: str) -> Path:
    """Write ``attacks`` to ``path`` in format ``fmt`` (:data:`FORMATS`); returns the path written."""
    require("export format", fmt, choices=FORMATS)
    path = Path(path).expanduser()
    if fmt == "datasets":
        try:
            from datasets import Dataset
        except ImportError:
            raise StoreError("exporting a datasets folder needs the datasets package: pip install datasets") from None
        Dataset.from_list([_dataset_row(a) for a in attacks]).save_to_disk(str(path))
        return path
    if path.is_dir():
        raise StoreError(f"export path {str(path)!r} is a folder; the {fmt} export writes one file")
    if fmt == "csv":

        def write(handle) -> None:
            writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS, lineterminator="\n")
            writer.writeheader()
            writer.writerows(_csv_row(a) for a in attacks)

    else:
        lines = (archive_record(a) if fmt == "archive" else a.to_dict() for a in attacks)

        def write(handle) -> None:
            for line in lines:
                handle.write(json.dumps(line, ensure_ascii=False) + "\n")

    _replace(path, write)
    return path
