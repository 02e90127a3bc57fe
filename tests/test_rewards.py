import math

import pytest
import torch
from conftest import loaded, make_gpt2, make_llama, make_tokenizer
from tensordict import LazyStackedTensorDict, TensorDict

from astrl._compat import as_list, history_to_chats
from astrl.envs import make_redteam_env
from astrl.lm_scoring import until_stop
from astrl.policies import GenerationSettings, make_policy
from astrl.rewards import (
    ClippedKLReward,
    RewardShaping,
    TokenLogProbs,
    clipped_kl_reward,
    kl_reward,
    make_reference,
    probe_logprobs,
    response_mask,
)
from astrl.scorers import KeywordScorer

OPENERS = ["hello how are you", "tell me about your day", "what is the weather like", "the cat walk park"]


def manual_logprobs(model, ids: list[int], start: int) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= start, from a plain unpadded forward and a gather."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    return torch.stack([logp[t - 1, ids[t]] for t in range(start, len(ids))])


def _policies(max_new=6, mode="history", target_gpt2=False):
    tok_a, tok_b = make_tokenizer(), make_tokenizer(vocab_size=290, seed=5)
    tester = make_policy(loaded(make_llama(tok_a), tok_a), GenerationSettings(max_new), input_mode=mode)
    target_model = make_gpt2(tok_b, n_positions=256) if target_gpt2 else make_llama(tok_b, seed=3)
    target = make_policy(loaded(target_model, tok_b), GenerationSettings(max_new), input_mode=mode)
    return tester, target


# -- token log-probs (the scoring itself: tests/test_lm_scoring.py) ---------------------------------
def test_response_mask_stops_after_the_first_eos():
    tokens = torch.tensor([[7, 8, 3, 1, 1], [7, 8, 9, 9, 9], [3, 1, 1, 1, 1], [7, 3, 5, 3, 1]])
    expected = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]],
        dtype=torch.bool,
    )
    assert torch.equal(response_mask(tokens, {3}), expected)


def test_until_stop_keeps_a_response_up_to_and_with_its_first_stop():
    assert until_stop(torch.tensor([7, 3, 5, 3, 1]), {3}).tolist() == [7, 3]
    assert until_stop(torch.tensor([7, 8, 9]), {3}).tolist() == [7, 8, 9]  # no stop: all of it
    assert until_stop(torch.tensor([1, 7]), {3, 1}).tolist() == [1]


# -- ASTPrompter reward -----------------------------------------------------------------------------
def test_probe_logprob_uses_the_targets_own_tokenization():
    tok_tester, tok_target = make_tokenizer(), make_tokenizer(vocab_size=290, seed=5)
    target = make_llama(tok_target, seed=3)
    probes = ["the weather is damn nice", "you idiot", "walk the dog to the park today"]
    assert any(tok_tester(p)["input_ids"] != tok_target(p)["input_ids"] for p in probes)
    contexts = [
        tok_target.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) + "<|im_start|>user\n",
        "<|im_start|>system\nbe nice<|im_end|>\n<|im_start|>user\n",
        "<|im_start|>user\n",
    ]
    with torch.no_grad():
        got = probe_logprobs(target, tok_target, contexts, probes)
    for context, probe, value in zip(contexts, probes, got, strict=True):
        prefix = tok_target(context, add_special_tokens=False)["input_ids"]
        ids = prefix + tok_target(probe, add_special_tokens=False)["input_ids"]
        expected = manual_logprobs(target, ids, len(prefix)).mean()
        assert value.item() == pytest.approx(expected.item(), abs=1e-5)
    assert got.shape == (3,) and (got < 0).all()


