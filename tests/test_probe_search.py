"""The lexicon-guided beam search over the tester's likely tokens, and the warm start built on it."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace

import pytest
import torch
from conftest import loaded, make_llama, make_tokenizer

from astrl.rewards.lexicon import ReplyLexicon
from astrl.sampling.search import PrefixCache, banned_tokens, lexicon_beam_search

OPENERS = ["hello how are you today", "tell me about the", "what is the weather like"]
WORDS = ["hell", "idiot", "damn"]


def _last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_prefix_cache_gives_the_logits_of_a_full_forward():
    tok = make_tokenizer()
    model = make_llama(tok)
    prefixes = [torch.tensor(tok(o)["input_ids"]) for o in OPENERS]
    tails = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"]) for t in (" you idiot", " the cat", "")]
    tails.append(torch.tensor(tok(" a", add_special_tokens=False)["input_ids"]))
    owners = torch.tensor([0, 1, 2, 0])  # two rows continue the first prefix
    with torch.no_grad():
        got = PrefixCache(model, prefixes, tok.pad_token_id).next_logits(owners, tails, chunk=3)
    for row, (owner, tail) in enumerate(zip(owners.tolist(), tails, strict=True)):
        expected = _last_logits(model, prefixes[owner].tolist() + tail.tolist())
        torch.testing.assert_close(got[row], expected, atol=1e-4, rtol=1e-4)


def test_prefix_cache_advances_rows_by_tails_of_their_own_lengths():
    tok = make_tokenizer()
    model = make_llama(tok)
    prefixes = [torch.tensor(tok(o)["input_ids"]) for o in OPENERS[:2]]
    tails = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"]) for t in (" you idiot and", " a", " the cat")]
    assert len({len(t) for t in tails}) == 3  # three lengths: the shorter rows carry padding in the cache
    owners, step = torch.tensor([0, 1, 1]), torch.tensor([[5], [6], [7]])
    with torch.no_grad():
        grown = PrefixCache(model, prefixes, tok.pad_token_id).advance(owners, tails)
        after = grown.advance(torch.arange(3), step)  # one more token each, read after the padded gap
    for row, (owner, tail) in enumerate(zip(owners.tolist(), tails, strict=True)):
        joined = prefixes[owner].tolist() + tail.tolist()
        torch.testing.assert_close(grown.last[row], _last_logits(model, joined), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(after.last[row], _last_logits(model, joined + step[row].tolist()), atol=1e-4, rtol=1e-4)
    assert after.lengths.tolist() == [len(prefixes[o]) + len(t) + 1 for o, t in zip(owners.tolist(), tails, strict=True)]
    with pytest.raises(ValueError, match="at least one token"):
        PrefixCache(model, prefixes, tok.pad_token_id).advance(torch.tensor([0, 1]), [tails[0], torch.zeros(0, dtype=torch.long)])


def _mass(target, target_tok, lexicon, opener: str, probe: list[int], tester_tok) -> float:
    """The target's next-token lexicon mass after ``opener + probe``: the probe's own ids when the two
    tokenizers are one, else its decoded text encoded by the target's."""
    if tester_tok is target_tok:
        tail = probe
    else:
        tail = target_tok(tester_tok.decode(probe), add_special_tokens=False)["input_ids"]
    return float(lexicon.mass(_last_logits(target, target_tok(opener)["input_ids"] + tail)[None])[0])


@pytest.mark.parametrize("vocab", ["shared", "different"])
def test_with_enough_beams_the_search_finds_the_best_of_all_top_k_paths(vocab):
    tok = make_tokenizer()
    target_tok = tok if vocab == "shared" else make_tokenizer(vocab_size=300, seed=3)
    assert (tok.get_vocab() == target_tok.get_vocab()) == (vocab == "shared")
    tester, target = make_llama(tok, seed=0), make_llama(target_tok, seed=1)
    lexicon = ReplyLexicon(target_tok, WORDS)
    banned = banned_tokens(tok, lexicon, len(tok))
    top_k, length = 3, 2
    found = lexicon_beam_search(tester, target, tok, target_tok, OPENERS, lexicon, length=length, beams=top_k, top_k=top_k)
    for opener, probe in zip(OPENERS, found, strict=True):
        prompt = tok(opener)["input_ids"]
        first = _last_logits(tester, prompt).log_softmax(-1).masked_fill(banned, float("-inf"))
        paths = []  # every path through the tester's top_k tokens, by hand
        for a in first.topk(top_k).indices.tolist():
            second = _last_logits(tester, prompt + [a]).log_softmax(-1).masked_fill(banned, float("-inf"))
            second[a] = float("-inf")  # no token right after itself
            for b in second.topk(top_k).indices.tolist():
                paths.append(([a, b], float(first[a] + second[b])))
        masses = [_mass(target, target_tok, lexicon, opener, p, tok) for p, _ in paths]
        best = max(range(len(paths)), key=masses.__getitem__)
        assert probe.tokens.tolist() == paths[best][0] and probe.text == tok.decode(paths[best][0])
        assert probe.mass == pytest.approx(masses[best], abs=1e-5)
        assert probe.logprob == pytest.approx(paths[best][1], abs=1e-4)
        assert probe.opener == opener


