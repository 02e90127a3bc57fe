"""Search-guided GRPO: the forcing processor, the forced first turn, and guided members in GRPO groups."""

from __future__ import annotations

import pytest
import torch
from conftest import make_llama, make_tokenizer
from test_training import _config, _trainer

from astrl._compat import as_list
from astrl.keys import NEXT, REWARD, STEP_COUNT, TOKENS_RESPONSE
from astrl.training.config import ConfigError, load_config
from astrl.training.guidance import ForceTokens, forced_first_turn, group_openers


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
    guide, rollout = algorithm.guide, algorithm.guide.rollout
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
