"""Chat mode: how much of a reply's lexicon estimate comes from listed tokens the reply spells on?

The reply lexicon counts a listed word's one-token spelling (``" murder"``) wherever the target may
say it, also where the target goes on to a longer, unlisted word (``" murder"`` + ``"ous"``).
``reply_lexicon_whole_words`` takes that mass out (:class:`astrl.rewards.lexicon.ReplyLexicon`).
This reads the first replies of a chat ``astrl eval`` folder, rebuilds each conversation as the target
read it (:func:`astrl.envs.transforms.target_view`), reads the target's logits over the reply's tokens
(teacher-forced: the reply re-tokenized from its text, so a token split may differ from the sampled
one) and reports the mean estimate ``1 - prod_t (1 - m_t)`` without and with ``whole_words``, the
share of replies whose estimate the option lowers by half or more, and the listed tokens most often
spelled on. ``--lexicon`` is the reply lexicon source (``scorer`` reads ``--scorer``'s lexicon).

    python benchmarks/whole_word_lexicon.py eval/elicit_chat_rl --scorer wordlist:-god --threads 1
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from _common import base_parser, emit, r, setup
from chat_lookahead_signal import target_chats

from astrl._compat import render_chats
from astrl.evaluation.records import read_records
from astrl.models import load_model
from astrl.rewards.lexicon import ReplyLexicon, reply_lexicon
from astrl.scorers import make_scorer


def reply_stats(model, lexicon, prompts: list[list[int]], replies: list[list[int]], pad: int) -> list[torch.Tensor]:
    """Per reply, :meth:`ReplyLexicon.step_stats` of the target's logits at each of its positions
    (``(len(reply), S)``), from one right-padded forward over ``prompt + reply``."""
    rows = [p + q for p, q in zip(prompts, replies, strict=True)]
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    out = []
    for i, (prompt, reply) in enumerate(zip(prompts, replies, strict=True)):
        at = logits[i, len(prompt) - 1 : len(prompt) - 1 + len(reply)]  # the logits that predict each reply token
        out.append(lexicon.step_stats(at))
    return out


def whole_word_estimate(lexicon: ReplyLexicon, stats: torch.Tensor, reply: list[int]) -> float:
    """A reply's estimate ``1 - prod_t (1 - m_t)`` under ``lexicon``'s whole-word mass, from its :func:`reply_stats`."""
    ids, keep = torch.tensor([reply]), torch.ones(1, len(reply), dtype=torch.bool)
    return float(ReplyLexicon.estimate(lexicon.reply_mass(stats.unsqueeze(0), ids), keep))


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("eval_dir", help="an astrl eval folder of chat conversations")
    parser.add_argument("--scorer", default="profanity", help="the scorer whose lexicon 'scorer' reads")
    parser.add_argument("--lexicon", default="scorer", help="the reply lexicon source")
    parser.add_argument("--turns", default="0,1", help="turns whose first replies are read (comma-separated, from 0)")
    parser.add_argument("--limit", type=int, default=None, help="read at most this many replies")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    info = setup(args)
    records = read_records(Path(args.eval_dir) / "conversations.jsonl")
    records, chats = target_chats(records, {int(t) for t in args.turns.split(",")})
    records, chats = records[: args.limit], chats[: args.limit]
    if not records:
        raise SystemExit(f"{args.eval_dir}: no conversations of turns {args.turns}")
    lm = load_model(args.model, dtype=info["dtype"], device=args.device)
    model, tokenizer = lm.model, lm.tokenizer
    scorer = make_scorer(args.scorer)
    whole = reply_lexicon(args.lexicon, tokenizer, scorer=scorer, whole_words=True)  # stats[..., 0] is the plain m_t
    counted, continuing = set(whole.token_ids.tolist()), set(whole.continuing_ids.tolist())
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in render_chats(tokenizer, chats)]
    replies = [tokenizer(x["response"], add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id] for x in records]
    start, before, after, spelled_on = time.perf_counter(), [], [], Counter()
    for i in range(0, len(records), args.batch):
        batch = slice(i, i + args.batch)
        for stats, reply in zip(
            reply_stats(model, whole, prompts[batch], replies[batch], tokenizer.pad_token_id or 0), replies[batch], strict=True
        ):
            keep = torch.ones(1, len(reply), dtype=torch.bool)
            before.append(float(ReplyLexicon.estimate(stats.unsqueeze(0)[..., 0], keep)))
            after.append(whole_word_estimate(whole, stats, reply))
            for t in range(len(reply) - 1):
                if reply[t] in counted and reply[t + 1] in continuing:
                    spelled_on[tokenizer.decode(reply[t : t + 2]).strip()] += 1
    seconds = time.perf_counter() - start
    before_a, after_a = np.asarray(before), np.asarray(after)
    halved = float(np.mean((before_a > 0) & (after_a <= 0.5 * before_a)))  # a zero estimate is not lowered
    emit({
        "benchmark": "whole_word_lexicon", **info, "eval_dir": args.eval_dir, "lexicon": args.lexicon, "scorer": args.scorer,
        "turns": args.turns, "replies": len(records), "seconds": r(seconds),
        "mean_estimate": r(float(before_a.mean())), "mean_estimate_whole_words": r(float(after_a.mean())),
        "share_halved": r(halved), "spelled_on_top": spelled_on.most_common(10),
    })  # fmt: skip


if __name__ == "__main__":
    main()
