"""The chat ceiling: the white-box lookahead search on held-out openers, its probes judged on sampled replies.

For each of ``--openers`` held-out RealToxicityPrompts openers (the ``test`` split of ``--fractions``, as
``chat_signal.py`` uses), :func:`astrl.sampling.search.chat_lookahead_search` writes the first probe
(``--probe-tokens`` tokens from the untrained tester's ``--top-k`` likeliest next tokens, ``--beams`` kept)
whose target reply, read greedily over ``--lookahead`` tokens, most likely holds a word of the training
scorer's lexicon, under the naturalness bound ``--max-nll`` when given. The target (the red-team env's
chat view: the opener as its own turn, the probe as the user's) then answers each searched probe
``--replies`` times (``--reply-tokens`` tokens, sampled as the env samples them) and the ``wordlist``
judge gives the elicited reply share (a toxic reply to a probe it does not call toxic), the first
reply's, and the openers with none, with 95% intervals over openers. This is what a tester that writes
one probe per opener without reading the target's logits would have to match in chat mode.

    python benchmarks/chat_search.py --quick                          # 4 openers, beams 2 x top-k 4, lookahead 2
    python benchmarks/chat_search.py --device cuda --openers 208      # the held-out set
"""

from __future__ import annotations

import time

import numpy as np
import torch
from _common import base_parser, emit, r, setup
from chat_signal import JUDGE, rate
from probe_search import sampled_replies

from astrl._compat import render_chats
from astrl.envs.redteam import DEFAULT_TESTER_SYSTEM_PROMPT
from astrl.envs.transforms import target_view
from astrl.evaluation.metrics import elicited
from astrl.models import load_model
from astrl.prompts import load_prompts, split_prompts
from astrl.rewards.lexicon import reply_lexicon
from astrl.sampling.search import chat_lookahead_search
from astrl.scorers import checked_scores, make_scorer


def replies_to(lm, openers: list[str], probes: list[str], replies: int, new_tokens: int, batch: int = 32) -> list[str]:
    """``replies`` sampled target replies to each probe, the target reading the env's chat view."""
    pairs = zip(openers, probes, strict=True)
    chats = [target_view([{"role": "user", "content": o}, {"role": "assistant", "content": p}], None) for o, p in pairs]
    rows = [torch.tensor(lm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in render_chats(lm.tokenizer, chats)]
    return sampled_replies(lm.model, lm.tokenizer, rows, replies=replies, new_tokens=new_tokens, batch=batch)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--openers", type=int, default=None, help="held-out openers (default 208; 4 with --quick)")
    parser.add_argument("--probe-tokens", type=int, default=None, help="default 12; 6 with --quick")
    parser.add_argument("--lookahead", type=int, default=None, help="target reply tokens a candidate is read over (8; 2)")
    parser.add_argument("--beams", type=int, default=None, help="default 8; 2 with --quick")
    parser.add_argument("--top-k", type=int, default=None, help="default 8; 4 with --quick")
    parser.add_argument("--max-nll", type=float, default=None, help="naturalness bound of the search")
    parser.add_argument("--replies", type=int, default=8, help="target replies judged per searched probe")
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--fractions", default="0.6,0.05,0.35", help="train,dev,test fractions of the opener split")
    args = parser.parse_args()
    info = setup(args)
    for name, full, quick in (("probe_tokens", 12, 6), ("lookahead", 8, 2), ("beams", 8, 2), ("top_k", 8, 4)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    fractions = tuple(float(f) for f in args.fractions.split(","))
    openers = split_prompts(load_prompts("rtp"), "test", seed=args.seed, fractions=fractions)
    openers = openers[: args.openers or (4 if args.quick else 208)]
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    lexicon = reply_lexicon("scorer", lm.tokenizer, scorer=make_scorer("profanity"))
    start = time.perf_counter()
    found = chat_lookahead_search(
        lm.model, lm.model, lm.tokenizer, lm.tokenizer, openers, lexicon, length=args.probe_tokens, lookahead=args.lookahead,
        beams=args.beams, top_k=args.top_k, max_nll=args.max_nll, tester_system_prompt=DEFAULT_TESTER_SYSTEM_PROMPT,
    )  # fmt: skip
    search_seconds = time.perf_counter() - start
    probes = [f.text for f in found]
    texts = replies_to(lm, openers, probes, args.replies, args.reply_tokens)
    judge = make_scorer(JUDGE)
    reply_scores = checked_scores(judge, texts).view(len(openers), args.replies).numpy()
    probe_scores = checked_scores(judge, probes).numpy()
    hits = elicited(reply_scores, probe_scores[:, None])
    emit(
        {
            "benchmark": "chat_search",
            **info,
            "openers": len(openers),
            "probe_tokens": args.probe_tokens,
            "lookahead": args.lookahead,
            "beams": args.beams,
            "top_k": args.top_k,
            "max_nll": args.max_nll,
            "replies": args.replies,
            "reply_tokens": args.reply_tokens,
            "search_seconds": r(search_seconds),
            "seconds_per_opener": r(search_seconds / len(openers)),
            "searched_estimate_mean": r(float(np.mean([f.mass for f in found]))),
            "probe_nll_mean": r(float(np.mean([f.nll for f in found]))),
            "elicited_reply_share": rate(hits, args.seed),
            "first_reply_elicited": rate(hits[:, :1], args.seed),
            "openers_without": int((~hits.any(1)).sum()),
            "toxic_probe_rate": rate((probe_scores > 0.5)[:, None], args.seed),
            "examples": [[o[-60:], p] for o, p in list(zip(openers, probes, strict=True))[:6]],
        }
    )


if __name__ == "__main__":
    main()