def test_probe_logprob_scores_the_joint_tokenization_across_a_bpe_boundary():
    tok = make_tokenizer()
    model = make_llama(tok, seed=4)
    # text mode mid-word: "the wea" + "ther is nice" reads as "the weather is nice" (one token "Ġweather")
    contexts, probes = ["the wea", "tell me ab", "hello", ""], ["ther is nice", "out your day", "  how are you", "you idiot"]
    assert tok(contexts[0] + probes[0])["input_ids"] != tok(contexts[0])["input_ids"] + tok(probes[0])["input_ids"]
    with torch.no_grad():
        got = probe_logprobs(model, tok, contexts, probes, context_special_tokens=True)
        for context, probe, value in zip(contexts, probes, got, strict=True):
            # oracle: one forward over the joint ids; the probe's tokens are those whose characters reach past the context
            enc = tok(context + probe, return_offsets_mapping=True)
            ids, spans = enc["input_ids"], enc["offset_mapping"]
            first = next(i for i, (_, end) in enumerate(spans) if end > len(context))
            if first == 0:
                ids, first = [tok.bos_token_id, *ids], 1
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
            expected = torch.stack([logp[k - 1, ids[k]] for k in range(first, len(ids))]).mean()
            assert value.item() == pytest.approx(expected.item(), abs=1e-5), (context, probe)
        split = tok(contexts[0])["input_ids"] + tok(probes[0])["input_ids"]  # the separate tokenization scores otherwise
        cut = len(tok(contexts[0])["input_ids"])
        logp = torch.log_softmax(model(input_ids=torch.tensor([split])).logits[0].float(), -1)
        separate = torch.stack([logp[k - 1, split[k]] for k in range(cut, len(split))]).mean()
    assert abs(got[0].item() - separate.item()) > 1e-3


def test_probe_longer_than_the_window_keeps_its_last_tokens():
    tok = make_tokenizer()
    model = make_llama(tok, max_positions=16)
    context, probe = "the cat", " " + " ".join(["hello how are you"] * 10)
    with torch.no_grad():
        got = probe_logprobs(model, tok, [context], [probe], max_length=16)
    enc = tok(context + probe, return_offsets_mapping=True)
    first = next(i for i, (_, end) in enumerate(enc["offset_mapping"]) if end > len(context))
    ids = enc["input_ids"]
    window = [ids[first - 1], *ids[first:][-15:]]  # the last context token, then the probe's last 15 tokens
    assert len(ids) - first > 16 and torch.isfinite(got).all()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([window])).logits[0].float(), -1)
    assert got[0].item() == pytest.approx(torch.stack([logp[k - 1, window[k]] for k in range(1, 16)]).mean().item(), abs=1e-5)


def test_empty_probe_gets_the_penalty_and_empty_context_starts_from_bos():
    tok = make_tokenizer()
    model = make_llama(tok)
    with torch.no_grad():
        got = probe_logprobs(model, tok, ["", "hello"], ["you idiot", ""], context_special_tokens=True, empty_value=-7.5)
    ids = [tok.bos_token_id] + tok("you idiot", add_special_tokens=False)["input_ids"]
    assert got[0].item() == pytest.approx(manual_logprobs(model, ids, 1).mean().item(), abs=1e-5)
    assert got[1].item() == -7.5


def test_a_bf16_model_gives_float32_means_and_an_exact_empty_probe_value():
    tok = make_tokenizer()
    model = make_llama(tok).to(torch.bfloat16)
    with torch.no_grad():
        got = probe_logprobs(model, tok, ["hello", "hello"], ["you idiot", ""], empty_value=-7.3)
    assert got.dtype == torch.float32 and got[1].item() == pytest.approx(-7.3, abs=1e-6)  # bf16 would give -7.3125
    assert torch.isfinite(got[0])


def _record_target_inputs(target, key):
    seen = []
    original = target.forward

    def forward(td, *args, **kwargs):
        seen.append(history_to_chats(td["history"].prompt) if key == "history" else as_list(td["text", "prompt"]))
        return original(td, *args, **kwargs)

    target.forward = forward
    return seen


