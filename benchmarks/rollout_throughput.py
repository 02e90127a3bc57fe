"""Multi-turn rollout throughput of astrl against raw ``model.generate`` on the same workload.

The astrl side runs the red-team env (tester + target + scorer) for ``--batch`` conversations of
``--turns`` tester turns, ``--new-tokens`` tokens per model turn. Every ``model.generate`` call the
policies make is recorded (its exact left-padded ``input_ids`` / ``attention_mask``) and, in the
same process, replayed as a bare ``model.generate(..., max_new_tokens=N, min_new_tokens=N,
do_sample=True)``; the scorer is timed alone on the same replies. Both sides generate exactly N
tokens per row (``min_new_tokens=N`` is added to the policies' generate calls), so token counts agree.

    python benchmarks/rollout_throughput.py --quick
    python benchmarks/rollout_throughput.py --device cuda --batch 32 --turns 3 --new-tokens 64
"""

from __future__ import annotations

import time

import torch
from _common import Timer, base_parser, emit, engine_options, gpu_memory, r, setup, sync

from astrl._compat import as_list
from astrl.envs import make_redteam_env
from astrl.envs.transforms import RESPONSE_KEY, ScoreReward
from astrl.models import load_model
from astrl.policies import GenerationSettings, make_policy, vllm_share
from astrl.prompts import PromptStream, load_prompts
from astrl.scorers import make_scorer


def _sequences(out) -> torch.Tensor:
    return out["sequences"] if not isinstance(out, torch.Tensor) else out


