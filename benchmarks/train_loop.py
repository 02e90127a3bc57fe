"""Full training steps of GRPO, PPO and IPO/DPO as users run them, against raw generate and a bare update.

Each algorithm is built from its shipped config (``configs/<name>.yaml``, sizes reduced by the
options below) through ``load_config`` and ``Trainer``, and runs ``Trainer.train_step()``: the
collection (GRPO and PPO through ``LLMCollector`` over the red-team env, IPO/DPO through the tree
sampler), behaviour / reference log-probs, and the update (every minibatch of every epoch: loss,
backward, clipping, optimizer and scheduler step). Timers wrap the tester and target policies, the
scorers, the likelihood term of the ASTPrompter reward, the batch preparation (behaviour +
reference log-probs) and the losses.

Two comparisons per timed step, interleaved with the steps:

- collection vs the same ``model.generate`` calls replayed bare: every generate call of the step
  is recorded (its exact ``input_ids`` / ``attention_mask``, and whether the tester or the target
  made it) and replayed as ``generate(..., max_new_tokens=n, min_new_tokens=n, do_sample=True)``
  with ``n`` the number of tokens the call generated, on the same model (target: adapters off);
- update vs a bare forward + masked log-prob loss + backward + AdamW (``train_step.py``'s bare
  step, lr 0 so the run's weights do not move) on the same minibatches of the same tokens (IPO/DPO:
  prompt + chosen and prompt + rejected of each pair), one row per turn. GRPO's update also holds
  the behaviour log-probs of the rows outside its first minibatch (``behaviour_in_update``), and
  its loss reads a conversation's turns from one forward (the bare step runs every turn's row).

The last JSON line holds, per algorithm, the medians over the timed steps of both time ratios
(``collect_vs_generate``, ``update_vs_bare``; 1.0 = the bare cost) and of the breakdown.

    python benchmarks/train_loop.py --quick
    python benchmarks/train_loop.py --algorithms ipo --tree-depth 3 --new-tokens 32
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
from _common import ROOT, Timer, base_parser, emit, r, setup, sync
from train_step import _bare_batch, _bare_loss

import astrl.rewards.astprompter as astprompter
from astrl.envs.transforms import ScoreReward, TargetTurn
from astrl.lm_scoring import response_mask, stop_ids
from astrl.prefill import SharedPrefill, TurnCache
from astrl.training.config import load_config
from astrl.training.trainer import Trainer

ALGORITHMS = ("grpo", "ppo", "ipo", "dpo")
PARTS = (
    "generate_tester",
    "generate_target",
    "scorer",
    "likelihood_term",
    "behaviour_reference_logprobs",
    "collect_rest",
    "update",
    "behaviour_in_update",  # part of "update": GRPO's behaviour log-probs read before the first update
)


def _overrides(args, name: str, run_dir: str) -> list[str]:
    common = [f"tester={args.model}", f"target={args.model}", f"device={args.device}", f"dtype={args.dtype}"]
    common += [f"seed={args.seed}", f"max_new_tokens={args.new_tokens}", "total_steps=1000", f"run_dir={run_dir}"]
    common += [f"share_prefill={str(args.share_prefill).lower()}", f"share_prompt={str(not args.no_share_prompt).lower()}"]
    common += [f"turn_cache={str(not args.no_turn_cache).lower()}"]
    if name in ("ipo", "dpo"):
        return [*common, f"algorithm={name}", f"prompts_per_step={args.trees}", f"tree_width={args.tree_width}"] + [
            f"tree_depth={args.tree_depth}"
        ]
    if name == "ppo":  # one conversation per opener, as configs/ppo.yaml
        return [*common, f"prompts_per_step={args.groups * args.group_size}", "group_size=1", f"turns={args.turns}"]
    return [*common, f"prompts_per_step={args.groups}", f"group_size={args.group_size}", f"turns={args.turns}"]


def summarize(steps: list[dict]) -> dict:
    """Medians over timed steps of the time ratios and of every breakdown part.

    Each step holds ``collect_s``, ``generate_s`` (the replayed raw generate calls), ``update_s``,
    ``bare_update_s`` and ``parts`` (seconds per breakdown part). A ratio is taken per step, then
    the median over steps (repeats are interleaved, so each ratio compares runs made side by side).
    """
    ratio = statistics.median
    return {
        "collect_vs_generate": ratio([s["collect_s"] / s["generate_s"] for s in steps]),
        "policy_generate_vs_generate": ratio(
            [(s["parts"].get("generate_tester", 0.0) + s["parts"].get("generate_target", 0.0)) / s["generate_s"] for s in steps]
        ),
        "update_vs_bare": ratio([s["update_s"] / s["bare_update_s"] for s in steps]),
        "step_s": ratio([s["collect_s"] + s["update_s"] for s in steps]),
        "collect_s": ratio([s["collect_s"] for s in steps]),
        "generate_s": ratio([s["generate_s"] for s in steps]),
        "update_s": ratio([s["update_s"] for s in steps]),
        "bare_update_s": ratio([s["bare_update_s"] for s in steps]),
        "breakdown_s": {k: ratio([s["parts"].get(k, 0.0) for s in steps]) for k in PARTS},
    }


def _minibatch_rows(minibatch, stops: set[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(prompt, response) token rows of a minibatch: a turn each (GRPO/PPO), chosen and rejected of a pair (IPO/DPO)."""
    keys = minibatch.keys()
    if "chosen_tokens" in keys:
        prompts = minibatch.get("prompt_tokens", as_list=True)
        rows = []
        for side in ("chosen", "rejected"):
            tokens, masks = minibatch.get(f"{side}_tokens", as_list=True), minibatch.get(f"{side}_mask", as_list=True)
            rows += [(p, q[m.bool()]) for p, q, m in zip(prompts, tokens, masks, strict=True)]
        return [p for p, _ in rows], [q for _, q in rows]
    prompts = minibatch.get(("tokens", "prompt"), as_list=True)
    responses = minibatch.get(("tokens", "response"), as_list=True)
    return prompts, [q[: int(response_mask(q, stops).sum())] for q in responses]


