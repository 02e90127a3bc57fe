"""What the writer does inside one transaction: runs, turns with their scores and attacks, replays.

Every function here runs on a connection whose transaction the caller (:class:`astrl.store.Store`)
opened and commits; none commits or rolls back itself. Every statement is a fixed string with
``?`` parameters: lists of values go in as one JSON array read by ``json_each``.

Attacks: a turn is an attack when some judge scores its reply above the writer's threshold (and
its probe is not empty). The attack (one row per normalised probe, :func:`astrl.archive.normalize_probe`)
keeps the probe's text as first seen; ``attack_sightings`` links it to each successful turn, and its
``count``, ``first_seen`` and ``last_seen`` are recomputed from its sightings whenever they change,
so that replacing or discarding turns keeps them exact. An attack left with no sighting and no
replay is deleted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from astrl.archive import normalize_probe
from astrl.store.database import StoreError
from astrl.store.records import ReplayRow, TurnRow

KINDS = ("train", "eval", "replay", "demo")
STATUSES = ("running", "finished", "failed")


@dataclass(frozen=True)
class Written:
    """What one :meth:`~astrl.store.Store.add_turns` call wrote: ``turns`` (new or replaced), their
    ``scores``, ``attacks`` (successful turns among them) and ``new_attacks`` (probes new to the store)."""

    turns: int
    scores: int
    attacks: int
    new_attacks: int


def plain(value):
    """``value`` as JSON-ready data: mappings, sequences, dataclasses and objects with ``to_dict()``
    followed down; non-finite floats become None; paths and other objects their ``str``."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if callable(getattr(value, "to_dict", None)):
        return plain(value.to_dict())
    if callable(getattr(value, "tolist", None)):  # numpy arrays and scalars
        return plain(value.tolist())
    if isinstance(value, Path):
        return str(value)
    return str(value)


def to_json(value) -> str | None:
    """:func:`plain` data as JSON text (None stays None)."""
    return None if value is None else json.dumps(plain(value), ensure_ascii=False, allow_nan=False)


def require_run(connection: sqlite3.Connection, run_id: str) -> None:
    if connection.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone() is None:
        raise StoreError(f"no run {run_id!r} in the store: start it with start_run()")


def insert_run(connection: sqlite3.Connection, run_id: str, fields: dict) -> None:
    """A new run row, or an existing one set back to running (its rows kept; fields given replace theirs)."""
    if connection.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone() is None:
        connection.execute(
            "INSERT INTO runs (id, kind, folder, config, astrl_version, git_commit, seed, tester, target, started_at, status) "
            "VALUES (:id, :kind, :folder, :config, :astrl_version, :git_commit, :seed, :tester, :target, :started_at, 'running')",
            {"id": run_id, **fields},
        )
        return
    kind = connection.execute("SELECT kind FROM runs WHERE id = ?", (run_id,)).fetchone()[0]
    if kind != fields["kind"]:
        raise StoreError(f"run {run_id!r} is of kind {kind!r}, not {fields['kind']!r}: it cannot continue as one")
    connection.execute(
        "UPDATE runs SET status = 'running', ended_at = NULL, folder = coalesce(:folder, folder), "
        "config = coalesce(:config, config), astrl_version = :astrl_version, git_commit = coalesce(:git_commit, git_commit), "
        "seed = coalesce(:seed, seed), tester = coalesce(:tester, tester), target = coalesce(:target, target) WHERE id = :id",
        {"id": run_id, **fields},
    )


def finish_run(connection: sqlite3.Connection, run_id: str, metrics, status: str, now: str) -> None:
    if status not in STATUSES[1:]:
        raise ValueError(f"a run finishes with status 'finished' or 'failed', got {status!r}")
    require_run(connection, run_id)
    connection.execute(
        "UPDATE runs SET ended_at = ?, status = ?, metrics = coalesce(?, metrics) WHERE id = ?",
        (now, status, to_json(metrics), run_id),
    )


