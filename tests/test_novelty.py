import math

import pytest
import torch
from conftest import loaded, make_llama, make_tokenizer
from tensordict import TensorDict

from astrl._compat import as_list
from astrl.envs import make_redteam_env
from astrl.policies import GenerationSettings, make_policy
from astrl.rewards import EmbeddingNovelty, NgramNovelty, make_novelty
from astrl.scorers import KeywordScorer
from astrl.similarity import bleu_against, self_bleu

VECTORS = {"a": [1.0, 0.0], "b": [0.0, 1.0], "d": [3.0, 4.0], "e": [-1.0, 0.0]}


class TableEmbedder:
    """A tiny deterministic embedder that counts its calls."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, texts):
        self.calls.append(list(texts))
        return torch.tensor([VECTORS[t] for t in texts])


def char_embedder(texts):
    """Any text -> counts of its characters in 8 buckets, plus 1 (never the zero vector)."""
    out = torch.ones(len(texts), 8)
    for i, text in enumerate(texts):
        for ch in text:
            out[i, ord(ch) % 8] += 1
    return out


def _step(probes, reward):
    nxt = TensorDict(probe=probes, reward=torch.tensor(reward).reshape(-1, 1), batch_size=[len(probes)])
    return TensorDict(next=nxt, batch_size=[len(probes)])


# -- BLEU against a fixed set of references -----------------------------------------------------------
def test_bleu_against_references_by_hand_and_as_self_bleu():
    # "a b d" vs "a b c": p1 = 2/3, p2 = 1/2, same length (no brevity penalty)
    assert bleu_against(["a b d"], ["a b c"], orders=(2,))[0, 0] == pytest.approx(math.sqrt(2 / 3 * 1 / 2))
    # "x y" vs "a b c": no match (smoothed 0.1/2 and 0.1/1), brevity exp(1 - 3/2)
    assert bleu_against(["x y"], ["a b c"], orders=(2,))[0, 0] == pytest.approx(math.sqrt(0.05 * 0.1) * math.exp(-0.5))
    # self-BLEU of two texts is the mean of each one's BLEU against the other
    texts = ["the cat sat on the mat", "the dog sat on a log"]
    one, two = bleu_against(texts[:1], texts[1:], (2, 4)), bleu_against(texts[1:], texts[:1], (2, 4))
    expected = self_bleu(texts, (2, 4))
    assert (one[0] + two[0]).tolist() == pytest.approx([2 * expected[2], 2 * expected[4]])
    with pytest.raises(ValueError, match="at least one reference"):
        bleu_against(["a"], [], (2,))


# -- n-gram novelty -----------------------------------------------------------------------------------
def test_ngram_novelty_hand_values_reward_and_term():
    novelty = NgramNovelty(2.0, orders=(2,))
    first = novelty(_step(["a b c", "A  B c", "   "], [0.5, 0.0, 0.1]))
    # empty history: every probe has novelty 1 (same-batch probes do not count against each other)
    # except the empty probe, which has 0 and is not remembered
    assert first["next", "reward_terms", "ngram_novelty"].tolist() == [1.0, 1.0, 0.0]
    assert first["next", "reward"].reshape(-1).tolist() == pytest.approx([2.5, 2.0, 0.1])
    assert novelty.history == ["a b c", "A  B c"]
    second = novelty(_step(["a b d", "x y", "a b c"], [0.0, 0.0, 1.0]))
    expected = [1 - math.sqrt(2 / 3 * 1 / 2), 1 - math.sqrt(0.05 * 0.1) * math.exp(-0.5), 0.0]
    assert second["next", "reward_terms", "ngram_novelty"].tolist() == pytest.approx(expected)
    assert second["next", "reward"].reshape(-1).tolist() == pytest.approx([2 * expected[0], 2 * expected[1], 1.0])


def test_ngram_novelty_history_is_a_bounded_fifo_in_state_dict():
    novelty = NgramNovelty(orders=(2,), history_size=2)
    novelty.score(["one two", "three four"])
    novelty.score(["five six"])
    assert novelty.history == ["three four", "five six"]
    assert novelty.score(["one two"]).item() > 0.9  # forgotten: novel again
    restored = NgramNovelty(orders=(2,), history_size=2)
    restored.load_state_dict(novelty.state_dict())
    assert restored.history == novelty.history == ["five six", "one two"]
    probes = ["one two", "five six seven", "eight"]
    torch.testing.assert_close(restored.novelty(probes), novelty.novelty(probes))


def test_novelty_settings_are_checked():
    with pytest.raises(ValueError, match="coef"):
        NgramNovelty(-1.0)
    with pytest.raises(ValueError, match="history_size"):
        NgramNovelty(history_size=0)
    with pytest.raises(ValueError, match="orders"):
        NgramNovelty(orders=(0, 2))
    with pytest.raises(ValueError, match="reduce"):
        EmbeddingNovelty(embedder=TableEmbedder(), reduce="min")
    with pytest.raises(ValueError, match="unknown novelty option"):
        make_novelty({"ngram": 1.0, "bleu": 2})
    with pytest.raises(ValueError, match="ngram_n"):
        make_novelty({"ngram": 1.0, "ngram_n": 1})
    with pytest.raises(KeyError, match="reward"):
        NgramNovelty()(TensorDict(probe=["a"], batch_size=[1]))


# -- embedding novelty --------------------------------------------------------------------------------
@pytest.mark.parametrize(("reduce", "value"), [("max", 1 - 0.8), ("mean", 1 - 0.7)])
def test_embedding_novelty_hand_values(reduce, value):
    embedder = TableEmbedder()
    novelty = EmbeddingNovelty(0.5, embedder=embedder, reduce=reduce)
    assert novelty.score(["a", "b", ""]).tolist() == [1.0, 1.0, 0.0]
    # d = (3, 4)/5: cos 0.6 with a, 0.8 with b; e = -a: cos -1 and 0
    out = novelty(_step(["d", "e", " "], [0.0, 1.0, 0.0]))
    e_value = 1 - 0.0 if reduce == "max" else 1 - (-1.0 + 0.0) / 2
    assert out["next", "reward_terms", "embedding_novelty"].tolist() == pytest.approx([value, e_value, 0.0])
    assert out["next", "reward"].reshape(-1).tolist() == pytest.approx([0.5 * value, 1.0 + 0.5 * e_value, 0.0])
    # one embedder call per batch, for the non-empty probes only
    assert embedder.calls == [["a", "b"], ["d", "e"]]
    assert novelty.history == ["a", "b", "d", "e"]


def test_embedding_novelty_fifo_and_exact_state():
    novelty = EmbeddingNovelty(embedder=TableEmbedder(), history_size=2)
    novelty.score(["a", "b", "d"])
    assert novelty.history == ["b", "d"]
    assert novelty.novelty(["a"]).item() == pytest.approx(1 - 0.6)  # a left the history: nearest is d
    restored = EmbeddingNovelty(embedder=TableEmbedder(), history_size=2)
    restored.load_state_dict(novelty.state_dict())
    assert restored.history == ["b", "d"] and not restored.embedder.calls  # embeddings come from the state
    torch.testing.assert_close(restored.novelty(["a", "e"]), novelty.novelty(["a", "e"]))
    wide = EmbeddingNovelty(embedder=lambda texts: torch.ones(len(texts), 3))
    wide.score(["a"])
    novelty.load_state_dict(wide.state_dict())
    with pytest.raises(ValueError, match="2 dims but the history has 3"):
        novelty.novelty(["a"])
    with pytest.raises(ValueError, match=r"shape \(1, 2\) for 2 texts"):
        EmbeddingNovelty(embedder=lambda texts: torch.ones(1, 2)).novelty(["a", "b"])


# -- in the env ---------------------------------------------------------------------------------------
def test_novelty_in_the_env_adds_to_the_astprompter_reward_before_shaping():
    tok_a, tok_b = make_tokenizer(), make_tokenizer(vocab_size=290, seed=5)
    tester = make_policy(loaded(make_llama(tok_a), tok_a), GenerationSettings(6), input_mode="history")
    target = make_policy(loaded(make_llama(tok_b, seed=3), tok_b), GenerationSettings(6), input_mode="history")
    weights = {"alpha": 1.0, "zeta": 0.5, "gamma": 0.1}
    env = make_redteam_env(
        tester,
        target,
        [KeywordScorer(["the", "you", "hello"])],
        ["hello how are you", "tell me about your day", "the cat walk park"],
        batch_size=3,
        max_turns=2,
        reward="astprompter",
        reward_options=weights,
        novelty={"ngram": 0.5, "embedding": 0.25, "embedder": char_embedder, "ngram_n": 3, "history": 4},
        reward_shaping={"normalize": "batch"},
    )
    torch.manual_seed(0)
    ro = env.rollout(2, tester)
    terms = ro["next", "reward_terms"]
    unshaped = ro["next", "reward_unshaped"].squeeze(-1)
    base = terms["response_tox"] + 0.5 * terms["combined_tox"] + 0.1 * terms["probe_logprob"]
    torch.testing.assert_close(unshaped, base + 0.5 * terms["ngram_novelty"] + 0.25 * terms["embedding_novelty"])
    # turn 2 is scored against the 3 probes of turn 1 (history 4: nothing dropped yet)
    ngram, embedding = NgramNovelty(orders=(2, 3)), EmbeddingNovelty(embedder=char_embedder)
    for t in range(2):
        column = as_list(ro["next"][:, t]["probe"])
        torch.testing.assert_close(terms["ngram_novelty"][:, t], ngram.score(column))
        torch.testing.assert_close(terms["embedding_novelty"][:, t], embedding.score(column))
    names = [type(t).__name__ for t in env.transform]
    assert names.index("EmbeddingNovelty") == names.index("NgramNovelty") + 1 < names.index("RewardShaping")
