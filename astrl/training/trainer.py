"""The training loop: collect, update, log, checkpoint, resume.

One :class:`Trainer` runs every path: it drives an :class:`~astrl.training.algorithm.Algorithm`
built by a :class:`~astrl.training.algorithm.TrainingSource` (:class:`ConfigSource` for a config,
:class:`SystemSource` for a System's solver).

A run directory holds ``config.yaml`` (the resolved config), ``metrics.csv`` (one row per
step, appended after it), ``samples.jsonl`` (sample conversations), ``checkpoints/step_NNNNNN/`` and, at the end,
``final/tester/`` (the LoRA adapter or the full model, with its tokenizer; with target hardening
also ``final/target/``, the target's adapter), and ``attacks.jsonl``
(the attack archive: every turn whose reward scorer's score is above ``archive_threshold``, once
per normalised probe; new attacks are appended after each step and the file is rewritten with
current counts at each checkpoint). ``resume`` continues from the newest checkpoint; on CPU with
the same seed the metrics after resuming equal those of an uninterrupted run, and the archive is
restored from the checkpoint (no attack is archived twice).
"""

from __future__ import annotations

import copy
import csv
import io
import json
import math
import random
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from astrl.archive import ARCHIVE_FILE, AttackArchive
from astrl.argtypes import require
from astrl.jsonl import numbered_lines
from astrl.locks import sole_writer
from astrl.models import LoadedModel, save_model
from astrl.prefill import SharedPrefill, clear_turn_caches
from astrl.rewards.reference import PinnedReference
from astrl.training.algorithm import Algorithm, DataPath, TrainingSource
from astrl.training.config import ALGORITHM_FAMILIES, OPTIMIZERS, ConfigError, TrainConfig, load_config
from astrl.training.setup import RunModels, build_env, build_models, build_stream, conversation_spec, training_conversation
from astrl.training.state_io import (
    STATE_FILE,
    DamagedCheckpointError,
    atomic_write_text,
    checkpoint_problem,
    load_state,
    load_trainable_state,
    rng_state,
    save_state,
    set_rng_state,
    trainable_state,
    write_manifest,
)
from astrl.training.stopping import StopOnSignal, announce_hold
from astrl.training.warm_start_state import WARM_START_PARTIAL as WARM_START_PARTIAL  # its name, kept importable here
from astrl.training.warm_start_state import WarmStartCheckpoint

CHECKPOINTS = "checkpoints"
REPLAY_SEEDS_FILE = "replay_seeds.jsonl"  # guide_replay_retest: every kept warm-start probe's re-test, best first


def make_algorithm(config: TrainConfig, models: RunModels, env, policy, stream=None):
    if config.algorithm == "grpo":
        from astrl.training.grpo import GRPOAlgorithm

        return GRPOAlgorithm(config, models, env, policy, stream)
    if config.algorithm == "ppo":
        from astrl.training.ppo import PPOAlgorithm

        return PPOAlgorithm(config, models, env, policy, stream)
    raise ConfigError(f"unknown algorithm {config.algorithm!r}")


def check_until(config: TrainConfig, step: int, until: int | None) -> None:
    """Raise ValueError unless ``until`` is None or a step that a run of ``config`` at ``step`` can stop
    after (:meth:`Trainer.train`): not before ``step``, and not inside the branches of step 0."""
    if until is None:
        return
    if isinstance(until, bool) or not isinstance(until, int) or until < step:
        raise ValueError(f"until must be a step at or after the run's step {step}, got {until!r}")
    if step == 0 and config.branches > 1 and 0 < until < config.branch_steps:
        raise ValueError(f"until {until} stops inside the branches (branch_steps {config.branch_steps}): use 0 or >= it")


def warmup_then_linear(warmup: int, total: int):
    """LR multiplier: linear warm-up over ``warmup`` updates, then linear decay to 0 at ``total``."""

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        return max(0.0, (total - update) / max(1, total - warmup))

    return factor


