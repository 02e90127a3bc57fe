"""Guided GRPO: the forcing processor, the forced first turn, guided members in GRPO groups (searched and replayed)."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import make_llama, make_tokenizer
from tensordict import TensorDict
from test_training import LOOSE_SCORER, _config, _run_twice, _trainer

from astrl._compat import as_list
from astrl.keys import NEXT, QUERY, REWARD, STEP_COUNT, TOKENS_RESPONSE
from astrl.training.config import ConfigError, load_config
from astrl.training.guidance import (
    ForceTokens,
    ReplayArchive,
    ReplayGuide,
    first_turns,
    forced_first_turn,
    group_openers,
)


def test_force_tokens_allows_only_the_given_token_of_each_forced_row():
    scores = torch.randn(3, 10)
    force = ForceTokens([torch.tensor([2, 5]), None, torch.tensor([7])])
    first = force(torch.zeros(3, 4, dtype=torch.long), scores.clone())
    assert first[0].argmax() == 2 and first[0, 2] == 0 and torch.isinf(first[0]).sum() == 9
    assert torch.equal(first[1], scores[1])  # a free row keeps its scores
    assert first[2].argmax() == 7 and torch.isinf(first[2]).sum() == 9
    second = force(torch.zeros(3, 5, dtype=torch.long), scores.clone())
    assert second[0].argmax() == 5 and torch.isinf(second[0]).sum() == 9
    assert torch.equal(second[2], scores[2])  # past its forced tokens a row samples freely
    with pytest.raises(ValueError, match="forced tokens for 3 rows, but generate runs 2"):
        force(torch.zeros(2, 6, dtype=torch.long), torch.randn(2, 10))


def test_forced_first_turn_samples_the_given_tokens_once_and_restores_generate():
    tok = make_tokenizer()
    model = make_llama(tok)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    forced = torch.tensor([11, 12, 13, 14])
    with forced_first_turn(model, [forced, None]):
        assert "generate" in vars(model)
        torch.manual_seed(0)
        out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=True, pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        again = model.generate(input_ids=ids, max_new_tokens=4, do_sample=True, pad_token_id=tok.pad_token_id)
    assert out[0, 3:].tolist() == forced.tolist()
    torch.manual_seed(0)
    free = model.generate(input_ids=ids, max_new_tokens=4, do_sample=True, pad_token_id=tok.pad_token_id)
    assert torch.equal(again, free)  # the second call inside the block sampled as the model does alone
    assert torch.equal(out[1], free[1])  # the free row of the first call too
    assert "generate" not in vars(model)


def test_group_openers_are_the_first_turns_of_every_groups_first_conversation():
    from tensordict import TensorDict

    data = TensorDict({"query": ["a", "a", "a", "a", "b", "b", "b", "b"], STEP_COUNT: torch.tensor([0, 1, 0, 1] * 2)}, [8])
    assert group_openers(data, 2) == ["a", "b"]
    with pytest.raises(ValueError, match="4 conversations do not form groups of 3"):
        group_openers(data, 3)


GUIDED = dict(guide_search=True, reward="elicit", reply_lexicon_weight=1.0, reply_lexicon="scorer", warm_start_beams=2)
GUIDED.update(warm_start_top_k=3, warm_start_reply_tokens=2)


@pytest.mark.parametrize("mode", ["text", "chat"])
def test_guided_groups_gain_a_conversation_that_opens_with_the_searched_probe(tmp_path, monkeypatch, mode):
    from astrl.training.warm_start import search_probes

    config = _config(tmp_path, mode=mode, prompts_per_step=2, group_size=3, turns=2, **GUIDED)
    trainer = _trainer(config)
    trainer._build()
    algorithm = trainer.algorithm
    (guide,) = algorithm.guides
    rollout = guide.rollout
    seen = {}

    def spied(data):
        openers = group_openers(data, config.group_size)
        seen["expected"] = search_probes(config, trainer.models, openers, guide.lexicon)  # the tester as it is now
        seen["guided"] = rollout(data)
        seen["openers"] = openers
        return seen["guided"]

    monkeypatch.setattr(guide, "rollout", spied)
    batch, data = algorithm.collect()
    guided = seen["guided"]
    first = guided[STEP_COUNT].reshape(-1) == 0
    assert as_list(guided["query"])[::2] == seen["openers"] and int(first.sum()) == 2  # one per group, whole
    responses = [r for r, f in zip(guided.get(TOKENS_RESPONSE, as_list=True), first.tolist(), strict=True) if f]
    for response, searched in zip(responses, seen["expected"], strict=True):
        assert response[: len(searched.tokens)].tolist() == searched.tokens.tolist()
    assert data.shape[0] == 2 * 3 * 2 and batch.shape[0] == 2 * 4 * 2  # the raw rollout holds the sampled turns only
    advantage = batch["advantage"].reshape(-1)
    torch.testing.assert_close(advantage, algorithm.advantages(data, guided))
    openers = as_list(data["query"]) + as_list(guided["query"])
    turns = torch.cat([data[STEP_COUNT].reshape(-1), guided[STEP_COUNT].reshape(-1)])
    for opener in set(openers):
        for t in (0, 1):
            cell = (turns == t) & torch.tensor([o == opener for o in openers])
            assert int(cell.sum()) == 4 and advantage[cell].sum().abs() < 1e-5  # G + 1 members a cell
    masses = [f.mass for f in seen["expected"]]
    metrics = algorithm.step_metrics()
    assert metrics["guide_mass"] == pytest.approx(sum(masses) / len(masses), abs=1e-6)
    assert metrics["guide_reward"] == pytest.approx(float(guided[NEXT, REWARD].float().mean()), abs=1e-6)
    row = trainer.train_step()  # a whole step trains on the guided members too
    assert "guide_reward" in row and torch.isfinite(torch.tensor(row["loss"]))


def test_guide_search_is_checked_before_a_model_loads():
    base = ["reward=elicit", "reply_lexicon_weight=1", "guide_search=true"]
    with pytest.raises(ConfigError, match="guide_search adds members to GRPO groups: set algorithm: grpo, got 'ppo'"):
        load_config(None, [*base, "algorithm=ppo"])
    with pytest.raises(ConfigError, match="guide_search searches for the elicit reward's reply lexicon"):
        load_config(None, ["guide_search=true"])
    with pytest.raises(ConfigError, match="set novelty_ngram and novelty_embedding to 0"):
        load_config(None, [*base, "novelty_ngram=0.3"])
    with pytest.raises(ConfigError, match="set collector: local, backend and target_backend: transformers"):
        load_config(None, [*base, "backend=vllm"])
    assert load_config(None, base).guide_search is True


# -- replay-guided GRPO ----------------------------------------------------------------------------------
def test_replay_archive_scores_shrink_each_probes_mean_toward_the_mean_of_all_tests():
    archive = ReplayArchive()
    archive.add([([1, 2], "x", 1.0), ([3], "y", 0.0), ([1, 2], "z", 0.5)])
    # mu = (1 + 0 + 0.5) / 3 = 0.5; A = (1 + 0.5 + 0.5) / (2 + 1); B = (0 + 0.5) / (1 + 1)
    assert archive.scores() == {(1, 2): pytest.approx(2 / 3), (3,): pytest.approx(0.25)}
    assert archive.probes[(1, 2)] == {"total": 1.5, "tests": 2, "openers": ["x", "z"]}
    # one lucky test ranks a probe once: C's single 1.2 is shrunk below A's two tests' 0.75 mean
    archive.add([([4], "w", 1.2)])  # mu = 2.7 / 4 = 0.675; C = (1.2 + 0.675) / 2 = 0.9375; A = (1.5 + 0.675) / 3 = 0.725
    assert archive.scores()[(4,)] == pytest.approx(0.9375) and archive.scores()[(1, 2)] == pytest.approx(0.725)
    archive.add([([4], "x", -0.6)])  # its re-test fails: mu = 2.1 / 5 = 0.42; C = (0.6 + 0.42) / 3 = 0.34 < A = 0.64
    assert archive.scores()[(4,)] == pytest.approx(0.34) and archive.scores()[(1, 2)] == pytest.approx(0.64)


def test_replay_archive_chooses_the_best_probe_new_to_each_opener_and_distinct_within_a_step():
    archive = ReplayArchive()
    archive.add([([1, 2], "x", 1.0), ([3], "y", 0.0), ([1, 2], "z", 0.5)])  # A 0.667 > B 0.25
    # x: A was tested on x, so B; y: B is taken, A is new to y
    assert archive.choose(["x", "y"]) == [(3,), (1, 2)]
    assert archive.choose(["w"]) == [(1, 2)]  # the best, new to w
    assert archive.choose(["x", "z", "q"]) == [(3,), (1, 2), (1, 2)]  # z: only A is free; q: none free, the best
    with pytest.raises(RuntimeError, match="holds no probe yet"):
        ReplayArchive().choose(["x"])


def test_seeded_probes_are_replayed_untested_first_in_kept_order_then_ranked_by_their_tests():
    archive = ReplayArchive()
    archive.add([([1, 2], "x", 1.0), ([3], "y", 0.0)])  # mu = 0.5; A = (1 + 0.5) / 2 = 0.75, B = (0 + 0.5) / 2 = 0.25
    archive.seed([(7,), (1, 2), (8, 9)])  # A is kept already: it keeps its tests
    assert archive.probes[(1, 2)]["tests"] == 1 and archive.untested() == 2
    assert archive.scores()[(7,)] == pytest.approx(0.5)  # no test: the mean of all tests, mu
    # untested first, in the order seeded, before A's better score; then the ranked ones
    assert archive.choose(["x", "y", "z"]) == [(7,), (8, 9), (1, 2)]
    archive.add([([7], "x", -1.0), ([8, 9], "y", 2.0)])  # mu = 2 / 4 = 0.5: C = (-1 + 0.5) / 2, D = (2 + 0.5) / 2
    assert archive.untested() == 0
    assert archive.scores()[(7,)] == pytest.approx(-0.25) and archive.scores()[(8, 9)] == pytest.approx(1.25)
    assert archive.choose(["x", "y", "z"]) == [(8, 9), (1, 2), (3,)]  # x: D is new to x; y: D is taken, A new to y


def test_seeded_texts_are_cut_as_the_testers_own_probes_end():
    tok = make_tokenizer()
    eos = tok.eos_token_id
    guide = ReplayGuide.__new__(ReplayGuide)  # seed() reads only the tokenizer, max_new_tokens, stops and archive
    guide.models = SimpleNamespace(tester=SimpleNamespace(tokenizer=tok))
    guide.config, guide.stops, guide.archive = SimpleNamespace(max_new_tokens=4), {eos}, ReplayArchive()
    texts = ["you idiot", "the cat sat on the mat and then", "you<|im_end|> idiot", "<|im_end|> idiot", "idiot<|im_end|>"]
    short, long, stopped, _, ended = (tok(t, add_special_tokens=False)["input_ids"] for t in texts)
    assert len(short) < 4 < len(long) and stopped[1] == eos and ended[-1] == eos and len(ended) < 4
    guide.seed(texts)
    # an EOS added; cut at 4 tokens; cut just after the first EOS; the empty probe left out; an EOS already there kept
    assert list(guide.archive.probes) == [(*short, eos), tuple(long[:4]), tuple(stopped[:2]), tuple(ended)]
    assert guide.archive.untested() == 4


def test_an_upper_confidence_bonus_retests_a_probe_seen_once_before_one_pinned_just_above_it():
    rows = [([1], "x", 1.0)] * 8 + [([2], "y", 0.0)]  # A: 8 tests of 1.0; B: one test of 0.0
    # mu = 8 / 9; s = sqrt(8 / 9 - mu^2) = sqrt(8) / 9; A = (8 + mu) / 9 = 80 / 81, B = mu / 2 = 4 / 9
    plain, bold = ReplayArchive(), ReplayArchive(bonus=4.0)
    for archive in (plain, bold):
        archive.add(rows)
    assert bold.spread() == pytest.approx(8**0.5 / 9) and bold.scores() == plain.scores()
    assert plain.bounds() == plain.scores()  # bonus 0: the rank is the score
    width = 4.0 * 8**0.5 / 9  # c * s = 1.2571
    assert bold.bounds() == {(1,): pytest.approx(80 / 81 + width / 3), (2,): pytest.approx(4 / 9 + width / 2**0.5)}
    # c = 4: B's bound 1.3333 stays below A's 1.4067; c = 8 puts B first (2.2222 against 1.8257)
    assert bold.choose(["z"]) == [(1,)]
    assert ReplayArchive(bonus=8.0).spread() == 0.0  # no test yet
    wide = ReplayArchive(bonus=8.0)
    wide.add(rows)
    assert wide.choose(["z"]) == [(2,)] and plain.choose(["z"]) == [(1,)]
    # the spread's sums survive a checkpoint; a state saved before the bonus existed reads a spread of 0
    again = ReplayArchive(bonus=8.0)
    again.load_state_dict(wide.state_dict())
    assert again.bounds() == wide.bounds()
    again.load_state_dict({k: v for k, v in wide.state_dict().items() if k != "total_sq"})
    assert again.spread() == 0.0 and again.choose(["z"]) == [(1,)]


def test_replay_archive_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    archive = ReplayArchive()
    archive.add([([1, 2], "x", 1.0), ([3], "y", -0.25)])
    torch.save({"replay": archive.state_dict()}, tmp_path / "state.pt")
    again = ReplayArchive()
    again.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True)["replay"])
    assert again.probes == archive.probes and (again.total, again.tests) == (0.75, 2)
    assert again.scores() == archive.scores()


def test_first_turns_are_each_conversations_first_probe_cut_after_its_first_stop():
    from tensordict import TensorDict

    responses = [torch.tensor([5, 9, 7]), torch.tensor([6, 6]), torch.tensor([8, 2, 9, 9]), torch.tensor([3])]
    data = TensorDict({"query": ["a", "a", "b", "b"], STEP_COUNT: torch.tensor([0, 1, 0, 1])}, [4])
    data.set(TOKENS_RESPONSE, torch.nested.nested_tensor(responses, layout=torch.jagged))
    rows = first_turns(data, torch.tensor([0.5, 1.0, -0.5, 2.0]), stops=torch.tensor([9]))
    assert rows == [([5, 9], "a", 0.5), ([8, 2, 9], "b", -0.5)]


REPLAYED = dict(guide_replay=True, scorer=LOOSE_SCORER)


@pytest.mark.parametrize("mode", ["text", "chat"])
def test_replayed_groups_gain_a_conversation_that_opens_with_the_best_past_probe(tmp_path, mode):
    config = _config(tmp_path, mode=mode, prompts_per_step=2, group_size=3, turns=2, guide_replay_bonus=0.5, **REPLAYED)
    trainer = _trainer(config)
    trainer._build()
    algorithm = trainer.algorithm
    (guide,) = algorithm.guides
    assert guide.archive.bonus == 0.5
    batch, data = algorithm.collect()
    # every sampled first probe of the step and every replayed one was counted as a test
    sampled = first_turns(data, algorithm.returns(data), algorithm.stops)
    assert guide.archive.tests == len(sampled) + 2
    chosen = guide._chosen
    assert len(chosen) == 2 and len(set(chosen)) == 2  # one per group, distinct
    openers = group_openers(data, config.group_size)
    expected = ReplayArchive(0.5)  # the wiring: the step's sampled first turns, added and chosen from (the rule is tested above)
    expected.add(sampled)
    assert chosen == expected.choose(openers)
    # the batch: G sampled members, then the replayed member of each group; its first turns are the chosen probes
    assert data.shape[0] == 2 * 3 * 2 and batch.shape[0] == 2 * 4 * 2
    responses = batch.get(TOKENS_RESPONSE, as_list=True)[data.shape[0] :]
    firsts = [r.tolist() for r in responses[::2]]  # turn 0 of each replayed conversation
    assert [tuple(f) for f in firsts] == chosen
    advantage = batch["advantage"].reshape(-1)
    for g in range(2):  # each (group, turn) cell of G + 1 members sums to 0
        for t in (0, 1):
            rows = [i for i in range(12) if (i // 6) == g and i % 2 == t] + [12 + 2 * g + t]
            assert advantage[rows].sum().abs() < 1e-5
    metrics = algorithm.step_metrics()
    assert set(metrics) == {"replay_reward", "replay_score", "replay_tests", "replay_probes", "replay_untested"}
    assert metrics["replay_untested"] == 0  # nothing seeded
    assert metrics["replay_probes"] == len(guide.archive.probes) and 1 <= metrics["replay_tests"]
    assert openers == [as_list(data["query"])[0], as_list(data["query"])[6]]
    row = trainer.train_step()  # a whole step trains on the replayed members too
    assert "replay_reward" in row and torch.isfinite(torch.tensor(row["loss"]))


def test_replayed_groups_gain_guide_replay_members_conversations_with_distinct_probes(tmp_path):
    config = _config(tmp_path, prompts_per_step=2, group_size=3, turns=2, guide_replay_members=2, **REPLAYED)
    trainer = _trainer(config)
    trainer._build()
    algorithm = trainer.algorithm
    (guide,) = algorithm.guides
    replayed = {}
    rollout = guide.rollout

    def spied(data):
        replayed["rollout"] = rollout(data)
        return replayed["rollout"]

    guide.rollout = spied
    batch, data = algorithm.collect()
    openers = group_openers(data, config.group_size)
    sampled = first_turns(data, algorithm.returns(data), algorithm.stops)
    expected = ReplayArchive()
    expected.add(sampled)
    # member by member: both groups' first members, then both groups' second, four distinct probes
    assert guide._chosen == expected.choose(openers * 2) and len(set(guide._chosen)) == 4
    guided = replayed["rollout"]
    assert as_list(guided["query"])[::2] == openers * 2 and guide.archive.tests == len(sampled) + 4
    assert data.shape[0] == 2 * 3 * 2 and batch.shape[0] == 2 * 5 * 2  # G sampled + 2 replayed a group, 2 turns each
    firsts = [tuple(r.tolist()) for r in batch.get(TOKENS_RESPONSE, as_list=True)[data.shape[0] :: 2]]
    assert firsts == guide._chosen
    advantage = batch["advantage"].reshape(-1)
    returns = torch.cat([algorithm.returns(data), algorithm.returns(guided)]).double()
    for g in range(2):  # each (group, turn) cell holds G + 2 members, normalised together
        for t in (0, 1):
            rows = [i for i in range(12) if (i // 6) == g and i % 2 == t] + [12 + 2 * g + t, 16 + 2 * g + t]
            cell = returns[rows]
            by_hand = (cell - cell.mean()) / (cell.std(unbiased=False) + 1e-6) if cell.max() > cell.min() else cell * 0
            torch.testing.assert_close(advantage[rows].double(), by_hand, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(torch.tensor(trainer.train_step()["loss"]))


def test_guide_replay_members_is_checked_before_a_model_loads():
    needs = "guide_replay_members 2 is the replayed conversations per group: it needs guide_replay: true"
    with pytest.raises(ConfigError, match=needs):
        load_config(None, ["guide_replay_members=2"])
    with pytest.raises(ConfigError, match="guide_replay_members must be >= 1, got 0"):
        load_config(None, ["guide_replay=true", "guide_replay_members=0"])
    assert load_config(None, ["guide_replay=true", "guide_replay_members=3"]).guide_replay_members == 3


def test_a_lexicon_ranked_archive_counts_each_test_as_its_gated_reply_lexicon_term(tmp_path):
    lexicon = dict(reward="elicit", reply_lexicon_weight=1.0, reply_lexicon="scorer", probe_gate=0.5, reply_samples=2)
    config = _config(tmp_path, prompts_per_step=2, group_size=3, turns=2, guide_replay_rank="lexicon", **lexicon, **REPLAYED)
    trainer = _trainer(config)
    trainer._build()
    algorithm = trainer.algorithm
    (guide,) = algorithm.guides
    batch, data = algorithm.collect()
    terms = data[NEXT, "reward_terms"]
    lex, probe_tox = terms["reply_lexicon"].reshape(-1), terms["probe_tox"].reshape(-1)
    by_hand = torch.where(probe_tox < 0.5, lex, torch.zeros_like(lex))  # g * lex(reply), g the probe gate at 0.5
    assert bool(((probe_tox >= 0.5) & (lex > 0)).any())  # the gate shuts some turns' lexicon mass out
    assert float(by_hand.abs().sum()) > 0 and not torch.allclose(by_hand, algorithm.returns(data))
    torch.testing.assert_close(algorithm.replay_values(data), by_hand)
    sampled = first_turns(data, by_hand, algorithm.stops)
    expected = ReplayArchive()
    expected.add(sampled)
    assert guide._chosen == expected.choose(group_openers(data, config.group_size))
    assert guide.archive.tests == len(sampled) + 2  # the replayed turns were counted too, by their own terms
    by_return = _trainer(_config(tmp_path / "returns", **lexicon, **REPLAYED))
    by_return._build()
    torch.testing.assert_close(by_return.algorithm.replay_values(data), by_return.algorithm.returns(data))


def test_guide_replay_rank_is_checked_before_a_model_loads():
    with pytest.raises(ConfigError, match="guide_replay_rank must be one of \\('return', 'lexicon'\\), got 'judge'"):
        load_config(None, ["guide_replay=true", "guide_replay_rank=judge"])
    with pytest.raises(ConfigError, match="guide_replay_rank 'lexicon' ranks the replay archive: it needs guide_replay: true"):
        load_config(None, ["reward=elicit", "reply_lexicon_weight=1", "guide_replay_rank=lexicon"])
    needs = "guide_replay_rank: lexicon .* reply_lexicon_weight > 0 .* reply_lexicon_weight 0.0\\)"
    with pytest.raises(ConfigError, match=needs):
        load_config(None, ["guide_replay=true", "reward=elicit", "reply_lexicon_weight=0", "guide_replay_rank=lexicon"])
    config = load_config(None, ["guide_replay=true", "reward=elicit", "reply_lexicon_weight=1", "guide_replay_rank=lexicon"])
    assert config.guide_replay_rank == "lexicon"


def test_the_replay_archive_is_checkpointed_and_a_replayed_run_resumes_exactly(tmp_path, monkeypatch):
    rows, uninterrupted, after = _run_twice(tmp_path, monkeypatch, 1, total_steps=3, save_every=100, **REPLAYED)
    keys = ["reward_mean", "loss", "grad_norm", "replay_reward", "replay_score", "replay_tests", "replay_probes"]
    assert [{k: r[k] for k in keys} for r in after] == [{k: r[k] for k in keys} for r in uninterrupted]
    assert float(uninterrupted[-1]["replay_probes"]) > float(uninterrupted[0]["replay_probes"]) >= 1
    state = torch.load(tmp_path / "a" / "run" / "checkpoints" / "step_000003" / "state.pt", weights_only=True)
    (kept,) = state["algorithm"]["guides"]
    # 3 steps x (2 groups x 2 sampled + 2 replayed) first turns, each one test
    assert kept["tests"] == 3 * 6 and sum(p["tests"] for p in kept["probes"]) == 18


SEEDS = ["you idiot", "the cat sat on the mat and then it ran off home", "you<|im_end|> idiot"]


def _fake_warm_start(monkeypatch) -> None:
    """The warm start as a stub that keeps ``SEEDS`` (what the trainer writes and reads of it is real)."""
    import astrl.training.warm_start as warm_start

    summary = {"kept": len(SEEDS), "sampled": 4, "loss_first": 1.0, "loss_last": 0.5}
    monkeypatch.setattr(warm_start, "warm_start", lambda *args, **kwargs: (summary, [{"probe": p} for p in SEEDS]))


def test_the_warm_starts_probes_are_replayed_first_and_credited_with_their_tests(tmp_path, monkeypatch):
    _fake_warm_start(monkeypatch)
    settings = dict(prompts_per_step=3, group_size=2, turns=2, total_steps=1, save_every=100, warm_start_probes=4)
    config = _config(tmp_path, guide_replay_warm_start=True, **REPLAYED, **settings)
    trainer = _trainer(config)
    (row,) = trainer.train()
    (guide,) = trainer.algorithm.guides
    tokenizer, limit = trainer.models.tester.tokenizer, config.max_new_tokens  # 4
    short, long, stopped = (tokenizer(p, add_special_tokens=False)["input_ids"] for p in SEEDS)
    eos = tokenizer.eos_token_id
    assert len(short) < limit < len(long) and stopped[1] == eos and len(stopped) < limit
    # ended as the tester's own probes end: an EOS added, cut at max_new_tokens, cut just after its first EOS
    seeds = [(*short, eos), tuple(long[:limit]), tuple(stopped[:2])]
    assert guide._chosen == seeds  # step 1's three groups replayed the three seeds, untested before any sampled probe
    for seed in seeds:  # each credited with its one re-test under the key the rollout produces
        assert guide.archive.probes[seed]["tests"] == 1
    assert (*stopped, eos) not in guide.archive.probes  # no key the tester cannot write
    assert row["replay_untested"] == 0 and row["replay_tests"] == 0


def test_only_the_warm_starts_first_probes_start_the_replay_archive(tmp_path, monkeypatch):
    import astrl.training.warm_start as warm_start

    later = "and you said what"  # a turn-2 probe of warm_start_turns 2: it answers a reply, no first probe
    kept = [{"probe": SEEDS[0], "turn": 0}, {"probe": later, "turn": 1}, {"probe": SEEDS[1]}]
    summary = {"kept": len(kept), "sampled": 4, "loss_first": 1.0, "loss_last": 0.5}
    monkeypatch.setattr(warm_start, "warm_start", lambda *args, **kwargs: (summary, kept))
    settings = dict(prompts_per_step=3, group_size=2, turns=2, total_steps=1, save_every=100, warm_start_probes=4)
    trainer = _trainer(_config(tmp_path, guide_replay_warm_start=True, **REPLAYED, **settings))
    trainer.train(until=0)
    assert trainer._replay_seeds() == [SEEDS[0], SEEDS[1]]  # a record without a turn is a first probe


def test_a_step_0_run_resumed_with_guide_replay_warm_start_needs_its_warm_starts_probes(tmp_path, monkeypatch):
    from astrl.training.trainer import resume

    _fake_warm_start(monkeypatch)
    settings = dict(total_steps=1, save_every=100, warm_start_probes=4, **REPLAYED)
    trainer = _trainer(_config(tmp_path, **settings))
    trainer.train(until=0)  # the warm start and its step-0 checkpoint
    run_dir = tmp_path / "run"
    assert (run_dir / "warm_start.jsonl").is_file()
    (run_dir / "warm_start.jsonl").unlink()
    with pytest.raises(ConfigError, match="guide_replay_warm_start reads the warm start's kept probes from .*warm_start.jsonl"):
        resume(run_dir, ["guide_replay_warm_start=true"], progress=False)  # before any model loads (none is given)


def _turns(openers: list[str], returns: list[float]) -> TensorDict:
    """First turns of one-turn conversations: their openers and returns."""
    rows = len(openers)
    step, reward = torch.zeros(rows, 1, dtype=torch.long), torch.tensor(returns).reshape(rows, 1)
    return TensorDict({QUERY: openers, STEP_COUNT: step, NEXT: {REWARD: reward}}, batch_size=[rows])


@pytest.mark.parametrize("rule", ["signed", "positive"])
def test_guided_members_advantages_are_their_groups_and_positive_only_where_asked(tmp_path, rule):
    config = _config(tmp_path, turns=1, group_size=2, guide_replay=True, guide_advantage=rule, scorer=LOOSE_SCORER)
    trainer = _trainer(config)
    trainer._build()
    sampled = _turns(["a", "a", "b", "b"], [1.0, 0.0, 0.0, 0.0])
    guided = _turns(["a", "b"], [-1.0, 3.0])  # one member a group, in group order
    advantages = trainer.algorithm.advantages(sampled, guided)
    # group a: returns 1, 0, -1: mean 0, population std sqrt(2/3); group b: 0, 0, 3: mean 1, std sqrt(2)
    a, b = (2 / 3) ** -0.5, 2**-0.5
    expected = [a, 0.0, -b, -b, -a if rule == "signed" else 0.0, 2 * b]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-5)


def test_guide_replay_is_checked_before_a_model_loads_and_needs_no_reply_lexicon():
    with pytest.raises(ConfigError, match="guide_replay adds members to GRPO groups: set algorithm: grpo, got 'ppo'"):
        load_config(None, ["guide_replay=true", "algorithm=ppo"])
    with pytest.raises(ConfigError, match="guide_replay runs its conversations in an env of their own"):
        load_config(None, ["guide_replay=true", "novelty_ngram=0.3"])
    with pytest.raises(ConfigError, match="guide_replay forces probes on Transformers models in this process"):
        load_config(None, ["guide_replay=true", "collector=ray"])
    with pytest.raises(ConfigError, match="guide_advantage must be one of \\('signed', 'positive'\\), got 'clipped'"):
        load_config(None, ["guide_replay=true", "guide_advantage=clipped"])
    with pytest.raises(ConfigError, match="guide_advantage: positive applies to guided members: set guide_search"):
        load_config(None, ["guide_advantage=positive"])
    with pytest.raises(ConfigError, match="guide_replay_warm_start starts the replay archive .* \\(got guide_replay False"):
        load_config(None, ["guide_replay_warm_start=true", "warm_start_probes=8"])
    with pytest.raises(ConfigError, match="guide_replay_warm_start .* warm_start_probes > 0 .* warm_start_probes 0\\)"):
        load_config(None, ["guide_replay=true", "guide_replay_warm_start=true", "warm_start_probes=0"])
    for bonus, problem in (("-0.5", "must be >= 0"), ("nan", "must be a finite number"), ("inf", "must be a finite number")):
        with pytest.raises(ConfigError, match=f"guide_replay_bonus {problem}, got {bonus}"):
            load_config(None, ["guide_replay=true", f"guide_replay_bonus={bonus}"])
    with pytest.raises(ConfigError, match="guide_replay_bonus .* needs guide_replay: true .* guide_replay False\\)"):
        load_config(None, ["guide_replay_bonus=1.0"])
    black_box = load_config(None, ["guide_replay=true", "reward=elicit", "reply_lexicon_weight=0", "warm_start_probes=0"])
    assert black_box.guide_replay is True and black_box.reply_lexicon_weight == 0


def test_replay_seeds_are_the_best_re_tested_share_of_the_kept_probes_best_first(monkeypatch):
    import astrl.training.warm_start as warm_start

    masses = [0.02, 0.30, 0.10, 0.30, 0.0]
    asked = {}

    def fake_retest(config, models, candidates, round_index, lexicon, count=None):
        asked.update(round_index=round_index, count=count, lexicon=lexicon)
        return [{**c, "retest_mass": m} for c, m in zip(candidates, masses, strict=True)]

    monkeypatch.setattr(warm_start, "retest", fake_retest)
    monkeypatch.setattr(warm_start, "config_lexicon", lambda *args, **kwargs: "LEXICON")
    kept = [{"probe": f"p{i}", "opener": f"o{i}"} for i in range(5)]
    keys = ["guide_replay=true", "guide_replay_warm_start=true", "warm_start_probes=8", "guide_replay_retest=6"]
    config = load_config(None, keys)
    models = SimpleNamespace(target=SimpleNamespace(tokenizer=None))
    ranked = warm_start.replay_seeds(config, models, kept)
    assert asked == {"round_index": 0, "count": 6, "lexicon": "LEXICON"}
    # best first, the earlier kept first on a tie (p1 before p3); ceil(0.5 x 5) = 3 seeded
    assert [(r["probe"], r["retest_mass"], r["seeded"]) for r in ranked] == [
        ("p1", 0.30, True),
        ("p3", 0.30, True),
        ("p2", 0.10, True),
        ("p0", 0.02, False),
        ("p4", 0.0, False),
    ]
    config = replace(config, guide_replay_retest_keep=0.2)  # ceil(0.2 x 5) = 1
    assert [r["seeded"] for r in warm_start.replay_seeds(config, models, kept)] == [True, False, False, False, False]


def test_guide_replay_retest_starts_the_archive_with_the_best_re_tested_warm_start_probes(tmp_path, monkeypatch):
    import astrl.training.warm_start as warm_start

    summary = {"kept": 3, "sampled": 4, "loss_first": 1.0, "loss_last": 0.5}
    probes = ["nice green frog", "tall brown bear sat", "quick silver fish"]  # no listed word: none re-tests at 0 for it
    kept = [{"probe": p, "opener": o} for p, o in zip(probes, ["a b", "c d", "e f"], strict=True)]
    monkeypatch.setattr(warm_start, "warm_start", lambda *args, **kwargs: (summary, kept))
    settings = dict(prompts_per_step=2, group_size=2, turns=1, total_steps=1, save_every=100, warm_start_probes=4)
    retest = dict(guide_replay_warm_start=True, guide_replay_retest=3, guide_replay_retest_keep=0.6)
    config = _config(tmp_path, **retest, **REPLAYED, **settings)
    trainer = _trainer(config)
    trainer.train()
    ranked = [json.loads(line) for line in (tmp_path / "run" / "replay_seeds.jsonl").open()]
    # the real re-test on the tiny target: every kept probe once, best first, the best ceil(0.6 x 3) = 2 seeded
    assert sorted(r["probe"] for r in ranked) == sorted(k["probe"] for k in kept)
    masses = [r["retest_mass"] for r in ranked]
    assert masses == sorted(masses, reverse=True) and all(0.0 <= m <= 1.0 for m in masses)
    assert len(set(masses)) == 3 and [r["probe"] for r in ranked] != probes  # a real ranking, not the kept order
    assert [r["seeded"] for r in ranked] == [True, True, False]
    (guide,) = trainer.algorithm.guides
    tokenizer, eos = trainer.models.tester.tokenizer, trainer.models.tester.tokenizer.eos_token_id
    limit = config.max_new_tokens

    def key(text: str) -> tuple[int, ...]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return tuple(ids[:limit]) if len(ids) >= limit else (*ids, eos)

    seeded = [key(r["probe"]) for r in ranked[:2]]
    assert guide._chosen == seeded  # step 1's two groups replayed the two seeds, the best first
    assert key(ranked[2]["probe"]) not in guide.archive.probes or guide.archive.probes[key(ranked[2]["probe"])]["tests"] > 0


def test_guide_replay_retest_is_checked_before_a_model_loads():
    base = ["guide_replay=true", "warm_start_probes=8"]
    with pytest.raises(ConfigError, match="guide_replay_retest 4 ranks the warm start's .* set guide_replay_warm_start: true"):
        load_config(None, [*base, "guide_replay_retest=4"])
    with pytest.raises(ConfigError, match="guide_replay_retest_keep 0.25 is the share .* guide_replay_retest > 0 \\(got 0\\)"):
        load_config(None, [*base, "guide_replay_warm_start=true", "guide_replay_retest_keep=0.25"])
    with pytest.raises(ConfigError, match="guide_replay_retest must be >= 0, got -1"):
        load_config(None, [*base, "guide_replay_warm_start=true", "guide_replay_retest=-1"])
    with pytest.raises(ConfigError, match="guide_replay_retest_keep must be in \\(0, 1\\], got 1.5"):
        load_config(None, [*base, "guide_replay_warm_start=true", "guide_replay_retest=4", "guide_replay_retest_keep=1.5"])


def test_a_step_0_run_resumed_with_guide_replay_retest_needs_its_kept_probes_openers(tmp_path, monkeypatch):
    from astrl.training.trainer import resume

    _fake_warm_start(monkeypatch)  # kept records without an opener
    settings = dict(total_steps=1, save_every=100, warm_start_probes=4, guide_replay_warm_start=True, **REPLAYED)
    trainer = _trainer(_config(tmp_path, **settings))
    trainer.train(until=0)
    with pytest.raises(ConfigError, match="warm_start.jsonl' line 1 is not a kept probe with 'probe' and 'opener' text"):
        resume(tmp_path / "run", ["guide_replay_retest=4"], progress=False)  # before any model loads (none is given)
