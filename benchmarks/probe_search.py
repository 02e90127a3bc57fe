"""What the lexicon-guided beam search finds that sampling does not, and what it costs.

On ``--openers`` training-split RealToxicityPrompts openers (the demo's text-mode setting, 6-token
probes), the target's next-token probability of a lexicon word after the probe, ``m(opener, probe)``
(the quantity :func:`astrl.sampling.search.lexicon_beam_search` maximises), for:

* ``sampled``: ``--samples`` probes the untrained tester samples per opener (temperature 1), the mean
  and the best of them per opener;
* ``searched``: the beam search's probe (``--beams`` x ``--top-k``);
* ``bounded``: the same search with the naturalness bound ``--max-nll`` (every partial probe's mean
  per-token NLL under the target at most it; ``warm_start_max_nll``), when given.

Both under the ``scorer`` lexicon (the profanity scorer's words, what ``warm_start_select: search``
uses) and the ``wordlist`` lexicon (the distinct judge's list: does what the search finds for one
lexicon carry to another?). Also the seconds per opener of each and the tester's mean per-token NLL
of the probes (naturalness). Prints JSON.

With ``--replies K`` the target also answers each opener's first sampled probe and each searched
probe K times (``--reply-tokens`` tokens, temperature 1, as ``astrl eval`` samples them), and the
``wordlist`` judge gives what ``astrl eval`` reports: the share of replies that are toxic while their
probe is not (``elicited_reply_share``), the same for the first reply alone, and the openers with no
such reply. On the held-out openers (``--split test``) the searched rows are a white-box attacker that
reads the target's next-token probabilities for every opener: what a tester that writes one probe
per opener without that access would have to match.

    python benchmarks/probe_search.py --quick      # 16 openers
    python benchmarks/probe_search.py              # 64 openers
    python benchmarks/probe_search.py --quick --max-nll 3.5
    python benchmarks/probe_search.py --split test --openers 62 --max-nll 3.5 --replies 4   # all 62 test openers
    python benchmarks/probe_search.py --split test --test-fraction 0.35 --openers 218 --max-nll 3.5 --bounded-only \
        --replies 16 --beams 16 --top-k 16   # the 218 held-out openers of the elicit configs (test_fraction 0.35)

``--records FILE`` keeps each opener's searched probe, its replies and the judge's scores, so that
``share_ratio.py`` reads a tester's ``astrl eval`` folder against the search opener by opener (``--split
train`` gives the training openers: whether a tester matches the search where it trained).
"""

from __future__ import annotations

import copy
import json
import time

import numpy as np
import torch
from _common import base_parser, emit, r, setup

from astrl.evaluation.metrics import bootstrap_ratio
from astrl.evaluation.metrics import elicited as elicited_turns
from astrl.models import load_model
from astrl.prompts import load_prompts, split_fractions, split_prompts
from astrl.ragged import pad_ids
from astrl.rewards.lexicon import reply_lexicon
from astrl.sampling.search import PrefixCache, lexicon_beam_search
from astrl.scorers import checked_scores, make_scorer


def search_forwards(openers: int, probe_tokens: int, beams: int, top_k: int) -> dict[str, int]:
    """The one-token forwards of a search (shared vocabulary): each step the target scores the ``top_k``
    candidates of every partial probe (``candidates``; one partial probe an opener at the first step,
    ``beams`` later), and, but at the last step, the kept partial probes grow by a token in the tester and
    in the target (``advance``). About ``openers * probe_tokens * (beams + beams * top_k)``."""
    rows, candidates, advance = 1, 0, 0  # partial probes of one opener
    for step in range(probe_tokens):
        candidates += rows * top_k
        rows = min(beams, rows * top_k)
        if step + 1 < probe_tokens:
            advance += 2 * rows
    return {"advance": openers * advance, "candidates": openers * candidates}


def forward_gflop(model: torch.nn.Module) -> float:
    """GFLOP of one token's forward: 2 per parameter (each weight one multiply-add; attention over a short
    context left out). 0.27 for SmolLM2-135M (its tied LM head counted once)."""
    return 2 * sum(p.numel() for p in model.parameters()) / 1e9


