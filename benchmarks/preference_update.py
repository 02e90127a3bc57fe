"""The IPO/DPO update on the same tree-sampled pairs: shared prompt vs prompt + response rows, vs a bare step.

One trainer is built from ``configs/ipo.yaml`` (sizes from the options) and its tree sampler
collects once; every variant then runs, on those pairs and the same minibatches, what a training
step does after the collection: the reference's summed log-probs (``reference_logprobs``) and, per
minibatch of every epoch, the loss, backward and an AdamW step (lr 0, so every variant sees the
same weights and must give the same losses and reference log-probs; the JSON gives the largest
gaps to ``rows``). Variants:

- ``rows``: prompt + chosen and prompt + rejected as separate rows (``share_prompt=False``), and the
  reference's full-vocabulary logits at every position (what the LoRA reference did before it
  exposed its LM head);
- ``rows_head``: separate rows, the reference's head applied to the response positions only;
- ``shared``: each pair's prompt run once with its KV cache reused for chosen and rejected
  (``share_prompt=True``, the default), head on the response positions.

``bare`` is ``train_step.py``'s bare step (forward, masked log-prob loss, backward, AdamW) on the
same minibatches, prompt + chosen and prompt + rejected as rows. Repeats interleave every variant
and the bare step (the order rotates); the JSON gives medians of per-repeat values:
``per_pair_s`` = (reference + update seconds) / pairs and ``update_vs_bare`` = update / bare.

    python benchmarks/preference_update.py --quick
    python benchmarks/preference_update.py --trees 2 --tree-depth 3 --new-tokens 32
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
from _common import ROOT, base_parser, emit, r, setup, sync
from train_loop import _minibatch_rows
from train_step import _bare_batch, _bare_loss

from astrl.lm_scoring import stop_ids
from astrl.training.config import load_config
from astrl.training.trainer import Trainer

VARIANTS = ("rows", "rows_head", "shared")


class _NoHead(torch.nn.Module):
    """A model seen without ``get_output_embeddings``: log-prob code falls back to its full logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "inner", model)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self.inner.parameters(recurse)


def _fresh(pairs):
    """The pairs without reference log-probs (each variant computes its own)."""
    return pairs.exclude("ref_chosen_logprob", "ref_rejected_logprob")


def run_variant(trainer: Trainer, pairs, name: str, optimizer, seed: int) -> dict:
    loss_module = trainer.algorithm.loss_module
    reference = loss_module.reference
    loss_module.share_prompt = name == "shared"
    if name == "rows":
        object.__setattr__(loss_module, "reference", _NoHead(reference))
    pairs = _fresh(pairs)
    try:
        sync(trainer.config.device)
        start = time.perf_counter()
        loss_module.reference_logprobs(pairs)
        sync(trainer.config.device)
        ref_s = time.perf_counter() - start
        losses = []
        generator = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        for minibatch in trainer.algorithm.minibatches(pairs, generator):
            optimizer.zero_grad(set_to_none=True)
            out = loss_module(minibatch)
            out[loss_module.loss_name].backward()
            optimizer.step()
            losses.append(float(out[loss_module.loss_name].detach()))
        sync(trainer.config.device)
        update_s = time.perf_counter() - start
        logprobs = torch.cat([pairs["ref_chosen_logprob"], pairs["ref_rejected_logprob"]])
    finally:
        object.__setattr__(loss_module, "reference", reference)
        loss_module.share_prompt = True
    return {"reference_s": ref_s, "update_s": update_s, "losses": losses, "logprobs": logprobs}