def make_optimizer(name: str, groups: list[dict], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer named by the config (:data:`~astrl.training.config.OPTIMIZERS`: ``adamw`` default;
    ``adam``, ``sgd``, ``rmsprop``, ``adagrad``)."""
    require("optimizer", name, choices=tuple(OPTIMIZERS), error=ConfigError)
    return getattr(torch.optim, OPTIMIZERS[name])(groups, lr=lr, weight_decay=weight_decay)


class ConfigSource(TrainingSource):
    """A run built from its config: the config's models (``models``, or loaded now), the GRPO / PPO
    env and collector or the DPO / IPO tree sampler, and the tester as what is trained and saved."""

    def __init__(self, config: TrainConfig, models: RunModels | None = None) -> None:
        from astrl.envs.recipe import preflight

        self.config = config
        # names, prompts and split before the models: a bad one costs milliseconds, not a model load
        preflight(conversation_spec(config), tester=models is None, target=models is None)
        self.models = models or build_models(config)

    def build(self, stream_state: dict | None) -> DataPath:
        config = self.config
        if config.share_prefill and config.backend == "transformers":
            for model in {id(m): m for m in (self.models.tester.model, self.models.target.model)}.values():
                if not isinstance(model.generate, SharedPrefill):
                    SharedPrefill(model)
        if config.algorithm in ("dpo", "ipo"):
            return self._preference()
        return self._on_policy(stream_state)

    def _preference(self) -> DataPath:
        from astrl.prompts import PromptStream, load_prompts, split_fractions, split_prompts
        from astrl.training.preference import PreferenceAlgorithm

        config = self.config
        fractions = split_fractions(config.test_fraction)
        prompts = split_prompts(load_prompts(config.prompts), config.split, seed=config.prompt_split_seed, fractions=fractions)
        stream = PromptStream(prompts, self.config.prompts_per_step, seed=self.config.seed)
        # the sampler draws inside collect() and its own state (with the stream's) is the algorithm's
        return DataPath(PreferenceAlgorithm.from_config(self.config, self.models, stream), stream)

    def _on_policy(self, stream_state: dict | None) -> DataPath:
        stream = build_stream(self.config)
        if stream_state is not None:
            stream.load_state_dict(stream_state)
        # The env's data loader draws openers ahead of the step that uses them (also while it is built),
        # so the state before each draw is recorded from the start: draw i feeds the build's step + i.
        draws: list[dict] = []
        stream.on_draw(draws.append)
        if self.config.collector == "ray":  # the workers build their own envs; the tester policy gives the weight layout
            env, policy = None, training_conversation(self.config, self.models, env=False).tester
        else:
            env, policy = build_env(self.config, self.models, stream)
        algorithm = make_algorithm(self.config, self.models, env, policy, stream)
        return DataPath(algorithm, stream, env=env, policy=policy, draws=draws)

    def before_collect(self) -> None:
        self.models.tester.model.eval()

    def after_collect(self) -> None:
        clear_turn_caches(self.models.tester.model, self.models.target.model)  # stale after the update: free them

    def save(self, folder: Path) -> None:
        save_model(self.models.tester.model, self.models.tester.tokenizer, folder)

    def trainable_state(self) -> dict:
        return trainable_state(self.models.tester.model)

    def load_trainable_state(self, state: dict) -> None:
        load_trainable_state(self.models.tester.model, state)

    def after_warm_start(self) -> None:
        """With ``kl_reference: warm_start``, the reference becomes a frozen copy of the warm-started tester."""
        if isinstance(self.models.reference, PinnedReference):
            self.models.reference.pin(self.models.tester.model)

    def reference_state(self) -> dict | None:
        reference = self.models.reference
        if not isinstance(reference, PinnedReference) or reference.pinned is None:
            return None
        return trainable_state(reference.pinned)

    def load_reference_state(self, state: dict) -> None:
        if not isinstance(self.models.reference, PinnedReference):
            raise ConfigError(
                "the checkpoint holds a pinned reference but this run has kl_reference: base: resume with kl_reference=warm_start"
            )
        load_trainable_state(self.models.reference.pin(self.models.tester.model), state)


class SystemSource(TrainingSource):
    """A System run as the trainer sees it: the solver bound to the sampler, the sampler's prompt stream
    (its state is the sampler's, inside the algorithm's state), and the System's parameters as what is
    trained (saved with ``system.save(folder)`` when the System has one, else as ``parameters.pt``).
    It only calls the solver and the sampler, so the trainer needs nothing from :mod:`astrl.system`.

    Args:
        config: the run's config (the solver's batching, the sampler's trees per call).
        sampler: an :class:`astrl.ASTSampler` of the solver's System.
        solver: :class:`astrl.DPO`, :class:`astrl.IPO`, :class:`astrl.PPO`, or any object with ``system``
            and ``bind(sampler, config)`` returning an :class:`~astrl.training.algorithm.Algorithm`.
    """

    def __init__(self, config: TrainConfig, sampler, solver) -> None:
        self.config, self.sampler, self.solver = config, sampler, solver

    def build(self, stream_state: dict | None) -> DataPath:
        if not callable(getattr(self.solver, "bind", None)):
            raise TypeError(f"algorithm must be an astrl solver (DPO, IPO, PPO), got {type(self.solver).__name__}")
        return DataPath(self.solver.bind(self.sampler, self.config), self.sampler.prompt_stream)

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        system = self.solver.system
        if callable(getattr(system, "save", None)):
            system.save(folder)
        else:
            torch.save([p.detach().cpu() for p in system.parameters()], folder / "parameters.pt")

    def trainable_state(self) -> list[torch.Tensor]:
        return [p.detach().cpu().clone() for p in self.solver.system.parameters()]

    def load_trainable_state(self, state: list[torch.Tensor]) -> None:
        params = list(self.solver.system.parameters())
        if len(params) != len(state):
            raise ValueError(f"checkpoint holds {len(state)} parameter tensors, the System has {len(params)}")
        with torch.no_grad():
            for param, saved in zip(params, state, strict=True):
                param.copy_(saved)


class Trainer:
    """Runs ``config.total_steps`` steps of the configured algorithm and keeps the run directory.

    ``Trainer(config)`` builds models, data path and algorithm from the config
    (:class:`ConfigSource`). With a :class:`astrl.System`, ``Trainer(config, sampler, algorithm)``
    trains it instead: ``sampler`` is an :class:`astrl.ASTSampler` and ``algorithm`` a solver
    (:class:`astrl.DPO`, :class:`astrl.IPO`, :class:`astrl.PPO`), bound together by
    :class:`SystemSource`; the loop, optimizer, schedule, logging and checkpoints
    are the same. The trainer drives an :class:`~astrl.training.algorithm.Algorithm`
    (:mod:`astrl.training.algorithm` gives the calls and their order).
    """

    def __init__(
        self,
        config: TrainConfig,
        sampler=None,
        algorithm=None,
        *,
        models: RunModels | None = None,
        progress: bool = True,
    ) -> None:
        if (sampler is None) != (algorithm is None):
            raise TypeError("pass both sampler= and algorithm= (a System's sampler and solver), or neither")
        if algorithm is not None and models is not None:
            raise TypeError("models= is for config-built runs; a System brings its own models")
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.progress = progress
        self.generator = torch.Generator()  # the trainer's own draws (minibatch order), seeded with the rest
        self.reseed(config.seed)
        if algorithm is not None:
            self.source: TrainingSource = SystemSource(config, sampler, algorithm)
        else:
            self.source = ConfigSource(config, models)
        self.step = 0
        self._pending_stream_state: dict | None = None
        self._built = False
        self._step_start: dict | None = None  # inside train(): the state before the running step
        self._step_updates = 0  # optimizer updates made by the running step
        self._columns: list[str] | None = None  # the header of metrics.csv, once it has one
        self.warm_start: dict | None = None  # what the warm start did, once it ran (warm_start_probes > 0)
        self.resumed = False  # made by resume(): a stopped warm start goes on from its last round
        self._replaced_earlier = False  # a new run removes what an earlier run left in its folder, once
        self.store_kind = "train"  # the run's kind in the results store (the demo sets "demo")
        self._turn_records: list[dict] = []  # the running step's turns, for the results store

    @property
    def models(self) -> RunModels | None:
        """The run's models (tester, reference, target); None for a System, whose models are its own."""
        return self.source.models

    # -- construction of the data path (after a possible resume of the prompt stream) ----------------
    def _build(self) -> None:
        self._data_path = self.source.build(self._pending_stream_state)
        self.algorithm, self.stream = self._data_path.algorithm, self._data_path.stream
        self.env, self.policy = self._data_path.env, self._data_path.policy
        if not isinstance(self.algorithm, Algorithm):
            kind = type(self.algorithm).__name__
            raise TypeError(f"the trainer runs an astrl.training.algorithm.Algorithm, got {kind}")
        self._start_step = self.step  # the step that the stream's draws since the build count from
        config = self.config
        groups = self.algorithm.parameter_groups(config.lr)
        self.optimizer = make_optimizer(config.optimizer, groups, config.lr, config.weight_decay)
        self.hardening = None
        if config.harden_every > 0:
            from astrl.training.hardening import Hardening

            self.hardening = Hardening(config, self.models)
        # The schedule runs over planned updates: epochs x minibatches (per grad_accum) a step, or one a step
        # with minibatch_size. A step that makes fewer updates (DPO/IPO pair counts vary) spreads its
        # share over the ones it makes, so the rate always ends at its end value on the last step.
        self._planned_updates = config.epochs * math.ceil(config.minibatches / config.grad_accum)
        if config.minibatch_size is not None:
            self._planned_updates = 1
        factor = warmup_then_linear(config.warmup_steps, config.total_steps * self._planned_updates)
        self._lr_position = self.step * self._planned_updates
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: factor(self._lr_position))
        # the reward scorer decides; unknown here (Ray workers, a System's own reward): any score present does
        scorer = self.algorithm.reward_scorer
        self.archive = AttackArchive(config.archive_threshold, scorers=[scorer] if scorer else None)
        self._new_attacks: list = []
        self._built = True

    # -- the loop -----------------------------------------------------------------------------------
    def train(self, until: int | None = None) -> list[dict]:
        """Train until ``total_steps``; returns the metrics rows of this call.

        ``until`` stops earlier, after step ``until`` (0: after the warm start), with a checkpoint there
        and no ``final/tester``; the learning-rate schedule still runs over ``total_steps``, so a resumed
        run goes on exactly as if it had not stopped (the ``branches`` setting trains its branches of
        step 0 this way)."""
        self.check_until(until)
        with sole_writer(self.run_dir, "run folder"):
            if not (self.resumed or self._replaced_earlier):
                replace_earlier_run(self.run_dir)
                self._replaced_earlier = True
            self.config.save(self.run_dir / "config.yaml")
            with self._recorder() as recorder:  # the run in the results store: failed if this raises
                rows = self._train(recorder, self.config.total_steps if until is None else min(until, self.config.total_steps))
                recorder.finish(rows[-1] if rows else None)
        return rows

    def check_until(self, until: int | None) -> None:
        """Raise ValueError unless ``until`` (see :meth:`train`) is None or a step this run can stop after."""
        check_until(self.config, self.step, until)

    def _train(self, recorder, last: int) -> list[dict]:
        """The body of :meth:`train`, up to step ``last``; each finished step's turns go to ``recorder``."""
        stop = StopOnSignal(self._step_has_updated, announce_hold(lambda: self._step_start["step"] + 1))
        with stop:
            return self._train_until(recorder, last, stop)

    def _step_has_updated(self) -> bool:
        """Whether the running step has changed the weights (a stop then waits for the step to end)."""
        return self._step_start is not None and self._step_updates > 0

    def _train_until(self, recorder, last: int, stop: StopOnSignal) -> list[dict]:
        if not self._built:
            self._build()
        self.archive.write(self.run_dir / ARCHIVE_FILE)  # drops attacks found after the checkpoint resumed from
        if self.step == 0 and self.config.warm_start_probes and self.warm_start is None:
            self._warm_start()
        if self.step == 0 and self.config.guide_replay_warm_start:
            self.algorithm.seed_replay(self._replay_seeds())
        if self.step == 0 and last > 0 and self.config.branches > 1:
            self._branch()
        if self.step > 0 or self.warm_start is not None:  # Ray workers / a vLLM engine start from the untrained weights
            self.algorithm.sync_weights()
        from tqdm.auto import tqdm

        self._trim_logs()  # a resumed run redoes the steps after its checkpoint: their rows go
        loggers = self._loggers()
        rows = []
        bar = tqdm(total=self.config.total_steps, initial=self.step, unit="step", disable=not self.progress, desc="train")
        saved = None  # the checkpoint the loop wrote of the step just finished: a stop right after it keeps it
        try:
            while self.step < last:
                saved = None
                self._step_start, self._step_updates = self._state_before_step(), 0
                row = self.train_step()
                rows.append(row)
                self._log(row, loggers)
                AttackArchive.append(self.run_dir / ARCHIVE_FILE, self._new_attacks)
                recorder.turns(self._turn_records, step=self.step, threshold=self.archive.threshold, judges=self.archive.scorers)
                self._step_start = None  # a step boundary: the run directory and the trainer agree
                bar.update(1)
                bar.set_postfix(reward=f"{row.get('reward_mean', math.nan):.3f}", loss=f"{row['loss']:.3f}")
                if self.step % self.config.save_every == 0 or self.step == last:
                    saved = self.save_checkpoint()
                stop.raise_pending()  # a signal held while the step finished: the step is checkpointed below
        except (KeyboardInterrupt, Exception) as error:
            self.stopped_checkpoint = saved or self._checkpoint_after_failure()
            signalled = stop.stop_behind(error)  # a signal whose interrupt became another error on its way up
            if signalled is not None:
                raise signalled from error
            raise
        finally:
            bar.close()
            if self.config.collector == "ray":  # stop the workers; a later train() builds them again
                self.algorithm.shutdown()
                self._built = False
        if self.step < self.config.total_steps:  # stopped early (until): the run is not finished
            self.archive.write(self.run_dir / ARCHIVE_FILE)
            return rows
        self.source.save(self.run_dir / "final" / "tester")
        if self.hardening is not None:
            save_model(self.models.target.model, self.models.target.tokenizer, self.run_dir / "final" / "target")
        self.archive.write(self.run_dir / ARCHIVE_FILE)
        return rows

    def _branch(self) -> None:
        """Train the run's branches of step 0 and go on as the chosen one (:mod:`astrl.training.branches`)."""
        from astrl.training.branches import adopt, train_branches

        if self.models is None:
            raise ConfigError("branches applies to config-built runs (a System trains its own models)")
        step0 = self.run_dir / CHECKPOINTS / f"step_{0:06d}"
        # a run without a warm start has no step 0 yet (an earlier run's was removed by train()): save it
        if not step0.is_dir():
            self.save_checkpoint()
        chosen = train_branches(self, step0, lambda seed, folder, reseed: self._open_branch(seed, folder, step0, reseed))
        # the run goes on as the chosen branch: its draws come from its seed, on the run's split of the openers
        self.config = replace(self.config, seed=chosen["seed"], split_seed=self.config.prompt_split_seed)
        self.source.config = self.config
        checkpoint = Path(chosen["folder"]) / CHECKPOINTS / f"step_{self.config.branch_steps:06d}"
        self.load_checkpoint(adopt(checkpoint, self.run_dir, self.config))

    def _open_branch(self, seed: int, folder: Path, step0: Path, reseed: bool) -> Trainer:
        """The trainer of the run's branch in ``folder`` (seed ``seed``, the run's split of the openers),
        on the run's models, at the branch's newest checkpoint; one with none starts from ``step0``, its
        draws from ``seed`` when ``reseed`` (the step-0 draws belong to the run's seed)."""
        settings = replace(self.config, seed=seed, split_seed=self.config.prompt_split_seed, branches=1, run_dir=str(folder))
        branch = Trainer(settings, models=self.models, progress=self.progress)
        branch.store_kind, branch.resumed = self.store_kind, True
        found = usable_checkpoint(folder)
        if found is None:  # a branch stopped before its first checkpoint starts again from the run's step 0
            shutil.rmtree(folder, ignore_errors=True)
            branch.load_checkpoint(step0)
            if reseed:
                branch.reseed(seed)
        else:
            branch.load_checkpoint(found[0], state=found[1])
        return branch

    def _recorder(self):
        """The run in the results store (:mod:`astrl.store.recorder`); a resumed run keeps its id and
        drops the rows of the steps after its checkpoint, which it redoes."""
        from astrl.store.recorder import RunRecorder

        config = self.config
        recorder = RunRecorder.begin(
            self.store_kind, self.run_dir, config.to_dict(), resume=self.step > 0, seed=config.seed,
            tester=str(config.tester), target=str(config.target),
        )  # fmt: skip
        if self.step > 0:
            recorder.discard_after(self.step)
        return recorder

    def _warm_start(self) -> None:
        """Fine-tune the tester on probes that already elicit (:mod:`astrl.training.warm_start`), write
        ``warm_start.json`` and ``warm_start.jsonl``, and checkpoint the result as step 0.

        Each finished round, and a search's progress within a round, is saved in ``warm_start.partial.pt``
        (:class:`~astrl.training.warm_start_state.WarmStartCheckpoint`); a resumed run (:func:`resume`)
        whose warm start stopped goes on from what was saved last. A new run in the same directory starts
        again."""
        from astrl.training.warm_start import warm_start

        source = self.source
        partial = WarmStartCheckpoint(self.run_dir, source.trainable_state, source.load_trainable_state, resumed=self.resumed)
        summary, kept = warm_start(self.config, self.models, partial, print if self.progress else None)
        source.after_warm_start()
        self.warm_start = summary
        atomic_write_text(self.run_dir / "warm_start.json", json.dumps(summary, indent=2) + "\n")
        atomic_write_text(self.run_dir / "warm_start.jsonl", "".join(json.dumps(k, ensure_ascii=False) + "\n" for k in kept))
        self.save_checkpoint()
        partial.remove()  # step 0 holds it now

    def _replay_seeds(self) -> list[str]:
        """The probes the replay archive starts with (``guide_replay_warm_start``): the warm start's kept first probes, in
        its order, or with ``guide_replay_retest`` the best re-tested share of them, best first
        (:func:`~astrl.training.warm_start.replay_seeds`; every kept probe's re-test in ``replay_seeds.jsonl``)."""
        kept = warm_start_probes(self.run_dir, openers=self.config.guide_replay_retest > 0)
        kept = [k for k in kept if k.get("turn", 0) == 0]  # a later turn's probe answers a reply: not a first probe
        if not self.config.guide_replay_retest:
            return [k["probe"] for k in kept]
        from astrl.training.warm_start import replay_seeds

        ranked = replay_seeds(self.config, self.models, kept)
        atomic_write_text(self.run_dir / REPLAY_SEEDS_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ranked))
        seeded = [r for r in ranked if r["seeded"]]
        if self.progress and seeded:
            print(
                f"replay archive: the best {len(seeded)} of {len(ranked)} warm-start probes by their re-test on "
                f"{self.config.guide_replay_retest} training openers (mean estimate {seeded[0]['retest_mass']:.4f} "
                f"to {seeded[-1]['retest_mass']:.4f})"
            )
        return [r["probe"] for r in seeded]

    def _state_before_step(self) -> dict:
        """What a step changes before its first update (RNG states, the algorithm's and hardening's
        state), kept so that a step that fails before updating can be checkpointed as not begun."""
        state = {
            "step": self.step,
            "rng": rng_state(),
            "generator": self.generator.get_state(),
            "algorithm": copy.deepcopy(self.algorithm.state_dict()),
        }
        if self.hardening is not None:
            state["hardening"] = copy.deepcopy(self.hardening.state_dict())
        return state

    def _checkpoint_after_failure(self) -> Path | None:
        """On Ctrl-C or an error: checkpoint the last finished step when the state allows it exactly
        (between steps, or in a step before its first update); else leave the newest checkpoint.
        Returns the checkpoint a resume will continue from."""
        start = self._step_start
        try:
            if self._built and start is None:
                return self.save_checkpoint()
            if self._built and start["step"] == self.step and self._step_updates == 0:
                return self.save_checkpoint({k: v for k, v in start.items() if k != "step"})
        except OSError:  # e.g. the disk is full: the previous checkpoint stays the newest
            pass
        return latest_checkpoint(self.run_dir)

    def _trim_logs(self) -> None:
        """Keep the rows of ``metrics.csv`` and the complete lines of ``samples.jsonl`` up to the current step."""
        self._columns = trim_csv(self.run_dir / "metrics.csv", self.step)
        path = self.run_dir / "samples.jsonl"
        if path.exists():
            kept = []
            for _, line in numbered_lines(path.read_text(encoding="utf-8", errors="replace")):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a killed process
                if isinstance(record, dict) and _int(record.get("step")) <= self.step:
                    kept.append(line + "\n")
            atomic_write_text(path, "".join(kept))

    def train_step(self) -> dict:
        start = time.perf_counter()
        on_gpu = str(self.config.device).startswith("cuda")
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        self.source.before_collect()
        batch, rollout = self.algorithm.collect()
        collect_seconds = time.perf_counter() - start
        self.source.after_collect()
        if self.models is not None:  # the kept KV caches go stale with the update: free them now
            clear_turn_caches(self.models.tester.model, self.models.target.model)
        new_attacks = self.hardening.observe(rollout) if self.hardening is not None else 0
        losses: dict[str, list[float]] = {}
        grad_norms = []
        self.optimizer.zero_grad(set_to_none=True)
        pending = 0
        minibatches = list(self.algorithm.minibatches(batch, self.generator))
        updates = math.ceil(len(minibatches) / self.config.grad_accum)
        for minibatch in minibatches:
            out = self.algorithm.loss(minibatch)
            total = sum(out.get(k) for k in out.keys() if isinstance(k, str) and k.startswith("loss_"))
            (total / self.config.grad_accum).backward()
            pending += 1
            for key in out.keys():
                value = out.get(key)
                if isinstance(key, str) and isinstance(value, torch.Tensor) and value.numel() == 1:
                    losses.setdefault(key, []).append(float(value.detach()))
            losses.setdefault("loss", []).append(float(total.detach()))
            if pending == self.config.grad_accum:
                self._lr_position = self._position_after(len(grad_norms) + 1, updates)
                grad_norms.append(self._optimizer_step())
                pending = 0
        if pending:
            self._lr_position = self._position_after(len(grad_norms) + 1, updates)
            grad_norms.append(self._optimizer_step())
        if not grad_norms:  # no update this step (e.g. no preference pair): the schedule still moves on
            self._lr_position = self._position_after(1, 1)
            self.scheduler.step()
        self.algorithm.push_weights()
        self.step += 1
        self._turn_records = self.algorithm.turn_records(rollout)
        self._new_attacks = self.archive.extend(self._turn_records, step=self.step)
        row = {"step": self.step, **self.algorithm.metrics(rollout), "attacks_unique": len(self.archive)}
        version = self.algorithm.data_policy_version(rollout)
        # updates behind the data: counted from this process's start (the collectors count from 0)
        row["policy_version"] = self.step - 1 if version is None else self._start_step + version
        row.update({k: sum(v) / len(v) for k, v in losses.items()})
        if not losses:  # nothing to learn from this batch (e.g. every sibling group tied)
            row["loss"] = float("nan")
        applied = [norm for norm in grad_norms if math.isfinite(norm)]  # a non-finite one was skipped
        grad_norm = sum(applied) / len(applied) if applied else (math.nan if grad_norms else 0.0)
        row.update(grad_norm=grad_norm, lr=self.scheduler.get_last_lr()[0])
        skipped = len(grad_norms) - len(applied)
        if skipped:  # the column appears with the first step that skips one
            row["skipped_updates"] = skipped
            print(
                f"astrl: warning: step {self.step}: {skipped} of {len(grad_norms)} updates had a gradient "
                "that is not finite and were skipped (the weights stay as they were; see skipped_updates in metrics.csv)",
                file=sys.stderr,
            )
        row.update(self.algorithm.step_metrics())
        if self.hardening is not None:
            row.update(harden_new_attacks=new_attacks, **self.hardening.after_step(self.step))
        if self.warm_start is not None:
            row["warm_start_kept"] = self.warm_start["kept"]
        row.update(collect_seconds=collect_seconds, step_seconds=time.perf_counter() - start)
        if on_gpu:  # what this process's PyTorch allocator held at most (a vLLM engine in-process included)
            row["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        self._last_samples = self.algorithm.samples(rollout)
        return row

    def _position_after(self, done: int, updates: int) -> int:
        """Where the schedule stands after ``done`` of this step's ``updates`` updates (in planned updates)."""
        return self.step * self._planned_updates + done * self._planned_updates // updates

    def _optimizer_step(self) -> float:
        """Clip to ``max_grad_norm``, step, zero, move the schedule to ``_lr_position``; returns the total
        gradient norm **before** clipping (``grad_norm`` in metrics.csv is its mean over the step's updates).

        A gradient that is not finite (``nan`` or ``inf`` anywhere; clipping would spread it to every
        weight) is not applied: the weights and the optimizer's moments stay, the schedule moves on, and
        the step's ``skipped_updates`` counts the non-finite norms returned."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))
        self._step_updates += 1
        if math.isfinite(norm):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # -- logging ------------------------------------------------------------------------------------
    def _loggers(self) -> list:
        from torchrl.record.loggers import get_logger

        loggers = []
        for kind in self.config.loggers:
            try:
                loggers.append(get_logger(kind, logger_name=str(self.run_dir / "logs"), experiment_name="astrl"))
            except ImportError as err:
                raise ConfigError(f"logger {kind!r} needs an extra package: {err}") from err
        return loggers

    def _log(self, row: dict, loggers: list) -> None:
        self._columns = append_csv_row(self.run_dir / "metrics.csv", self._columns, {k: str(v) for k, v in row.items()})
        if row["step"] % self.config.log_every == 0:
            for logger in loggers:
                for key, value in row.items():
                    if key != "step" and isinstance(value, (int, float)):
                        logger.log_scalar(key, value, step=row["step"])
        if row["step"] % self.config.sample_every == 0 or row["step"] == 1:
            lines = "".join(json.dumps({"step": row["step"], **s}, ensure_ascii=False) + "\n" for s in self._last_samples)
            with (self.run_dir / "samples.jsonl").open("a", encoding="utf-8") as handle:
                handle.write(lines)  # one write: whole lines
            if self.progress:
                print(sample_table(self._last_samples, row["step"]))

    # -- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self, replace: dict | None = None) -> Path:
        """Write ``checkpoints/step_NNNNNN`` (through a ``.tmp`` folder renamed when complete, with a
        manifest of file sizes and checksums); ``replace`` overrides entries of the saved state."""
        folder = self.run_dir / CHECKPOINTS / f"step_{self.step:06d}"
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.source.save(tmp / "tester")
        state = {
            "step": self.step,
            "trainable": self.source.trainable_state(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "generator": self.generator.get_state(),
            "stream": self._stream_state_for_next_step(),
            "algorithm": self.algorithm.state_dict(),
            "algorithm_name": self.config.algorithm,
            "archive": self.archive.state_dict(),
        }
        if self.hardening is not None:
            state["hardening"] = self.hardening.state_dict()
        if self.warm_start is not None:
            state["warm_start"] = self.warm_start
        reference = self.source.reference_state()
        if reference is not None:
            state["reference"] = reference
        state.update(replace or {})
        save_state(state, tmp / STATE_FILE)
        write_manifest(tmp)
        self.archive.write(self.run_dir / ARCHIVE_FILE)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        self._prune_checkpoints()
        return folder

    def _stream_state_for_next_step(self) -> dict:
        return self._data_path.stream_state(self.step - self._start_step)

    def _prune_checkpoints(self) -> None:
        folders = checkpoints(self.run_dir)
        for old in folders[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    def reseed(self, seed: int) -> None:
        """Seed every draw of the run from ``seed``: torch's, Python's and NumPy's global RNGs and the
        trainer's own generator."""
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        self.generator.manual_seed(seed)

    def load_checkpoint(
        self, folder: Path, *, trust: bool = False, state: dict | None = None, new_algorithm: bool = False
    ) -> None:
        """Restore the state saved in ``folder`` (or ``state``, already read from it): loaded with
        ``weights_only=True`` unless ``trust`` (full unpickling, for checkpoints of older astrl versions
        whose origin you trust). ``new_algorithm``: a step-0 checkpoint saved under another algorithm
        (:func:`switches_algorithm`); the tester, reference, archive and random states are restored, and the
        algorithm, optimizer and schedule start as this run's own would."""
        if state is None:
            problem = checkpoint_problem(folder)
            if problem is not None:
                raise DamagedCheckpointError(f"checkpoint {str(folder)!r} is damaged: {problem}")
            state = load_state(folder / STATE_FILE, trust=trust)
        self.step = state["step"]
        self._pending_stream_state = state["stream"]
        self._build()
        self.source.load_trainable_state(state["trainable"])
        self._load_reference(folder, state)
        if not new_algorithm:
            self.algorithm.load_state_dict(state["algorithm"])
        if "archive" in state:
            self.archive.load_state_dict(state["archive"])
        if self.hardening is not None:
            if "hardening" not in state:
                raise ConfigError(f"checkpoint {str(folder)!r} has no hardening state (it was saved with harden_every: 0)")
            self.hardening.load_state_dict(state["hardening"])
        if not new_algorithm:
            rates = list(self.scheduler.base_lrs)  # this run's settings: a resume may change lr
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])  # its position; the saved base rates are replaced
            self.scheduler.base_lrs = rates
            for group, rate, factor in zip(self.optimizer.param_groups, rates, self.scheduler.lr_lambdas, strict=True):
                group["initial_lr"], group["lr"] = rate, rate * factor(self.scheduler.last_epoch)
        self.generator.set_state(state["generator"])
        set_rng_state(state["rng"])
        self.warm_start = state.get("warm_start")

    def _load_reference(self, folder: Path, state: dict) -> None:
        """Restore a pinned reference (``kl_reference: warm_start``). A checkpoint saved without one can
        be pinned only at step 0, where the tester is still the warm start's."""
        if "reference" in state:
            self.source.load_reference_state(state["reference"])
        elif self.config.kl_reference == "warm_start" and state.get("warm_start") is not None:
            if self.step > 0:
                raise ConfigError(
                    f"checkpoint {str(folder)!r} (step {self.step}) was saved with kl_reference: base, so it holds no "
                    "warm-started reference to restore: resume with kl_reference=base"
                )
            self.source.after_warm_start()


