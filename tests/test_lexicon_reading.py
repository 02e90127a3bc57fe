"""The reply lexicon read back from an evaluation's replies: teacher-forced estimates and their share."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_tokenizer

from astrl.evaluation.lexicon_reading import lexicon_settings, lexicon_share, reply_estimates, target_chats
from astrl.rewards.lexicon import ReplyLexicon, reply_estimate, teacher_forced_stats


class FixedLM(torch.nn.Module):
    """A model whose next-token distribution at position ``t`` is ``probs[t]`` whatever it reads."""

    def __init__(self, probs: torch.Tensor) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # a device to read
        self.probs = probs
        self.calls = 0

    def forward(self, input_ids, attention_mask):
        self.calls += 1
        rows, length = input_ids.shape
        return SimpleNamespace(logits=self.probs[:length].log().expand(rows, length, -1))


def _probs(tok, lexicon: ReplyLexicon, masses: list[tuple[float, float]]) -> torch.Tensor:
    """Per position, the two listed tokens at the given probabilities, the rest spread evenly."""
    a, b = lexicon.token_ids.tolist()
    vocab = len(tok)
    rows = []
    for pa, pb in masses:
        row = torch.full((vocab,), (1.0 - pa - pb) / (vocab - 2))
        row[a], row[b] = pa, pb
        rows.append(row)
    return torch.stack(rows)


def test_a_replys_estimate_is_one_minus_the_product_of_its_positions_misses():
    tok = make_tokenizer()
    lexicon = ReplyLexicon(tok, ["hell", "idiot"])
    # positions 0..4; a reply after a 2-token prompt is predicted at positions 1, 2 and 3
    model = FixedLM(_probs(tok, lexicon, [(0.5, 0.5), (0.1, 0.0), (0.1, 0.1), (0.3, 0.2), (0.4, 0.4)]))
    prompts, replies = [[5, 6], [7, 8, 9]], [[10, 11, 12], [13]]
    stats = teacher_forced_stats(model, lexicon, prompts, replies, tok.pad_token_id)
    assert model.calls == 1  # one right-padded forward for the batch
    assert [s.shape[0] for s in stats] == [3, 1]
    assert reply_estimate(lexicon, stats[0], replies[0]) == pytest.approx(1 - 0.9 * 0.8 * 0.5)
    assert reply_estimate(lexicon, stats[1], replies[1]) == pytest.approx(0.1 + 0.1)  # after a 3-token prompt: position 2


def _record(conversation, turn, opener, probe, response, probe_score):
    return {
        "conversation": conversation,
        "turn": turn,
        "prompt": opener,
        "probe": probe,
        "response": response,
        "scores": {"kw": {"probe": probe_score, "reply": 0.0}},
    }


def test_the_target_reads_the_opener_as_its_own_turn_and_each_probe_as_the_users():
    records = [_record(0, 1, "hi", "p2", "r2", 0.0), _record(0, 0, "hi", "p1", "r1", 0.0), _record(1, 0, "yo", "q1", "s1", 0.0)]
    kept, chats = target_chats(records, {1}, system_prompt="Be kind.")
    assert [r["probe"] for r in kept] == ["p2"]
    roles = [(m["role"], m["content"]) for m in chats[0]]
    assert roles == [("system", "Be kind."), ("assistant", "hi"), ("user", "p1"), ("assistant", "r1"), ("user", "p2")]
    kept, chats = target_chats(records)
    assert [r["probe"] for r in kept] == ["p1", "p2", "q1"] and chats[2] == [
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "q1"},
    ]


def test_reply_estimates_come_back_in_the_records_order_whatever_the_batch():
    tok = make_tokenizer()
    lexicon = ReplyLexicon(tok, ["hell", "idiot"])
    probs = _probs(tok, lexicon, [(0.01 * (t % 7), 0.02 * (t % 5)) for t in range(256)])
    target = SimpleNamespace(model=FixedLM(probs), tokenizer=tok)
    records = [
        _record(0, 1, "hello how", "you idiot", "damn hell", 0.0),
        _record(0, 0, "hello how", "tell me", "the cat sat", 0.0),
        _record(1, 0, "what is", "nice day", "good", 0.0),
    ]
    one = reply_estimates(records, target, lexicon, batch=1)
    assert np.allclose(reply_estimates(records, target, lexicon, batch=3), one)
    kept, _ = target_chats(records)  # conversation order: record 1 is read before record 0
    assert kept[0] is records[1]
    again = reply_estimates([records[1], records[0], records[2]], target, lexicon, batch=2)
    assert np.allclose(again, one[[1, 0, 2]])
    assert len(set(np.round(one, 6))) == 3 and ((one > 0) & (one < 1)).all()
    with pytest.raises(ValueError, match="batch must be >= 1, got 0"):
        reply_estimates(records, target, lexicon, batch=0)


def test_the_lexicon_share_pays_nothing_for_a_toxic_probe_and_resamples_openers():
    records = [
        _record(0, 0, "A", "p", "r", 0.0),
        _record(1, 0, "A", "p", "r", 0.9),  # the scorer calls this probe toxic: its reply counts 0
        _record(2, 0, "B", "p", "r", 0.1),
    ]
    result = lexicon_share(records, np.array([0.2, 0.8, 0.4]), "kw", threshold=0.5, resamples=200)
    assert result["reply_lexicon_share"] == pytest.approx((0.2 + 0.0 + 0.4) / 3)
    low, high = result["reply_lexicon_share_ci"]
    # resampling the two openers: A alone gives 0.1, B alone 0.4
    assert 0.1 - 1e-12 <= low < result["reply_lexicon_share"] < high <= 0.4 + 1e-12
    assert result["n_replies"] == 3
    with pytest.raises(ValueError, match="got 2 estimates for 3 records"):
        lexicon_share(records, np.array([0.2, 0.8]), "kw", threshold=0.5)


def test_a_runs_lexicon_settings_fall_back_to_the_rewards_defaults():
    assert lexicon_settings({}) == {"reply_lexicon": "scorer", "reply_lexicon_threshold": 0.9, "reply_lexicon_whole_words": False}
    given = {"reply_lexicon": "hell,idiot", "reply_lexicon_whole_words": True, "reply_lexicon_threshold": None}
    expected = {"reply_lexicon": "hell,idiot", "reply_lexicon_threshold": 0.9, "reply_lexicon_whole_words": True}
    assert lexicon_settings(given) == expected


def test_a_conversation_past_the_targets_window_loses_its_oldest_messages_as_the_env_drops_them():
    from conftest import make_llama

    from astrl._compat import render_chats
    from astrl.envs.truncation import fit_chats

    tok = make_tokenizer()
    target = SimpleNamespace(model=make_llama(tok, max_positions=64), tokenizer=tok)
    lexicon = ReplyLexicon(tok, ["hell", "idiot"])
    long = " ".join(["hello how are you today what is the weather like"] * 3)
    records = [_record(0, t, long, f"{long} {t}", f"damn hell you idiot {t}", 0.0) for t in range(3)]
    estimates = reply_estimates(records, target, lexicon, batch=2)  # the whole conversation is past 64 positions
    _, chats = target_chats(records)
    reply = tok(records[2]["response"], add_special_tokens=False)["input_ids"]
    (fitted,) = fit_chats([chats[2]], tok, 64 - len(reply))
    assert len(fitted) < len(chats[2])  # messages were dropped
    prompt = tok(render_chats(tok, [fitted])[0], add_special_tokens=False)["input_ids"]
    (stats,) = teacher_forced_stats(target.model, lexicon, [prompt], [reply], tok.pad_token_id)
    assert estimates[2] == pytest.approx(reply_estimate(lexicon, stats, reply), abs=1e-6)
    assert ((estimates > 0) & (estimates < 1)).all()