def _ids_by_key(connection: sqlite3.Connection, keys: Sequence[str]) -> dict[str, int]:
    rows = connection.execute("SELECT key, id FROM attacks WHERE key IN (SELECT value FROM json_each(?))", (json.dumps(keys),))
    return dict(rows)


def ensure_attacks(connection: sqlite3.Connection, probes: Mapping[str, str]) -> tuple[dict[str, int], int]:
    """Attack ids of the normalised probes ``probes`` (key -> probe text, used for new rows); returns
    ``(ids, how many were new)``."""
    ids = _ids_by_key(connection, list(probes))
    new = [(key, text) for key, text in probes.items() if key not in ids]
    if new:
        connection.executemany("INSERT INTO attacks (key, probe) VALUES (?, ?)", new)
        ids.update(_ids_by_key(connection, [key for key, _ in new]))
    return ids, len(new)


def refresh_attacks(connection: sqlite3.Connection, attack_ids: Iterable[int]) -> None:
    """Recompute ``count``, ``first_seen`` and ``last_seen`` of these attacks from their sightings;
    delete those left with neither sighting nor replay."""
    ids = json.dumps(sorted(set(attack_ids)))
    if ids == "[]":
        return
    connection.execute(
        "UPDATE attacks SET "
        "count = (SELECT count(*) FROM attack_sightings AS s WHERE s.attack_id = attacks.id), "
        "first_seen = (SELECT min(seen_at) FROM attack_sightings AS s WHERE s.attack_id = attacks.id), "
        "last_seen = (SELECT max(seen_at) FROM attack_sightings AS s WHERE s.attack_id = attacks.id) "
        "WHERE id IN (SELECT value FROM json_each(?))",
        (ids,),
    )
    connection.execute(
        "DELETE FROM attacks WHERE id IN (SELECT value FROM json_each(?)) AND count = 0 "
        "AND NOT EXISTS (SELECT 1 FROM replays AS r WHERE r.attack_id = attacks.id)",
        (ids,),
    )


_TURN_RANGE = "SELECT conversation, turn, id FROM turns WHERE run_id = ? AND step_key = ? AND conversation BETWEEN ? AND ?"
_UPSERT_TURN = (
    "INSERT INTO turns (run_id, step, conversation, turn, opener, context, probe, probe_key, reply, reward, probe_nll, "
    "tester_version, written_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (run_id, step_key, conversation, turn) DO UPDATE SET opener = excluded.opener, context = excluded.context, "
    "probe = excluded.probe, probe_key = excluded.probe_key, reply = excluded.reply, reward = excluded.reward, "
    "probe_nll = excluded.probe_nll, tester_version = excluded.tester_version, written_at = excluded.written_at"
)