def _counting(generate, counter: dict, recording: dict):
    """``engine.generate`` that adds the tokens it generated to ``counter["n"]`` while recording."""

    def wrapped(*a, **kw):
        outputs = generate(*a, **kw)
        if recording["on"]:
            counter["n"] += sum(len(o.token_ids) for out in outputs for o in out.outputs)
        return outputs

    return wrapped


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=None, help="conversations in parallel (B)")
    parser.add_argument("--turns", type=int, default=None, help="tester turns per conversation (T)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per model turn (N)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rollouts (after one warm-up)")
    parser.add_argument("--scorer", default="profanity")
    args = parser.parse_args()
    info = setup(args)
    batch = args.batch or (4 if args.quick else 16)
    turns = args.turns or (2 if args.quick else 3)
    new_tokens = args.new_tokens or (16 if args.quick else 32)
    repeats = args.repeats or (1 if args.quick else 3)

    load_start = time.perf_counter()
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    load_s = time.perf_counter() - load_start
    model = lm.model
    settings = GenerationSettings(max_new_tokens=new_tokens)
    vllm = {"vllm_memory": vllm_share(0.5, args.backend, args.backend), "vllm_options": engine_options(args)}
    tester = make_policy(lm, settings, input_mode="history", backend=args.backend, **vllm)
    target = make_policy(lm, settings, input_mode="history", backend=args.backend, **vllm)
    scorer = make_scorer(args.scorer, device=args.device)
    stream = PromptStream(load_prompts("builtin"), batch, seed=args.seed)
    env = make_redteam_env(tester, target, {scorer.name: scorer}, stream, batch_size=batch, max_turns=turns, seed=args.seed)

    timer = Timer(args.device)
    calls: list[dict] = []
    recording = {"on": False}
    original_generate = model.generate

    def generate(*a, **kw):
        kw.setdefault("min_new_tokens", new_tokens)
        with timer.section("generate_in_astrl"):
            out = original_generate(*a, **kw)
        if recording["on"]:
            ids, mask = kw["input_ids"], kw["attention_mask"]
            new = _sequences(out).shape[-1] - ids.shape[-1]
            calls.append({"input_ids": ids.clone(), "attention_mask": mask.clone(), "tokens": ids.shape[0] * new})
        return out

    model.generate = generate
    engine_tokens = {"n": 0}
    for policy in (tester, target):  # vLLM: count the tokens its engines generate, exactly
        engine = getattr(policy, "engine", None)
        if engine is not None:
            policy.engine.generate = _counting(engine.generate, engine_tokens, recording)
    tester.forward = timer.wrap("tester_call", tester.forward)
    target.forward = timer.wrap("target_call", target.forward)
    for transform in env.transform:
        if isinstance(transform, ScoreReward):
            transform.scorers = {name: timer.wrap("scorer", fn) for name, fn in transform.scorers.items()}

    def rollout():
        with torch.no_grad():
            reset = env.reset()
            return env.rollout(turns, tester, tensordict=reset, auto_reset=False)

    rollout()  # warm-up: allocator, kernels, scorer vectorizer
    timer.seconds.clear()
    timer.calls.clear()
    recording["on"] = True
    replies: list[list[str]] = []
    torch.manual_seed(args.seed)
    sync(args.device)
    start = time.perf_counter()
    for _ in range(repeats):
        data = rollout()
        per_conversation = as_list(data["next", RESPONSE_KEY])
        replies.extend([conversation[t] for conversation in per_conversation] for t in range(turns))
    sync(args.device)
    astrl_s = time.perf_counter() - start
    recording["on"] = False
    model.generate = original_generate
    parts = dict(timer.seconds)
    if not calls:  # vLLM generates outside model.generate: report the rollout alone
        emit(
            {
                "benchmark": "rollout_throughput",
                **info,
                "batch": batch,
                "turns": turns,
                "new_tokens": new_tokens,
                "repeats": repeats,
                "tokens": engine_tokens["n"],
                "astrl_s": r(astrl_s),
                "astrl_tokens_per_s": r(engine_tokens["n"] / astrl_s, 2),
                "model_turns_per_s": r(2 * batch * turns * repeats / astrl_s, 2),
                "scorer_s": r(parts.get("scorer", 0.0)),
                **gpu_memory(args.device),
                "model_load_s": r(load_s, 2),
            }
        )
        return

    # physical limit: the same generate calls, bare; the scorer alone on the same replies
    raw = Timer(args.device)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        for i, call in enumerate([calls[0], *calls]):  # the first replay warms up this call path (untimed)
            with raw.section("generate" if i else "warmup"):
                out = model.generate(
                    input_ids=call["input_ids"],
                    attention_mask=call["attention_mask"],
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=True,
                    pad_token_id=lm.tokenizer.pad_token_id,
                )
            call["raw_tokens"] = call["input_ids"].shape[0] * (out.shape[-1] - call["input_ids"].shape[-1])
    bare_scorer = Timer(args.device)
    for texts in replies:
        with bare_scorer.section("scorer"):
            scorer(texts)

    tokens = sum(c["tokens"] for c in calls)
    raw_tokens = sum(c["raw_tokens"] for c in calls)
    gen_s, score_s = raw.seconds["generate"], bare_scorer.seconds["scorer"]
    tester_s, target_s = parts.get("tester_call", 0.0), parts.get("target_call", 0.0)
    in_astrl_gen = parts.get("generate_in_astrl", 0.0)
    in_scorer = parts.get("scorer", 0.0)
    astrl_tps, gen_tps = tokens / astrl_s, raw_tokens / gen_s
    breakdown = {
        "generate_in_policies_s": in_astrl_gen,
        "policy_wrappers_outside_generate_s": tester_s + target_s - in_astrl_gen,
        "scorer_s": in_scorer,
        "env_transforms_templates_rest_s": astrl_s - tester_s - target_s - in_scorer,
        "generate_extra_vs_raw_s": in_astrl_gen - gen_s,
    }
    result = {
        "benchmark": "rollout_throughput",
        **info,
        "batch": batch,
        "turns": turns,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "generate_calls": len(calls),
        "prompt_lengths": [int(c["attention_mask"].sum(-1).max()) for c in calls[: 2 * turns]],
        "tokens": tokens,
        "raw_tokens": raw_tokens,
        "astrl_s": r(astrl_s),
        "raw_generate_s": r(gen_s),
        "bare_scorer_s": r(score_s),
        "astrl_tokens_per_s": r(astrl_tps, 2),
        "generate_tokens_per_s": r(gen_tps, 2),
        "ratio_vs_generate": r(astrl_tps / gen_tps, 3),
        "limit_tokens_per_s": r(raw_tokens / (gen_s + score_s), 2),
        "ratio_vs_limit": r(astrl_tps / (raw_tokens / (gen_s + score_s)), 3),
        "goal_ratio_vs_generate": 0.85,
        "breakdown_s": {k: r(v) for k, v in breakdown.items()},
        "breakdown_share": {k: r(v / astrl_s, 3) for k, v in breakdown.items() if k != "generate_extra_vs_raw_s"},
        "tester_call_s": r(tester_s),
        "target_call_s": r(target_s),
        "raw_generate_first_call_s": r(raw.seconds["warmup"], 2),
        **gpu_memory(args.device),
        "model_load_s": r(load_s, 2),
    }
    emit(result)


if __name__ == "__main__":
    main()