def _int(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1 << 62  # unreadable: dropped by the step filters


def _csv_text(columns: list[str], rows: list[dict], *, header: bool = True) -> str:
    """CSV lines of ``rows`` under ``columns`` (a missing value is empty), after the header when ``header``."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def append_csv_row(path: Path, columns: list[str] | None, row: dict[str, str]) -> list[str]:
    """Append ``row`` to the CSV file ``path`` whose header is ``columns`` (None: no file yet) in one write;
    returns the header. A row with a column the header lacks (a hardening round's, or loss terms after a
    step without any) rewrites the file once, with the new columns added at the end of the header (empty
    in earlier rows); a row without some of the columns leaves them empty."""
    if columns is not None and set(row) <= set(columns):
        with path.open("a", encoding="utf-8") as handle:
            handle.write(_csv_text(columns, [row], header=False))
        return columns
    rows = list(csv.DictReader(path.open(encoding="utf-8"))) if columns is not None else []
    columns = list(dict.fromkeys([*(columns or []), *row]))
    atomic_write_text(path, _csv_text(columns, [*rows, row]))
    return columns


def trim_csv(path: Path, step: int) -> list[str] | None:
    """Keep the header and the complete rows up to ``step`` (its ``step`` column) of a CSV file written by
    :func:`append_csv_row`; a line cut short by a killed process goes. Returns the header, or None when no
    row is left (the file is removed then)."""
    if not path.exists():
        return None
    lines = [line + "\n" for line in path.read_text(encoding="utf-8", errors="replace").split("\n")[:-1]]
    rows = [next(csv.reader([line]), []) for line in lines]
    if not rows:
        path.unlink()
        return None
    header = rows[0]
    kept = [
        line for line, row in zip(lines[1:], rows[1:], strict=True)
        if len(row) == len(header) and _int(dict(zip(header, row, strict=True)).get("step")) <= step
    ]  # fmt: skip
    if not kept:
        path.unlink()
        return None
    atomic_write_text(path, lines[0] + "".join(kept))
    return header


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The checkpoint folders of a run, oldest first (``step_NNNNNN``; never ``.tmp`` or ``.damaged`` ones)."""
    return sorted(p for p in (Path(run_dir) / CHECKPOINTS).glob("step_*") if p.name[5:].isdigit() and p.is_dir())


# what a run leaves in its folder beside its logs: a new run in the folder removes an earlier run's
EARLIER_RUN_FILES = (CHECKPOINTS, "final", "warm_start.json", "warm_start.jsonl", REPLAY_SEEDS_FILE)


def earlier_run(run_dir: str | Path) -> str | None:
    """What an earlier run left in ``run_dir`` that a new run there replaces (its checkpoints or its
    final tester), in words; None when there is none."""
    run_dir = Path(run_dir)
    folders = checkpoints(run_dir)
    if folders:
        return f"checkpoints up to step {int(folders[-1].name.removeprefix('step_'))}"
    if (run_dir / "final").is_dir():
        return "a final tester"
    return None


def replace_earlier_run(run_dir: str | Path) -> None:
    """Remove an earlier run's checkpoints, final models and warm-start record from ``run_dir``, so that
    none of them outlives a new run there (a later ``--resume`` would pick a stale newest checkpoint).
    The logs are trimmed by the new run itself."""
    for name in EARLIER_RUN_FILES:
        path = Path(run_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    folders = checkpoints(run_dir)
    return folders[-1] if folders else None


def usable_checkpoint(run_dir: str | Path, *, trust: bool = False, on_warning=None) -> tuple[Path, dict] | None:
    """The newest checkpoint whose files are intact, with its state, or None when the run has none.

    A damaged newest checkpoint (missing, truncated or changed files, or a ``state.pt`` that does
    not load) is skipped for the one before it, and when one is usable the skipped ones are renamed
    ``step_NNNNNN.damaged`` with a warning each; when none is usable a :class:`DamagedCheckpointError`
    names each one and why (and nothing is moved)."""
    import warnings

    warn = on_warning or (lambda text: warnings.warn(text, stacklevel=3))
    problems, damaged = [], []
    for folder in reversed(checkpoints(run_dir)):
        problem = checkpoint_problem(folder)
        state = None
        if problem is None:
            try:
                state = load_state(folder / STATE_FILE, trust=trust)
                problem = None if isinstance(state, dict) and "step" in state else f"{folder / STATE_FILE} holds no step"
            except DamagedCheckpointError as err:
                problem = str(err)
        if problem is None:
            for bad, why in damaged:  # set aside, so that neither resume nor eval picks them up again
                aside = bad.with_name(bad.name + ".damaged")
                shutil.rmtree(aside, ignore_errors=True)
                bad.rename(aside)
                warn(f"checkpoint {str(bad)!r} is damaged ({why}); moved to {aside.name}, resuming from {folder.name}")
            return folder, state
        problems.append(f"{folder.name}: {problem}")
        damaged.append((folder, problem))
    if problems:
        raise DamagedCheckpointError(f"no usable checkpoint in {str(run_dir)!r}: " + "; ".join(problems))
    return None


def warm_start_probes(run_dir: Path, *, openers: bool = False) -> list[dict]:
    """The records of the probes the run's warm start kept, in order (its ``warm_start.jsonl``), each with a
    ``probe`` text and, with ``openers`` (what ``guide_replay_retest`` reads), the ``opener`` it was found for."""
    path = Path(run_dir) / "warm_start.jsonl"
    if not path.is_file():
        raise ConfigError(
            f"guide_replay_warm_start reads the warm start's kept probes from {str(path)!r}, which does not exist: "
            "resume a run whose warm start wrote it, or set guide_replay_warm_start=false"
        )
    fields = ("probe", "opener") if openers else ("probe",)
    records = []
    for number, line in numbered_lines(path.read_text(encoding="utf-8")):
        try:
            record = json.loads(line)
            records.append({**record, **{key: str(record[key]) for key in fields}})
        except (ValueError, KeyError, TypeError) as error:
            names = " and ".join(repr(key) for key in fields)
            raise ConfigError(f"{str(path)!r} line {number} is not a kept probe with {names} text: {error}") from None
    return records


def saved_algorithm(state: dict, config_algorithm: str) -> str:
    """The algorithm that saved a checkpoint of an earlier release (its state names none): the run's
    ``config.yaml`` says, but for a PPO config over a state without a value head, which GRPO saved before
    the run went on as PPO from step 0."""
    if config_algorithm == "ppo" and "value_head" not in state.get("algorithm", {}):
        return "grpo"
    return config_algorithm


def switches_algorithm(folder: Path, state: dict, saved: str, wanted: str) -> bool:
    """Whether going on from the checkpoint ``state`` (in ``folder``) under algorithm ``wanted`` changes its
    algorithm (the one it names, else :func:`saved_algorithm` of the run's ``saved``). Only a
    step-0 checkpoint may change, within one of :data:`~astrl.training.config.ALGORITHM_FAMILIES`: later ones
    hold an optimizer and algorithm state (a value head, the replay archive) that only their own algorithm
    reads. Raises :class:`ConfigError` otherwise, before any model loads."""
    was = state.get("algorithm_name") or saved_algorithm(state, saved)
    if was == wanted:
        return False
    step = state.get("step")
    if step != 0:
        raise ConfigError(
            f"algorithm={wanted!r}: checkpoint {str(folder)!r} (step {step}) was saved by {was!r}, whose optimizer and "
            f"algorithm state only {was!r} goes on with; another algorithm can start only from a step-0 checkpoint "
            "(the warm-started tester): resume a copy of the run that holds only checkpoints/step_000000"
        )
    if not any(was in family and wanted in family for family in ALGORITHM_FAMILIES):
        raise ConfigError(
            f"algorithm={wanted!r}: checkpoint {str(folder)!r} was saved by {was!r}; from step 0 a run can change "
            f"algorithm only within {' or '.join('/'.join(family) for family in ALGORITHM_FAMILIES)}, which read one data path"
        )
    return True


def resume(
    run_dir: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    progress: bool = True,
    tester_lm: LoadedModel | None = None,
    trust_checkpoint: bool = False,
    on_warning=None,
) -> Trainer:
    """A trainer that continues the run in ``run_dir`` from its newest checkpoint.

    ``tester_lm`` replaces loading the config's tester (for models that are not on disk). The
    checkpoint's ``state.pt`` is loaded with ``torch.load(..., weights_only=True)``; one that needs
    full unpickling (older astrl versions) raises :class:`~astrl.training.state_io.UnsafeCheckpointError`
    unless ``trust_checkpoint=True``, an explicit opt-in for run directories whose origin you trust.
    A damaged newest checkpoint is set aside with a warning (``on_warning(text)``, default
    :func:`warnings.warn`) and the previous one is used (:func:`usable_checkpoint`).

    The checkpoint's random states are restored, so the run goes on as if never stopped; an override
    that changes ``seed`` branches it instead: every draw after the checkpoint (sampling, shuffles)
    comes from the new seed, while the openers go on in the checkpoint's order (a second training seed
    from a shared warm start: ``--resume RUN_DIR seed=1``). An override of ``algorithm`` goes on from a step-0
    checkpoint under another algorithm of its family (:func:`switches_algorithm`): GRPO and PPO from one
    warm start."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a run directory (no config.yaml)")
    saved = load_config(run_dir / "config.yaml", on_warning=lambda _: None)  # its notes come with the next read
    config = load_config(run_dir / "config.yaml", [*overrides, f"run_dir={run_dir}"])
    found = usable_checkpoint(run_dir, trust=trust_checkpoint, on_warning=on_warning)  # read before any model loads
    new_algorithm = found is not None and switches_algorithm(*found, saved.algorithm, config.algorithm)
    if found is not None and found[1].get("step") == 0 and config.guide_replay_warm_start:
        warm_start_probes(run_dir, openers=config.guide_replay_retest > 0)  # the archive's seeds, read at step 0: named now
    trainer = Trainer(config, progress=progress, models=build_models(config, tester_lm) if tester_lm else None)
    trainer.resumed = True
    if found is not None:
        trainer.load_checkpoint(found[0], trust=trust_checkpoint, state=found[1], new_algorithm=new_algorithm)
        if config.seed != saved.seed:  # a branch: the saved draws belong to the old seed
            trainer.reseed(config.seed)
    return trainer


def sample_table(samples: list[dict], step: int, limit: int = 4) -> str:
    """A small text table of sample turns with their rewards."""

    def cut(text: str, n: int = 60) -> str:
        text = " ".join(text.split())
        return text if len(text) <= n else text[: n - 1] + "…"

    lines = [f"samples at step {step}:", f"  {'reward':>7}  turn  probe -> reply"]
    for s in sorted(samples, key=lambda s: -s["reward"])[:limit]:
        lines.append(f"  {s['reward']:7.3f}  {s['turn']:>4}  {cut(s['probe'])!r} -> {cut(s['response'])!r}")
    return "\n".join(lines)
