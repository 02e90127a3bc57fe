"""The store file: where it lives, its tables, and opening it safely.

A store is one SQLite file (``ASTRL_STORE``, else ``runs/astrl.sqlite``). Its ``meta`` table
holds the schema version; a store written by a newer astrl, a file that is not SQLite, or an
SQLite file that is not an astrl store is refused with an error naming the path. A store from
someone else is data: it is opened with ``trusted_schema`` off, and one that holds triggers or
views (astrl creates none) is refused, so that no SQL of its author runs on reads or writes.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

SCHEMA_VERSION = 1
STORE_ENV = "ASTRL_STORE"
STORE_FILE = "astrl.sqlite"
DEFAULT_STORE = Path("runs") / STORE_FILE
BUSY_TIMEOUT_S = 30.0
MIN_SQLITE = (3, 31, 0)  # generated columns
SQLITE_MAGIC = b"SQLite format 3\x00"

SCHEMA = """
CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE runs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL CHECK (kind IN ('train', 'eval', 'replay', 'demo')),
    folder TEXT,
    config TEXT,
    astrl_version TEXT NOT NULL,
    git_commit TEXT,
    seed INTEGER,
    tester TEXT,
    target TEXT,
    started_at TEXT NOT NULL,
    ended_at TEXT,
    status TEXT NOT NULL CHECK (status IN ('running', 'finished', 'failed')),
    metrics TEXT
);
CREATE INDEX runs_by_kind ON runs (kind, folder);
CREATE INDEX runs_by_target ON runs (target);
CREATE TABLE turns (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    step INTEGER,
    step_key INTEGER GENERATED ALWAYS AS (coalesce(step, -1)) VIRTUAL,
    conversation INTEGER NOT NULL,
    turn INTEGER NOT NULL,
    opener TEXT,
    context TEXT NOT NULL,
    probe TEXT NOT NULL,
    probe_key TEXT NOT NULL,
    reply TEXT NOT NULL,
    reward REAL,
    probe_nll REAL,
    tester_version TEXT,
    written_at TEXT NOT NULL,
    UNIQUE (run_id, step_key, conversation, turn)
);
CREATE INDEX turns_by_probe ON turns (probe_key);
CREATE TABLE scores (
    turn_id INTEGER NOT NULL REFERENCES turns (id) ON DELETE CASCADE,
    judge TEXT NOT NULL,
    what TEXT NOT NULL CHECK (what IN ('reply', 'probe', 'combined')),
    value REAL NOT NULL,
    PRIMARY KEY (turn_id, judge, what)
) WITHOUT ROWID;
CREATE INDEX scores_by_value ON scores (what, judge, value);
CREATE TABLE attacks (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    probe TEXT NOT NULL,
    first_seen TEXT,
    last_seen TEXT,
    count INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE attack_sightings (
    attack_id INTEGER NOT NULL REFERENCES attacks (id) ON DELETE CASCADE,
    turn_id INTEGER NOT NULL REFERENCES turns (id) ON DELETE CASCADE,
    seen_at TEXT NOT NULL,
    PRIMARY KEY (attack_id, turn_id)
) WITHOUT ROWID;
CREATE INDEX sightings_by_turn ON attack_sightings (turn_id);
CREATE TABLE replays (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    attack_id INTEGER NOT NULL REFERENCES attacks (id),
    item INTEGER NOT NULL,
    target TEXT NOT NULL,
    sample INTEGER NOT NULL,
    judge TEXT NOT NULL,
    context TEXT NOT NULL,
    reply TEXT NOT NULL,
    score REAL NOT NULL,
    probe_score REAL,
    written_at TEXT NOT NULL,
    UNIQUE (run_id, item, target, sample, judge)
);
CREATE INDEX replays_by_attack ON replays (attack_id);
CREATE INDEX replays_by_target ON replays (target, judge, score);
"""
TABLES = ("meta", "runs", "turns", "scores", "attacks", "attack_sightings", "replays")


class StoreError(ValueError):
    """The store cannot be opened, read or written as asked; the message names the file or value."""


def store_path(explicit: str | os.PathLike | None = None) -> Path:
    """The store file: ``explicit`` when given, else ``$ASTRL_STORE``, else ``runs/astrl.sqlite``
    (relative to the current folder). A folder (existing, or written with a trailing ``/``) means
    ``FOLDER/astrl.sqlite``."""
    raw = os.fspath(explicit) if explicit is not None else os.environ.get(STORE_ENV, "")
    if not raw.strip():
        return DEFAULT_STORE
    path = Path(raw).expanduser()
    if raw.endswith(("/", os.sep)) or path.is_dir():
        return path / STORE_FILE
    return path


def _tables(connection: sqlite3.Connection) -> dict[str, str]:
    return dict(connection.execute("SELECT name, type FROM sqlite_master WHERE type IN ('table', 'view', 'trigger')"))


def _create(connection: sqlite3.Connection, version: str) -> None:
    """The schema, in one transaction; a second process that created it first wins (checked under the lock)."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        if not _tables(connection):
            for statement in SCHEMA.split(";"):  # one by one: executescript would commit the open transaction
                if statement.strip():
                    connection.execute(statement)
            connection.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)",
                [("schema_version", str(SCHEMA_VERSION)), ("created_by", f"astrl {version}")],
            )
        connection.execute("COMMIT")
    except BaseException:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        raise


