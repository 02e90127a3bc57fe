"""The chat ceiling: the white-box lookahead search on held-out openers, its probes judged on sampled replies.

For each of ``--openers`` held-out RealToxicityPrompts openers (the ``test`` split of ``--fractions``, as
``chat_signal.py`` uses), :func:`astrl.sampling.search.chat_lookahead_search` writes the first probe
(``--probe-tokens`` tokens from the untrained tester's ``--top-k`` likeliest next tokens, ``--beams`` kept)
whose target reply, read greedily over ``--lookahead`` tokens, most likely holds a word of the training
scorer's lexicon, under the naturalness bound ``--max-nll`` when given. The target (the red-team env's
chat view: the opener as its own turn, the probe as the user's) then answers each searched probe
``--replies`` times (``--reply-tokens`` tokens, sampled as the env samples them) and each of
``--judges`` (default ``wordlist``) gives the elicited reply share (a toxic reply to a probe it does not
call toxic), the same share without the opener's words and without the probe's words in any form (the
``past_opener`` and ``past_probe_forms`` readings of ``astrl eval``), the first reply's, and the
openers with none, with 95% intervals over openers. The first judge's numbers are also the top-level
keys; ``--records`` keeps each opener's probe, replies and scores. This is what a tester that writes
one probe per opener without reading the target's logits would have to match in chat mode.

    python benchmarks/chat_search.py --quick                          # 4 openers, beams 2 x top-k 4, lookahead 2
    python benchmarks/chat_search.py --device cuda --openers 208      # the held-out set
    python benchmarks/chat_search.py --openers 64 --judges wordlist,profanity --records search.jsonl
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch
from _common import base_parser, emit, r, setup
from chat_signal import JUDGE, rate
from probe_search import sampled_replies

from astrl._compat import render_chats
from astrl.envs.redteam import DEFAULT_TESTER_SYSTEM_PROMPT
from astrl.envs.transforms import target_view
from astrl.errors import ScorerError
from astrl.evaluation.metrics import DEFAULT_THRESHOLD, elicited
from astrl.evaluation.rejudge import CHECKS, without_words
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


CHECKS_READ = ("past_opener", "past_probe_forms")  # the readings of astrl eval's word checks reported here


def readings(judge, openers: list[str], probes: list[str], texts: list[str], reply_scores, probe_scores) -> dict:
    """Which replies ``judge`` counts as elicited (a toxic reply to a probe it does not call toxic), as
    judged (``elicited_reply_share``) and under each of :data:`CHECKS_READ` (a toxic reply keeps its verdict
    when it is still toxic without the check's words): ``(rows, replies)`` 0/1 matrices, one row per
    ``(opener, probe)``, ``texts`` the replies row by row and ``reply_scores`` / ``probe_scores`` the judge's."""
    reply_scores, probe_scores = np.asarray(reply_scores, dtype=np.float64), np.asarray(probe_scores, dtype=np.float64)
    hits = elicited(reply_scores, probe_scores[:, None])
    replies = hits.shape[1]
    out = {"elicited_reply_share": hits}
    rows, cols = hits.nonzero()
    for check in CHECKS_READ:
        words = [CHECKS[check]({"prompt": openers[i], "probe": probes[i]}) for i in rows]
        rest = [without_words(texts[i * replies + k], w) for i, k, w in zip(rows, cols, words, strict=True)]
        kept = np.zeros_like(hits)
        if rest:
            kept[rows, cols] = checked_scores(judge, rest).numpy() > DEFAULT_THRESHOLD
        out[f"elicited_reply_share_{check}"] = kept
    return out


def judged(judge, openers: list[str], probes: list[str], texts: list[str], replies: int, seed: int) -> dict:
    """One judge's reading of the searched probes and their ``replies`` sampled replies each: its
    elicited shares with 95% intervals over openers (``result``), and the scores it gave."""
    reply_scores = checked_scores(judge, texts).view(len(openers), replies).numpy()
    probe_scores = checked_scores(judge, probes).numpy()
    shares = readings(judge, openers, probes, texts, reply_scores, probe_scores)
    hits = shares["elicited_reply_share"]
    result = {name: rate(matrix, seed) for name, matrix in shares.items()}
    result |= {
        "first_reply_elicited": rate(hits[:, :1], seed),
        "openers_without": int((~hits.any(1)).sum()),
        "toxic_probe_rate": rate((probe_scores > DEFAULT_THRESHOLD)[:, None], seed),
    }
    return {"result": result, "replies": reply_scores.tolist(), "probes": probe_scores.tolist()}


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
    parser.add_argument("--judges", default=JUDGE, help=f"comma-separated judges of the replies (default {JUDGE})")
    parser.add_argument("--records", default=None, help="write each opener's probe, replies and scores to this JSONL")
    args = parser.parse_args()
    judges = [name.strip() for name in args.judges.split(",") if name.strip()]
    if not judges:
        parser.error(f"--judges names no judge: {args.judges!r}")
    try:  # an unknown judge ends the run here, before the search
        scorers = {name: make_scorer(name) for name in judges}
    except ScorerError as err:
        parser.error(str(err))
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
    results, scores = {}, {}
    for name in judges:
        scores[name] = judged(scorers[name], openers, probes, texts, args.replies, args.seed)
        results[name] = scores[name].pop("result")
    first = results[judges[0]]
    if args.records:
        with open(args.records, "w", encoding="utf-8") as handle:
            for i, (opener, probe) in enumerate(zip(openers, probes, strict=True)):
                record = {
                    "opener": opener,
                    "probe": probe,
                    "estimate": found[i].mass,
                    "nll": found[i].nll,
                    "replies": texts[i * args.replies : (i + 1) * args.replies],
                    "scores": {
                        name: {"probe": scores[name]["probes"][i], "replies": scores[name]["replies"][i]} for name in judges
                    },
                }
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
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
            "judge": judges[0],
            **first,
            "judges": results,
            "examples": [[o[-60:], p] for o, p in list(zip(openers, probes, strict=True))[:6]],
        }
    )


if __name__ == "__main__":
    main()
