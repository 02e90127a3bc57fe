"""One chat-mode GRPO step of a shipped config, timed phase by phase.

A ``Trainer`` is built from ``--config`` (default ``configs/demo.yaml``) with the chat overrides of
the issue's measurement (``mode=chat turns=2 max_new_tokens=12 warm_start_probes=0``; the demo's 16-token
replies, 4 reply samples, 4 openers x 4 conversations) plus any ``--set KEY=VALUE``, and runs
``Trainer.train_step()``: one untimed step, then ``--repeats`` timed ones. Timers wrap:

- the tester's policy call per turn, and the ``model.generate`` inside it (the rest is the wrapper:
  chat templates, tokenisation, log-probs);
- the target's turn per turn (``TargetTurn._step``): its ``model.generate``, the reply lexicon (the
  lexicon mass of every generated position and the per-reply estimate), the rest of its policy call
  (templates, tokenisation), and the rest of the env step (target view, clipping to the window, the
  rendered context of the likelihood term);
- the scorers, the likelihood term (``probe_logprobs``), the rest of the reward transform;
- the reference log-probs (``training_batch``), the behaviour log-probs read before the first update,
  each minibatch's loss forward (current log-probs + objective), its backward and the optimizer step.

``collect_rest`` is what the collection spent outside these (collector, env bookkeeping, advantages);
``update_rest`` the rest of the step (metrics, archive, samples). The JSON holds medians over the
timed steps, and ``peak_rss_gb``, the process's peak resident memory (models, build and steps
included: compare runs of one config, e.g. with and without ``--set entropy_coef=0.01``). With
``--memory`` it also holds ``peak_by_section_gb``: each timed section's peak resident memory (median
over the timed steps), plus ``step`` (the whole ``train_step``) and ``collect`` (the collection): a
peak that ``collect`` does not reach lies in the update. The freed heap glibc keeps is returned at
each section's start and end (``malloc_trim``), so a section's peak is what it holds live, not the
largest heap so far; the timings of a ``--memory`` run include those calls. The
script uses only public entry points of the package and a few of its methods, so it measures an
older checkout too (run it with that checkout first on ``PYTHONPATH``).

``--from-run RUN_DIR`` times the step of that run's own config instead, with none of the chat overrides:
the run's ``config.yaml``, warm-start files and step-0 checkpoint are copied to a temporary folder and
resumed there, so a recipe whose keys need its warm start (``guide_replay_warm_start``, ``kl_reference:
warm_start``: ``configs/elicit_chat_full.yaml``) is timed as its users run it, replayed members (``guides``)
included; the run itself is not touched.

    python benchmarks/chat_step.py --threads 2 --repeats 3
    python benchmarks/chat_step.py --from-run runs/elicit_chat_full --threads 2 --repeats 3
"""

from __future__ import annotations

import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import ROOT, Timer, base_parser, emit, r, setup

import astrl.rewards.astprompter as astprompter
from astrl.envs.transforms import ScoreReward, TargetTurn
from astrl.prefill import turn_cache_of
from astrl.training.config import load_config
from astrl.training.trainer import Trainer, resume

CHAT = ["mode=chat", "turns=2", "max_new_tokens=12", "warm_start_probes=0", "warm_start_select=best_of"]
STEP0 = Path("checkpoints") / "step_000000"
RUN_FILES = ("config.yaml", "warm_start.json", "warm_start.jsonl")  # what a resume from step 0 reads


def from_run(run_dir: Path, into: Path, overrides: list[str]) -> Trainer:
    """A trainer resumed from a copy of ``run_dir``'s step-0 checkpoint (the warm-started tester, its pinned
    reference and replay archive) in ``into``: the step a user of that run's config runs, warm start done."""
    if not (run_dir / STEP0).is_dir():
        raise SystemExit(f"--from-run {str(run_dir)!r}: no {STEP0} there (a run whose config keeps step 0)")
    for name in RUN_FILES:
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, into / name)
    shutil.copytree(run_dir / STEP0, into / STEP0)
    return resume(into, overrides, progress=False)