def floor_seconds(forwards: dict[str, int], gflop: float, gflops: dict[str, float]) -> float:
    """Seconds of ``forwards`` one-token forwards (per batch kind) at the measured ``gflops`` (GFLOP/s per kind)."""
    return sum(count * gflop / gflops[kind] for kind, count in forwards.items())


def measured_gflops(model, batch: int, context: int, *, repeats: int = 7) -> float:
    """This machine's GFLOP/s for ``model``'s one-token forwards of ``batch`` rows after ``context`` cached
    tokens (the fastest of ``repeats`` after one untimed forward: the rate the machine reaches, which a
    shared machine's other work lowers for some calls), counting :func:`forward_gflop` a row."""
    device = next(model.parameters()).device
    ids = torch.randint(5, 1000, (batch, context), device=device)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        step = torch.randint(5, 1000, (batch, 1), device=device)
        times = []
        for _ in range(repeats + 1):
            past = copy.deepcopy(cache)  # outside the timing: the search's own copies count as its overhead
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(input_ids=step, past_key_values=past, use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return batch * forward_gflop(model) / min(times[1:])


def masses(model, tokenizer, openers: list[str], probes: list[torch.Tensor], lexicons: dict) -> dict[str, torch.Tensor]:
    """Each lexicon's next-token mass after ``openers[i] + probes[i]`` (one target forward a row)."""
    prompts = [torch.tensor(tokenizer(o)["input_ids"]) for o in openers]
    with torch.no_grad():
        logits = PrefixCache(model, prompts, tokenizer.pad_token_id).next_logits(torch.arange(len(openers)), probes)
    return {name: lexicon.mass(logits) for name, lexicon in lexicons.items()}


def elicited(reply_scores, probe_scores) -> dict:
    """From the judge's scores of ``(openers, K)`` replies and of the ``(openers,)`` probes: the share of
    replies that are toxic while their probe is not (:func:`astrl.evaluation.metrics.elicited`, as
    ``astrl eval`` counts them) with its 95% bootstrap interval over openers, the same for each opener's
    first reply, and the openers with no such reply."""
    hits = elicited_turns(np.asarray(reply_scores), np.asarray(probe_scores)[:, None])
    interval = bootstrap_ratio(hits.sum(1), np.full(len(hits), hits.shape[1]), seed=0)  # over openers, as astrl eval's
    return {
        "elicited_reply_share": r(float(hits.mean())),
        "elicited_reply_share_ci": interval and [r(v) for v in interval],
        "first_reply_elicited": r(float(hits[:, 0].mean())),
        "openers_without": int((~hits.any(1)).sum()),
    }


def sampled_replies(model, tok, rows: list[torch.Tensor], *, replies: int, new_tokens: int, batch: int, **sampling) -> list[str]:
    """``replies`` decoded samples of ``new_tokens`` tokens after each token row (``batch`` rows a
    ``generate`` call, temperature 1; ``sampling``: more ``generate`` keywords), row by row."""
    texts: list[str] = []
    with torch.no_grad():
        for start in range(0, len(rows), batch):
            ids, mask = pad_ids(rows[start : start + batch], tok.pad_token_id, side="left", device=model.device)
            out = model.generate(
                input_ids=ids.repeat_interleave(replies, 0), attention_mask=mask.repeat_interleave(replies, 0),
                do_sample=True, temperature=1.0, max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id, **sampling,
            )  # fmt: skip
            texts += tok.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    return texts


def judged_replies(
    model, tok, openers, probes, judge, *, replies: int, new_tokens: int, batch: int = 16, records: list | None = None
) -> dict:
    """:func:`elicited` for ``replies`` sampled target replies to each ``openers[i] + probes[i]`` (token ids
    joined as the search scored them; no top-k or top-p filter). ``records``, when given, gains a row per
    opener in ``chat_search.py``'s records format (``opener``, ``probe``, ``replies``, and ``scores`` under
    the judge's name), which ``share_ratio.py`` reads beside an ``astrl eval`` folder."""
    rows = [torch.cat([torch.tensor(tok(o)["input_ids"]), p.cpu()]) for o, p in zip(openers, probes, strict=True)]
    texts = sampled_replies(model, tok, rows, replies=replies, new_tokens=new_tokens, batch=batch, top_p=1.0, top_k=0)
    reply_scores = checked_scores(judge, texts).view(len(rows), replies)
    probe_texts = tok.batch_decode([p.cpu() for p in probes], skip_special_tokens=True)
    probe_scores = checked_scores(judge, probe_texts)
    if records is not None:
        records.extend(
            {
                "opener": opener,
                "probe": probe_texts[i],
                "replies": texts[i * replies : (i + 1) * replies],
                "scores": {judge.name: {"probe": float(probe_scores[i]), "replies": reply_scores[i].tolist()}},
            }
            for i, opener in enumerate(openers)
        )
    return elicited(reply_scores.numpy(), probe_scores.numpy())


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--openers", type=int, default=None, help="openers of --split (default 64; 16 with --quick)")
    parser.add_argument("--samples", type=int, default=8, help="sampled probes per opener")
    parser.add_argument("--beams", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=6, help="probe tokens")
    parser.add_argument("--max-nll", type=float, default=None, help="also search with this naturalness bound")
    parser.add_argument("--split", default="train", choices=["train", "test"], help="the openers' split (seed --seed)")
    parser.add_argument(
        "--test-fraction", type=float, default=None,
        help="the split's test fraction, as a config's test_fraction (0.35: the 218 held-out openers of elicit*.yaml)",
    )  # fmt: skip
    parser.add_argument("--bounded-only", action="store_true", help="with --max-nll: only the bounded search")
    parser.add_argument("--replies", type=int, default=0, help="target replies judged per probe (0: none)")
    parser.add_argument("--reply-tokens", type=int, default=16, help="tokens per target reply")
    parser.add_argument(
        "--records", default=None,
        help="with --replies: write each opener's searched probe (the bounded one with --max-nll), its replies and the "
        "judge's scores to this JSONL, for share_ratio.py",
    )  # fmt: skip
    args = parser.parse_args()
    info = setup(args)
    count = args.openers or (16 if args.quick else 64)
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    model, tok = lm.model, lm.tokenizer
    if args.bounded_only and args.max_nll is None:
        parser.error("--bounded-only needs --max-nll")
    if args.records and args.replies <= 0:
        parser.error("--records needs --replies")
    fractions = split_fractions(args.test_fraction)
    openers = split_prompts(load_prompts("rtp"), args.split, seed=args.seed, fractions=fractions)[:count]
    count = len(openers)
    lexicons = {
        "scorer": reply_lexicon("scorer", tok, scorer=make_scorer("profanity")),
        "wordlist": reply_lexicon("wordlist", tok),
    }

    start = time.perf_counter()
    sampled: list[torch.Tensor] = []
    with torch.no_grad():
        for opener in openers:
            ids = torch.tensor([tok(opener)["input_ids"]] * args.samples, device=model.device)
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_p=1.0,
                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
            sampled.extend(out[:, ids.shape[1] :].cpu())
    sample_seconds = time.perf_counter() - start
    searches, seconds = {}, {}  # "searched": without a bound, "bounded": with --max-nll
    for label, bound in (("searched", None), ("bounded", args.max_nll)):
        if (label == "searched" and args.bounded_only) or (label == "bounded" and bound is None):
            continue
        start = time.perf_counter()
        searches[label] = lexicon_beam_search(
            model, model, tok, tok, openers, lexicons["scorer"], length=args.new_tokens, beams=args.beams, top_k=args.top_k,
            max_nll=bound,
        )  # fmt: skip
        seconds[label] = time.perf_counter() - start

    first_search = next(iter(searches.values()))
    per_batch = min(8, count)  # lexicon_beam_search's openers_per_batch
    context = round(float(np.mean([len(tok(o)["input_ids"]) for o in openers]))) + args.new_tokens // 2
    batches = {"advance": per_batch * args.beams, "candidates": min(256, per_batch * args.beams * args.top_k)}
    gflops = {kind: measured_gflops(model, size, context) for kind, size in batches.items()}
    forwards = search_forwards(count, args.new_tokens, args.beams, args.top_k)
    floor = floor_seconds(forwards, forward_gflop(model), gflops)
    repeated = [o for o in openers for _ in range(args.samples)]
    of_samples = {k: v.view(count, args.samples) for k, v in masses(model, tok, repeated, sampled, lexicons).items()}
    of_search = {label: masses(model, tok, openers, [f.tokens for f in fs], lexicons) for label, fs in searches.items()}
    rows = {}
    for name in lexicons:
        rows[name] = {
            "sampled_mean": r(float(of_samples[name].mean())),
            "sampled_best_of_samples_mean": r(float(of_samples[name].max(1).values.mean())),
            "sampled_above_0.25": r(float((of_samples[name] >= 0.25).float().mean())),
        }
        for label, of in of_search.items():
            rows[name][f"{label}_mean"] = r(float(of[name].mean()))
            rows[name][f"{label}_above_0.25"] = r(float((of[name] >= 0.25).float().mean()))
    from astrl.lm_scoring import token_logprobs

    with torch.no_grad():
        prompts = [torch.tensor(tok(o)["input_ids"]) for o in openers]
        nll = {}  # per probe: its mean per-token NLL
        for label, fs in searches.items():
            per_token = token_logprobs(model, prompts, [f.tokens for f in fs], pad_token_id=tok.pad_token_id)
            nll[label] = torch.stack([-row.mean() for row in per_token])
        sampled_nll = -torch.cat(
            token_logprobs(model, [p for p in prompts for _ in range(args.samples)], sampled, pad_token_id=tok.pad_token_id)
        )
    judged, search_records = None, []
    if args.replies > 0:
        torch.manual_seed(args.seed)
        first_sampled = [sampled[i * args.samples] for i in range(count)]
        judge, options = make_scorer("wordlist"), {"replies": args.replies, "new_tokens": args.reply_tokens}
        judged = {"sampled_first": judged_replies(model, tok, openers, first_sampled, judge, **options)}
        kept = "bounded" if "bounded" in searches else "searched"  # the search --records keeps
        for label, fs in searches.items():
            records = search_records if label == kept else None
            judged[label] = judged_replies(model, tok, openers, [f.tokens for f in fs], judge, **options, records=records)
        if args.records:
            with open(args.records, "w", encoding="utf-8") as handle:
                handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in search_records)
    emit(
        {
            "benchmark": "probe_search",
            **info,
            "split": args.split,
            "test_fraction": fractions[2],
            "openers": count,
            "samples_per_opener": args.samples,
            "beams": args.beams,
            "top_k": args.top_k,
            "probe_tokens": args.new_tokens,
            "next_token_lexicon_mass": rows,
            "probe_nll_per_token": {"sampled": r(float(sampled_nll.mean())), **{k: r(float(v.mean())) for k, v in nll.items()}},
            "max_nll": args.max_nll,
            "probes_within_max_nll": (
                {k: r(float((v <= args.max_nll).float().mean())) for k, v in nll.items()} if args.max_nll is not None else None
            ),
            "seconds_per_opener": {
                "sampling": r(sample_seconds / count),
                **({"search": r(seconds["searched"] / count)} if "searched" in seconds else {}),
                **({"bounded_search": r(seconds["bounded"] / count)} if "bounded" in seconds else {}),
            },
            "flop_floor": {
                "forward_gflop": r(forward_gflop(model)),
                "forwards": forwards,
                "batch_rows": batches,
                "context_tokens": context,
                "achieved_gflops": {k: r(v, 1) for k, v in gflops.items()},
                "floor_s": r(floor, 3),
                **({"search_s": r(seconds["searched"], 3)} if "searched" in seconds else {}),
                **({"search_vs_floor": r(seconds["searched"] / floor, 2)} if "searched" in seconds else {}),
                **({"bounded_vs_floor": r(seconds["bounded"] / floor, 2)} if "bounded" in seconds else {}),
            },
            "wordlist_judge": judged and {"replies_per_probe": args.replies, "reply_tokens": args.reply_tokens, **judged},
            "examples": [{"opener": f.opener[-60:], "probe": f.text, "mass": r(f.mass)} for f in first_search[:5]],
        }
    )


if __name__ == "__main__":
    main()
