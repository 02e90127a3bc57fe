"""What the trainer runs: the :class:`Algorithm` contract and the :class:`TrainingSource` that builds it.

One training step of :class:`astrl.training.Trainer` calls, in this order::

    algorithm.collect()                       -> (batch, rollout)
    algorithm.minibatches(batch, generator)   -> minibatches; for each: algorithm.loss(minibatch)
    (optimizer updates)
    algorithm.push_weights()
    algorithm.turn_records(rollout)           -> the attack archive's records
    algorithm.metrics(rollout)                -> the step's row in metrics.csv
    algorithm.data_policy_version(rollout)
    algorithm.step_metrics()
    algorithm.samples(rollout)                -> samples.jsonl

and ``state_dict()`` / ``load_state_dict()`` at step boundaries and checkpoints,
``sync_weights()`` once before the first collection of a resumed run and ``shutdown()`` when a
run with Ray collectors ends. An algorithm implements :meth:`Algorithm.collect`,
:meth:`Algorithm.loss` and :meth:`Algorithm.parameter_groups`; every other method has a default
that does nothing (or reports nothing).

A :class:`TrainingSource` gives the trainer its algorithm and prompt stream (a
:class:`DataPath`) and saves and restores what is trained: the config's models
(``astrl.training.trainer.ConfigSource``) or a System (``astrl.system.solvers.SystemSource``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase

if TYPE_CHECKING:
    from astrl.prompts import PromptStream
    from astrl.training.setup import RunModels


class Algorithm(ABC):
    """The algorithm of a training run, as the trainer calls it (the module docstring gives the order)."""

    name = "custom"

    # -- what every algorithm implements ------------------------------------------------------------
    @abstractmethod
    def collect(self) -> tuple[TensorDictBase, TensorDictBase]:
        """One step's data: ``(batch, rollout)``, the batch the loss trains on and the raw data it came
        from (what metrics, samples, the archive and target hardening read)."""

    @abstractmethod
    def loss(self, minibatch: TensorDictBase) -> TensorDictBase:
        """The loss outputs of a minibatch: the ``loss_*`` entries are summed and minimised; every
        other scalar entry is logged."""

    @abstractmethod
    def parameter_groups(self, lr: float) -> list[dict]:
        """The optimizer's parameter groups (each with its ``params`` and ``lr``)."""

    # -- defaults: optional hooks do nothing, reports are empty -------------------------------------
    def minibatches(self, batch: TensorDictBase, generator: torch.Generator) -> Iterable[TensorDictBase]:
        """The minibatches of one step, in order (one optimizer update per ``grad_accum`` of them);
        by default the whole batch once, none when it is empty."""
        return [batch] if batch.batch_size.numel() else []

    def metrics(self, rollout: TensorDictBase) -> dict:
        """Logged values of the collected data (``reward_mean`` shows in the progress bar)."""
        return {}

    def step_metrics(self) -> dict:
        """Logged values of the algorithm itself after the step's updates (e.g. an adaptive KL coefficient)."""
        return {}

    def samples(self, rollout: TensorDictBase) -> list[dict]:
        """Records of collected turns for ``samples.jsonl`` and the sample table: ``opener``, ``turn``,
        ``probe``, ``response``, ``reward``."""
        return []

    def turn_records(self, rollout: TensorDictBase) -> list[dict]:
        """Records for the attack archive: ``probe``, ``reply``, ``conversation``, ``scores``, ``reward``, ``turn``."""
        return []

    @property
    def reward_scorer(self) -> str | None:
        """The scorer whose score the archive keeps attacks by (None: any score present)."""
        return None

    def data_policy_version(self, rollout: TensorDictBase) -> int | None:
        """The oldest policy version (updates since the collector started) behind ``rollout``; None when
        the data comes from the current weights."""
        return None

    def push_weights(self) -> None:
        """After a step's updates: bring an acting policy that holds its own copy of the weights up to date."""
        return None

    def sync_weights(self) -> None:
        """Before the first collection of a resumed run: the same, without counting an update."""
        return None

    def shutdown(self) -> None:
        """Release collectors that run outside this process."""
        return None

    def state_dict(self) -> dict:
        """What the algorithm keeps across steps, for checkpoints (plain data and tensors)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        return None


@dataclass
class DataPath:
    """What a :class:`TrainingSource` builds: the algorithm, the prompt stream whose state each
    checkpoint keeps, and for env-driven runs the env and the acting policy.

    ``draws`` holds the stream's state before each batch drawn since the build, for streams that an
    env's data loader draws from ahead of the step that uses the batch; it stays empty when batches
    are drawn only inside :meth:`Algorithm.collect`.
    """

    algorithm: Algorithm
    stream: PromptStream
    env: Any = None
    policy: Any = None
    draws: list[dict] = field(default_factory=list)

    def stream_state(self, draw: int) -> dict:
        """The stream's state before draw ``draw`` (counted from the build): the recorded one when the
        stream has drawn it already, else the state now."""
        return self.draws[draw] if draw < len(self.draws) else self.stream.state_dict()


class TrainingSource(ABC):
    """What a trainer trains and where its data comes from.

    ``models`` are the run's models when the trainer owns them (``None`` for a System, whose models are
    its own); :meth:`build` gives the data path, the other methods save and restore the trained weights.
    """

    models: RunModels | None = None

    @abstractmethod
    def build(self, stream_state: dict | None) -> DataPath:
        """The algorithm and its prompt stream; ``stream_state`` is a resumed run's stream state (a
        source whose stream state lives in the algorithm's own state may ignore it)."""

    def before_collect(self) -> None:
        """Called at the start of each step, before :meth:`Algorithm.collect`."""
        return None

    def after_collect(self) -> None:
        """Called right after :meth:`Algorithm.collect`, before the updates."""
        return None

    @abstractmethod
    def save(self, folder: Path) -> None:
        """Write the trained weights as users load them (``final/tester`` and each checkpoint's ``tester``)."""

    @abstractmethod
    def trainable_state(self) -> Any:
        """The trained weights for a checkpoint's state."""

    @abstractmethod
    def load_trainable_state(self, state: Any) -> None:
        """Restore :meth:`trainable_state`."""

    def after_warm_start(self) -> None:
        """Called once the warm start has trained the tester, before step 0 is saved."""
        return None

    def reference_state(self) -> Any:
        """The weights of a reference pinned during the run, for a checkpoint (None: nothing pinned)."""
        return None

    def load_reference_state(self, state: Any) -> None:
        """Restore :meth:`reference_state`."""
        raise TypeError(f"{type(self).__name__} pins no reference; its checkpoints hold none to restore")