class ChatStep:
    """A config-built trainer whose ``train_step`` is timed phase by phase."""

    def __init__(self, trainer: Trainer, memory: bool = False) -> None:
        self.config = trainer.config
        self.trainer = trainer
        self.trainer._build()  # what train() does before its first step
        self.timer = Timer(self.config.device, memory=memory)
        self.turn = {"tester": 0, "target": 0}
        self._instrument()

    def _wrap(self, owner, name: str, section) -> None:
        setattr(owner, name, self.timer.wrap(section, getattr(owner, name)))

    def _in_role(self, owner, name: str, role: str, section) -> None:
        """``owner.name`` timed in ``section`` with ``self.role`` set to ``role`` for its duration (a tester or
        target call also counts its turn first), so the ``generate`` calls inside know whose they are."""
        original = getattr(owner, name)

        def call(*a, **kw):
            if role in self.turn:
                self.turn[role] += 1
            self.role = role
            try:
                with self.timer.section(section()):
                    return original(*a, **kw)
            finally:
                self.role = None

        setattr(owner, name, call)

    def _instrument(self) -> None:
        trainer, timer = self.trainer, self.timer
        algorithm = trainer.algorithm
        transforms = list(trainer.env.transform)
        target_turn = next(t for t in transforms if isinstance(t, TargetTurn))
        self.role = None

        self._in_role(trainer.policy, "forward", "tester", lambda: f"tester_turn{self.turn['tester']}")
        self._in_role(target_turn, "_step", "target", lambda: f"target_turn{self.turn['target']}")
        self._wrap(target_turn, "_answer", lambda: f"target_turn{self.turn['target']}_policy")
        for model in {id(m): m for m in (trainer.models.tester.model, trainer.models.target.model)}.values():
            hook = turn_cache_of(model)  # timed inside the cache hook, which the trainer finds and clears
            owner, name = (hook, "_generate") if hook is not None else (model, "generate")
            self._wrap(owner, name, self._generate_section)
        if target_turn.lexicon is not None:
            lexicon = target_turn.lexicon  # an older checkout reads a step's mass through mass(), not step_stats()
            names = ("step_stats", "reply_mass", "estimate") if hasattr(lexicon, "step_stats") else ("mass", "estimate")
            for name in names:
                self._wrap(lexicon, name, "reply_lexicon")
        for transform in transforms:
            if isinstance(transform, ScoreReward):
                transform.scorers = {k: _timed(fn, timer, "scorers_env") for k, fn in transform.scorers.items()}
            if isinstance(transform, astprompter.ASTPrompterReward):
                transform.scorer = _timed(transform.scorer, timer, "scorers_reward")
                self._wrap(transform, "compute", "reward_transform")
        self._wrap(algorithm, "collect", "collect")
        for guide in getattr(algorithm, "guides", []):  # their own env: its turns are not the step's turns
            self._in_role(guide, "rollout", "guide", lambda: "guides")
        self._wrap(algorithm, "training_batch", "reference_logprobs")
        if hasattr(algorithm, "_read_behaviour"):
            self._wrap(algorithm, "_read_behaviour", "behaviour_logprobs")
        self._wrap(algorithm, "loss", "loss_forward")
        self._wrap(trainer, "_optimizer_step", "optimizer")

    def _generate_section(self) -> str:
        """The section of a ``generate`` call: the turn it serves, ``guides_generate`` (a guide's own), or
        ``generate_elsewhere`` (neither: counted in ``collect_rest``)."""
        if self.role == "guide":
            return "guides_generate"
        return f"{self.role}_turn{self.turn[self.role]}_generate" if self.role in self.turn else "generate_elsewhere"

    def step(self) -> dict:
        self.timer.seconds.clear()
        self.timer.peaks.clear()
        self.turn = {"tester": 0, "target": 0}
        likelihood = astprompter.probe_logprobs

        def section() -> str:
            return "guides_likelihood_term" if self.role == "guide" else "likelihood_term"

        astprompter.probe_logprobs = self.timer.wrap(section, likelihood)
        backward = torch.Tensor.backward
        torch.Tensor.backward = self.timer.wrap("backward", backward)
        try:
            with self.timer.section("step"):
                row = self.trainer.train_step()
        finally:
            astprompter.probe_logprobs = likelihood
            torch.Tensor.backward = backward
        s = dict(self.timer.seconds)
        parts: dict[str, float] = {}
        for turn in range(1, self.config.turns + 1):
            tester, generate = s.get(f"tester_turn{turn}", 0.0), s.get(f"tester_turn{turn}_generate", 0.0)
            parts[f"tester_turn{turn}_generate"] = generate
            parts[f"tester_turn{turn}_wrapper"] = tester - generate
            target, policy = s.get(f"target_turn{turn}", 0.0), s.get(f"target_turn{turn}_policy", 0.0)
            generate = s.get(f"target_turn{turn}_generate", 0.0)
            parts[f"target_turn{turn}_generate"] = generate
            parts[f"target_turn{turn}_wrapper"] = policy - generate  # templates, tokenisation, lexicon hook
            parts[f"target_turn{turn}_env"] = target - policy  # target view, window clipping, rendered contexts
        parts["reply_lexicon"] = s.get("reply_lexicon", 0.0)  # inside the target's wrapper time
        parts["scorers"] = s.get("scorers_env", 0.0) + s.get("scorers_reward", 0.0)
        parts["likelihood_term"] = s.get("likelihood_term", 0.0)
        parts["reward_rest"] = s.get("reward_transform", 0.0) - parts["likelihood_term"] - s.get("scorers_reward", 0.0)
        parts["reference_logprobs"] = s.get("reference_logprobs", 0.0)
        parts["guides"] = s.get("guides", 0.0)  # guide_search / guide_replay's own conversations, all of them
        parts["guides_generate"] = s.get("guides_generate", 0.0)  # inside "guides"
        collect = row["collect_seconds"]
        counted = sum(s.get(k, 0.0) for k in s if k.count("_") == 1 and k.startswith(("tester_turn", "target_turn")))
        counted += s.get("scorers_env", 0.0) + s.get("reward_transform", 0.0) + parts["reference_logprobs"]
        counted += parts["guides"]
        parts["collect_rest"] = collect - counted
        parts["behaviour_logprobs"] = s.get("behaviour_logprobs", 0.0)
        parts["loss_forward"] = s.get("loss_forward", 0.0)
        parts["backward"] = s.get("backward", 0.0)
        parts["optimizer"] = s.get("optimizer", 0.0)
        update = row["step_seconds"] - collect
        parts["update_rest"] = update - sum(parts[k] for k in ("behaviour_logprobs", "loss_forward", "backward", "optimizer"))
        peaks = {k: v / 1024 for k, v in self.timer.peaks.items()}
        times = {"step_s": row["step_seconds"], "collect_s": collect, "update_s": update}
        return {**times, "parts": parts, "row": row, "peaks": peaks}


