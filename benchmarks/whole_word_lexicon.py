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

``whole_words`` reads the continuation of the token the reply took; the mass of a counted token it
did not take is paid as it stands (``" Ass"`` where the reply goes on ``"ass|istant"``). With
``--unsampled-min P``, each position where the likeliest counted token other than the sampled one has
probability ``p >= P`` is read once more: the target after ``prompt + reply[:t] + that token``, and
``p`` times its probability of a token that continues the word comes off too. The JSON then gives the
mean estimate with that discount, the share of replies it halves, the positions read and the pieces
most often continued (the token and its likeliest next token).

The JSON also counts the counted tokens that begin a longer word of better-profanity's list that
``--scorer`` calls toxic (``" dick"`` -> "dickhead"): the whole-word reading discounts such a word
as a token spelled on.

    python benchmarks/whole_word_lexicon.py eval/elicit_chat_rl --scorer wordlist:-god --threads 1
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from _common import base_parser, emit, r, setup

from astrl._compat import render_chats
from astrl.evaluation.lexicon_reading import target_chats
from astrl.evaluation.records import read_records
from astrl.models import load_model
from astrl.names import wordlist_words
from astrl.ragged import pad_ids
from astrl.rewards.lexicon import ReplyLexicon, reply_lexicon, teacher_forced_stats
from astrl.rewards.lexicon import reply_estimate as whole_word_estimate
from astrl.scorers import make_scorer


def unsampled_pieces(lexicon: ReplyLexicon, stats: torch.Tensor, reply: list[int], least: float) -> list[tuple[int, int, float]]:
    """``(t, k, p)`` for each position ``t`` of ``reply`` whose likeliest counted token ``k`` other than the
    sampled one has probability ``p >= least`` (``stats``: its :func:`~astrl.rewards.lexicon.teacher_forced_stats`)."""
    probs = stats[:, 2:].clone()
    counted = lexicon.token_ids.tolist()
    for t, token in enumerate(reply):
        if token in counted:
            probs[t, counted.index(token)] = 0.0
    best = probs.max(-1)
    return [(t, counted[int(i)], float(v)) for t, (v, i) in enumerate(zip(best.values, best.indices, strict=True)) if v >= least]


def next_token_probs(model, rows: list[list[int]], pad: int) -> torch.Tensor:
    """``(len(rows), V)``: the next-token distribution after each row, one right-padded forward."""
    ids, mask = pad_ids([torch.tensor(row) for row in rows], pad)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return logits[torch.arange(len(rows)), mask.sum(1) - 1].float().softmax(-1)


def unsampled_discounts(
    model,
    lexicon,
    prompts: list[list[int]],
    replies: list[list[int]],
    stats: list[torch.Tensor],
    least: float,
    pad: int,
    pieces: Counter,
    tok,
) -> list[tuple[torch.Tensor, int]]:
    """Per reply, the whole-word mass of its positions (``(1, T)``), less ``p * c`` at each position that
    :func:`unsampled_pieces` finds (``c``: the target's probability that the token after the piece continues
    its word), and the count of such positions; one forward reads every piece of the batch. ``pieces``
    counts each piece and its likeliest next token."""
    masses = [lexicon.reply_mass(s.unsqueeze(0), torch.tensor([q])) for s, q in zip(stats, replies, strict=True)]
    found = [
        (i, t, k, p)
        for i, (s, q) in enumerate(zip(stats, replies, strict=True))
        for t, k, p in unsampled_pieces(lexicon, s, q, least)
    ]
    if found:
        after = next_token_probs(model, [prompts[i] + replies[i][:t] + [k] for i, t, k, _ in found], pad)
        go_on = after[:, lexicon.continuing_ids].sum(-1)
        for (i, t, k, p), c, probs in zip(found, go_on.tolist(), after, strict=True):
            masses[i][0, t] = (masses[i][0, t] - p * c).clamp(min=0.0)
            pieces[tok.decode([k, int(probs.argmax())]).strip()] += 1
    counts = Counter(i for i, *_ in found)
    return [(mass, counts[i]) for i, mass in enumerate(masses)]


