"""The :class:`Store` object: one open store file, its writer calls and its queries.

Writing, from a command (each call is one transaction: all of it lands, or none)::

    store = Store.open()                                  # $ASTRL_STORE, else runs/astrl.sqlite
    run_id = store.start_run("eval", out_dir, config, seed=0, tester="runs/a", target="smollm2-135m")
    store.add_turns(run_id, records)                      # eval records; or a training step's turn
    store.add_turns(run_id, turn_records, step=12)        #   records with the step
    store.add_replay(run_id, replies)                     # astrl replay's replies.jsonl rows
    store.finish_run(run_id, metrics)                     # or status="failed"

or ``with store.recording("eval", out_dir, config) as run_id: ...``, which marks the run failed
when the block raises and finished when it ends. A resumed training run passes its run id back to
:meth:`Store.start_run` and calls :meth:`Store.discard_steps` with its checkpoint's step; the steps
it redoes replace their rows (same run, step, conversation and turn), so the store holds what the
run's files hold.

Several processes may write one store at once: SQLite's WAL journal lets readers go on while one
writer holds the lock, each write transaction takes the lock first (``BEGIN IMMEDIATE``) and waits
up to ``timeout`` seconds for it, and a transaction refused as locked is retried ``retries`` times
with a doubling pause. One :class:`Store` belongs to one thread.
"""

from __future__ import annotations

import importlib.metadata
import os
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

from astrl.argtypes import require
from astrl.store import queries, writes
from astrl.store.database import BUSY_TIMEOUT_S, StoreError, connect, store_path
from astrl.store.records import replay_rows, turn_rows

T = TypeVar("T")
RETRIES = 5
BACKOFF_S = 0.05