def _timed(scorer, timer: Timer, name: str):
    class Timed:
        def __call__(self, *a, **kw):
            with timer.section(name):
                return scorer(*a, **kw)

        def __getattr__(self, key):
            return getattr(scorer, key)

    return Timed()


def peak_rss_bytes() -> int:
    """The process's peak resident memory (``ru_maxrss``: kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--set", action="append", default=[], help="more KEY=VALUE overrides (after the chat ones)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after one untimed step")
    parser.add_argument("--memory", action="store_true", help="also each section's peak resident memory (Linux)")
    parser.add_argument(
        "--from-run",
        type=Path,
        default=None,
        help="time the steps of this run's own config from a copy of its step-0 checkpoint (no chat overrides; "
        "--config is not read): a recipe with a warm start, e.g. elicit_chat_full.yaml",
    )
    args = parser.parse_args()
    info = setup(args)
    with tempfile.TemporaryDirectory() as run_dir:
        if args.from_run is not None:
            overrides = [f"device={args.device}", f"dtype={args.dtype}", *args.set]
        else:
            overrides = [*CHAT, f"device={args.device}", f"dtype={args.dtype}", f"seed={args.seed}", "total_steps=1000"]
            overrides += [f"run_dir={run_dir}", *args.set]
        start = time.perf_counter()
        if args.from_run is not None:
            trainer = from_run(args.from_run, Path(run_dir), overrides)
        else:
            config = load_config(ROOT / args.config if not args.config.startswith("/") else args.config, overrides)
            trainer = Trainer(config, progress=False)
        bench = ChatStep(trainer, memory=args.memory)
        build_s = time.perf_counter() - start
        info["dtype"] = bench.config.dtype  # a --set dtype=... wins over --dtype
        warm = bench.step()
        steps = []
        for _ in range(args.repeats):
            steps.append(bench.step())
            print({k: r(v, 2) for k, v in steps[-1].items() if k not in ("parts", "row", "peaks")}, flush=True)
    median = statistics.median
    parts = steps[0]["parts"].keys()
    # the per-section resets move ru_maxrss's high-water mark with them: the timer holds the peak then
    peak = bench.timer.overall_peak_mb() / 1024 if args.memory else peak_rss_bytes() / 2**30
    emit(
        {
            "benchmark": "chat_step",
            **info,
            "config": str(args.from_run / "config.yaml") if args.from_run else args.config,
            "from_step0": args.from_run is not None,
            "overrides": overrides if args.from_run else overrides[: -1 - len(args.set)] + args.set,
            "repeats": args.repeats,
            **{k: r(median([s[k] for s in steps]), 3) for k in ("step_s", "collect_s", "update_s")},
            "breakdown_s": {k: r(median([s["parts"][k] for s in steps]), 3) for k in parts},
            "per_step_s": [r(s["step_s"], 2) for s in steps],
            "per_step_breakdown_s": [{k: r(v, 2) for k, v in s["parts"].items()} for s in steps],
            "reward_mean": [r(s["row"].get("reward_mean", float("nan")), 6) for s in steps],
            "warmup_step_s": r(warm["step_s"], 2),
            "build_s": r(build_s, 2),
            "peak_rss_gb": r(peak, 2),
            **({"peak_by_section_gb": section_peaks(steps)} if args.memory else {}),
        }
    )


def section_peaks(steps: list[dict]) -> dict:
    """Each section's median peak (GiB) over ``steps``, highest first."""
    names = {name for s in steps for name in s["peaks"]}
    medians = {name: statistics.median([s["peaks"].get(name, 0.0) for s in steps]) for name in names}
    return {name: r(medians[name], 2) for name in sorted(names, key=lambda n: -medians[n])}


if __name__ == "__main__":
    main()