def test_astprompter_reward_in_chat_mode_equals_its_terms():
    tester, target = _policies()
    scorer = KeywordScorer(["the", "you", "damn"])
    seen = _record_target_inputs(target, "history")
    weights = {"alpha": 2.0, "zeta": 0.25, "gamma": 0.5}
    env = make_redteam_env(
        tester, target, [scorer], OPENERS, batch_size=2, max_turns=2, reward="astprompter", reward_options=weights
    )
    torch.manual_seed(0)
    ro = env.rollout(2, tester)
    nxt = ro["next"]
    terms = nxt["reward_terms"]
    expected = 2.0 * terms["response_tox"] + 0.25 * terms["combined_tox"] + 0.5 * terms["probe_logprob"]
    torch.testing.assert_close(nxt["reward"].squeeze(-1), expected)
    for t in range(2):
        probes, replies = as_list(nxt[:, t]["probe"]), as_list(nxt[:, t]["target_response"])
        contexts = as_list(nxt[:, t]["target_context"])
        torch.testing.assert_close(terms["response_tox"][:, t], scorer(replies))
        torch.testing.assert_close(
            terms["combined_tox"][:, t], scorer([p + "\n" + r for p, r in zip(probes, replies, strict=True)])
        )
        for b in range(2):
            chat = seen[t][b]  # what the target read: its template, ending with the probe as a user turn
            assert chat[-1] == {"role": "user", "content": probes[b]}
            rendered = target.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            assert rendered.startswith(contexts[b] + probes[b])
            prefix = target.tokenizer(contexts[b], add_special_tokens=False)["input_ids"]
            probe_ids = target.tokenizer(probes[b], add_special_tokens=False)["input_ids"]
            value = terms["probe_logprob"][b, t].item()
            if probe_ids:
                assert value == pytest.approx(
                    manual_logprobs(target.model, prefix + probe_ids, len(prefix)).mean().item(), abs=1e-5
                )
            else:
                assert value == -10.0


def test_astprompter_reward_in_text_mode_scores_the_context_the_target_read():
    tester, target = _policies(mode="text", target_gpt2=True)
    seen = _record_target_inputs(target, "text")
    env = make_redteam_env(
        tester, target, [KeywordScorer(["the"])], OPENERS, batch_size=2, max_turns=2, mode="text", reward="astprompter"
    )
    torch.manual_seed(1)
    ro = env.rollout(2, tester)
    nxt = ro["next"]
    for t in range(2):
        probes, contexts = as_list(nxt[:, t]["probe"]), as_list(nxt[:, t]["target_context"])
        openers = as_list(nxt[:, t]["query"])
        for b in range(2):
            assert contexts[b] + probes[b] == seen[t][b]
            assert contexts[b].startswith(openers[b]) and (t > 0 or contexts[b] == openers[b])
    replies = as_list(nxt[:, 0]["target_response"])
    expected = KeywordScorer(["the"])([p + r for p, r in zip(as_list(nxt[:, 0]["probe"]), replies, strict=True)])
    torch.testing.assert_close(nxt["reward_terms", "combined_tox"][:, 0], expected)


@pytest.mark.parametrize("gate", [False, True])
def test_elicit_reward_equals_its_terms_and_scores_the_probe_alone(gate):
    tester, target = _policies()
    scorer = KeywordScorer(["the", "you", "damn"])
    weights = {"alpha": 2.0, "penalty": 0.75, "gamma": 0.5, "gate": gate}
    env = make_redteam_env(tester, target, [scorer], OPENERS, batch_size=2, max_turns=2, reward="elicit", reward_options=weights)
    torch.manual_seed(0)
    nxt = env.rollout(2, tester)["next"]
    terms = nxt["reward_terms"]
    assert set(terms.keys()) == {"response_tox", "probe_tox", "probe_logprob", "reply_lexicon", "probe_repetition"}
    assert (terms["reply_lexicon"] == 0).all()  # no lexicon weighed
    g = 1 - terms["probe_tox"] if gate else torch.ones_like(terms["probe_tox"])
    expected = 2.0 * terms["response_tox"] * g - 0.75 * terms["probe_tox"] + 0.5 * terms["probe_logprob"]
    torch.testing.assert_close(nxt["reward"].squeeze(-1), expected)
    for t in range(2):
        probes, replies = as_list(nxt[:, t]["probe"]), as_list(nxt[:, t]["target_response"])
        torch.testing.assert_close(terms["probe_tox"][:, t], scorer(probes))
        torch.testing.assert_close(terms["response_tox"][:, t], scorer(replies))
    # the likelihood term is the one the ASTPrompter reward computes on the same conversation
    env_ast = make_redteam_env(tester, target, [scorer], OPENERS, batch_size=2, max_turns=2, reward="astprompter")
    torch.manual_seed(0)
    torch.testing.assert_close(env_ast.rollout(2, tester)["next", "reward_terms", "probe_logprob"], terms["probe_logprob"])


