"""StopOnSignal: which signals stop a run at once, which wait for the step, which are left alone."""

from __future__ import annotations

import os
import signal

import pytest

from astrl.training.stopping import StopOnSignal, Terminated, exit_code


def _send(signum: int) -> None:
    os.kill(os.getpid(), signum)
    for _ in range(1000):  # the handler runs at the next bytecode boundary of the main thread
        pass


def test_sigterm_and_sigint_raise_at_once_when_not_held_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(Terminated) as stopped, StopOnSignal(lambda: False):
        _send(signal.SIGTERM)
    assert exit_code(stopped.value) == 143 and str(stopped.value) == "terminated (SIGTERM)"
    with pytest.raises(KeyboardInterrupt) as stopped, StopOnSignal(lambda: False):
        _send(signal.SIGINT)
    assert not isinstance(stopped.value, Terminated) and exit_code(stopped.value) == 130
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_held_signal_waits_for_raise_pending_and_a_second_one_stops_at_once():
    held, told = [True], []
    with StopOnSignal(lambda: held[0], told.append) as stop:
        _send(signal.SIGTERM)  # kept: no exception here
        assert stop.pending == signal.SIGTERM and told == ["SIGTERM"]
        with pytest.raises(KeyboardInterrupt) as second:
            _send(signal.SIGINT)
        assert not isinstance(second.value, Terminated)
        with pytest.raises(Terminated):
            stop.raise_pending()
        stop.raise_pending()  # nothing kept any more
        held[0] = False
        with pytest.raises(Terminated):
            _send(signal.SIGTERM)
    assert told == ["SIGTERM"]


def test_an_ignored_sigint_and_a_handler_of_the_users_stay_as_they_were():
    seen = []
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with StopOnSignal(lambda: False):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            _send(signal.SIGINT)
            _send(signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


def test_the_hold_notice_reaches_stderr_even_when_the_signal_came_inside_a_write_to_it(monkeypatch, capfd):
    from astrl.training.stopping import announce_hold

    class Busy:
        def write(self, text):
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

        def flush(self):
            pass

    monkeypatch.setattr("sys.stderr", Busy())
    announce_hold(lambda: 7)("SIGTERM")
    monkeypatch.undo()
    assert capfd.readouterr().err == "astrl: SIGTERM: finishing step 7 to checkpoint it; send it again to stop now\n"


def test_an_error_raised_while_a_signal_unwinds_is_answered_as_that_signal():
    with StopOnSignal(lambda: False) as stop:
        assert stop.stop_behind(RuntimeError("no signal")) is None
        try:
            try:
                _send(signal.SIGTERM)
            except KeyboardInterrupt:
                raise RuntimeError("Converting a tensordict to boolean value is not permitted") from None
        except RuntimeError as error:
            behind = stop.stop_behind(error)
        assert isinstance(behind, Terminated) and exit_code(behind) == 143
        assert stop.stop_behind(Terminated()) is None  # the interrupt itself goes up as it is
    with StopOnSignal(lambda: False) as stop:  # a new run starts with no signal seen
        assert stop.stop_behind(RuntimeError("a plain error")) is None