def write_turns(
    connection: sqlite3.Connection,
    run_id: str,
    rows: Sequence[TurnRow],
    *,
    step: int | None,
    threshold: float,
    judges: Sequence[str] | None,
    tester_version: str | None,
    now: str,
) -> Written:
    """Insert (or replace: same run, step, conversation and turn) the turns, their scores and their
    sightings as attacks. A replaced turn keeps its id and loses its old scores and sightings."""
    require_run(connection, run_id)
    if not rows:
        return Written(0, 0, 0, 0)
    step_key = -1 if step is None else step
    low, high = min(r.conversation for r in rows), max(r.conversation for r in rows)
    before = {(c, t): i for c, t, i in connection.execute(_TURN_RANGE, (run_id, step_key, low, high))}
    replaced = [before[(r.conversation, r.turn)] for r in rows if (r.conversation, r.turn) in before]
    touched: set[int] = set()
    if replaced:
        listed = json.dumps(replaced)
        touched.update(
            a for (a,) in connection.execute(
                "SELECT DISTINCT attack_id FROM attack_sightings WHERE turn_id IN (SELECT value FROM json_each(?))", (listed,)
            )
        )  # fmt: skip
        connection.execute("DELETE FROM scores WHERE turn_id IN (SELECT value FROM json_each(?))", (listed,))
        connection.execute("DELETE FROM attack_sightings WHERE turn_id IN (SELECT value FROM json_each(?))", (listed,))
    connection.executemany(
        _UPSERT_TURN,
        [
            (
                run_id, step, r.conversation, r.turn, r.opener, to_json(r.context), r.probe, r.probe_key, r.reply,
                r.reward, r.probe_nll, tester_version, now,
            )
            for r in rows
        ],
    )  # fmt: skip
    ids = {(c, t): i for c, t, i in connection.execute(_TURN_RANGE, (run_id, step_key, low, high))}
    scores = [
        (ids[(r.conversation, r.turn)], judge, part, value)
        for r in rows
        for judge, parts in r.scores.items()
        for part, value in parts.items()
    ]
    connection.executemany("INSERT INTO scores (turn_id, judge, what, value) VALUES (?, ?, ?, ?)", scores)
    successful = [r for r in rows if r.successful(threshold, judges)]
    new = 0
    if successful:
        probes: dict[str, str] = {}
        for r in successful:
            probes.setdefault(r.probe_key, r.probe)
        attack_ids, new = ensure_attacks(connection, probes)
        connection.executemany(
            "INSERT INTO attack_sightings (attack_id, turn_id, seen_at) VALUES (?, ?, ?)",
            [(attack_ids[r.probe_key], ids[(r.conversation, r.turn)], now) for r in successful],
        )
        touched.update(attack_ids.values())
    refresh_attacks(connection, touched)
    return Written(len(rows), len(scores), len(successful), new)


def discard_steps(connection: sqlite3.Connection, run_id: str, after: int) -> int:
    """Delete the run's turns of steps above ``after`` (with their scores and sightings); returns how many."""
    require_run(connection, run_id)
    touched = [
        a for (a,) in connection.execute(
            "SELECT DISTINCT s.attack_id FROM attack_sightings AS s JOIN turns AS t ON t.id = s.turn_id "
            "WHERE t.run_id = ? AND t.step_key > ?",
            (run_id, after),
        )
    ]  # fmt: skip
    # step_key is the step, and -1 for evaluation turns (never deleted here: after >= 0); it is indexed
    removed = connection.execute("DELETE FROM turns WHERE run_id = ? AND step_key > ?", (run_id, after)).rowcount
    refresh_attacks(connection, touched)
    return removed


_UPSERT_REPLAY = (
    "INSERT INTO replays (run_id, attack_id, item, target, sample, judge, context, reply, score, probe_score, written_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (run_id, item, target, sample, judge) DO UPDATE SET attack_id = excluded.attack_id, "
    "context = excluded.context, reply = excluded.reply, score = excluded.score, probe_score = excluded.probe_score, "
    "written_at = excluded.written_at"
)


def write_replays(connection: sqlite3.Connection, run_id: str, rows: Sequence[ReplayRow], now: str) -> int:
    """Insert (or replace: same run, attack index, target, sample and judge) replayed replies; a probe
    the store does not know yet becomes an attack with no sighting (``count`` 0)."""
    require_run(connection, run_id)
    if not rows:
        return 0
    previous = [
        a for (a,) in connection.execute("SELECT DISTINCT attack_id FROM replays WHERE run_id = ?", (run_id,))
    ]  # fmt: skip
    probes: dict[str, str] = {}
    for r in rows:
        probes.setdefault(normalize_probe(r.probe), r.probe)
    attack_ids, _ = ensure_attacks(connection, probes)
    connection.executemany(
        _UPSERT_REPLAY,
        [
            (
                run_id, attack_ids[normalize_probe(r.probe)], r.item, r.target, r.sample, r.judge, to_json(r.context),
                r.reply, r.score, r.probe_score, now,
            )
            for r in rows
        ],
    )  # fmt: skip
    refresh_attacks(connection, previous)  # an attack index given another probe may leave its old attack unused
    return len(rows)