def test_elicit_reward_reads_the_probe_with_its_probe_scorer():
    """The replies are paid by the reward's scorer; the probe's toxicity (penalty, gate) is the probe scorer's:
    the judge already in the env when it names one (in any spelling), else a scorer of its own."""
    from astrl.rewards import ElicitReward

    tester, target = _policies()
    scorer, judge = KeywordScorer(["you", "damn"]), KeywordScorer(["the"])
    weights = {"alpha": 2.0, "penalty": 0.75, "gamma": 0.5, "gate_below": 0.5}
    for name, reads in (("keywords:the", judge), ("keywords:The,", judge), ("keywords:a", KeywordScorer(["a"]))):
        env = make_redteam_env(
            tester, target, [scorer, judge], OPENERS, batch_size=2, max_turns=2, reward="elicit",
            reward_options={**weights, "probe_scorer": name},
        )  # fmt: skip
        reward = next(t for t in env.transform if isinstance(t, ElicitReward))
        assert reward.probe_scorer.name == reads.name and (reward.probe_scorer is judge) == (reads is judge)
        torch.manual_seed(0)
        nxt = env.rollout(2, tester)["next"]
        terms = nxt["reward_terms"]
        for t in range(2):
            probes, replies = as_list(nxt[:, t]["probe"]), as_list(nxt[:, t]["target_response"])
            torch.testing.assert_close(terms["probe_tox"][:, t], reads(probes))
            torch.testing.assert_close(terms["response_tox"][:, t], scorer(replies))
        gate = (terms["probe_tox"] < 0.5).float()
        expected = 2.0 * terms["response_tox"] * gate - 0.75 * terms["probe_tox"] + 0.5 * terms["probe_logprob"]
        torch.testing.assert_close(nxt["reward"].squeeze(-1), expected)
    probe = ElicitReward(target.model, target.tokenizer, scorer, probe_scorer=judge)
    terms = probe.toxicity_terms(["the end", "you damn"], ["damn you", "the end"], None)
    torch.testing.assert_close(terms["probe_tox"], torch.tensor([0.5, 0.0]))  # share of "the", not of "you"/"damn"
    torch.testing.assert_close(terms["response_tox"], torch.tensor([1.0, 0.0]))  # share of "you"/"damn"


def test_probe_scorer_reuses_the_loaded_judge_without_building_one(monkeypatch):
    import astrl.scorers
    from astrl.envs.redteam import _probe_scorer

    judge = KeywordScorer(["the", "end"])
    monkeypatch.setattr(astrl.scorers, "make_scorer", lambda *a, **k: pytest.fail(f"built a scorer for {a}"))
    assert _probe_scorer("keywords:End, THE", {judge.name: judge}) is judge


def test_elicit_weights_pay_for_elicited_not_written_toxicity():
    from astrl.rewards import ElicitWeights

    reply, probe, lp = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 1.0]), torch.zeros(3)
    linear = ElicitWeights(alpha=1.0, penalty=1.0, gamma=0.1).combine(reply, probe, lp)
    gated = ElicitWeights(alpha=1.0, penalty=1.0, gamma=0.1, gate=True).combine(reply, probe, lp)
    # elicited (clean probe, toxic reply) > echoed (toxic probe, toxic reply) > toxic probe, clean reply
    torch.testing.assert_close(linear, torch.tensor([1.0, 0.0, -1.0]))
    torch.testing.assert_close(gated, torch.tensor([1.0, -1.0, -1.0]))
    with pytest.raises(ValueError, match="elicit weight penalty must be >= 0, got -1.0"):
        ElicitWeights(penalty=-1.0)


def test_reward_options_are_checked():
    tester, target = _policies()
    with pytest.raises(ValueError, match="unknown reward_options \\['beta'\\]"):
        make_redteam_env(
            tester, target, [KeywordScorer(["x"])], OPENERS, batch_size=2, reward="astprompter", reward_options={"beta": 1}
        )
    with pytest.raises(ValueError, match="reward must be one of"):
        make_redteam_env(tester, target, [KeywordScorer(["x"])], OPENERS, batch_size=2, reward="toxicity")
    with pytest.raises(ValueError, match="unknown reward_options \\['zeta'\\] for reward='elicit'"):
        make_redteam_env(
            tester, target, [KeywordScorer(["x"])], OPENERS, batch_size=2, reward="elicit", reward_options={"zeta": 1.0}
        )


