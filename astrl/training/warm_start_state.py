"""The rounds a stopped warm start finished: ``warm_start.partial.pt`` in the run directory.

After each round of a warm start (:mod:`astrl.training.warm_start`) its records, the tester's
trainable state and the RNG states are saved here, and a search's progress within a round (under
``searching`` in the saved rounds) after each batch of openers, so that a stop loses at most that
batch, or, for a warm start that samples, the round it was in.
A resumed run loads them and goes on with the next round; a new run in the same directory removes
them (another run's rounds); once step 0's checkpoint holds the warm start, the trainer removes them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from astrl.training.state_io import load_state, rng_state, save_state, set_rng_state

WARM_START_PARTIAL = "warm_start.partial.pt"  # the rounds a stopped warm start finished


class WarmStartCheckpoint:
    """The partial save of a warm start in ``run_dir``.

    Args:
        run_dir: the run directory; the file is ``run_dir / WARM_START_PARTIAL``.
        trainable_state: returns the tester's trainable state (what a round changes).
        load_trainable_state: puts a state returned by ``trainable_state`` back.
        resumed: whether the run is a resumed one (:func:`astrl.training.trainer.resume`): only then are
            saved rounds loaded; a new run removes them.
    """

    def __init__(
        self,
        run_dir: str | Path,
        trainable_state: Callable[[], Any],
        load_trainable_state: Callable[[Any], None],
        *,
        resumed: bool,
    ) -> None:
        self.path = Path(run_dir) / WARM_START_PARTIAL
        self._trainable_state, self._load_trainable_state = trainable_state, load_trainable_state
        self.resumed = resumed

    def load(self) -> dict | None:
        """The rounds done so far (the dict :meth:`save` was given), with the tester's trainable state
        and the RNG states restored as they were after the last of them; None when there are none to
        go on from (a new run removes another run's file)."""
        if not self.resumed:
            self.path.unlink(missing_ok=True)
            return None
        if not self.path.is_file():
            return None
        state = load_state(self.path)
        self._load_trainable_state(state["trainable"])
        set_rng_state(state["rng"])
        return state["done"]

    def save(self, done: dict) -> None:
        """Save the rounds ``done``, the trainable state and the RNG states (through a ``.tmp`` file
        renamed when complete: a reader never sees half a file)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        save_state({"done": done, "trainable": self._trainable_state(), "rng": rng_state()}, tmp)
        os.replace(tmp, self.path)

    def remove(self) -> None:
        """Remove the file (a checkpoint holds the finished warm start now)."""
        self.path.unlink(missing_ok=True)
