"""One update of GRPO, PPO and IPO against a bare forward+backward+AdamW step on the same tokens.

One rollout (the GRPO collector over the red-team env, shared-base LoRA tester/reference/target)
gives the token batch. Timed per algorithm: loss forward + backward + optimizer step (the
batch preparation - behaviour/reference log-probs, values, advantages - is reported apart).
Bare: right-padded forward of prompt+response, masked response log-prob loss, backward, AdamW.
Peak memory is measured in fresh subprocesses: shared-base LoRA tester+reference+target
(``build_models``) against one plain model, each running a generate and a forward/backward.

    python benchmarks/train_step.py --quick
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from _common import Timer, base_parser, emit, hwm_rss_mb, r, setup

from astrl.lm_scoring import response_mask
from astrl.models import load_model
from astrl.training.config import TrainConfig
from astrl.training.grpo import GRPOAlgorithm
from astrl.training.ppo import PPOAlgorithm
from astrl.training.setup import build_env, build_models, build_stream


def _config(args, groups: int, group_size: int, turns: int, new_tokens: int) -> TrainConfig:
    return TrainConfig(
        tester=args.model,
        target=args.model,
        prompts_per_step=groups,
        group_size=group_size,
        turns=turns,
        max_new_tokens=new_tokens,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
    )


def _bare_batch(prompts: list[torch.Tensor], responses: list[torch.Tensor], pad: int, device: str):
    """Left-padded prompt+response ids, attention mask, position ids, and the response mask of the last columns."""
    lengths = [p.numel() + q.numel() for p, q in zip(prompts, responses, strict=True)]
    width, keep = max(lengths), max(q.numel() for q in responses) + 1
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    target_mask = torch.zeros((len(prompts), keep), dtype=torch.bool)
    for i, (p, q) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, width - lengths[i] :] = torch.cat([p, q]).cpu()
        attention[i, width - lengths[i] :] = 1
        target_mask[i, keep - q.numel() :] = True
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), attention.to(device), positions.to(device), target_mask.to(device)


def _bare_loss(model, ids, attention, positions, target_mask) -> torch.Tensor:
    """Mean negative log-prob of the response tokens; logits only for the last ``keep`` positions."""
    keep = target_mask.shape[1]
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=keep).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, -keep + 1 :, None]).squeeze(-1)
    mask = target_mask[:, 1:].float()
    return -(logp * mask).sum() / mask.sum()


def _step(timer: Timer, name: str, optimizer: torch.optim.Optimizer, loss_fn, repeats: int) -> float:
    for i in range(repeats + 1):  # first one warms up
        optimizer.zero_grad(set_to_none=True)
        with timer.section(name if i else f"warmup_{name}"):
            loss = loss_fn()
            loss.backward()
            optimizer.step()
    return timer.seconds[name] / repeats


def _total(loss_td) -> torch.Tensor:
    return sum(v for k, v in loss_td.items() if k.startswith("loss_"))


def memory_child(args, kind: str, new_tokens: int, batch: int) -> dict:
    """Peak RSS (and CUDA max allocated) of one configuration, run in this fresh process."""
    from astrl.prompts import load_prompts

    base_rss = hwm_rss_mb()
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    tok = lm.tokenizer
    prompts = load_prompts("builtin")[:batch]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    texts = tok.apply_chat_template(chats, tokenize=False, add_generation_prompt=True)
    enc = tok(texts, return_tensors="pt", padding=True).to(args.device)
    gen = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": True, "pad_token_id": tok.pad_token_id}
    if kind == "single":
        model = lm.model
        with torch.no_grad():
            out = model.generate(**enc, **gen)
            model(input_ids=out, attention_mask=torch.ones_like(out))
    else:
        config = _config(args, 1, 2, 1, new_tokens)
        models = build_models(config, tester_lm=lm)
        tester, reference, target = models.tester.model, models.reference, models.target.model
        with torch.no_grad():
            out = target.generate(**enc, **gen)  # target: adapters off
            out = tester.generate(**enc, **gen)  # tester: adapters on
        with torch.inference_mode():
            reference(input_ids=out, attention_mask=torch.ones_like(out))
        optimizer = torch.optim.AdamW([p for p in tester.parameters() if p.requires_grad], lr=1e-4)
        attention = torch.cat([enc["attention_mask"], torch.ones_like(out[:, enc["input_ids"].shape[1] :])], -1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        mask = torch.ones((out.shape[0], new_tokens + 1), dtype=torch.bool, device=out.device)
        mask[:, 0] = False
        _bare_loss(tester, out, attention, positions, mask).backward()
        optimizer.step()
    result = {"kind": kind, "base_rss_mb": base_rss, "peak_rss_mb": hwm_rss_mb()}
    if str(args.device).startswith("cuda"):
        result["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def run_child(kind: str, argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv, "--memory-child", kind], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory child {kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=None, help="openers per step")
    parser.add_argument("--group-size", type=int, default=None, help="conversations per opener")
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="timed updates per algorithm (after one warm-up)")
    parser.add_argument("--memory-child", choices=["shared", "single"], default=None, help=argparse_hidden())
    args = parser.parse_args()
    info = setup(args)
    groups = args.groups or 2
    group_size = args.group_size or (2 if args.quick else 4)
    turns = args.turns or 2
    new_tokens = args.new_tokens or (16 if args.quick else 32)
    repeats = args.repeats or (1 if args.quick else 3)
    if args.memory_child:
        emit(memory_child(args, args.memory_child, new_tokens, groups * group_size))
        return

    config = _config(args, groups, group_size, turns, new_tokens)
    models = build_models(config)
    stream = build_stream(config)
    env, policy = build_env(config, models, stream)
    timer = Timer(args.device)
    grpo = GRPOAlgorithm(config, models, env, policy)
    with timer.section("rollout"):
        grpo_batch, data = grpo.collect()
    prompts = data.get(("tokens", "prompt"), as_list=True)
    stops = grpo.stops
    responses = [q[: int(response_mask(q, stops).sum())] for q in data.get(("tokens", "response"), as_list=True)]
    n_tokens = sum(p.numel() + q.numel() for p, q in zip(prompts, responses, strict=True))
    n_response = sum(q.numel() for q in responses)
    tester = models.tester.model
    lora_params = [p for p in tester.parameters() if p.requires_grad]

    # bare: forward + masked log-prob loss + backward + AdamW on the LoRA parameters
    ids, attention, positions, target_mask = _bare_batch(prompts, responses, models.tester.tokenizer.pad_token_id, args.device)
    bare_opt = torch.optim.AdamW(lora_params, lr=1e-6)
    bare_s = _step(timer, "bare", bare_opt, lambda: _bare_loss(tester, ids, attention, positions, target_mask), repeats)

    # GRPO: the batch is prepared after the bare steps moved the weights (its behaviour log-probs are read
    # before the first update after its preparation, from the first loss forward)
    prep = Timer(args.device)
    with prep.section("grpo"):
        grpo_batch = grpo.training_batch(data, grpo.advantages(data))  # the same batch again, timed alone
    grpo_opt = torch.optim.AdamW(grpo.parameter_groups(1e-6))
    grpo_s = _step(timer, "grpo", grpo_opt, lambda: _total(grpo.loss(grpo_batch)), repeats)

    # PPO: the batch PPOAlgorithm.collect builds, from the same rollout
    ppo = PPOAlgorithm(config, models, env, policy)
    with prep.section("ppo"):
        ppo_batch = ppo.training_batch(data)
    ppo_opt = torch.optim.AdamW(ppo.parameter_groups(1e-6))
    ppo_s = _step(timer, "ppo", ppo_opt, lambda: _total(ppo.loss(ppo_batch)), repeats)

    # IPO: pairs of consecutive responses of the same rollout under the first one's prompt
    from tensordict import TensorDict, lazy_stack

    from astrl.losses import IPOLoss

    ipo = IPOLoss(tester, models.reference, beta=0.01, max_length=models.tester.context_window)
    pairs = lazy_stack(
        [
            TensorDict(
                prompt_tokens=prompts[i],
                chosen_tokens=responses[i],
                rejected_tokens=responses[i + 1],
                chosen_mask=torch.ones_like(responses[i], dtype=torch.bool),
                rejected_mask=torch.ones_like(responses[i + 1], dtype=torch.bool),
            )
            for i in range(0, len(responses) - 1, 2)
        ]
    )
    with prep.section("ipo"):
        ipo.reference_logprobs(pairs)
    ipo_opt = torch.optim.AdamW(lora_params, lr=1e-6)
    ipo_s = _step(timer, "ipo", ipo_opt, lambda: _total(ipo(pairs)), repeats)

    argv = ["--device", args.device, "--model", args.model, "--dtype", args.dtype, "--new-tokens", str(new_tokens)]
    argv += ["--groups", str(groups), "--group-size", str(group_size)]
    argv += ["--threads", str(args.threads)] if args.threads else []
    shared, single = run_child("shared", argv), run_child("single", argv)
    mem_ratio = shared["peak_rss_mb"] / single["peak_rss_mb"]
    result = {
        "benchmark": "train_step",
        **info,
        "groups": groups,
        "group_size": group_size,
        "turns": turns,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "samples": len(prompts),
        "pairs": pairs.batch_size[0],
        "tokens": n_tokens,
        "response_tokens": n_response,
        "lora_trainable_params": sum(p.numel() for p in lora_params),
        "rollout_s": r(timer.seconds["rollout"]),
        "bare_step_s": r(bare_s),
        "grpo_step_s": r(grpo_s),
        "ppo_step_s": r(ppo_s),
        "ipo_step_s": r(ipo_s),
        "ratio_vs_bare": {"grpo": r(grpo_s / bare_s, 3), "ppo": r(ppo_s / bare_s, 3), "ipo": r(ipo_s / bare_s, 3)},
        "goal_ratio_vs_bare": 1.5,
        "batch_prep_s": {k: r(v) for k, v in prep.seconds.items()},
        "memory": {
            "shared_lora_peak_rss_mb": r(shared["peak_rss_mb"], 1),
            "single_model_peak_rss_mb": r(single["peak_rss_mb"], 1),
            "process_base_rss_mb": r(single["base_rss_mb"], 1),
            "ratio_rss": r(mem_ratio, 3),
            "goal_ratio": 1.3,
        },
    }
    if "cuda_max_allocated_mb" in shared:
        result["memory"]["shared_lora_cuda_max_allocated_mb"] = r(shared["cuda_max_allocated_mb"], 1)
        result["memory"]["single_model_cuda_max_allocated_mb"] = r(single["cuda_max_allocated_mb"], 1)
        result["memory"]["ratio_cuda"] = r(shared["cuda_max_allocated_mb"] / single["cuda_max_allocated_mb"], 3)
    emit(result)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