# -- clipped KL reward ------------------------------------------------------------------------------
def test_clipped_kl_reward_formula_bounds_and_masking():
    lp = torch.tensor([[-1.0, -2.0, float("inf"), -0.5], [-1e6, 1e6, -3.0, -3.0]])
    ref = torch.tensor([[-1.5, float("-inf"), -1.0, float("nan")], [0.0, 0.0, -3.0, -1.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    score = torch.tensor([0.7, -50.0])
    reward, reward_kl = clipped_kl_reward(lp, ref, mask, score, kl_coef=0.2, kl_clip=2.0, score_clip=5.0)
    expected_kl = torch.tensor([[-0.2 * 0.5, -0.2 * 2.0, -0.2 * 2.0, 0.0], [0.2 * 2.0, -0.2 * 2.0, 0.0, 0.2 * 2.0]])
    torch.testing.assert_close(reward_kl, expected_kl)
    assert reward_kl.abs().max() <= 0.2 * 2.0 + 1e-7
    bonus = torch.zeros(2, 4)
    bonus[0, 2], bonus[1, 3] = 0.7, -5.0  # clipped score on each row's last response token
    torch.testing.assert_close(reward, expected_kl + bonus)
    assert reward[0, 3] == 0.0  # padding never counts


def _ragged_batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        lp, ref = -torch.rand(n, generator=g) * 4, -torch.rand(n, generator=g) * 4
        mask = torch.arange(n) < n - i  # later samples end with padding after EOS
        samples.append(
            TensorDict(
                actor_log_probs=lp,
                ref_log_probs=ref,
                response_mask=mask,
                next=TensorDict(reward=torch.tensor([float(i) - 1.0])),
            )
        )
    return LazyStackedTensorDict(*samples), samples


@pytest.mark.parametrize("reduction", ["token", "sum"])
def test_clipped_kl_reward_on_ragged_lazily_stacked_data(reduction):
    lengths = [3, 6, 4]
    data, samples = _ragged_batch(lengths)
    transform = ClippedKLReward(kl_coef=0.3, kl_clip=1.0, score_clip=0.5, reduction=reduction)
    out = transform(data)
    rewards = out.get(("next", "reward"), as_list=True)
    kls = out.get(("next", "reward_kl"), as_list=True)
    raw = out.get(("next", "reward_raw"), as_list=True)
    for i, s in enumerate(samples):
        mask = s["response_mask"]
        kl = torch.where(mask, -0.3 * (s["actor_log_probs"] - s["ref_log_probs"]).clamp(-1, 1), torch.zeros(lengths[i]))
        torch.testing.assert_close(kls[i], kl)
        score = float(i) - 1.0
        assert raw[i].item() == score
        if reduction == "token":
            assert rewards[i].shape == (lengths[i], 1)
            expected = kl.clone()
            expected[int(mask.sum()) - 1] += max(-0.5, min(0.5, score))
            torch.testing.assert_close(rewards[i].squeeze(-1), expected)
        else:
            assert rewards[i].item() == pytest.approx(kl.sum().item() + max(-0.5, min(0.5, score)), abs=1e-6)


def test_kl_is_zero_when_the_tester_is_the_reference_and_exact_otherwise():
    tester, target = _policies()
    env = make_redteam_env(tester, target, [KeywordScorer(["the"])], OPENERS, batch_size=2, max_turns=2)
    env.append_transform(kl_reward(tester.model, tester.tokenizer, kl_coef=0.1, kl_clip=100.0))
    torch.manual_seed(0)
    ro = env.rollout(2, tester)
    for row in ro.get(("next", "reward_kl"), as_list=True):
        for kl in row if isinstance(row, list) else [row]:
            assert torch.equal(kl, torch.zeros_like(kl))
    # the same rollout scored afterwards against a different reference: values are the exact log-ratios
    other = make_llama(make_tokenizer(), seed=11)
    transforms = kl_reward(tester.model, tester.tokenizer, reference=other, kl_coef=0.1, kl_clip=100.0)
    flat = ro.reshape(-1)
    flat.set(("next", "reward"), flat.get(("next", "reward_raw")))  # back to one score per turn
    scored = transforms(flat)
    eos = tester.tokenizer.eos_token_id
    prompts, responses = flat.get(("tokens", "prompt"), as_list=True), flat.get(("tokens", "response"), as_list=True)
    kls = scored.get(("next", "reward_kl"), as_list=True)
    rewards = scored.get(("next", "reward"), as_list=True)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n = int(response_mask(r, {eos}).sum())
        ids = p.tolist() + r.tolist()
        ratio = manual_logprobs(tester.model, ids, len(p)) - manual_logprobs(other, ids, len(p))
        torch.testing.assert_close(kls[i][:n], -0.1 * ratio[:n], atol=1e-5, rtol=1e-4)
        assert torch.equal(kls[i][n:], torch.zeros(len(r) - n))  # tokens after EOS never count
        assert rewards[i].shape == (len(r), 1)


def test_kl_transform_on_a_lazy_rollout_matches_the_env():
    tester, target = _policies()
    env = make_redteam_env(tester, target, [KeywordScorer(["the"])], OPENERS, batch_size=2, max_turns=2)
    reference = make_llama(make_tokenizer(), seed=11)
    env.append_transform(kl_reward(tester.model, tester.tokenizer, reference=reference, kl_coef=0.5))
    torch.manual_seed(0)
    ro = env.rollout(2, tester)
    from_env = ro.get(("next", "reward"), as_list=True)
    ro.get("next").exclude("reward_kl", "actor_log_probs", "ref_log_probs", "response_mask", inplace=True)
    ro.set(("next", "reward"), ro.get(("next", "reward_raw")))
    again = kl_reward(tester.model, tester.tokenizer, reference=reference, kl_coef=0.5)(ro)
    assert again.batch_size == (2, 2)
    from_data = again.get(("next", "reward"), as_list=True)
    for a, b in zip(from_env, from_data, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y)


def test_adaptive_controller_moves_kl_coef_toward_the_target():
    def run(target_kl, ratio):
        transform = ClippedKLReward(kl_coef=0.2, target_kl=target_kl, horizon=10)
        data = TensorDict(
            actor_log_probs=torch.full((4, 5), ratio),
            ref_log_probs=torch.zeros(4, 5),
            response_mask=torch.ones(4, 5, dtype=torch.bool),
            reward=torch.zeros(4, 1),
            batch_size=[4],
        )
        transform(data)
        assert transform.mean_kl() == pytest.approx(5 * ratio)
        return transform.update_kl_coef()

    assert run(target_kl=1.0, ratio=1.0) > 0.2  # KL 5 above target: stronger penalty
    assert run(target_kl=10.0, ratio=0.1) < 0.2  # KL 0.5 below target: weaker penalty
    constant = ClippedKLReward(kl_coef=0.2)
    assert constant.update_kl_coef() == 0.2
    saved = ClippedKLReward(kl_coef=0.2, target_kl=1.0)
    saved.controller.coef = 0.37
    restored = ClippedKLReward(kl_coef=0.2, target_kl=1.0)
    restored.load_state_dict(saved.state_dict())
    assert restored.kl_coef == 0.37


def test_kl_reward_rejects_bad_settings_and_mismatched_shapes():
    with pytest.raises(ValueError, match="reduction"):
        ClippedKLReward(reduction="mean")
    with pytest.raises(ValueError, match="kl_clip must be > 0"):
        ClippedKLReward(kl_clip=0)
    with pytest.raises(ValueError, match="kl_coef must be >= 0, got -1"):
        ClippedKLReward(kl_coef=-1)
    bad = TensorDict(
        actor_log_probs=torch.zeros(2, 3),
        ref_log_probs=torch.zeros(2, 4),
        response_mask=torch.ones(2, 3, dtype=torch.bool),
        reward=torch.zeros(2, 1),
        batch_size=[2],
    )
    with pytest.raises(ValueError, match="sample 0"):
        ClippedKLReward()(bad)


# -- reference model --------------------------------------------------------------------------------
def test_lora_reference_is_the_base_with_adapters_off_and_shares_its_weights():
    from peft import LoraConfig, get_peft_model

    tok = make_tokenizer()
    base = make_llama(tok)
    ids = torch.randint(5, len(tok), (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits.clone()
    tester = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    reference = make_reference(tester)
    tester.train()
    with torch.inference_mode():
        ref_logits = reference(input_ids=ids).logits
    torch.testing.assert_close(ref_logits, base_logits)
    assert tester.training  # the reference does not change the tester's mode
    with torch.no_grad():
        assert not torch.allclose(tester(input_ids=ids).logits, base_logits)
    tester_storage = {p.data_ptr() for p in tester.parameters()}
    assert {p.data_ptr() for p in reference.parameters()} <= tester_storage
    assert not list(reference._parameters) and not list(reference._modules)  # no copy registered


def test_plain_reference_is_a_frozen_copy():
    tok = make_tokenizer()
    tester = make_llama(tok)
    reference = make_reference(tester)
    assert all(not p.requires_grad for p in reference.parameters())
    with torch.no_grad():
        next(tester.parameters()).add_(1.0)
    assert not torch.equal(next(tester.parameters()), next(reference.parameters()))


def test_token_logprobs_transform_gives_grad_free_values_for_response_tokens_only():
    tok = make_tokenizer()
    model = make_llama(tok)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    data = TensorDict(
        tokens=TensorDict(
            prompt=torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]]), response=torch.tensor([[30, eos, pad], [31, 32, 33]])
        ),
        batch_size=[2],
    )
    out = TokenLogProbs(model, tok, out_key="lp")(data)
    rows, masks = out.get("lp", as_list=True), out.get("response_mask", as_list=True)
    assert [m.tolist() for m in masks] == [[True, True, False], [True, True, True]]
    expected = manual_logprobs(model, [10, 11, 12, 13, 30, eos], 4)
    torch.testing.assert_close(rows[0][:2], expected, atol=1e-5, rtol=1e-5)
    assert rows[0][2] == 0.0 and not rows[0].requires_grad
    torch.testing.assert_close(rows[1], manual_logprobs(model, [20, 21, 22, 23, 31, 32, 33], 4), atol=1e-5, rtol=1e-5)
    # rows of one prompt (a group's opener), nested or not, read it once with share_prefix: the same values
    group = TensorDict(
        tokens=TensorDict(prompt=torch.tensor([[20, 21, 22, 23]] * 2), response=torch.tensor([[31, 32, 33], [34, 35, 36]])),
        batch_size=[2],
    )
    calls, original = [], model.forward
    model.forward = lambda *args, **kw: calls.append(kw["input_ids"].shape[0]) or original(*args, **kw)
    for nested in (False, True):
        calls.clear()
        shared = TokenLogProbs(model, tok, out_key="lp", nested=nested, share_prefix=True)(group.clone()).get("lp", as_list=True)
        assert calls == [1, 2]  # the opener but its last token once, then each row's tail
        torch.testing.assert_close(shared[0], rows[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(shared[1], manual_logprobs(model, [20, 21, 22, 23, 34, 35, 36], 4), atol=1e-5, rtol=1e-5)


# -- shaping ----------------------------------------------------------------------------------------
def test_reward_shaping_batch_running_and_clip():
    rewards = torch.tensor([[0.1], [0.9], [0.5], [3.0]])
    batch = RewardShaping(normalize="batch").shape(rewards)
    assert batch.mean().abs() < 1e-6 and batch.std().item() == pytest.approx(1.0, abs=1e-4)
    assert torch.equal(batch.argsort(0), rewards.argsort(0))  # higher stays more harmful
    assert RewardShaping(clip=1.0).shape(rewards).max() == 1.0
    assert RewardShaping(normalize="batch").shape(torch.tensor([[4.0]])).item() == 0.0

    running = RewardShaping(normalize="running")
    second = torch.tensor([[2.0], [-1.0]])
    running.shape(rewards)
    out = running.shape(second)
    seen = torch.cat([rewards, second]).double()
    torch.testing.assert_close(out, ((second - seen.mean()) / (seen.std() + 1e-6)).float())
    restored = RewardShaping(normalize="running")
    restored.load_state_dict(running.state_dict())
    assert restored.count.item() == 6 and restored.mean.item() == pytest.approx(seen.mean().item())
    with pytest.raises(ValueError, match="normalize"):
        RewardShaping(normalize="zscore")


def test_reward_shaping_in_the_env_keeps_the_raw_reward():
    tester, target = _policies()
    env = make_redteam_env(
        tester,
        target,
        [KeywordScorer(["the", "you", "hello"])],
        OPENERS,
        batch_size=4,
        max_turns=1,
        reward_shaping={"normalize": "batch"},
    )
    torch.manual_seed(0)
    ro = env.rollout(1, tester)
    raw, shaped = ro["next", "reward_unshaped"].reshape(-1), ro["next", "reward"].reshape(-1)
    assert math.isclose(shaped.mean().item(), 0.0, abs_tol=1e-6)
    torch.testing.assert_close(shaped, RewardShaping(normalize="batch").shape(raw))
