"""Chat mode: does the search's lookahead estimate of a probe predict the probe's elicited rate?

Reads the records of a two-reply-or-more chat ``astrl eval`` folder (one tester's held-out
conversations). For each probe of ``--turns`` it rebuilds the conversation as the target read it
(:func:`astrl.envs.transforms.target_view`, the target's chat template with its generation prompt),
follows the target's greedy reply for ``--lookahead`` tokens and scores it with
:func:`astrl.sampling.search.lookahead_estimate`, ``1 - prod_t (1 - m_t)`` over the scorer lexicon
(the chat search's objective and a candidate per-probe reward, free of reply sampling). No clipping
to the window: the recipe's contexts fit it. Against the probe's elicited rate over its sampled
replies under ``--judge`` (:func:`astrl.evaluation.metrics.elicited`) it reports:

* Pearson correlations, over all probes and within opener (each opener's mean removed:
  what a GRPO group of one opener sees);
* for reference, reply 1's judge score against the rate over replies 2..K (the sampled signal);
* ``best_of``: each opener's probe with the largest estimate against the mean of its probes, with 95%
  intervals over openers.

    python benchmarks/chat_lookahead_signal.py eval/elicit_chat_step0 --threads 1
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from _common import base_parser, emit, r, setup
from chat_signal import pearson, rate

from astrl._compat import render_chats
from astrl.evaluation.lexicon_reading import target_chats
from astrl.evaluation.metrics import elicited
from astrl.evaluation.records import read_records
from astrl.models import load_model
from astrl.rewards.lexicon import reply_lexicon
from astrl.sampling.search import PrefixCache, lookahead_estimate
from astrl.scorers import make_scorer


def rows_by_opener(openers: list[str]) -> list[list[int]]:
    """The row indices of each opener, in order of first appearance."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, opener in enumerate(openers):
        groups[opener].append(i)
    return list(groups.values())


def within_opener(values: np.ndarray, openers: list[str]) -> np.ndarray:
    """``values`` less the mean of their opener's values."""
    out = np.asarray(values, dtype=np.float64).copy()
    for rows in rows_by_opener(openers):
        out[rows] -= out[rows].mean()
    return out


def best_of(estimates: np.ndarray, rates: np.ndarray, openers: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per opener with 2+ probes: the rate of its probe with the largest estimate (ties: the first) and
    the mean rate of its probes."""
    chosen, mean = [], []
    for rows in rows_by_opener(openers):
        if len(rows) > 1:
            chosen.append(rates[rows[int(np.argmax(estimates[rows]))]])
            mean.append(rates[rows].mean())
    return np.asarray(chosen), np.asarray(mean)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("eval_dir", help="an astrl eval folder of chat conversations with 2+ replies a probe")
    parser.add_argument("--turns", default="0,1", help="turns whose probes are read (comma-separated, from 0)")
    parser.add_argument("--lookahead", type=int, default=8, help="greedy reply tokens read (>= 1)")
    parser.add_argument("--judge", default="wordlist")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    if args.lookahead < 1:
        parser.error(f"--lookahead must be >= 1, got {args.lookahead}")
    info = setup(args)
    records = read_records(Path(args.eval_dir) / "conversations.jsonl")
    records, chats = target_chats(records, {int(t) for t in args.turns.split(",")})
    if not records or len(records[0]["scores"][args.judge].get("replies", [])) < 2:
        raise SystemExit(f"{args.eval_dir}: no probes of turns {args.turns} with 2+ replies under {args.judge!r}")
    lm = load_model(args.model, dtype=info["dtype"], device=args.device)
    model, tokenizer = lm.model, lm.tokenizer
    lexicon = reply_lexicon("scorer", tokenizer, scorer=make_scorer("profanity"))
    stops = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in render_chats(tokenizer, chats)]
    start, estimates = time.perf_counter(), []
    for i in range(0, len(ids), args.batch):
        rows = ids[i : i + args.batch]  # the cache reads all but the last token; the estimate reads it, then answers
        with torch.no_grad():  # the cache's first forward too: no graph kept alive with it
            cache = PrefixCache(model, [torch.tensor(row[:-1]) for row in rows], tokenizer.pad_token_id or 0)
            tails = torch.tensor([row[-1:] for row in rows])
            estimates.append(lookahead_estimate(cache, torch.arange(len(rows)), tails, lexicon, args.lookahead, stops))
    seconds = time.perf_counter() - start
    estimate = torch.cat(estimates).numpy().astype(np.float64)
    hits = np.stack([elicited(np.asarray(x["scores"][args.judge]["replies"]), x["scores"][args.judge]["probe"]) for x in records])
    rates = hits.mean(1)
    first = np.asarray([x["scores"][args.judge]["replies"][0] for x in records], dtype=np.float64)
    openers = [x["prompt"] for x in records]
    chosen, mean = best_of(estimate, rates, openers)
    emit({
        "benchmark": "chat_lookahead_signal", **info, "eval_dir": args.eval_dir, "turns": args.turns,
        "lookahead": args.lookahead, "judge": args.judge, "probes": len(records), "openers": len(set(openers)),
        "seconds": r(seconds), "mean_estimate": r(float(estimate.mean())), "elicited_rate": r(float(rates.mean())),
        "pearson_estimate_rate": pearson(estimate, rates),
        "pearson_within_opener": pearson(within_opener(estimate, openers), within_opener(rates, openers)),
        "pearson_reply1_judge_later": pearson(first, hits[:, 1:].mean(1)),
        "best_of": {"by_estimate": rate(chosen[:, None], args.seed), "mean_of_opener": rate(mean[:, None], args.seed)},
    })  # fmt: skip


if __name__ == "__main__":
    main()
