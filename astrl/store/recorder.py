"""How the commands write their runs into the store as they go (``astrl train``, ``eval``, ``replay``, ``demo``).

A run's own files (``metrics.csv``, ``attacks.jsonl``, ``conversations.jsonl``, ...) stay its record
of truth; the store is a copy that can be queried across runs. So a store that cannot be opened
is an error when the command starts (before any model loads), but a write that fails later is a
warning and the recorder stops writing: the run goes on and its files are complete.

``ASTRL_STORE=off`` (or ``none``, ``0``, ``false``) turns the store off.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping

from astrl.store.database import STORE_ENV, StoreError
from astrl.store.store import Store

OFF = ("off", "none", "0", "false", "no")


def store_enabled() -> bool:
    """False when ``$ASTRL_STORE`` turns the store off."""
    return os.environ.get(STORE_ENV, "").strip().lower() not in OFF


def check_store(path=None) -> None:
    """Open the store and close it again: a store that cannot be opened is a :class:`StoreError`
    naming the file, raised before a command loads its models (nothing when the store is off)."""
    if store_enabled() or path is not None:
        Store.open(path).close()


class RunRecorder:
    """One command's run in the store (or nothing, when the store is off or a write has failed).
    Use it as a context manager: ``with RunRecorder.begin(...) as recorder: ...``."""

    def __init__(self, store: Store | None = None, run_id: str | None = None, warn: Callable[[str], None] | None = None) -> None:
        self.store, self.run_id = store, run_id
        self.warn = warn or (lambda text: warnings.warn(text, stacklevel=3))

    @classmethod
    def begin(
        cls,
        kind: str,
        folder,
        config=None,
        *,
        resume: bool = False,
        warn: Callable[[str], None] | None = None,
        path=None,
        **fields,
    ) -> RunRecorder:
        """Open the store and record the run as running. ``resume``: continue the newest run of this
        kind in ``folder`` (a resumed training run keeps its id). Raises :class:`StoreError` when the
        store cannot be opened (a newer schema, not a store, ...), naming the file."""
        if not store_enabled() and path is None:
            return cls(warn=warn)
        store = Store.open(path)
        run_id = store.latest_run(kind, folder) if resume else None
        try:
            run_id = store.start_run(kind, folder, config, run_id=run_id, **fields)
        except StoreError:
            store.close()
            raise
        return cls(store, run_id, warn)

    @property
    def active(self) -> bool:
        return self.store is not None

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """Leaving a ``with`` block: the run is ``failed`` when the block raised (the exception goes
        on), else ``finished`` unless :meth:`finish` already ended it."""
        if self.active:
            self.finish(status="failed" if kind is not None else "finished")

    def _write(self, what: str, call: Callable[[Store], object]) -> None:
        if self.store is None:
            return
        try:
            call(self.store)
        except (StoreError, ValueError, OSError) as err:
            self.warn(f"the results store {self.store.path} was not written ({what}: {err}); the run's own files are complete")
            self.close()

    def discard_after(self, step: int) -> None:
        """A resumed run redoes the steps after its checkpoint: their rows go first."""
        self._write("resume", lambda s: s.discard_steps(self.run_id, step))

    def turns(self, records: Iterable[Mapping], **options) -> None:
        """:meth:`Store.add_turns` (one transaction)."""
        records = list(records)
        self._write("turns", lambda s: s.add_turns(self.run_id, records, **options))

    def replay(self, rows: Iterable[Mapping]) -> None:
        """:meth:`Store.add_replay` (one transaction)."""
        rows = list(rows)
        self._write("replay", lambda s: s.add_replay(self.run_id, rows))

    def finish(self, metrics: Mapping | None = None, status: str = "finished") -> None:
        """Mark the run ``finished`` (or ``failed``) with its headline metrics, and close the store."""
        self._write("finish", lambda s: s.finish_run(self.run_id, metrics, status))
        self.close()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.store = None