def _check(connection: sqlite3.Connection, path: Path) -> None:
    """Refuse a file that is not an astrl store of a version this code reads."""
    found = _tables(connection)
    code = sorted(name for name, kind in found.items() if kind in ("trigger", "view"))
    if code:
        raise StoreError(
            f"store {str(path)!r} holds {found[code[0]]} {code[0]!r}, which astrl never creates: refusing to use it "
            "(a store is data; a trigger or view would run its author's SQL)"
        )
    if "meta" not in found:
        raise StoreError(f"{str(path)!r} is an SQLite database but not an astrl store (it has no meta table)")
    row = connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    try:
        version = int(row[0]) if row else None
    except (TypeError, ValueError):
        version = None
    if version is None:
        raise StoreError(f"store {str(path)!r} has no readable schema version in its meta table")
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"store {str(path)!r} has schema version {version}, newer than version {SCHEMA_VERSION} "
            "that this astrl reads: upgrade astrl to use it"
        )
    if version < SCHEMA_VERSION:
        raise StoreError(f"store {str(path)!r} has schema version {version}, and no migration to {SCHEMA_VERSION} exists")
    missing = [t for t in TABLES if found.get(t) != "table"]
    if missing:
        raise StoreError(f"store {str(path)!r} lacks the table {missing[0]!r}: it is damaged or not an astrl store")


def connect(path: Path, *, create: bool, timeout: float = BUSY_TIMEOUT_S, version: str = "unknown") -> sqlite3.Connection:
    """An open, checked connection to the store at ``path`` (created with its schema when ``create``
    and the file is missing or empty). Transactions are explicit (``isolation_level=None``); foreign
    keys are on; a writer waits up to ``timeout`` seconds for another one's lock (``busy_timeout``);
    a writer's connection uses WAL journaling."""
    if sqlite3.sqlite_version_info < MIN_SQLITE:
        need = ".".join(map(str, MIN_SQLITE))
        raise StoreError(f"the results store needs SQLite {need} or newer; Python here has SQLite {sqlite3.sqlite_version}")
    path = Path(path)
    if path.is_dir():
        raise StoreError(f"store path {str(path)!r} is a folder: pass the file, or the folder with a trailing '/'")
    if not path.exists():
        if not create:
            raise StoreError(f"no store at {path} (set {STORE_ENV} or --store)")
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        try:
            with path.open("rb") as handle:
                head = handle.read(len(SQLITE_MAGIC))
        except OSError as err:
            raise StoreError(f"store {str(path)!r} cannot be read: {err.strerror or err}") from None
        if head and head != SQLITE_MAGIC:
            raise StoreError(f"{str(path)!r} is not an SQLite database, so not an astrl store")
        if not head and not create:
            raise StoreError(f"{str(path)!r} is an empty file, not an astrl store")
    connection = sqlite3.connect(str(path), timeout=timeout, isolation_level=None)
    try:
        connection.execute("PRAGMA trusted_schema = OFF")
        connection.execute("PRAGMA foreign_keys = ON")
        try:
            empty = not _tables(connection)
        except sqlite3.DatabaseError:
            raise StoreError(f"{str(path)!r} is not an SQLite database, so not an astrl store") from None
        if create:
            connection.execute("PRAGMA journal_mode = WAL")
            connection.execute("PRAGMA synchronous = NORMAL")  # with WAL: a killed process loses no commit
            if empty:
                _create(connection, version)
        _check(connection, path)
    except BaseException:
        connection.close()
        raise
    return connection