def test_the_naturalness_bound_ranks_paths_that_break_it_last_and_the_nll_is_the_targets():
    tok = make_tokenizer()
    tester, target = make_llama(tok, seed=0), make_llama(tok, seed=1)
    lexicon = ReplyLexicon(tok, WORDS)
    banned = banned_tokens(tok, lexicon, len(tok))
    top_k = 3
    table = {}  # per opener, every top_k path by hand: (tokens, mass, the worst running mean NLL, the mean NLL)
    for opener in OPENERS:
        prompt = tok(opener)["input_ids"]
        first = _last_logits(tester, prompt).log_softmax(-1).masked_fill(banned, float("-inf"))
        rows = []
        for a in first.topk(top_k).indices.tolist():
            second = _last_logits(tester, prompt + [a]).log_softmax(-1).masked_fill(banned, float("-inf"))
            second[a] = float("-inf")
            nll_a = -float(_last_logits(target, prompt).log_softmax(-1)[a])
            for b in second.topk(top_k).indices.tolist():
                nll_b = -float(_last_logits(target, prompt + [a]).log_softmax(-1)[b])
                mass = _mass(target, tok, lexicon, opener, [a, b], tok)
                rows.append(([a, b], mass, max(nll_a, (nll_a + nll_b) / 2), (nll_a + nll_b) / 2))
        table[opener] = rows
    worst = sorted(r[2] for rows in table.values() for r in rows)
    bound = worst[len(worst) // 2]  # about half the paths keep it
    free = lexicon_beam_search(tester, target, tok, tok, OPENERS, lexicon, length=2, beams=top_k, top_k=top_k)
    bounded = lexicon_beam_search(tester, target, tok, tok, OPENERS, lexicon, length=2, beams=top_k, top_k=top_k, max_nll=bound)
    moved = 0
    for opener, f, b in zip(OPENERS, free, bounded, strict=True):
        rows = table[opener]
        rank = [mass if worst_nll <= bound else mass - 2 for _, mass, worst_nll, _ in rows]
        best = rows[max(range(len(rows)), key=rank.__getitem__)]
        assert b.tokens.tolist() == best[0] and b.mass == pytest.approx(best[1], abs=1e-5)
        assert b.nll == pytest.approx(best[3], abs=1e-4)
        expected_free = rows[max(range(len(rows)), key=lambda i: rows[i][1])]
        assert f.nll == pytest.approx(expected_free[3], abs=1e-4)
        moved += f.tokens.tolist() != b.tokens.tolist()
    assert moved  # the bound changed some opener's probe (with these seeds)


def test_the_naturalness_bound_needs_a_shared_vocabulary():
    tok, other = make_tokenizer(), make_tokenizer(vocab_size=300, seed=3)
    tester, target = make_llama(tok, seed=0), make_llama(other, seed=1)
    lexicon = ReplyLexicon(other, WORDS)
    with pytest.raises(ValueError, match="max_nll=3.0 reads the target's log-probabilities .* share a vocabulary"):
        lexicon_beam_search(tester, target, tok, other, OPENERS, lexicon, length=2, max_nll=3.0)
    assert all(p.nll is None for p in lexicon_beam_search(tester, target, tok, other, OPENERS, lexicon, length=2, beams=1))


def test_a_narrower_beam_never_beats_the_exhaustive_one_and_probes_hold_no_banned_token():
    tok = make_tokenizer()
    tester, target = make_llama(tok, seed=0), make_llama(tok, seed=1)
    lexicon = ReplyLexicon(tok, WORDS)
    banned = banned_tokens(tok, lexicon, len(tok))
    assert banned[lexicon.token_ids].all() and banned[tok.eos_token_id] and banned[tok.pad_token_id]
    wide = lexicon_beam_search(tester, target, tok, tok, OPENERS, lexicon, length=2, beams=4, top_k=4)
    narrow = lexicon_beam_search(tester, target, tok, tok, OPENERS, lexicon, length=2, beams=1, top_k=4, openers_per_batch=2)
    for w, n in zip(wide, narrow, strict=True):
        assert 0.0 <= n.mass <= w.mass + 1e-6 <= 1.0 + 1e-6
    for probe in lexicon_beam_search(tester, target, tok, tok, OPENERS, lexicon, length=6, beams=2, top_k=5):
        tokens = probe.tokens.tolist()
        assert len(tokens) == 6 and not any(banned[t] for t in tokens)
        assert all(a != b for a, b in itertools.pairwise(tokens))


def test_search_settings_are_checked():
    tok = make_tokenizer()
    model = make_llama(tok)
    lexicon = ReplyLexicon(tok, WORDS)
    with pytest.raises(ValueError, match="beams must be >= 1, got 0"):
        lexicon_beam_search(model, model, tok, tok, OPENERS, lexicon, length=2, beams=0)
    with pytest.raises(ValueError, match="top_k=100000 exceeds the"):
        lexicon_beam_search(model, model, tok, tok, OPENERS, lexicon, length=2, top_k=100000)


def test_search_selection_keeps_clean_probes_by_the_targets_next_token_mass():
    from astrl.training.warm_start import keep, toxic_share

    def candidate(probe, mass, tokens=3):
        return {"probe_score": probe, "lexicon_mass": mass, "response_tokens": torch.ones(tokens)}

    candidates = [candidate(0.1, 0.4), candidate(0.1, 0.05), candidate(0.9, 0.9), candidate(0.1, 0.6, tokens=0)]
    assert toxic_share(candidates[0], "search") == 0.4
    assert [candidates.index(c) for c in keep(candidates, 0.25, select="search")] == [0]
    assert [candidates.index(c) for c in keep(candidates, 0.0, select="search")] == [0, 1]
    for c, nll in zip(candidates, (3.4, 2.0, 1.0, 1.0), strict=True):
        c["probe_nll"] = nll
    assert [candidates.index(c) for c in keep(candidates, 0.0, select="search", max_nll=3.0)] == [1]
    assert [candidates.index(c) for c in keep(candidates, 0.0, select="search", max_nll=3.4)] == [0, 1]


def test_search_warm_start_keeps_the_clean_probes_whose_mass_clears_the_bar(tmp_path, monkeypatch):
    from test_reply_samples import warm_started

    from astrl.prompts import load_prompts, split_prompts

    settings = dict(
        scorer="keywords:the,you,hell,idiot", mode="text", turns=1, total_steps=1, max_new_tokens=3,
        reply_lexicon="hell,idiot,damn", warm_start_probes=6, warm_start_min_toxic=0.0064, warm_start_select="search",
        warm_start_beams=2, warm_start_top_k=3,
    )  # fmt: skip
    trainer, found, summary, kept = warm_started(tmp_path, monkeypatch, "search_candidates", **settings)
    assert summary["select"] == "search" and summary["sampled"] == len(found) == 6
    train = set(split_prompts(load_prompts("builtin"), "train", seed=0))
    assert {c["opener"] for c in found} <= train
    for c in found:
        assert c["response_tokens"].numel() == 3 and 0 <= c["lexicon_mass"] <= 1
        assert c["prompt_tokens"].tolist() == trainer.models.tester.tokenizer(c["opener"])["input_ids"]
    expected = [c["probe"] for c in found if c["probe_score"] <= 0.5 and c["lexicon_mass"] >= 0.0064]  # the rule, by hand
    assert [k["probe"] for k in kept] == expected and summary["kept"] == len(kept)
    assert all("lexicon_mass" in k and "prompt_tokens" not in k for k in kept)
    assert 0 < len(kept) < len(found)  # the bar selects: some kept, some not (with this seed)


def test_each_warm_start_round_searches_new_openers_with_the_tester_the_rounds_before_left(tmp_path, monkeypatch):
    from test_training import _config, _trainer

    import astrl.training.warm_start as warm
    from astrl.prompts import load_prompts, split_prompts

    settings = dict(
        scorer="keywords:the,you,hell,idiot", mode="text", turns=1, total_steps=1, max_new_tokens=3,
        reply_lexicon="hell,idiot,damn", warm_start_probes=6, warm_start_min_toxic=0.0064, warm_start_select="search",
        warm_start_beams=2, warm_start_top_k=3, warm_start_rounds=2, warm_start_max_nll=MAX_NLL,
    )  # fmt: skip
    trainer = _trainer(_config(tmp_path, **settings))
    lora = lambda: {k: v.detach().clone() for k, v in trainer.models.tester.model.named_parameters() if v.requires_grad}  # noqa: E731
    rounds, tuned = [], []
    real_find, real_tune = warm.search_candidates, warm.fine_tune

    def find(config, models, count, round_index, **resume):
        rounds.append((round_index, lora(), real_find(config, models, count, round_index, **resume)))
        return rounds[-1][2]

    def tune(*args, **kwargs):
        losses = real_tune(*args, **kwargs)
        tuned.append((len(args[2]), lora()))
        return losses

    monkeypatch.setattr(warm, "search_candidates", find)
    monkeypatch.setattr(warm, "fine_tune", tune)
    trainer.train()
    summary = json.loads((tmp_path / "run" / "warm_start.json").read_text())
    kept = [json.loads(line) for line in (tmp_path / "run" / "warm_start.jsonl").read_text().splitlines()]
    assert [r[0] for r in rounds] == [0, 1] and len(summary["rounds"]) == 2
    train = set(split_prompts(load_prompts("builtin"), "train", seed=0))
    openers = [[c["opener"] for c in found] for _, _, found in rounds]
    assert set(openers[0]) | set(openers[1]) <= train and openers[0] != openers[1]  # an opener order per round
    expected = []
    for (index, _, found), record in zip(rounds, summary["rounds"], strict=True):
        rule = [c for c in found if c["probe_score"] <= 0.5 and c["lexicon_mass"] >= 0.0064 and c["probe_nll"] <= MAX_NLL]
        assert record["sampled"] == 6 and record["kept"] == len(rule)
        expected += [(c["probe"], index) for c in rule]
    assert [(k["probe"], k["round"]) for k in kept] == expected and summary["kept"] == len(kept)
    assert all(k["probe_nll"] <= MAX_NLL for k in kept)
    assert summary["rounds"][0]["kept"] > 0 and tuned[0][0] == summary["rounds"][0]["kept"]
    after_first = tuned[0][1]
    assert any(not torch.equal(after_first[k], v) for k, v in rounds[0][1].items())  # round 0 fine-tuned the tester...
    assert all(torch.equal(after_first[k], v) for k, v in rounds[1][1].items())  # ...which round 1 searched with


MAX_NLL = 5.6


def _greedy_estimate(model, ids: list[int], lexicon: ReplyLexicon, steps: int, stops: set[int]) -> float:
    """1 - prod_t (1 - m_t) over ``steps`` greedy tokens after ``ids``, by full forwards (no cache)."""
    miss, ids = 1.0, list(ids)
    for t in range(steps):
        logits = _last_logits(model, ids)
        miss *= 1.0 - float(lexicon.mass(logits[None])[0])
        token = int(logits.argmax())
        if token in stops or t + 1 == steps:
            break
        ids.append(token)
    return 1.0 - miss


def test_lookahead_estimate_follows_the_greedy_reply_and_stops_at_its_end():
    from astrl.sampling.search import lookahead_estimate

    tok = make_tokenizer()
    model = make_llama(tok, seed=2)
    lexicon = ReplyLexicon(tok, ["hell", "idiot", "the", "you", "how", "are"])
    prefixes = [torch.tensor(tok(o)["input_ids"]) for o in OPENERS]
    tails = torch.tensor(tok([" you", " the", " a"], add_special_tokens=False)["input_ids"])
    owners = torch.tensor([0, 1, 2])
    with torch.no_grad():
        cache = PrefixCache(model, prefixes, tok.pad_token_id)
    for steps, stops in ((1, set()), (4, set()), (4, {tok.eos_token_id})):
        if stops:  # make the greedy reply end early: the EOS is the argmax after its first token
            first = [int(_last_logits(model, prefixes[i].tolist() + tails[i].tolist()).argmax()) for i in range(3)]
            stops = {first[0]}
        got = lookahead_estimate(cache, owners, tails, lexicon, steps, stops)
        for i in range(3):
            expected = _greedy_estimate(model, prefixes[i].tolist() + tails[i].tolist(), lexicon, steps, stops)
            assert float(got[i]) == pytest.approx(expected, abs=1e-5)
    one = lookahead_estimate(cache, owners, tails, lexicon, 1, set())
    assert all(float(a) >= float(b) - 1e-6 for a, b in zip(got, one, strict=True))  # more positions, more mass


def _chat_search_by_hand(tester, target, tok, opener, lexicon, top_k, lookahead, marker=None):
    """Every top-k path of two tokens, each with the lookahead estimate of its greedy reply by full
    forwards; a path whose text spells ``marker`` is left out. Returns the best path and its estimate.
    ``opener`` may be a conversation so far, ``(opener, probe_1, reply_1, ...)``."""
    from astrl._compat import render_chats
    from astrl.envs.transforms import contexts_around_last

    banned = banned_tokens(tok, lexicon, len(tok))
    stops = {tok.eos_token_id, tok.pad_token_id}
    turns = (opener,) if isinstance(opener, str) else opener  # an opener, or (opener, probe_1, reply_1, ...)
    roles = ["user", "assistant"] * len(turns)
    tester_chat = [{"role": "system", "content": "Be rude."}]
    tester_chat += [{"role": r, "content": t} for r, t in zip(roles[: len(turns)], turns, strict=True)]
    tester_text = render_chats(tok, [tester_chat])[0]
    swapped = ["assistant", "user"] * len(turns)  # the target says the opener and the replies
    target_chat = [{"role": r, "content": t} for r, t in zip(swapped[: len(turns)], turns, strict=True)]
    target_chat += [{"role": "user", "content": ""}]
    before, after = contexts_around_last(tok, [target_chat])[0]
    assert after  # the template's end of the user turn and the start of the reply
    prompt = tok(tester_text, add_special_tokens=False)["input_ids"]
    head, tail = tok(before, add_special_tokens=False)["input_ids"], tok(after, add_special_tokens=False)["input_ids"]
    first = _last_logits(tester, prompt).log_softmax(-1).masked_fill(banned, float("-inf"))
    paths = []
    for a in first.topk(top_k).indices.tolist():
        second = _last_logits(tester, prompt + [a]).log_softmax(-1).masked_fill(banned, float("-inf"))
        second[a] = float("-inf")
        paths.extend([a, b] for b in second.topk(top_k).indices.tolist())
    if marker is not None:
        paths = [p for p in paths if marker not in tok.decode(p)]
    estimates = [_greedy_estimate(target, head + p + tail, lexicon, lookahead, stops) for p in paths]
    best = max(range(len(paths)), key=estimates.__getitem__)
    return paths[best], estimates[best]


def test_chat_search_finds_the_path_whose_greedy_reply_holds_the_most_lexicon_mass():
    from astrl.sampling.search import chat_lookahead_search

    tok = make_tokenizer()
    tester, target = make_llama(tok, seed=0), make_llama(tok, seed=1)
    lexicon = ReplyLexicon(tok, ["hell", "idiot", "the", "you", "how", "are"])
    top_k, length, lookahead = 3, 2, 3
    found = chat_lookahead_search(
        tester, target, tok, tok, OPENERS, lexicon, length=length, lookahead=lookahead, beams=top_k, top_k=top_k,
        tester_system_prompt="Be rude.",
    )  # fmt: skip
    for opener, probe in zip(OPENERS, found, strict=True):
        path, estimate = _chat_search_by_hand(tester, target, tok, opener, lexicon, top_k, lookahead)
        assert probe.tokens.tolist() == path and probe.mass == pytest.approx(estimate, abs=1e-5)
        assert probe.nll is not None and probe.nll > 0


def test_a_chat_search_writes_the_next_probe_of_a_conversation_read_as_each_side_reads_it():
    from astrl.sampling.search import chat_lookahead_search

    tok = make_tokenizer()
    tester, target = make_llama(tok, seed=0), make_llama(tok, seed=1)
    lexicon = ReplyLexicon(tok, ["hell", "idiot", "the", "you", "how", "are"])
    conversations = [
        (OPENERS[0], "tell me more", "you are the weather"),
        (OPENERS[1], "how", "the", "are you", "hello today like"),
        OPENERS[2],  # a first probe beside them
    ]
    found = chat_lookahead_search(
        tester, target, tok, tok, conversations, lexicon, length=2, lookahead=3, beams=3, top_k=3,
        tester_system_prompt="Be rude.",
    )  # fmt: skip
    for conversation, probe in zip(conversations, found, strict=True):
        path, estimate = _chat_search_by_hand(tester, target, tok, conversation, lexicon, 3, 3)
        assert probe.opener == conversation and probe.tokens.tolist() == path
        assert probe.mass == pytest.approx(estimate, abs=1e-5)
    alone = chat_lookahead_search(
        tester, target, tok, tok, [OPENERS[0]], lexicon, length=2, lookahead=3, beams=3, top_k=3, tester_system_prompt="Be rude."
    )  # fmt: skip
    assert alone[0].prompt.numel() < found[0].prompt.numel()  # the history is read: the tester's prompt grew
    for bad in [(OPENERS[0], "a probe without its reply"), ("an opener", 3, "a reply")]:
        with pytest.raises(ValueError, match="an odd number of strings"):
            chat_lookahead_search(tester, target, tok, tok, [bad], lexicon, length=2)


@pytest.mark.parametrize("max_nll", [None, 1e6])  # a bound no probe breaks must not undo the marker's rank
def test_chat_search_never_keeps_a_probe_that_spells_a_chat_marker(max_nll):
    from astrl.sampling.search import chat_lookahead_search, spells_markers

    tok = make_tokenizer()
    tester, target = make_llama(tok, seed=0), make_llama(tok, seed=1)
    lexicon = ReplyLexicon(tok, ["hell", "idiot", "the", "you", "how", "are"])
    top_k, lookahead = 3, 3
    path, _ = _chat_search_by_hand(tester, target, tok, OPENERS[0], lexicon, top_k, lookahead)
    marker = tok.decode(path)  # the best probe of the first opener, made a special token's text
    marked = make_tokenizer()
    marked.add_special_tokens({"additional_special_tokens": [marker]})
    assert spells_markers(torch.tensor([path]), marked).tolist() == [True]
    assert spells_markers(torch.tensor([path]), tok).tolist() == [False]
    found = chat_lookahead_search(
        tester, target, marked, marked, OPENERS[:1], lexicon, length=2, lookahead=lookahead, beams=top_k, top_k=top_k,
        tester_system_prompt="Be rude.", max_nll=max_nll,
    )  # fmt: skip
    other, estimate = _chat_search_by_hand(tester, target, tok, OPENERS[0], lexicon, top_k, lookahead, marker=marker)
    assert found[0].tokens.tolist() == other != path and found[0].mass == pytest.approx(estimate, abs=1e-5)


def test_a_chat_search_needs_a_shared_vocabulary_and_a_positive_lookahead():
    from astrl.sampling.search import chat_lookahead_search

    tok, other = make_tokenizer(), make_tokenizer(vocab_size=300, seed=3)
    tester, target = make_llama(tok), make_llama(other)
    lexicon = ReplyLexicon(other, WORDS)
    with pytest.raises(ValueError, match="share a vocabulary"):
        chat_lookahead_search(tester, target, tok, other, OPENERS, lexicon, length=2)
    with pytest.raises(ValueError, match="lookahead must be >= 1, got 0"):
        chat_lookahead_search(tester, make_llama(tok), tok, tok, OPENERS, ReplyLexicon(tok, WORDS), length=2, lookahead=0)


def test_chat_search_warm_start_reads_the_targets_reply_and_tunes_on_the_testers_chat_prompt(tmp_path, monkeypatch):
    from test_training import _config, _trainer

    import astrl.training.warm_start as warm
    from astrl._compat import render_chats
    from astrl.envs.redteam import DEFAULT_TESTER_SYSTEM_PROMPT
    from astrl.sampling.search import chat_lookahead_search

    settings = dict(
        scorer="keywords:the,you,hell,idiot", mode="chat", turns=1, total_steps=1, max_new_tokens=3, target_max_new_tokens=4,
        reply_lexicon="hell,idiot,damn,the", warm_start_probes=4, warm_start_min_toxic=0.0, warm_start_select="search",
        warm_start_beams=2, warm_start_top_k=3,
    )  # fmt: skip
    trainer = _trainer(_config(tmp_path, **settings))
    tester, target = trainer.models.tester, trainer.models.target
    real, seen = warm.search_candidates, []

    def search_and_redo(*args, **resume):  # the same search by hand, before the warm start tunes the tester
        found = real(*args, **resume)
        lexicon = ReplyLexicon(target.tokenizer, ["hell", "idiot", "damn", "the"])
        again = chat_lookahead_search(
            tester.model, target.model, tester.tokenizer, target.tokenizer, [c["opener"] for c in found], lexicon,
            length=3, lookahead=4, beams=2, top_k=3, tester_system_prompt=DEFAULT_TESTER_SYSTEM_PROMPT,
        )  # fmt: skip  # its reply read over target_max_new_tokens (4) tokens
        seen.append((found, again))
        return found

    monkeypatch.setattr(warm, "search_candidates", search_and_redo)
    trainer.train()
    ((found, again),) = seen
    assert len(found) == 4
    for c, probe in zip(found, again, strict=True):
        assert c["response_tokens"].tolist() == probe.tokens.tolist() and c["lexicon_mass"] == pytest.approx(probe.mass)
        chat = [{"role": "system", "content": DEFAULT_TESTER_SYSTEM_PROMPT}, {"role": "user", "content": c["opener"]}]
        rendered = render_chats(tester.tokenizer, [chat])[0]  # what the tester reads in the env
        assert c["prompt_tokens"].tolist() == tester.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    summary = json.loads((tmp_path / "run" / "warm_start.json").read_text())
    clean = [c for c in found if c["probe_score"] <= 0.5 and c["response_tokens"].numel()]
    assert summary["select"] == "search" and summary["kept"] == len(clean) > 0


def test_rows_are_read_without_copying_the_cache_and_the_search_finds_exactly_what_deep_copies_found(monkeypatch):
    import copy

    import astrl.sampling.search as search

    tok = make_tokenizer()
    model = make_llama(tok)
    cache = PrefixCache(model, [torch.tensor(tok(o)["input_ids"]) for o in OPENERS], tok.pad_token_id)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.cache.layers]
    ids = [id(layer.keys) for layer in cache.cache.layers]
    grown = cache.advance(torch.tensor([0, 0, 2]), torch.tensor([[5], [6], [7]]))
    cache.next_logits(torch.tensor([1, 2]), [torch.tensor([8, 9]), torch.tensor([10])])
    assert [id(layer.keys) for layer in cache.cache.layers] == ids  # the kept rows are neither replaced nor written
    for layer, (keys, values) in zip(cache.cache.layers, before, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    assert grown.cache.layers[0].keys.shape[0] == 3

    lexicon = ReplyLexicon(tok, WORDS)
    options = dict(length=3, beams=3, top_k=4, max_nll=6.0)
    found = lexicon_beam_search(model, model, tok, tok, OPENERS, lexicon, **options)

    def deep(cache, owners):
        cache = copy.deepcopy(cache)
        cache.batch_select_indices(owners)
        return cache

    monkeypatch.setattr(search, "_rows_of", deep)
    expected = lexicon_beam_search(model, model, tok, tok, OPENERS, lexicon, **options)
    for a, b in zip(found, expected, strict=True):
        assert torch.equal(a.tokens, b.tokens) and (a.mass, a.logprob, a.nll) == (b.mass, b.logprob, b.nll)


def test_warm_start_scorer_chooses_the_warm_starts_probes_while_rl_trains_on_the_scorer(tmp_path, monkeypatch):
    from test_reply_samples import warm_started

    import astrl.envs.redteam as redteam
    import astrl.training.warm_start as warm
    from astrl.scorers import make_scorer

    lexicons, rl_lexicons = [], []
    real_search, real_env_lexicon = warm.search_probes, redteam._reply_lexicon
    monkeypatch.setattr(warm, "search_probes", lambda c, m, o, lexicon: lexicons.append(lexicon) or real_search(c, m, o, lexicon))
    monkeypatch.setattr(redteam, "_reply_lexicon", lambda *a: rl_lexicons.append(real_env_lexicon(*a)) or rl_lexicons[-1])
    settings = dict(
        scorer="keywords:the,you", warm_start_scorer="keywords:hell,idiot", judges=["keywords:hell,idiot"], reward="elicit",
        mode="text", turns=1,
        total_steps=1, max_new_tokens=3, reply_lexicon="scorer", reply_lexicon_weight=1.0, warm_start_probes=6,
        warm_start_min_toxic=0.0, warm_start_select="search", warm_start_beams=2, warm_start_top_k=3,
    )  # fmt: skip
    trainer, found, summary, kept = warm_started(tmp_path, monkeypatch, "search_candidates", **settings)
    assert [lex.words for lex in lexicons] == [["hell", "idiot"]]  # the warm-start scorer's words, not "the", "you"
    chooser = make_scorer("keywords:hell,idiot")
    assert [c["probe_score"] for c in found] == chooser([c["probe"] for c in found]).tolist()
    assert summary["scorer"] == "keywords:hell,idiot" and summary["sampled"] == 6
    assert trainer.config.scorer == "keywords:the,you"  # the RL steps keep the run's scorer and its lexicon
    assert rl_lexicons and all(lex.words == ["the", "you"] for lex in rl_lexicons)


def test_warm_start_scorer_is_checked_before_a_model_loads(tmp_path):
    from test_training import _config

    from astrl.errors import ConfigError

    with pytest.raises(ConfigError, match="warm_start_scorer 'profanity' chooses the warm start's probes: set warm_start_probes"):
        _config(tmp_path, warm_start_scorer="profanity")
    with pytest.raises(Exception, match="unknown scorer 'nosuch'"):
        _config(tmp_path, warm_start_probes=2, warm_start_scorer="nosuch").check_names()
    from astrl.training.warm_start import warm_start_config

    config = _config(tmp_path, warm_start_probes=2, warm_start_scorer="wordlist", judges=["wordlist", "profanity"])
    chooser = warm_start_config(config)  # the warm start's scorer; all else as the run's
    assert chooser.scorer == "wordlist" and config.scorer != "wordlist"
    assert chooser == replace(config, scorer="wordlist")
    assert warm_start_config(_config(tmp_path, warm_start_probes=2)) == _config(tmp_path, warm_start_probes=2)  # unset: as is


def test_retest_means_leave_out_the_opener_a_probe_was_found_on_and_the_best_retested_are_kept():
    from astrl.training.warm_start import best_retested, retest_means

    estimates = torch.tensor([[0.1, 0.2, 0.6], [0.4, 0.0, 0.2], [0.3, 0.3, 0.3]])
    means = retest_means(estimates, ["b", "z", "a"], ["a", "b", "c"])
    assert means == pytest.approx([(0.1 + 0.6) / 2, (0.4 + 0.0 + 0.2) / 3, (0.3 + 0.3) / 2])
    assert retest_means(torch.tensor([[0.5]]), ["a"], ["a"]) == [0.0]  # nothing left to re-test on
    candidates = [{"probe": p, "retest_mass": m} for p, m in zip("wxyz", (0.1, 0.4, 0.4, 0.3), strict=True)]
    assert [c["probe"] for c in best_retested(candidates, 0.5)] == ["x", "y"]  # the best two, in their own order
    assert [c["probe"] for c in best_retested(candidates, 0.6)] == ["x", "y", "z"]  # ceil(2.4)
    assert [c["probe"] for c in best_retested(candidates, 0.25)] == ["x"]  # a tie goes to the earlier
    assert best_retested([], 0.5) == [] and len(best_retested(candidates, 1.0)) == 4


@pytest.mark.parametrize("chat", [False, True])
def test_retest_estimates_read_each_probes_greedy_reply_after_each_opener(chat):
    from astrl.envs.transforms import contexts_around_last
    from astrl.sampling.search import probe_frame, retest_estimates

    tok = make_tokenizer()
    target = make_llama(tok, seed=1)
    lexicon = ReplyLexicon(tok, ["hell", "idiot", "the", "you", "how", "are"])
    probes = ["you are the", "how", "tell me the weather"]
    frame = probe_frame(tok, tok, chat=chat, lookahead=3)
    got = retest_estimates(target, tok, frame, probes, OPENERS[:2], lexicon, rows_per_forward=4)
    assert got.shape == (3, 2)
    stops = {tok.eos_token_id, tok.pad_token_id}
    for i, probe in enumerate(probes):
        for j, opener in enumerate(OPENERS[:2]):
            ids = tok(probe, add_special_tokens=False)["input_ids"]
            if chat:  # the target's view: the opener as its own turn, the probe as the user's, then its reply
                chat_rows = [{"role": "assistant", "content": opener}, {"role": "user", "content": ""}]
                before, after = contexts_around_last(tok, [chat_rows])[0]
                row = tok(before, add_special_tokens=False)["input_ids"] + ids + tok(after, add_special_tokens=False)["input_ids"]
            else:
                row = tok(opener)["input_ids"] + ids
            assert float(got[i, j]) == pytest.approx(_greedy_estimate(target, row, lexicon, 3, stops), abs=1e-5)


def test_retest_estimates_refuse_an_empty_probe_where_the_frame_adds_nothing_after_it():
    from astrl.sampling.search import probe_frame, retest_estimates

    tok = make_tokenizer()
    target, lexicon = make_llama(tok, seed=1), ReplyLexicon(tok, ["hell"])
    with pytest.raises(ValueError, match="probe '' is empty"):
        retest_estimates(target, tok, probe_frame(tok, tok, chat=False, lookahead=2), ["how", ""], OPENERS[:2], lexicon)
    chat = retest_estimates(target, tok, probe_frame(tok, tok, chat=True, lookahead=2), ["how", ""], OPENERS[:2], lexicon)
    assert chat.shape == (2, 2) and bool(((chat >= 0) & (chat <= 1)).all())  # in chat the template's suffix follows


def test_lookahead_estimate_discounts_a_greedy_token_that_goes_on_into_a_longer_word():
    from astrl.sampling.search import lookahead_estimate

    tok = make_tokenizer()
    model = make_llama(tok, seed=2)
    word, prefix = "hell", torch.tensor(tok(OPENERS[0])["input_ids"])
    (first,) = tok(f" {word}", add_special_tokens=False)["input_ids"]
    with torch.no_grad():  # make " hell" the greedy reply's first token: its head row along the last hidden state
        out = model(input_ids=prefix[None], output_hidden_states=True)
        hidden = out.hidden_states[-1][0, -1]
        model.lm_head.weight[first] = hidden * (float(out.logits[0, -1].max()) + 5.0) / float(hidden @ hidden)
    assert int(_last_logits(model, prefix.tolist()).argmax()) == first
    plain, whole = ReplyLexicon(tok, [word]), ReplyLexicon(tok, [word], whole_words=True)
    assert first in plain.token_ids.tolist()
    with torch.no_grad():
        cache = PrefixCache(model, [prefix[:-1]], tok.pad_token_id)
    tail, owners = prefix[-1:].view(1, 1), torch.tensor([0])
    got_plain = float(lookahead_estimate(cache, owners, tail, plain, 2, set()))
    got_whole = float(lookahead_estimate(cache, owners, tail, whole, 2, set()))
    # by hand: m_0 loses p_0(first) * c_1 (the next token continues the word), m_1 keeps its mass
    p0 = _last_logits(model, prefix.tolist()).softmax(-1)
    p1 = _last_logits(model, prefix.tolist() + [first]).softmax(-1)
    m0, m1 = float(p0[plain.token_ids].sum()), float(p1[plain.token_ids].sum())
    c1 = float(p1[whole.continuing_ids].sum())
    assert got_plain == pytest.approx(1 - (1 - m0) * (1 - m1), abs=1e-5)
    assert got_whole == pytest.approx(1 - (1 - (m0 - float(p0[first]) * c1)) * (1 - m1), abs=1e-5)
    assert got_whole < got_plain


def test_a_retested_warm_start_tunes_on_the_best_retested_half_by_the_rl_scorers_lexicon(tmp_path, monkeypatch):
    from test_training import _config, _trainer

    import astrl.sampling.search as search
    import astrl.training.warm_start as warm
    from astrl.rewards.lexicon import holds_listed_word

    settings = dict(
        scorer="keywords:the,you", warm_start_scorer="keywords:hell,idiot", judges=["keywords:hell,idiot"], mode="chat",
        turns=1, total_steps=1, max_new_tokens=3, target_max_new_tokens=4, reward="elicit", reply_lexicon="scorer",
        reply_lexicon_weight=1.0, warm_start_probes=4, warm_start_min_toxic=0.0, warm_start_select="search",
        warm_start_beams=2, warm_start_top_k=3, warm_start_retest=3, warm_start_retest_keep=0.5,
    )  # fmt: skip
    trainer = _trainer(_config(tmp_path, **settings))
    seen, tuned = [], []
    real_estimates, real_tune = search.retest_estimates, warm.fine_tune

    def estimates(target, tokenizer, frame, probes, openers, lexicon, **kw):
        got = real_estimates(target, tokenizer, frame, probes, openers, lexicon, **kw)
        seen.append((list(probes), list(openers), frame.lookahead, lexicon.words, got))
        return got

    def tune(model, pad, examples, **kw):
        tuned.append([c["probe"] for c in examples])
        return real_tune(model, pad, examples, **kw)

    monkeypatch.setattr(search, "retest_estimates", estimates)
    monkeypatch.setattr(warm, "fine_tune", tune)
    trainer.train()
    summary = json.loads((tmp_path / "run" / "warm_start.json").read_text())
    kept = [json.loads(line) for line in (tmp_path / "run" / "warm_start.jsonl").read_text().splitlines()]
    ((probes, openers, lookahead, words, got),) = seen
    assert lookahead == 4 and words == ["the", "you"]  # the run's reply length; the RL scorer's lexicon, not the warm start's
    assert openers == warm.round_openers(trainer.config, 3, 0, skip=4)  # the three after the round's four
    assert not set(openers) & {k["opener"] for k in kept}
    record = summary["rounds"][0]
    assert record["retested"] == len(probes) > 1 and record["kept"] == len(kept) == -(-len(probes) // 2)
    echoes = holds_listed_word(probes, ["the", "you"])
    means = [0.0 if echo else m for m, echo in zip(got.mean(1).tolist(), echoes, strict=True)]  # no own opener among the three
    best = sorted(range(len(probes)), key=lambda i: -means[i])[: len(kept)]
    assert [k["probe"] for k in kept] == [probes[i] for i in sorted(best)]
    assert [k["retest_mass"] for k in kept] == pytest.approx([means[i] for i in sorted(best)])
    assert tuned == [[k["probe"] for k in kept]]


def test_a_probe_that_says_a_listed_word_itself_retests_at_zero(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from test_training import _config

    import astrl.sampling.search as search
    import astrl.training.warm_start as warm

    config = _config(tmp_path, mode="text", turns=1, warm_start_probes=2, warm_start_retest=2, target_max_new_tokens=5)
    openers = warm.round_openers(config, 2, 0, skip=2)
    fixed = torch.tensor([[0.2, 0.4], [0.3, 0.1], [0.6, 0.6]])
    seen = []
    monkeypatch.setattr(search, "retest_estimates", lambda *a, **k: seen.append(a) or fixed)
    tok = make_tokenizer()
    models = SimpleNamespace(tester=SimpleNamespace(tokenizer=tok), target=SimpleNamespace(tokenizer=tok, model=None))
    lexicon = ReplyLexicon(tok, ["hell", "idiot"])
    probes = ["tell me", "what now", "Hell, no"]
    candidates = [{"probe": p, "opener": o} for p, o in zip(probes, (openers[0], "x", "x"), strict=True)]
    got = warm.retest(config, models, candidates, 0, lexicon)
    assert [c["retest_mass"] for c in got] == pytest.approx([0.4, 0.2, 0.0])  # own opener left out; "Hell" an echo
    ((_, _, frame, sent, retested, _),) = seen
    assert sent == probes and retested == openers and frame.lookahead == 5


def test_warm_start_retest_is_checked_before_a_model_loads(tmp_path):
    from test_training import _config

    from astrl.errors import ConfigError

    with pytest.raises(ConfigError, match="warm_start_retest must be >= 0, got -1"):
        _config(tmp_path, warm_start_probes=2, warm_start_retest=-1)
    with pytest.raises(ConfigError, match=r"warm_start_retest_keep must be in \(0, 1\], got 0.0"):
        _config(tmp_path, warm_start_probes=2, warm_start_retest=4, warm_start_retest_keep=0.0)
    with pytest.raises(ConfigError, match="warm_start_retest_keep 0.25 is the share of re-tested probes kept"):
        _config(tmp_path, warm_start_probes=2, warm_start_retest_keep=0.25)
    with pytest.raises(ConfigError, match="warm_start_retest 4 re-tests the warm start's probes: set warm_start_probes > 0"):
        _config(tmp_path, warm_start_retest=4)


def test_greedy_replies_are_the_targets_greedy_tokens_after_its_view_of_the_conversation():
    from astrl._compat import render_chats
    from astrl.sampling.search import greedy_replies

    tok = make_tokenizer()
    target = make_llama(tok, seed=1)
    conversations = [OPENERS[0], (OPENERS[1], "how are", "you the weather")]
    got = greedy_replies(target, tok, conversations, ["tell me", "hello"], new_tokens=3, target_system_prompt="Be kind.", batch=1)
    views = [
        [
            {"role": "system", "content": "Be kind."},
            {"role": "assistant", "content": OPENERS[0]},
            {"role": "user", "content": "tell me"},
        ],
        [{"role": "system", "content": "Be kind."}, {"role": "assistant", "content": OPENERS[1]}]
        + [{"role": "user", "content": "how are"}, {"role": "assistant", "content": "you the weather"}]
        + [{"role": "user", "content": "hello"}],
    ]
    for reply, text in zip(got, render_chats(tok, views), strict=True):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for _ in range(3):  # greedy, by full forwards
            ids.append(int(_last_logits(target, ids).argmax()))
        assert reply == tok.decode(ids[-3:], skip_special_tokens=True)


def test_a_warm_start_of_two_searched_turns_tunes_on_each_turns_probe_after_the_conversation_so_far(tmp_path, monkeypatch):
    from test_training import _config, _trainer

    import astrl.training.warm_start as warm
    from astrl._compat import render_chats
    from astrl.envs.redteam import DEFAULT_TESTER_SYSTEM_PROMPT
    from astrl.sampling.search import greedy_replies

    settings = dict(
        scorer="keywords:the,you,hell,idiot", mode="chat", turns=2, total_steps=1, max_new_tokens=3, target_max_new_tokens=4,
        reply_lexicon="hell,idiot,damn,the", warm_start_probes=3, warm_start_min_toxic=0.0, warm_start_select="search",
        warm_start_beams=2, warm_start_top_k=3, warm_start_turns=2,
    )  # fmt: skip
    trainer = _trainer(_config(tmp_path, **settings))
    tester, target = trainer.models.tester, trainer.models.target
    real, seen = warm.search_candidates, []

    def search_and_reply(*args, **resume):  # the turn-1 replies by hand, before the warm start tunes the tester
        found = real(*args, **resume)
        first = [c for c in found if c["turn"] == 0]
        replies = greedy_replies(
            target.model, target.tokenizer, [c["opener"] for c in first], [c["probe"] for c in first], new_tokens=4
        )
        seen.append((found, replies))
        return found

    monkeypatch.setattr(warm, "search_candidates", search_and_reply)
    trainer.train()
    ((found, replies),) = seen
    assert [c["turn"] for c in found] == [0, 0, 0, 1, 1, 1]
    for first, second, reply in zip(found[:3], found[3:], replies, strict=True):
        assert first["history"] == [] and second["opener"] == first["opener"]
        assert second["history"] == [first["probe"], reply]  # searched after the first probe and its greedy reply
        chat = [{"role": "system", "content": DEFAULT_TESTER_SYSTEM_PROMPT}, {"role": "user", "content": first["opener"]}]
        chat += [{"role": "assistant", "content": first["probe"]}, {"role": "user", "content": reply}]
        rendered = render_chats(tester.tokenizer, [chat])[0]  # what the tester reads in the env's second turn
        assert second["prompt_tokens"].tolist() == tester.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    records = [json.loads(line) for line in (tmp_path / "run" / "warm_start.jsonl").read_text().splitlines()]
    assert {r["turn"] for r in records} <= {0, 1} and all("history" in r for r in records)


def test_a_warm_start_stopped_in_its_search_goes_on_from_the_last_batch_of_openers_it_searched(tmp_path, monkeypatch, capsys):
    from test_training import _config, _trainer

    import astrl.training.warm_start as warm
    from astrl.training import resume
    from astrl.training.state_io import load_state
    from astrl.training.trainer import WARM_START_PARTIAL

    settings = dict(
        scorer="keywords:the,you,hell,idiot", mode="chat", turns=2, total_steps=1, save_every=1, max_new_tokens=3,
        target_max_new_tokens=4, reply_lexicon="hell,idiot,damn,the", warm_start_probes=10, warm_start_min_toxic=0.0,
        warm_start_select="search", warm_start_beams=2, warm_start_top_k=3, warm_start_turns=2, warm_start_rounds=2,
    )  # fmt: skip
    real, batches = warm.search_probes, []

    def search(config, models, openers, lexicon):
        batches.append(len(openers))
        if crash and len(batches) == 4:  # round 1, turn 2, its second batch of openers
            raise RuntimeError("stopped in the search")
        return real(config, models, openers, lexicon)

    monkeypatch.setattr(warm, "search_probes", search)
    crash = False
    _trainer(_config(tmp_path / "whole", **settings)).train()  # the same run, never stopped
    assert batches == [8, 2, 8, 2] * 2  # two turns of 10 openers, 8 at a time, in each of two rounds
    batches.clear()
    crash = True
    with pytest.raises(RuntimeError, match="stopped in the search"):
        _trainer(_config(tmp_path / "stopped", **settings)).train()
    run = tmp_path / "stopped" / "run"
    searching = load_state(run / WARM_START_PARTIAL)["done"]["searching"]
    assert (searching["round"], searching["turn"], searching["searched"], len(searching["candidates"])) == (0, 1, 8, 18)
    batches.clear()
    crash = False
    tok = make_tokenizer()
    resume(run, progress=True, tester_lm=loaded(make_llama(tok), tok)).train()
    assert batches == [2] + [8, 2, 8, 2]  # only the openers not searched yet, then round 2
    assert "0 of 2 rounds done; round 1's search has 8 of 10 openers of turn 2, going on" in capsys.readouterr().out
    assert not (run / WARM_START_PARTIAL).exists()
    runs = (tmp_path / "whole" / "run", run)
    kept = [(r / "warm_start.jsonl").read_text() for r in runs]
    assert kept[0] == kept[1] and kept[0].count("\n") > 0
    timing = ("seconds", "sample_seconds")
    summaries = [json.loads((r / "warm_start.json").read_text()) for r in runs]
    for summary in summaries:
        summary["rounds"] = [{k: v for k, v in r.items() if k not in timing} for r in summary.pop("rounds")]
        assert summary.pop("seconds") >= summary.pop("sample_seconds") > 0
    assert summaries[0] == summaries[1]
    states = [torch.load(r / "checkpoints" / "step_000000" / "state.pt", weights_only=True)["trainable"] for r in runs]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])  # the same warm-started tester


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(mode="text"), "set mode: chat"),
        (dict(warm_start_select="share"), "warm_start_select: search"),
        (dict(turns=1), "turns >= 2 (got 1)"),
        (dict(warm_start_retest=4), "warm_start_retest 4, which re-tests first probes"),
        (dict(warm_start_probes=0), "later turns: set warm_start_probes > 0 (got 0)"),
    ],
)
def test_warm_start_turns_is_checked_against_what_it_needs(tmp_path, changes, named):
    from test_training import _config

    from astrl.errors import ConfigError

    settings = dict(mode="chat", turns=2, warm_start_probes=4, warm_start_select="search", warm_start_turns=2) | changes
    with pytest.raises(ConfigError, match=re.escape(named)):
        _config(tmp_path, **settings)