class _TimedScorer:
    """A scorer whose calls are timed; its other attributes (``name``, ...) are the scorer's."""

    def __init__(self, scorer, timer: Timer) -> None:
        self._scorer, self._timer = scorer, timer

    def __call__(self, *args, **kwargs):
        with self._timer.section("scorer"):
            return self._scorer(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._scorer, name)


def generate_hooks(*models) -> list:
    """The SharedPrefill / TurnCache hooks set on the models' ``generate`` (outermost first)."""
    hooks = []
    for model in models:
        generate = model.generate
        while isinstance(generate, (SharedPrefill, TurnCache)):
            if generate not in hooks:
                hooks.append(generate)
            generate = generate.original
    return hooks


class Instrumented:
    """A config-built trainer whose step is timed part by part, with its generate calls and minibatches recorded."""

    def __init__(self, args, name: str, run_dir: str) -> None:
        config_file = "ipo" if name == "dpo" else name
        self.config = load_config(ROOT / "configs" / f"{config_file}.yaml", _overrides(args, name, run_dir))
        self.device = args.device
        self.trainer = Trainer(self.config, progress=False)
        self.trainer._build()  # what train() does before its first step (train() would also write checkpoints)
        self.models = self.trainer.models
        self.timer = Timer(args.device)
        self.calls: list[dict] = []
        self.minibatches: list[tuple[list, list]] = []
        self._role = None
        self._depth = 0
        self.hooks = generate_hooks(self.models.tester.model, self.models.target.model)  # off for the replay
        self._instrument()

    # -- wrapping --------------------------------------------------------------------------
    def _policy_wrap(self, policy, role: str) -> None:
        forward = policy.forward

        def timed(*a, **kw):
            self._role = role
            try:
                with self.timer.section(f"generate_{role}"):
                    return forward(*a, **kw)
            finally:
                self._role = None

        policy.forward = timed

    def _generate_wrap(self, model) -> None:
        original = model.generate

        def generate(*a, **kw):
            self._depth += 1
            try:
                out = original(*a, **kw)
            finally:
                self._depth -= 1
            if self._depth == 0 and "input_ids" in kw:  # the outer call (a target's generate calls the tester's base)
                ids = kw["input_ids"]
                seq = out if isinstance(out, torch.Tensor) else out["sequences"]
                new = seq.shape[-1] - ids.shape[-1]
                mask = kw.get("attention_mask", torch.ones_like(ids))
                call = {"generate": original, "role": self._role, "new": new}
                self.calls.append(call | {"input_ids": ids.clone(), "attention_mask": mask.clone()})
            return out

        model.generate = generate

    def _instrument(self) -> None:
        algorithm, timer = self.trainer.algorithm, self.timer
        if hasattr(algorithm, "sampler"):  # IPO / DPO: the tree sampler
            tester, target = algorithm.sampler.tester, algorithm.sampler.target
            transforms = algorithm.sampler.transforms
            algorithm.loss_module.reference_logprobs = timer.wrap(
                "behaviour_reference_logprobs", algorithm.loss_module.reference_logprobs
            )
        else:  # GRPO / PPO: the collector's env
            transforms = list(self.trainer.env.transform)
            tester = self.trainer.policy
            target = next(t.target for t in transforms if isinstance(t, TargetTurn))
            algorithm.training_batch = timer.wrap("behaviour_reference_logprobs", algorithm.training_batch)
            if hasattr(algorithm, "_read_behaviour"):  # GRPO reads the behaviour log-probs when it draws minibatches
                algorithm._read_behaviour = timer.wrap("behaviour_in_update", algorithm._read_behaviour)
        self._policy_wrap(tester, "tester")
        self._policy_wrap(target, "target")
        seen = set()
        for model in (self.models.tester.model, self.models.target.model):
            if id(model) not in seen:
                seen.add(id(model))
                self._generate_wrap(model)
        for transform in transforms:
            if isinstance(transform, ScoreReward):
                transform.scorers = {k: _TimedScorer(fn, timer) for k, fn in transform.scorers.items()}
            if isinstance(transform, astprompter.ASTPrompterReward):
                transform.scorer = _TimedScorer(transform.scorer, timer)
        loss = algorithm.loss
        self.stops = stop_ids(self.models.tester.tokenizer, self.models.tester.model)

        def recorded_loss(minibatch):
            self.minibatches.append(_minibatch_rows(minibatch, self.stops))
            return loss(minibatch)

        algorithm.loss = recorded_loss

    # -- one step and its bare counterparts -------------------------------------------------
    def step(self) -> dict:
        self.timer.seconds.clear()
        self.timer.calls.clear()
        self.calls.clear()
        self.minibatches.clear()
        likelihood = astprompter.probe_logprobs
        astprompter.probe_logprobs = self.timer.wrap("likelihood_term", likelihood)
        caches = [h for h in self.hooks if isinstance(h, TurnCache)]
        before = [(h.tokens_reused, h.tokens_prefilled) for h in caches]
        try:
            row = self.trainer.train_step()
        finally:
            astprompter.probe_logprobs = likelihood
        reused = sum(h.tokens_reused - b[0] for h, b in zip(caches, before, strict=True))
        prefilled = sum(h.tokens_prefilled - b[1] for h, b in zip(caches, before, strict=True))
        seconds = self.timer.seconds
        collect_s = row["collect_seconds"]
        parts = {k: seconds.get(k, 0.0) for k in PARTS[:5]}
        parts["collect_rest"] = collect_s - sum(parts.values())
        parts["update"] = row["step_seconds"] - collect_s
        parts["behaviour_in_update"] = seconds.get("behaviour_in_update", 0.0)
        return {
            "collect_s": collect_s,
            "update_s": parts["update"],
            "parts": parts,
            "generate_calls": len(self.calls),
            "generate_calls_tester": sum(c["role"] == "tester" for c in self.calls),
            "generated_tokens": sum(c["input_ids"].shape[0] * c["new"] for c in self.calls),
            "prompt_tokens_reused": reused,
            "prompt_tokens_prefilled": prefilled,
            "updates": len(self.minibatches),
            "update_sequences": sum(len(p) for p, _ in self.minibatches),
            "reward_mean": row.get("reward_mean"),
        }

    def replay_generate(self) -> float:
        """The step's generate calls again, bare, on the same models (target: adapters off)."""
        pad = self.models.tester.tokenizer.pad_token_id
        for hook in self.hooks:
            hook.enabled = False  # the replay is raw generate
        sync(self.device)
        start = time.perf_counter()
        with torch.no_grad():
            for call in self.calls:
                call["generate"](
                    input_ids=call["input_ids"],
                    attention_mask=call["attention_mask"],
                    max_new_tokens=call["new"],
                    min_new_tokens=call["new"],
                    do_sample=True,
                    pad_token_id=pad,
                )
        sync(self.device)
        seconds = time.perf_counter() - start
        for hook in self.hooks:
            hook.enabled = True
        return seconds

    def bare_update(self) -> float:
        """Forward + masked log-prob loss + backward + AdamW per recorded minibatch, on the tester's trainable weights."""
        tester = self.models.tester.model
        params = [p for p in tester.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=0.0)  # the same arithmetic; the run's weights stay put
        pad = self.models.tester.tokenizer.pad_token_id
        batches = [_bare_batch(p, q, pad, self.device) for p, q in self.minibatches]  # padding: outside the timing
        sync(self.device)
        start = time.perf_counter()
        for ids, attention, positions, mask in batches:
            optimizer.zero_grad(set_to_none=True)
            _bare_loss(tester, ids, attention, positions, mask).backward()
            optimizer.step()
        sync(self.device)
        seconds = time.perf_counter() - start
        optimizer.zero_grad(set_to_none=True)
        return seconds