def listed_words_split(lexicon: ReplyLexicon, tokenizer, listed: list[str]) -> dict[str, list[str]]:
    """For each counted token, the longer ``listed`` words whose word-initial spelling (``" word"`` or
    ``" Word"``) the tokenizer begins with that token: a reply that says one is read by the whole-word
    reading as the token spelled on into another word (``" ass"`` + ``"hole"``)."""
    by_first: dict[int, list[str]] = {}  # a token: the listed words a spelling of which it begins, tokenized once
    for word in listed:
        for spelling in (f" {word}", f" {word.capitalize()}"):
            ids = tokenizer(spelling, add_special_tokens=False)["input_ids"]
            if len(ids) > 1 and word not in by_first.get(ids[0], []):
                by_first.setdefault(ids[0], []).append(word)
    found: dict[str, list[str]] = {}
    for token in lexicon.token_ids.tolist():
        text = tokenizer.decode([token]).strip().lower()  # " ass" and " Ass" share one entry
        for word in by_first.get(token, []):
            if word != text and word.startswith(text) and word not in found.get(text, []):
                found.setdefault(text, []).append(word)
    return found


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("eval_dir", help="an astrl eval folder of chat conversations")
    parser.add_argument("--scorer", default="profanity", help="the scorer whose lexicon 'scorer' reads")
    parser.add_argument("--lexicon", default="scorer", help="the reply lexicon source")
    parser.add_argument("--turns", default="0,1", help="turns whose first replies are read (comma-separated, from 0)")
    parser.add_argument("--limit", type=int, default=None, help="read at most this many replies")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--unsampled-min", type=float, default=None, metavar="P",
        help="also read the continuation of the likeliest unsampled counted token where its probability is at least P",
    )  # fmt: skip
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
    listed = sorted({w.lower() for w in wordlist_words() or [] if w.isalpha()})
    split = listed_words_split(whole, tokenizer, [w for w, x in zip(listed, scorer(listed).tolist(), strict=True) if x > 0.5])
    counted, continuing = set(whole.token_ids.tolist()), set(whole.continuing_ids.tolist())
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in render_chats(tokenizer, chats)]
    replies = [tokenizer(x["response"], add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id] for x in records]
    start, before, after, spelled_on = time.perf_counter(), [], [], Counter()
    unsampled, pieces, read = [], Counter(), 0
    pad = tokenizer.pad_token_id or 0
    for i in range(0, len(records), args.batch):
        batch = slice(i, i + args.batch)
        stats_batch = teacher_forced_stats(model, whole, prompts[batch], replies[batch], pad)
        if args.unsampled_min is not None:
            discounted = unsampled_discounts(
                model, whole, prompts[batch], replies[batch], stats_batch, args.unsampled_min, pad, pieces, tokenizer
            )
            unsampled += [float(ReplyLexicon.estimate(mass, torch.ones_like(mass, dtype=torch.bool))) for mass, _ in discounted]
            read += sum(n for _, n in discounted)
        for stats, reply in zip(stats_batch, replies[batch], strict=True):
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
        "counted_tokens": len(whole), "counted_tokens_opening_listed_words": len(split),
        "listed_words_split": sum(len(v) for v in split.values()),
        "listed_words_split_examples": {k: v[:3] for k, v in split.items()},
        **(unsampled_reading(after_a, np.asarray(unsampled), read, pieces, args.unsampled_min) if unsampled else {}),
    })  # fmt: skip


def unsampled_reading(after: np.ndarray, unsampled: np.ndarray, read: int, pieces: Counter, least: float) -> dict:
    """The ``--unsampled-min`` part of the JSON: the estimate with the unsampled pieces' continuations discounted too."""
    halved = float(np.mean((after > 0) & (unsampled <= 0.5 * after)))
    return {
        "unsampled_min": least, "positions_read": read, "mean_estimate_unsampled": r(float(unsampled.mean())),
        "share_halved_unsampled": r(halved), "unsampled_pieces_top": pieces.most_common(10),
    }  # fmt: skip


if __name__ == "__main__":
    main()
