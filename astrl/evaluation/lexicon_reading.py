"""The training reward's reply-lexicon term, read back from an evaluation's chat replies.

A run trained with the elicit reward and ``reply_lexicon_weight > 0`` is paid, besides its scorer's
calls on sampled replies, each reply's lexicon estimate ``1 - prod_t (1 - m_t)``: ``m_t`` is the
target's probability, at reply position ``t``, of a word of the run's reply lexicon
(:mod:`astrl.rewards.lexicon`). A word list flags a few replies in a hundred; the estimate reads every
reply. Here each turn's first reply of an ``astrl eval`` folder is read again through the target,
teacher-forced (the conversation as the target saw it, then the reply re-tokenized from its text), and
the estimates are averaged over those replies, a reply to a probe the scorer calls toxic counting 0, as
it counts nothing in the elicited share:

    lexicon_share = mean over replies of  estimate(reply) * [scorer(probe) <= threshold]

with a percentile interval from resampling openers. ``astrl select --by lexicon`` chooses by it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import fields
from typing import TYPE_CHECKING

import numpy as np

from astrl.envs.transforms import target_view
from astrl.evaluation.metrics import bootstrap_ratio, grouped

if TYPE_CHECKING:
    from astrl.models import LoadedModel
    from astrl.rewards.lexicon import ReplyLexicon

# the run's settings a lexicon is built from, and what makes two runs' readings comparable
LEXICON_KEYS = ("reply_lexicon", "reply_lexicon_threshold", "reply_lexicon_whole_words")


def lexicon_settings(run_config: dict) -> dict:
    """The run's :data:`LEXICON_KEYS`, its config's values over the defaults."""
    from astrl.rewards.settings import RewardSettings

    defaults = {f.name: f.default for f in fields(RewardSettings) if f.name in LEXICON_KEYS}
    return {key: defaults[key] if run_config.get(key) is None else run_config[key] for key in LEXICON_KEYS}


def run_lexicon(settings: dict, tokenizer, scorer: str) -> ReplyLexicon:
    """The reply lexicon of :func:`lexicon_settings` for the target's ``tokenizer``; a ``scorer`` source reads
    ``scorer``'s words."""
    from astrl.rewards.lexicon import reply_lexicon
    from astrl.scorers import make_scorer

    return reply_lexicon(
        settings["reply_lexicon"],
        tokenizer,
        scorer=make_scorer(scorer),
        threshold=float(settings["reply_lexicon_threshold"]),
        whole_words=bool(settings["reply_lexicon_whole_words"]),
    )


def target_chats(records: list[dict], turns: set[int] | None = None, system_prompt: str | None = None):
    """The records of ``turns`` (all turns: ``None``) and, for each, the conversation up to its probe as the
    target read it: the opener is the target's own message, each probe a user turn, each first reply the
    target's (:func:`~astrl.envs.transforms.target_view`, with the target's ``system_prompt``)."""
    by_conversation: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        by_conversation[record["conversation"]].append(record)
    kept, chats = [], []
    for conversation in by_conversation.values():
        tester_chat = [{"role": "user", "content": conversation[0]["prompt"]}]
        for record in sorted(conversation, key=lambda x: x["turn"]):
            tester_chat = [*tester_chat, {"role": "assistant", "content": record["probe"]}]
            if turns is None or record["turn"] in turns:
                kept.append(record)
                chats.append(target_view(tester_chat, system_prompt))
            tester_chat = [*tester_chat, {"role": "user", "content": record["response"]}]
    return kept, chats


def reply_estimates(
    records: list[dict], target: LoadedModel, lexicon: ReplyLexicon, *, system_prompt: str | None = None, batch: int = 32
) -> np.ndarray:
    """Each record's first reply's lexicon estimate under ``lexicon``, read through ``target`` (teacher-forced).
    A conversation longer than the target's window (``max_position_embeddings``) loses its oldest messages
    first, as the env's target turn drops them (:func:`~astrl.envs.truncation.fit_chats`)."""
    from astrl._compat import render_chats
    from astrl.envs.truncation import fit_chats
    from astrl.rewards.lexicon import reply_estimate, teacher_forced_stats

    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    kept, chats = target_chats(records, None, system_prompt)
    order = {id(record): i for i, record in enumerate(kept)}
    tokenizer = target.tokenizer
    replies = [tokenizer(r["response"], add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id] for r in kept]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in render_chats(tokenizer, chats)]
    window = getattr(getattr(target.model, "config", None), "max_position_embeddings", None)
    for i, (prompt, reply) in enumerate(zip(prompts, replies, strict=True)):
        if window is not None and len(prompt) + len(reply) > window:
            (fitted,) = fit_chats([chats[i]], tokenizer, window - len(reply))
            prompts[i] = tokenizer(render_chats(tokenizer, [fitted])[0], add_special_tokens=False)["input_ids"]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = np.zeros(len(kept))
    for start in range(0, len(kept), batch):
        part = slice(start, start + batch)
        stats = teacher_forced_stats(target.model, lexicon, prompts[part], replies[part], pad)
        for i, (stat, reply) in enumerate(zip(stats, replies[part], strict=True)):
            out[start + i] = reply_estimate(lexicon, stat, reply)
    return out[[order[id(record)] for record in records]]


def lexicon_share(
    records: list[dict],
    estimates: np.ndarray,
    scorer_key: str,
    *,
    threshold: float,
    resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """``reply_lexicon_share`` (the mean of ``estimates``, 0 where the record's probe is scored above
    ``threshold`` by ``scorer_key``), its interval over openers and the replies read."""
    if len(records) != len(estimates) or not records:
        raise ValueError(f"got {len(estimates)} estimates for {len(records)} records")
    clean = np.array([r["scores"][scorer_key]["probe"] <= threshold for r in records])
    paid = np.asarray(estimates, dtype=np.float64) * clean
    num, den = grouped(paid, np.ones(len(records)), [r["prompt"] for r in records])
    interval = bootstrap_ratio(num, den, resamples=resamples, confidence=confidence, seed=seed)
    return {"reply_lexicon_share": float(paid.mean()), "reply_lexicon_share_ci": interval, "n_replies": len(records)}