def run_bare(trainer: Trainer, pairs, optimizer, seed: int) -> float:
    tester = trainer.models.tester.model
    stops = stop_ids(trainer.models.tester.tokenizer, tester)
    pad = trainer.models.tester.tokenizer.pad_token_id
    generator = torch.Generator().manual_seed(seed)
    pairs = _fresh(pairs)
    batches = [
        _bare_batch(*_minibatch_rows(mb, stops), pad, trainer.config.device)
        for mb in trainer.algorithm.minibatches(pairs, generator)
    ]
    sync(trainer.config.device)
    start = time.perf_counter()
    for ids, attention, positions, mask in batches:
        optimizer.zero_grad(set_to_none=True)
        _bare_loss(tester, ids, attention, positions, mask).backward()
        optimizer.step()
    sync(trainer.config.device)
    return time.perf_counter() - start


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="ipo", choices=("ipo", "dpo"))
    parser.add_argument("--trees", type=int, default=None, help="trees per collection")
    parser.add_argument("--tree-width", type=int, default=2)
    parser.add_argument("--tree-depth", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=None, help="max new tokens per model turn")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats of every variant (after one warm-up)")
    args = parser.parse_args()
    info = setup(args)
    args.trees = args.trees or (1 if args.quick else 2)
    args.new_tokens = args.new_tokens or (16 if args.quick else 32)
    args.repeats = args.repeats or (2 if args.quick else 3)
    start_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [f"tester={args.model}", f"target={args.model}", f"device={args.device}", f"dtype={args.dtype}"]
        overrides += [f"seed={args.seed}", f"algorithm={args.algorithm}", f"prompts_per_step={args.trees}"]
        overrides += [f"tree_width={args.tree_width}", f"tree_depth={args.tree_depth}", f"max_new_tokens={args.new_tokens}"]
        overrides += ["total_steps=1000", f"run_dir={run_dir}"]
        config = load_config(ROOT / "configs" / "ipo.yaml", overrides)
        trainer = Trainer(config, progress=False)
        trainer._build()
        start = time.perf_counter()
        result = trainer.algorithm.sampler.sample()
        collect_s = time.perf_counter() - start
        pairs = result["pairs"]
        count = pairs.batch_size[0]
        if not count:
            raise SystemExit("the collection gave no pairs: try another --seed")
        params = [p for p in trainer.models.tester.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=0.0)  # the same arithmetic; the weights stay put
        for name in VARIANTS:  # warm-up: kernels, allocator, the once-per-model head check
            run_variant(trainer, pairs, name, optimizer, args.seed)
        run_bare(trainer, pairs, optimizer, args.seed)
        repeats = []
        for i in range(args.repeats):
            order = list(VARIANTS[i % len(VARIANTS) :] + VARIANTS[: i % len(VARIANTS)])
            row = {name: run_variant(trainer, pairs, name, optimizer, args.seed) for name in order}
            row["bare_s"] = run_bare(trainer, pairs, optimizer, args.seed)
            repeats.append(row)
    losses = {name: repeats[0][name]["losses"] for name in VARIANTS}
    loss_gap = max(
        abs(a - b) / max(abs(b), 1e-12) for name in VARIANTS for a, b in zip(losses[name], losses["rows"], strict=True)
    )
    rows = repeats[0]["rows"]["logprobs"]
    logprob_gap = max(float((repeats[0][name]["logprobs"] - rows).abs().max()) for name in VARIANTS)
    med = statistics.median
    variants = {}
    for name in VARIANTS:
        variants[name] = {
            "reference_s": r(med([row[name]["reference_s"] for row in repeats]), 3),
            "update_s": r(med([row[name]["update_s"] for row in repeats]), 3),
            "per_pair_s": r(med([(row[name]["reference_s"] + row[name]["update_s"]) / count for row in repeats]), 4),
            "update_vs_bare": r(med([row[name]["update_s"] / row["bare_s"] for row in repeats]), 3),
        }
    lengths = pairs.get("prompt_tokens", as_list=True)
    emit(
        {
            **info,
            "script": "preference_update",
            "algorithm": args.algorithm,
            "sizes": {"trees": args.trees, "tree_width": args.tree_width, "tree_depth": args.tree_depth}
            | {"new_tokens": args.new_tokens, "epochs": config.epochs, "minibatches": config.minibatches},
            "pairs": count,
            "prompt_tokens_mean": r(sum(len(p) for p in lengths) / count, 1),
            "collect_s": r(collect_s, 2),
            "bare_s": r(med([row["bare_s"] for row in repeats]), 3),
            "variants": variants,
            "shared_vs_rows_per_pair": r(variants["shared"]["per_pair_s"] / variants["rows"]["per_pair_s"], 3),
            "max_relative_loss_gap": float(f"{loss_gap:.2e}"),
            "max_summed_logprob_gap": float(f"{logprob_gap:.2e}"),
            "repeats": args.repeats,
            "total_s": r(time.perf_counter() - start_all, 1),
        }
    )


if __name__ == "__main__":
    main()
