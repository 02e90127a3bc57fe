"""How a training run stops on a signal: Ctrl-C (SIGINT) and SIGTERM (``kill PID``, a job scheduler's
preemption, a container's stop).

While :meth:`Trainer.train` runs, either signal stops the run as an exception in the main thread, so
the trainer checkpoints what it can before the process ends. A signal that arrives between steps, or
in a step that has not changed the weights yet, stops at once: the last finished step is checkpointed
and the step is redone on resume. One that arrives after the step's first optimizer update is held
until the step ends (its update, log rows and checkpoint), so the step is kept instead of lost; a
second signal stops at once. A signal the process ignores (a job started with ``&`` by a
non-interactive shell ignores SIGINT; ``nohup`` ignores SIGHUP) or one with a handler of its own
is left as it is.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises :class:`KeyboardInterrupt` (and caught with it)."""

    exit_code = 128 + signal.SIGTERM

    def __init__(self) -> None:
        super().__init__("terminated (SIGTERM)")


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """The shell's exit status for a run stopped by ``interrupt``: 130 for Ctrl-C, 143 for SIGTERM."""
    return getattr(interrupt, "exit_code", 128 + signal.SIGINT)


class StopOnSignal:
    """Context manager: inside it, SIGINT raises :class:`KeyboardInterrupt` and SIGTERM :class:`Terminated`,
    except while ``hold()`` is true, when the first signal is kept until :meth:`raise_pending`.

    ``hold`` is asked in the signal handler (keep it cheap); ``on_hold(signal_name)`` is called when a
    signal is kept. Handlers are installed only in the main thread and only over the default ones
    (Python's Ctrl-C handler, SIGTERM's default action); the previous ones come back on exit.
    """

    def __init__(self, hold: Callable[[], bool], on_hold: Callable[[str], None] | None = None) -> None:
        self.hold = hold
        self.on_hold = on_hold
        self.pending: int | None = None
        self.raised: int | None = None  # the signal the handler last raised for
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopOnSignal:
        self.pending = self.raised = None
        if threading.current_thread() is not threading.main_thread():
            return self
        defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
        for signum, default in defaults.items():
            if signal.getsignal(signum) is default:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.pending is None and self.hold():
            self.pending = signum
            if self.on_hold is not None:
                self.on_hold(signal.Signals(signum).name)
            return
        self.raised = signum
        raise _interrupt(signum)

    def stop_behind(self, error: BaseException) -> KeyboardInterrupt | None:
        """The stop to raise instead of ``error`` when ``error`` came after the handler raised one: code the
        interrupt landed in may answer it with an error of its own (tensordict, say, raised "Converting a
        tensordict to boolean value is not permitted" while unwinding), which must still stop the run as
        the signal does. None when no signal was raised, or when ``error`` is the interrupt itself."""
        if self.raised is None or isinstance(error, KeyboardInterrupt):
            return None
        return _interrupt(self.raised)

    def raise_pending(self) -> None:
        """Raise the signal kept while ``hold()`` was true, if any."""
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise _interrupt(signum)


def _interrupt(signum: int) -> KeyboardInterrupt:
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def announce_hold(step: Callable[[], int]) -> Callable[[str], None]:
    """An ``on_hold`` that tells the user which step is being finished and how to stop at once."""

    def on_hold(name: str) -> None:
        line = f"astrl: {name}: finishing step {step()} to checkpoint it; send it again to stop now\n"
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except RuntimeError:  # the signal came inside a write to stderr (a reentrant call): write past its buffer
            os.write(2, line.encode())

    return on_hold