def astrl_version() -> str:
    """The installed astrl version, or ``"unknown"``."""
    try:
        return importlib.metadata.version("astrl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def git_commit(folder: str | Path | None = None) -> str | None:
    """``git rev-parse HEAD`` in ``folder`` (default: the current one); None outside a checkout or without git."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


def timestamp(moment: datetime) -> str:
    """``YYYY-MM-DDTHH:MM:SS.mmmZ`` in UTC (sorts as text; SQLite's date functions read it)."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _locked(err: sqlite3.OperationalError) -> bool:
    text = str(err).lower()
    return "locked" in text or "busy" in text


def _folder(folder: str | os.PathLike | None) -> str | None:
    return None if folder is None else str(Path(folder).expanduser().resolve())


class Store:
    """An open results store (module docstring). Build it with :meth:`Store.open`."""

    def __init__(
        self,
        connection: sqlite3.Connection,
        path: Path,
        *,
        retries: int = RETRIES,
        backoff: float = BACKOFF_S,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self._connection = connection
        self.path = path
        self.retries = retries
        self.backoff = backoff
        self.clock = clock or (lambda: datetime.now(timezone.utc))
        self.lock_retries = 0  # transactions retried because another writer held the lock

    @classmethod
    def open(
        cls,
        path: str | os.PathLike | None = None,
        *,
        create: bool = True,
        timeout: float = BUSY_TIMEOUT_S,
        retries: int = RETRIES,
        clock: Callable[[], datetime] | None = None,
    ) -> Store:
        """Open the store at :func:`~astrl.store.database.store_path` ``(path)``; with ``create`` a
        missing file is created with the schema, without it a missing file is a :class:`StoreError`.
        ``timeout``: seconds a writer waits for another one's lock; ``retries``: transactions still
        refused as locked are retried this many times; ``clock``: the time source (tests)."""
        path = store_path(path)
        connection = connect(path, create=create, timeout=timeout, version=astrl_version())
        return cls(connection, path, retries=retries, clock=clock)

    @property
    def connection(self) -> sqlite3.Connection:
        """The SQLite connection, for queries of your own (``docs/store.md`` has examples)."""
        return self._connection

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _now(self) -> str:
        return timestamp(self.clock())

    def _write(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``work`` in one write transaction: committed when it returns, rolled back when it
        raises; retried when the store is locked."""
        connection = self._connection
        for attempt in range(self.retries + 1):
            try:
                connection.execute("BEGIN IMMEDIATE")
                try:
                    result = work(connection)
                    connection.execute("COMMIT")
                    return result
                except BaseException:
                    if connection.in_transaction:
                        connection.execute("ROLLBACK")
                    raise
            except sqlite3.OperationalError as err:
                if not _locked(err):
                    raise StoreError(f"store {self.path}: {err}") from None
                if attempt == self.retries:
                    raise StoreError(
                        f"store {self.path} stayed locked by another writer through {self.retries + 1} tries: {err}"
                    ) from None
                self.lock_retries += 1
                time.sleep(self.backoff * 2**attempt)
            except sqlite3.IntegrityError as err:
                raise StoreError(f"store {self.path}: {err}") from None
        raise AssertionError("unreachable")

    # -- writing ------------------------------------------------------------------------------------
    def start_run(
        self,
        kind: str,
        folder: str | os.PathLike | None = None,
        config: Mapping | object | None = None,
        *,
        seed: int | None = None,
        tester: str | None = None,
        target: str | None = None,
        run_id: str | None = None,
    ) -> str:
        """Record a run as running and return its id (a new uuid4 hex unless ``run_id`` is given).

        ``kind``: ``train``, ``eval``, ``replay`` or ``demo``; ``folder``: its output folder (stored
        absolute); ``config``: a mapping, dataclass or object with ``to_dict()``, stored as JSON.
        Passing the id of a run already stored continues it (a resumed training run): it is running
        again, its rows stay, and the fields given here replace those stored."""
        require("run kind", kind, choices=writes.KINDS)
        if run_id is not None and (not isinstance(run_id, str) or not run_id.strip()):
            raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        run_id = run_id or uuid.uuid4().hex
        fields = {
            "kind": kind,
            "folder": _folder(folder),
            "config": writes.to_json(config),
            "astrl_version": astrl_version(),
            "git_commit": git_commit(),
            "seed": seed,
            "tester": None if tester is None else str(tester),
            "target": None if target is None else str(target),
            "started_at": self._now(),
        }
        self._write(lambda c: writes.insert_run(c, run_id, fields))
        return run_id

    def add_turns(
        self,
        run_id: str,
        records: Iterable[Mapping],
        *,
        step: int | None = None,
        threshold: float = 0.5,
        judges: Sequence[str] | None = None,
        tester_version: str | None = None,
    ) -> writes.Written:
        """Write turn records (evaluation or training shape: :mod:`astrl.store.records`) in one transaction.

        ``step``: the training step (None in an evaluation); a turn already stored under the same
        run, step, conversation and turn is replaced. ``threshold``: a turn is an attack when a judge
        of ``judges`` (None: every judge) scores its reply above it; attacks are added to the
        cross-run archive in the same transaction. ``tester_version``: which weights wrote the
        probes (a checkpoint name, ``final``), if known. Records are checked before anything is written.
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step must be an integer >= 0 or None, got {step!r}")
        threshold = queries.check_threshold(threshold)
        judges = None if judges is None else [str(j) for j in judges]
        rows = turn_rows(records)
        now = self._now()
        return self._write(
            lambda c: writes.write_turns(
                c, run_id, rows, step=step, threshold=threshold, judges=judges, tester_version=tester_version, now=now
            )
        )

    def add_replay(self, run_id: str, rows: Iterable[Mapping]) -> int:
        """Write ``astrl replay``'s reply rows (``replies.jsonl`` lines, optionally with each attack's
        ``conversation``) in one transaction; returns the judge verdicts written (rows x judges)."""
        checked = replay_rows(rows)
        now = self._now()
        return self._write(lambda c: writes.write_replays(c, run_id, checked, now))

    def finish_run(self, run_id: str, metrics: Mapping | None = None, status: str = "finished") -> None:
        """Mark the run ``finished`` (or ``failed``) now, with its headline ``metrics`` (kept when None)."""
        now = self._now()
        self._write(lambda c: writes.finish_run(c, run_id, metrics, status, now))

    def discard_steps(self, run_id: str, after: int) -> int:
        """Delete the run's turns of steps above ``after`` (a resumed run's checkpoint step), with their
        scores and attack sightings; returns how many turns went."""
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise ValueError(f"after must be a step >= 0, got {after!r}")
        return self._write(lambda c: writes.discard_steps(c, run_id, after))

    @contextmanager
    def recording(self, kind: str, folder: str | os.PathLike | None = None, config=None, **fields) -> Iterator[str]:
        """:meth:`start_run` as a context: yields the run id; the run is marked ``failed`` when the
        block raises (the exception goes on) and ``finished`` when it ends, unless
        :meth:`finish_run` was called in it."""
        run_id = self.start_run(kind, folder, config, **fields)
        try:
            yield run_id
        except BaseException:
            self.finish_run(run_id, status="failed")
            raise
        if self.runs(run_id)[0].status == "running":
            self.finish_run(run_id)

    # -- reading ------------------------------------------------------------------------------------
    def attacks(
        self,
        judge: str | None = None,
        threshold: float = 0.5,
        elicited_only: bool = False,
        target: str | None = None,
        run: str | None = None,
        text: str | None = None,
        limit: int | None = None,
        novel: float | None = None,
    ) -> list[queries.FoundAttack]:
        """Attacks across runs (:func:`astrl.store.queries.find_attacks` gives the filters), best
        first; ``novel``: drop attacks whose probe has word-bigram Jaccard similarity >= ``novel``
        to a better one (:func:`astrl.store.novelty.dedupe`), before ``limit`` applies."""
        queries.check_limit(limit)
        found = queries.find_attacks(
            self._connection,
            judge=judge,
            threshold=threshold,
            elicited_only=elicited_only,
            target=target,
            run=run,
            text=text,
            limit=None if novel is not None else limit,
        )
        if novel is not None:
            from astrl.store.novelty import dedupe

            found = dedupe(found, novel)
            found = found if limit is None else found[:limit]
        return found

    def runs(self, run: str | None = None) -> list[queries.RunSummary]:
        """Every run (or the one with id ``run``) with its counts and headline metrics, oldest first."""
        return queries.list_runs(self._connection, run)

    def resolve_run(self, text: str) -> str:
        """The run id ``text`` is or uniquely begins."""
        return queries.resolve_run(self._connection, text)

    def latest_run(self, kind: str, folder: str | os.PathLike) -> str | None:
        """The id of the newest run of ``kind`` with output folder ``folder`` (None when there is none):
        what a resumed run passes back to :meth:`start_run`."""
        row = self._connection.execute(
            "SELECT id FROM runs WHERE kind = ? AND folder = ? ORDER BY started_at DESC, rowid DESC LIMIT 1",
            (kind, _folder(folder)),
        ).fetchone()
        return None if row is None else row[0]