def run_algorithm(args, name: str) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        load_start = time.perf_counter()
        bench = Instrumented(args, name, run_dir)
        build_s = time.perf_counter() - load_start
        warm = bench.step()  # untimed first step: kernels, allocator, one-time checks; it warms both bare paths too
        steps = []
        for _ in range(args.repeats):  # interleaved: a step, its raw generate calls, its bare update
            step = bench.step()
            step["generate_s"] = bench.replay_generate()
            step["bare_update_s"] = bench.bare_update()
            steps.append(step)
    summary = summarize(steps)
    config = bench.config
    result = {
        "sizes": (
            {"trees": config.prompts_per_step, "tree_width": config.tree_width, "tree_depth": config.tree_depth}
            if name in ("ipo", "dpo")
            else {"openers": config.prompts_per_step, "group_size": config.group_size, "turns": config.turns}
        )
        | {"epochs": config.epochs, "minibatches": config.minibatches, "reward": config.reward},
        "collect_vs_generate": r(summary["collect_vs_generate"], 3),
        "policy_generate_vs_generate": r(summary["policy_generate_vs_generate"], 3),
        "update_vs_bare": r(summary["update_vs_bare"], 3),
        **{k: r(summary[k], 3) for k in ("step_s", "collect_s", "generate_s", "update_s", "bare_update_s")},
        "breakdown_s": {k: r(v, 3) for k, v in summary["breakdown_s"].items()},
        "per_step": [
            {k: (r(v, 3) if isinstance(v, float) else v) for k, v in s.items() if k not in ("parts", "reward_mean")}
            for s in steps
        ],
        "warmup_step_s": r(warm["collect_s"] + warm["update_s"], 2),
        "build_s": r(build_s, 2),
    }
    del bench
    return result


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="grpo,ppo,ipo", help=f"comma-separated, of {','.join(ALGORITHMS)}")
    parser.add_argument("--groups", type=int, default=2, help="GRPO openers per step (PPO: groups x group-size openers)")
    parser.add_argument("--group-size", type=int, default=None, help="GRPO conversations per opener")
    parser.add_argument("--turns", type=int, default=None, help="tester turns per conversation (GRPO, PPO)")
    parser.add_argument("--trees", type=int, default=2, help="IPO/DPO trees per step")
    parser.add_argument("--tree-width", type=int, default=2)
    parser.add_argument("--tree-depth", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None, help="max new tokens per model turn")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per algorithm (after one warm-up step)")
    parser.add_argument("--share-prefill", action="store_true", help="config share_prefill: identical prompt rows prefill once")
    parser.add_argument("--no-share-prompt", action="store_true", help="config share_prompt false: DPO/IPO pairs as two rows")
    parser.add_argument("--no-turn-cache", action="store_true", help="config turn_cache false: every call prefills in full")
    args = parser.parse_args()
    info = setup(args)
    if args.backend != "transformers":
        parser.error("train_loop replays model.generate calls: --backend transformers only")
    args.group_size = args.group_size or (2 if args.quick else 4)
    args.turns = args.turns or (2 if args.quick else 3)
    args.tree_depth = args.tree_depth or (2 if args.quick else 3)
    args.new_tokens = args.new_tokens or (16 if args.quick else 32)
    args.repeats = args.repeats or (2 if args.quick else 3)
    names = [n.strip() for n in args.algorithms.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        parser.error(f"unknown algorithms {unknown}; choose from {list(ALGORITHMS)}")
    start = time.perf_counter()
    results = {}
    for name in names:
        results[name] = run_algorithm(args, name)
        print(f"{name}: {results[name]}", flush=True)
    emit(
        {
            "benchmark": "train_loop",
            **info,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "share_prefill": args.share_prefill,
            "share_prompt": not args.no_share_prompt,
            "collect_vs_generate": {n: res["collect_vs_generate"] for n, res in results.items()},
            "update_vs_bare": {n: res["update_vs_bare"] for n, res in results.items()},
            "algorithms": results,
            "total_s": r(time.perf_counter() - start, 1),
        }
    )


if __name__ == "__main__":
    main()
