"""Locks across processes: one at a time in the embedded model's cache, one writer per run or eval folder.

Both use ``fcntl.flock`` (released by the operating system when a process ends, however it ends, so a
crashed job leaves no stale lock); where there is none, such as Windows, nothing is locked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from astrl.errors import FolderInUseError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

LOCK_FILE = ".astrl.lock"  # in a run or eval folder while a job writes it
_HELD: dict[Path, IO[str]] = {}  # the folders this process holds (resolved), with their open lock files


def _forget_in_child() -> None:
    """A forked child holds no folder: it closes its copies of the lock files (the parent's copies keep
    the locks), so a worker that outlives a crashed job does not keep the job's folder locked."""
    for handle in _HELD.values():
        handle.close()
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Wait for, then hold, an exclusive lock on the file ``path`` (created if missing)."""
    if fcntl is None:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def sole_writer(folder: Path, what: str) -> Iterator[None]:
    """Hold ``folder`` (created if missing) for this process while it writes there; a second job asked
    to write the same folder meanwhile gets a :class:`~astrl.errors.FolderInUseError` at once, naming
    the folder and the process that holds it, before it has loaded or written anything. Nested holds of
    one folder in one process are one hold. The lock file
    (:data:`LOCK_FILE`) is removed when the job ends, so a finished folder holds only what the job wrote."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = folder.resolve()
    if key in _HELD:  # this process holds it already (a command that holds its run folder, then trains):
        yield  # the outer hold keeps the lock and releases it
        return
    if fcntl is None:  # pragma: no cover - not POSIX
        yield
        return
    path = folder / LOCK_FILE
    while True:
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - closed below, or kept open while held
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise FolderInUseError(
                f"{what} {str(folder)!r} is being written by another astrl job ({holder}); "
                "wait for it to end or choose another folder"
            ) from None
        if path.exists() and os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()  # locked a file its last holder had just removed: take the one at the path now
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        _HELD[key] = handle
        yield
    finally:
        _HELD.pop(key, None)
        path.unlink(missing_ok=True)  # while still held: a job that opened it meanwhile sees a removed file
        handle.close()  # closing releases the lock
