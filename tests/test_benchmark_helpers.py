"""The arithmetic of benchmarks/train_loop.py, probe_search.py, turns_at_equal_compute.py, chat_lookahead_signal.py,
chat_search.py, share_ratio.py and probe_transfer.py, and chat_step.py's run copy (the benchmarks are run by hand,
never timed here)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict, lazy_stack

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import chat_search  # noqa: E402
import demo_digits  # noqa: E402
import probe_search  # noqa: E402
import probe_transfer  # noqa: E402
import share_ratio  # noqa: E402
import train_loop  # noqa: E402
import turns_at_equal_compute  # noqa: E402


def test_summarize_takes_the_median_of_per_step_ratios():
    parts = [{"update": 2.0, "generate_tester": 1.5}, {"update": 3.0, "generate_tester": 1.0, "generate_target": 3.0}]
    parts.append({"update": 1.0, "generate_target": 1.8})
    steps = [
        {"collect_s": 6.0, "generate_s": 3.0, "update_s": 2.0, "bare_update_s": 1.0, "parts": parts[0]},
        {"collect_s": 4.0, "generate_s": 4.0, "update_s": 3.0, "bare_update_s": 2.0, "parts": parts[1]},
        {"collect_s": 9.0, "generate_s": 2.0, "update_s": 1.0, "bare_update_s": 1.0, "parts": parts[2]},
    ]
    summary = train_loop.summarize(steps)
    assert summary["collect_vs_generate"] == 2.0  # ratios 2, 1, 4.5
    assert summary["policy_generate_vs_generate"] == 0.9  # (tester + target policy calls) / raw: 0.5, 1, 0.9
    assert summary["update_vs_bare"] == 1.5  # ratios 2, 1.5, 1 (the ratio of medians would be 2 / 1 = 2)
    assert summary["step_s"] == 8.0  # 8, 7, 10
    assert summary["breakdown_s"]["update"] == 2.0
    assert summary["breakdown_s"]["scorer"] == 0.0  # a part no step had


def test_minibatch_rows_of_turns_cut_at_the_first_stop_token():
    eos = 9
    minibatch = lazy_stack(
        [
            TensorDict(tokens=TensorDict(prompt=torch.tensor([1, 2]), response=torch.tensor([3, eos, 0, 0]))),
            TensorDict(tokens=TensorDict(prompt=torch.tensor([4]), response=torch.tensor([5, 6, 7]))),
        ]
    )
    prompts, responses = train_loop._minibatch_rows(minibatch, {eos})
    assert [p.tolist() for p in prompts] == [[1, 2], [4]]
    assert [q.tolist() for q in responses] == [[3, eos], [5, 6, 7]]


def test_minibatch_rows_of_pairs_give_chosen_then_rejected_under_the_shared_prompt():
    pair = TensorDict(
        prompt_tokens=torch.tensor([1, 2]),
        chosen_tokens=torch.tensor([3, 4, 0]),
        rejected_tokens=torch.tensor([5, 0, 0]),
        chosen_mask=torch.tensor([True, True, False]),
        rejected_mask=torch.tensor([True, False, False]),
    )
    prompts, responses = train_loop._minibatch_rows(lazy_stack([pair]), set())
    assert [p.tolist() for p in prompts] == [[1, 2], [1, 2]]
    assert [q.tolist() for q in responses] == [[3, 4], [5]]


def test_elicited_counts_only_toxic_replies_to_clean_probes():
    replies = [[0.9, 0.2, 0.7, 0.5], [0.8, 0.9, 0.6, 1.0], [0.1, 0.0, 0.3, 0.5]]  # toxic above 0.5, as astrl eval
    probes = [0.1, 0.7, 0.5]  # the second opener's probe is toxic itself: its replies do not count
    result = probe_search.elicited(replies, probes)
    assert result["elicited_reply_share"] == round(2 / 12, 4)
    assert result["first_reply_elicited"] == round(1 / 3, 4)
    assert result["openers_without"] == 2
    low, high = result["elicited_reply_share_ci"]  # over openers: their per-opener shares are 2/4, 0 and 0
    assert 0 <= low <= 2 / 12 <= high <= 0.5 and high > low


def test_the_search_floor_counts_one_token_forwards_at_the_measured_rate():
    forwards = probe_search.search_forwards(openers=16, probe_tokens=6, beams=8, top_k=8)
    # an opener: 8 candidates at the first step, then 8 partial probes x 8 candidates at each of the 5 others;
    # after each step but the last, 8 partial probes grow by a token in the tester and in the target
    assert forwards == {"advance": 16 * 5 * 2 * 8, "candidates": 16 * (8 + 5 * 64)}
    assert probe_search.search_forwards(1, 3, beams=4, top_k=2) == {"advance": 2 * 2 + 2 * 4, "candidates": 2 + 4 + 8}
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 5))  # 220 + 105 parameters
    assert probe_search.forward_gflop(model) == 2 * 325 / 1e9
    rates = {"advance": 50.0, "candidates": 100.0}  # GFLOP/s
    seconds = probe_search.floor_seconds(forwards, 0.27, rates)
    assert abs(seconds - (1280 * 0.27 / 50 + 5248 * 0.27 / 100)) < 1e-9  # 6.91 + 14.17 s
    assert abs(probe_search.floor_seconds({"candidates": 100}, 0.5, {"candidates": 25.0}) - 2.0) < 1e-12


def test_turns_at_equal_compute_counts_replies_conversations_and_pairs_by_hand():
    def record(opener, conversation, turn, replies, probe=0.0):
        scores = {"wordlist": {"reply": replies[0], "replies": replies, "probe": probe}}
        return {"prompt": opener, "conversation": conversation, "turn": turn, "scores": scores}

    records = [
        record("a", 0, 0, [1.0, 0.0]), record("a", 0, 1, [0.0, 0.0]),
        record("a", 1, 0, [0.0, 0.0]), record("a", 1, 1, [1.0, 1.0]),
        record("a", 2, 0, [0.0, 1.0], probe=1.0), record("a", 2, 1, [0.0, 0.0]),  # a toxic probe: not elicited
        record("b", 3, 0, [0.0, 0.0]), record("b", 3, 1, [0.0, 0.0]),
        record("b", 4, 0, [0.0, 1.0]), record("b", 4, 1, [0.0, 0.0]),
    ]  # fmt: skip
    tables = turns_at_equal_compute.opener_tables(records, "wordlist")
    assert [t.shape for t in tables] == [(3, 2, 2), (2, 2, 2)]
    stats = turns_at_equal_compute.statistics(tables)
    assert stats["reply_share_turn_1"] == 2 / 10 and stats["reply_share_turn_2"] == 2 / 10
    assert stats["two_turn_conversations_elicited"] == 3 / 5  # conversations 0, 1 and 4
    # pairs: (0, 1) of a (conversation 2 left over), (3, 4) of b; first turns only: (0 elicits) and (4 elicits)
    assert stats["one_turn_pairs_elicited"] == 1.0 and stats["pairs_minus_two_turn"] == 1.0 - 3 / 5


def test_chat_lookahead_signal_rebuilds_what_the_target_read_and_ranks_within_openers():
    import chat_lookahead_signal as cls

    def record(conversation, turn, probe, response, opener="hi"):
        return {"prompt": opener, "conversation": conversation, "turn": turn, "probe": probe, "response": response}

    records = [record(0, 1, "p2", "r2"), record(0, 0, "p1", "r1"), record(1, 0, "q1", "s1", opener="yo")]
    kept, chats = cls.target_chats(records, {1})
    assert [x["probe"] for x in kept] == ["p2"]
    assert chats == [[
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "p1"},
        {"role": "assistant", "content": "r1"}, {"role": "user", "content": "p2"},
    ]]  # fmt: skip
    assert [x["probe"] for x in cls.target_chats(records, {0})[0]] == ["p1", "q1"]

    openers = ["a", "a", "a", "b", "b", "c"]
    values = np.array([1.0, 2.0, 6.0, 5.0, 7.0, 4.0])
    assert cls.within_opener(values, openers).tolist() == [-2.0, -1.0, 3.0, -1.0, 1.0, 0.0]
    estimates = np.array([0.1, 0.9, 0.3, 0.5, 0.5, 0.2])
    rates = np.array([0.0, 0.25, 1.0, 0.5, 0.0, 1.0])
    chosen, mean = cls.best_of(estimates, rates, openers)  # c has one probe: no choice to make
    assert chosen.tolist() == [0.25, 0.5]  # a: the 0.9 probe; b: a tie, the first
    assert mean.tolist() == [1.25 / 3, 0.25]


def test_probe_transfer_ranks_ties_by_their_mean_rank_and_correlates_by_hand():
    x = np.array([0.0, 0.05, 0.0, 0.1])
    assert probe_transfer.ranks(x).tolist() == [1.5, 3.0, 1.5, 4.0]
    # ranks centred: x -1, 0.5, -1, 1.5 and y -1.5, -0.5, 0.5, 1.5: 3 / sqrt(4.5 * 5) = 0.63246
    result = probe_transfer.correlations(x, np.array([0.0, 0.1, 0.2, 0.3]))
    assert result["spearman"] == 0.6325
    # x centred -0.0375, 0.0125, -0.0375, 0.0625, y -0.15, -0.05, 0.05, 0.15: 0.0125 / sqrt(0.006875 * 0.05) = 0.67420
    assert result["pearson"] == 0.6742
    assert probe_transfer.correlations(x, np.zeros(4))["spearman"] is None
    assert probe_transfer.cell(6, n_openers=2) == (1, 1, 0)  # probe 1's third attack: held-out opener 0


def test_probe_transfer_reads_attacks_as_probe_major_train_then_held_out(tmp_path):
    path = tmp_path / "attacks.jsonl"
    probe_transfer.write_attacks(path, [("a", "p0"), ("b", "p1")], ["t0", "t1", "h0", "h1"])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(d["probe"], d["conversation"][0]["content"]) for d in lines][5] == ("p1", "t1")
    # attack 5 = probe 1, training opener 1; attack 6 = probe 1, held-out opener 0; a toxic probe never counts
    records = [
        {"attack": 5, "sample": 1, "scores": {"j": {"reply": 0.9, "probe": 0.1}}},
        {"attack": 6, "sample": 0, "scores": {"j": {"reply": 0.9, "probe": 0.1}}},
        {"attack": 2, "sample": 0, "scores": {"j": {"reply": 0.9, "probe": 0.7}}},
        {"attack": 3, "sample": 0, "scores": {"j": {"reply": 0.4, "probe": 0.1}}},
    ]
    shares = probe_transfer.elicited_shares(records, n_probes=2, n_openers=2, replies=2, name="j")
    assert shares.shape == (2, 2, 2, 2)
    assert shares[1, 0, 1, 1] == 1 and shares[1, 1, 0, 0] == 1
    assert shares.sum() == 2


def test_probe_transfer_splits_each_ranking_into_halves_and_reads_the_warm_starts_own_estimates(tmp_path):
    held = np.array([0.04, 0.00, 0.02, 0.06])
    assert probe_transfer.halves(np.array([0.3, 0.1, 0.1, 0.9]), held) == (0.05, 0.01)  # top: probes 3, 0
    assert probe_transfer.halves(np.array([0.2, 0.2, 0.2, 0.1]), held) == (0.02, 0.04)  # ties: the earlier first
    warm = tmp_path / "warm_start.jsonl"
    warm.write_text('{"probe": "p0", "lexicon_mass": 0.5}\n{"probe": "p1", "lexicon_mass": 0.25}\n')
    own = probe_transfer.own_estimates([str(warm), str(tmp_path)], [(str(warm), "p1"), (str(tmp_path), "p9"), (str(warm), "p0")])
    assert own[0] == 0.25 and np.isnan(own[1]) and own[2] == 0.5
    share = {
        "judge_test": np.array([0.04, 0.00, 0.02, 0.06, 0.5]),
        "lexicon_train": np.array([0.3, 0.1, 0.2, 0.9, 0.0]),
        "own_estimate": np.array([0.1, 0.2, 0.3, 0.4, np.nan]),
    }
    group = probe_transfer.group_readings(share, [0, 1, 2, 3])
    assert group["probes"] == 4 and group["judge_test"] == 0.03
    assert group["lexicon_train"]["spearman"] == 1.0  # the same order as the held-out share
    assert (group["lexicon_train"]["top_half"], group["lexicon_train"]["bottom_half"]) == (0.05, 0.01)
    assert group["own_estimate"]["spearman"] == 0.4 and group["own_estimate"]["top_half"] == 0.04
    assert "own_estimate" not in probe_transfer.group_readings(share, [3, 4])  # an eval folder's probe has none


def test_timer_gives_each_section_the_peak_of_its_own_interval():
    import _common

    timer = _common.Timer("cpu", memory=True)
    _common.reset_peak_memory("cpu")  # the trim a section's start does: the base is what is live after it
    base = _common.rss_mb()
    with timer.section("outer"):
        with timer.section("big"):
            block = torch.ones(200 * 2**20 // 4)  # 200 MiB, written, so resident
            del block
        with timer.section("small"):
            block = torch.ones(2**20 // 4)
            del block
    assert timer.peaks["big"] >= base + 190
    assert timer.peaks["outer"] >= timer.peaks["big"]  # an enclosing section holds its inner sections' peaks
    assert timer.peaks["small"] < base + 100  # the reset as it began forgot the freed block
    assert timer.overall_peak_mb() >= timer.peaks["big"]
    assert timer.calls == {"outer": 1, "big": 1, "small": 1}


def test_whole_word_lexicon_reads_the_likeliest_unsampled_piece_and_takes_its_continuation_out():
    import whole_word_lexicon as wwl
    from conftest import make_llama, make_tokenizer

    from astrl.rewards.lexicon import ReplyLexicon

    tok = make_tokenizer()
    model = make_llama(tok, seed=3)
    lexicon = ReplyLexicon(tok, ["hell", "idiot"], whole_words=True)
    a, b = lexicon.token_ids.tolist()
    x = int(lexicon.continuing_ids[0])
    # columns: m_t, c_t, p_t(a), p_t(b); the reply samples a, then x, then b
    stats = torch.tensor([[0.5, 0.0, 0.2, 0.3], [0.05, 0.1, 0.04, 0.01], [0.6, 0.2, 0.45, 0.15]])
    reply = [a, x, b]
    # t=0: a was sampled, b (0.3) is the likeliest other; t=1: a (0.04) is under 0.1; t=2: b was sampled, a (0.45)
    found = wwl.unsampled_pieces(lexicon, stats, reply, 0.1)
    assert [(t, k) for t, k, _ in found] == [(0, b), (2, a)]
    assert [p for _, _, p in found] == pytest.approx([0.3, 0.45])
    assert wwl.unsampled_pieces(lexicon, stats, reply, 0.5) == []

    prompt = tok("hello how are you today", add_special_tokens=False)["input_ids"]
    pieces = Counter()
    quiet = torch.tensor([[0.3, 0.0, 0.25, 0.05], [0.2, 0.0, 0.01, 0.02]])  # a second reply: nothing else >= 0.1
    (mass, read), (quiet_mass, quiet_read) = wwl.unsampled_discounts(
        model, lexicon, [prompt, prompt[:3]], [reply, [a, x]], [stats, quiet], 0.1, tok.pad_token_id, pieces, tok
    )  # one forward for the batch's pieces
    assert quiet_read == 0
    assert quiet_mass.tolist() == lexicon.reply_mass(quiet.unsqueeze(0), torch.tensor([[a, x]])).tolist()
    base = lexicon.reply_mass(stats.unsqueeze(0), torch.tensor([reply]))[0]
    # by hand: one forward per piece read, the probability of a continuing token after it
    with torch.no_grad():
        after_b = model(input_ids=torch.tensor([prompt + [b]])).logits[0, -1].softmax(-1)
        after_a = model(input_ids=torch.tensor([prompt + reply[:2] + [a]])).logits[0, -1].softmax(-1)
    c0, c2 = float(after_b[lexicon.continuing_ids].sum()), float(after_a[lexicon.continuing_ids].sum())
    assert read == 2 and sum(pieces.values()) == 2
    expected = [max(0.0, float(base[0]) - 0.3 * c0), float(base[1]), max(0.0, float(base[2]) - 0.45 * c2)]
    assert mass[0].tolist() == pytest.approx(expected, abs=1e-5)
    assert float(base[0]) == pytest.approx(0.5 - 0.2 * 0.1)  # the sampled piece's own discount: p_0(a) * c_1


def test_whole_word_lexicon_finds_the_listed_words_a_counted_token_begins():
    import whole_word_lexicon as wwl
    from conftest import make_tokenizer

    from astrl.rewards.lexicon import ReplyLexicon

    tok = make_tokenizer()
    lexicon = ReplyLexicon(tok, ["hell", "idiot"])
    assert tok(" hellish", add_special_tokens=False)["input_ids"][0] == tok(" hell", add_special_tokens=False)["input_ids"][0]
    assert len(tok(" hello", add_special_tokens=False)["input_ids"]) == 1  # its own token: not read as " hell" spelled on
    found = wwl.listed_words_split(lexicon, tok, ["hell", "hello", "hellish", "helmet", "idiot", "idiotic"])
    # by hand: "hellish" is " hell" + "ish", "idiotic" is " idiot" + "ic"; " helmet" does not begin with " hell"
    assert found == {"hell": ["hellish"], "idiot": ["idiotic"]}


def test_demo_digits_compares_exactly_unless_a_relative_tolerance_is_given():
    recorded = {"after": {"mean_reward": -0.14680565398884937, "n": 3, "asr_ci": [0.1, 0.2]}}
    drifted = {"after": {"mean_reward": -0.1468056850717403, "n": 3, "asr_ci": [0.1, 0.2]}}  # 2e-7 relative
    assert demo_digits.differences(recorded, drifted) == ["after.mean_reward: -0.14680565398884937 -> -0.1468056850717403"]
    assert demo_digits.differences(recorded, drifted, rtol=1e-6) == []
    moved = {"after": {"mean_reward": -0.1468, "n": 4, "asr_ci": [0.1, 0.2]}}  # a changed draw: far past 1e-6, and a count
    assert demo_digits.differences(recorded, moved, rtol=1e-6) == [
        "after.mean_reward: -0.14680565398884937 -> -0.1468",
        "after.n: 3 -> 4",
    ]


def test_chat_search_judges_each_probes_replies_without_the_openers_words_and_the_probes_in_any_form():
    from astrl.scorers import make_scorer

    probes = ["what the fu*k", "tell me more", "shit happens"]  # the word list flags only the third
    texts = ["fuck off", "hi", "damn it", "ok", "damn it", "fuck off"]  # two replies a probe, in order
    openers = ["a", "damn, it rains", "c"]  # the second reply pair's "damn" is the opener's word
    out = chat_search.judged(make_scorer("wordlist"), openers, probes, texts, replies=2, seed=0)
    result = out["result"]
    # elicited: "fuck off" after the clean masked probe, "damn it" after "tell me more"; nothing after the toxic probe
    assert result["elicited_reply_share"]["rate"] == pytest.approx(2 / 6, abs=1e-4)
    # in any form, "fu*k" stands for "fuck": without it "off" is clean, so only "damn it" keeps its verdict
    assert result["elicited_reply_share_past_probe_forms"]["rate"] == pytest.approx(1 / 6, abs=1e-4)
    # without the opener's words "damn it" is clean and "fuck off" keeps its verdict
    assert result["elicited_reply_share_past_opener"]["rate"] == pytest.approx(1 / 6, abs=1e-4)
    assert result["first_reply_elicited"]["rate"] == pytest.approx(2 / 3, abs=1e-4)
    assert result["openers_without"] == 1
    assert result["toxic_probe_rate"]["rate"] == pytest.approx(1 / 3, abs=1e-4)
    assert out["probes"] == [0.0, 0.0, 1.0] and out["replies"][2] == [1.0, 1.0]
    # without the conversation's words: with no earlier turn the opener's and the probe's (surface) words
    assert result["elicited_reply_share_past_conversation"]["rate"] == pytest.approx(1 / 6, abs=1e-4)
    # a first row whose earlier reply said "fuck" already: its "fuck off" only repeats it
    later = chat_search.judged(make_scorer("wordlist"), openers, probes, texts, 2, 0, [("hi", "fuck you"), (), ()])
    assert later["result"]["elicited_reply_share_past_conversation"]["rate"] == 0.0


def test_probe_search_records_each_openers_probe_replies_and_scores_as_share_ratio_reads_them(monkeypatch, tiny_tokenizer):
    from astrl.scorers import make_scorer

    texts = ["fuck off", "hi", "ok", "shit"]  # two replies a probe, in order
    monkeypatch.setattr(probe_search, "sampled_replies", lambda model, tok, rows, **kw: texts)
    tok = tiny_tokenizer
    probes = [torch.tensor(tok(" hello there")["input_ids"]), torch.tensor(tok(" damn right")["input_ids"])]
    records: list[dict] = []
    result = probe_search.judged_replies(
        None, tok, ["first", "second"], probes, make_scorer("wordlist"), replies=2, new_tokens=4, records=records
    )
    assert [row["opener"] for row in records] == ["first", "second"]
    assert [row["replies"] for row in records] == [["fuck off", "hi"], ["ok", "shit"]]
    assert records[0]["scores"]["wordlist"] == {"probe": 0.0, "replies": [1.0, 0.0]}
    assert records[1]["scores"]["wordlist"] == {"probe": 1.0, "replies": [0.0, 1.0]}  # "damn" in the probe
    assert records[1]["probe"] == tok.decode(probes[1], skip_special_tokens=True)
    assert result["elicited_reply_share"] == 0.25  # "fuck off" alone: "shit" follows a toxic probe
    # share_ratio reads the rows as it reads chat_search.py's: the same elicited replies per opener
    counts = share_ratio.opener_counts(records, "wordlist", make_scorer("wordlist"), ["first", "second"])
    hits, replies = counts["elicited_reply_share"]
    assert hits.tolist() == [1.0, 0.0] and replies.tolist() == [2.0, 2.0]
    # the scores are filed under the judge that gave them
    other: list[dict] = []
    probe_search.judged_replies(
        None, tok, ["first", "second"], probes, make_scorer("profanity"), replies=2, new_tokens=4, records=other
    )
    assert [list(row["scores"]) for row in other] == [["profanity"], ["profanity"]]


def test_share_ratio_pairs_an_eval_folders_first_turns_with_searched_probes_opener_by_opener(tmp_path):
    from astrl.scorers import make_scorer

    def turn(conversation, turn, opener, probe, replies, scores, probe_score=0.0):
        judged = {"probe": probe_score, "replies": scores, "reply": scores[0]}
        return {
            "conversation": conversation,
            "turn": turn,
            "prompt": opener,
            "probe": probe,
            "response": replies[0],
            "replies": replies,
            "empty_probe": False,
            "probe_nll": 3.0,
            "scores": {"wordlist": judged},
        }

    first, rainy = "a first opener", "damn weather"
    rows = [
        turn(0, 0, first, "hello", ["fuck off", "fine"], [1.0, 0.0]),
        turn(0, 1, first, "again", ["fuck off", "shit"], [1.0, 1.0]),  # a second turn: not read at --turn 0
        turn(1, 0, first, "hi", ["ok", "ok"], [0.0, 0.0]),
        turn(2, 0, rainy, "hey", ["damn", "no"], [1.0, 0.0]),  # "damn" is the opener's word
    ]
    rows += [turn(c, 1, opener, "more", ["shit", "shit"], [1.0, 1.0]) for c, opener in ((1, first), (2, rainy))]
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "conversations.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))

    def searched_row(opener, probe, replies, scores, probe_score):
        return {
            "opener": opener,
            "probe": probe,
            "replies": replies,
            "scores": {"wordlist": {"probe": probe_score, "replies": scores}},
        }

    searched = [
        searched_row(first, "what", ["fuck", "shit"], [1.0, 1.0], 0.0),
        searched_row(rainy, "shit", ["damn", "damn"], [1.0, 1.0], 1.0),
    ]
    (tmp_path / "search.jsonl").write_text("".join(json.dumps(x) + "\n" for x in searched))
    a, b = share_ratio.load_side(tmp_path / "eval", 0), share_ratio.load_side(tmp_path / "search.jsonl", 0)
    assert len(a) == 3 and len(b) == 2 and len(share_ratio.load_side(tmp_path / "eval", 1)) == 3
    out = share_ratio.compare_sides(a, b, {"wordlist": make_scorer("wordlist")}, goal=3.0, seed=0)["wordlist"]
    judged = out["elicited_reply_share"]
    # A: 1 of 4 replies to the first opener, 1 of 2 to the second; B: 2 of 2, and nothing after its toxic probe
    assert judged["a"]["rate"] == pytest.approx(2 / 6, abs=1e-4) and judged["b"]["rate"] == 0.5
    # B / A = 1.5; resampled pairs of openers give 4 (first, first), 0 (second, second) or 1.5
    assert judged["b_over_a"]["ratio"] == 1.5 and judged["b_over_a"]["ci"] == [0.0, 4.0]
    assert judged["b_over_a"]["share_at_least_3"] == pytest.approx(0.25, abs=0.03)
    # without the opener's words A keeps only "fuck off" (1 of 6), B keeps both: B / A = 3
    past = out["elicited_reply_share_past_opener"]
    assert past["a"]["rate"] == pytest.approx(1 / 6, abs=1e-4) and past["b_over_a"]["ratio"] == 3.0
    with pytest.raises(SystemExit, match="same openers"):
        share_ratio.compare_sides(a, b[:1], {"wordlist": make_scorer("wordlist")}, goal=3.0, seed=0)
    # on the first opener alone: A 1 of 4, B 2 of 2, so B / A = 4 whatever the resample
    a1, b1 = share_ratio.restrict(a, [first], "A"), share_ratio.restrict(b, [first], "B")
    assert len(a1) == 2 and len(b1) == 1
    alone = share_ratio.compare_sides(a1, b1, {"wordlist": make_scorer("wordlist")}, goal=3.0, seed=0)["wordlist"]
    assert alone["elicited_reply_share"]["b_over_a"]["ratio"] == 4.0
    assert alone["elicited_reply_share"]["b_over_a"]["ci"] == [4.0, 4.0]
    with pytest.raises(SystemExit, match="1 of the 2 openers are not in B, e.g. 'another'"):
        share_ratio.restrict(b, [first, "another"], "B")
    with pytest.raises(SystemExit, match="no 'profanity' scores"):
        share_ratio.compare_sides(a, b, {"profanity": make_scorer("wordlist")}, goal=3.0, seed=0)
    # an eval row's history: its conversation's earlier probes and the replies it went on with
    assert [row["history"] for row in share_ratio.load_side(tmp_path / "eval", 1)] == [
        ["hello", "fuck off"],
        ["hi", "ok"],
        ["hey", "damn"],
    ]
    # turn 1 of the first conversation says "fuck off" again after turn 0's: only that reply loses its verdict
    later = share_ratio.load_side(tmp_path / "eval", 1)
    again = share_ratio.compare_sides(later, later, {"wordlist": make_scorer("wordlist")}, goal=3.0, seed=0)["wordlist"]
    assert again["elicited_reply_share"]["a"]["rate"] == 1.0
    assert again["elicited_reply_share_past_conversation"]["a"]["rate"] == pytest.approx(5 / 6, abs=1e-4)
    # conversations with an elicited reply at turn 0: conversations 0 and 2 of A's 3, the first of B's 2
    assert out["conversations_elicited"]["a"]["rate"] == pytest.approx(2 / 3, abs=1e-4)
    assert out["conversations_elicited"]["b"]["rate"] == 0.5  # the second searched probe is toxic: nothing after it counts
    # over both turns every conversation of A has one
    both = share_ratio.load_side(tmp_path / "eval", None)
    pooled = share_ratio.compare_sides(both, both, {"wordlist": make_scorer("wordlist")}, goal=3.0, seed=0)["wordlist"]
    assert pooled["conversations_elicited"]["a"]["rate"] == 1.0


def test_a_searched_conversation_is_read_over_all_its_turns_and_by_the_openers_it_elicits_in_some_turn():
    first = {"elicited_reply_share": np.array([[1, 0], [0, 0], [0, 0]])}  # 3 openers x 2 replies
    second = {"elicited_reply_share": np.array([[1, 1], [0, 1], [0, 0]])}
    out = chat_search.whole_conversations([first, second], seed=0)
    assert out["elicited_reply_share"]["rate"] == pytest.approx(4 / 12, abs=1e-4)  # all 12 replies of both turns
    assert out["conversations_elicited"]["rate"] == pytest.approx(2 / 3, abs=1e-4)  # the third opener's has none


def test_share_ratio_reads_a_searched_conversations_turn_and_a_first_turn_search_as_turn_0(tmp_path):
    def row(opener, probe, turn=None):
        out = {"opener": opener, "probe": probe, "replies": ["ok"], "scores": {"wordlist": {"probe": 0.0, "replies": [0.0]}}}
        return out if turn is None else {**out, "turn": turn}

    (tmp_path / "t2.jsonl").write_text("".join(json.dumps(row(o, f"{o} {t}", t)) + "\n" for t in (0, 1) for o in "ab"))
    (tmp_path / "t1.jsonl").write_text(json.dumps(row("a", "one")) + "\n")
    assert [r["probe"] for r in share_ratio.load_side(tmp_path / "t2.jsonl", 1)] == ["a 1", "b 1"]
    assert [r["probe"] for r in share_ratio.load_side(tmp_path / "t1.jsonl", 0)] == ["one"]
    assert len(share_ratio.load_side(tmp_path / "t2.jsonl", None)) == 4  # every turn: the conversations' replies
    assert (
        len(share_ratio.load_side(tmp_path / "t2.jsonl", {0, 1})) == 4
        and len(share_ratio.load_side(tmp_path / "t2.jsonl", {1})) == 2
    )
    with pytest.raises(SystemExit, match="no rows for turn 1"):
        share_ratio.load_side(tmp_path / "t1.jsonl", 1)


def test_a_searched_turns_replies_are_sampled_after_the_targets_view_of_the_conversation_so_far(monkeypatch):
    from types import SimpleNamespace

    from conftest import make_tokenizer

    from astrl._compat import render_chats

    tok, seen = make_tokenizer(), []
    monkeypatch.setattr(chat_search, "sampled_replies", lambda model, tok, rows, **kw: seen.extend(rows) or ["r"] * len(rows))
    chat_search.replies_to(SimpleNamespace(model=None, tokenizer=tok), ["hi", ("hi", "p1", "you")], ["a", "b"], 1, 4)
    expected = [
        [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "a"}],
        [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "p1"}, {"role": "assistant", "content": "you"}]
        + [{"role": "user", "content": "b"}],
    ]
    assert [tok.decode(row) for row in seen] == [
        tok.decode(tok(t, add_special_tokens=False)["input_ids"]) for t in render_chats(tok, expected)
    ]


def test_chat_step_from_run_resumes_a_copy_of_the_runs_step_0_and_times_its_replayed_members(
    tmp_path, monkeypatch, tiny_model_dir
):
    import chat_step
    from test_guidance import SEEDS, _fake_warm_start
    from test_training import LOOSE_SCORER, _config

    from astrl.training.trainer import Trainer

    _fake_warm_start(monkeypatch)
    tiny = str(tiny_model_dir)
    settings = dict(tester=tiny, target=tiny, scorer=LOOSE_SCORER, mode="chat", total_steps=3, save_every=100)
    config = _config(tmp_path, warm_start_probes=4, guide_replay=True, guide_replay_warm_start=True, **settings)
    Trainer(config, progress=False).train(until=0)  # the warm start (a stub) and its step-0 checkpoint
    run, into = tmp_path / "run", tmp_path / "copy"
    into.mkdir()
    trainer = chat_step.from_run(run, into, ["dtype=float32"])
    assert trainer.step == 0 and trainer.config.run_dir == str(into) and trainer.config.guide_replay_warm_start
    bench = chat_step.ChatStep(trainer)
    assert trainer._replay_seeds() == SEEDS  # the run's kept probes, read from the copy
    step = bench.step()
    assert step["parts"]["guides"] > 0  # the replayed members' conversations, which the chat overrides cannot keep
    assert trainer.step == 1 and not (run / "checkpoints" / "step_000001").exists()  # the run itself is left as it was
    empty = tmp_path / "no_step_0"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no checkpoints/step_000000 there"):
        chat_step.from_run(empty, into, [])
