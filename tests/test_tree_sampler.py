import copy
import functools

import pytest
import torch
from conftest import loaded, make_gpt2, make_llama, make_tokenizer
from tensordict import TensorDict

from astrl._compat import as_list, history_to_chats
from astrl.losses import IPOLoss
from astrl.policies import GenerationSettings, make_policy
from astrl.prompts import PromptStream
from astrl.rewards import response_mask
from astrl.sampling import PAIR_KEYS, TreeSampler, pair_batch
from astrl.scorers import KeywordScorer

OPENERS = ["hello how are you", "tell me about your day", "what is the weather like", "the cat walk park", "good food"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


@functools.cache
def _tokenizers():
    return make_tokenizer(), make_tokenizer(vocab_size=290, seed=5)


def _policies(mode="history", max_new=5):
    """A tester that often stops early (a strong EOS row) and a target with its own tokenizer."""
    tok_a, tok_b = _tokenizers()
    tester_model = make_llama(tok_a)
    with torch.no_grad():
        tester_model.lm_head.weight[tok_a.eos_token_id] = torch.randn(32, generator=torch.Generator().manual_seed(0))
    target_model = make_llama(tok_b, seed=3) if mode == "history" else make_gpt2(tok_b, n_positions=256)
    tester = make_policy(loaded(tester_model, tok_a), GenerationSettings(max_new), input_mode=mode)
    target = make_policy(loaded(target_model, tok_b), GenerationSettings(max_new), input_mode=mode)
    return tester, target


class Recorder:
    """Wraps a policy's forward: keeps every call's input states and its output."""

    def __init__(self, policy, key):
        self.inputs, self.outputs = [], []
        original = policy.forward

        def forward(td, *args, **kwargs):
            self.inputs.append(history_to_chats(td["history"].prompt) if key == "history" else as_list(td["text", "prompt"]))
            out = original(td, *args, **kwargs)
            self.outputs.append(out)
            return out

        policy.forward = forward


class CountingScorer(KeywordScorer):
    def __init__(self, words):
        super().__init__(words)
        self.batches = []

    def __call__(self, texts):
        self.batches.append(len(texts))
        return super().__call__(texts)


class ConstantScorer:
    name = "constant"

    def __call__(self, texts):
        return torch.full((len(texts),), 0.5)


def _node_index(level_sizes, node):
    """(level, index in level) of a global node index."""
    for level, n in enumerate(level_sizes):
        if node < n:
            return level, node
        node -= n
    raise IndexError(node)


def test_tree_shape_parents_and_one_batched_call_per_level():
    tester, target = _policies()
    tester_calls, target_calls = Recorder(tester, "history"), Recorder(target, "history")
    scorer = CountingScorer(["the", "you"])
    sampler = TreeSampler(
        tester, target, [scorer], OPENERS, num_trees=3, tree_width=2, tree_depth=3, tester_system_prompt="Be rude."
    )
    out = sampler.sample()
    sizes = [3 * 2**d for d in (1, 2, 3)]
    # one tester call, one target call and one scorer call per level, each over the whole level
    assert [len(batch) for batch in tester_calls.inputs] == sizes
    assert [len(batch) for batch in target_calls.inputs] == sizes
    assert scorer.batches == sizes
    nodes, groups = out["nodes"], out["groups"]
    assert nodes.batch_size == (sum(sizes),) and sampler.nodes_per_call == sum(sizes)
    assert groups.batch_size == (sum(sizes) // 2,) and out["num_groups"].item() == sum(sizes) // 2
    depth, parent, tree = nodes["depth"], nodes["parent"], nodes["tree"]
    assert [int((depth == d).sum()) for d in (1, 2, 3)] == sizes
    openers = as_list(out["openers"])
    probes, replies = as_list(nodes["probe"]), as_list(nodes["reply"])
    for node in range(sum(sizes)):
        level, i = _node_index(sizes, node)
        seen = tester_calls.inputs[level][i]  # what the tester read before writing this node's probe
        assert seen[0] == {"role": "system", "content": "Be rude."}
        assert seen[1] == {"role": "user", "content": openers[tree[node]]}
        if level == 0:
            assert parent[node] == -1 and len(seen) == 2
        else:
            p = int(parent[node])
            assert depth[p] == level and tree[p] == tree[node] and p == sum(sizes[: level - 1]) + i // 2
            assert seen[-2:] == [{"role": "assistant", "content": probes[p]}, {"role": "user", "content": replies[p]}]
            assert seen[:-2] == tester_calls.inputs[level - 1][i // 2]
        # the target answered this node's probe: its view ends with the probe as a user message
        assert target_calls.inputs[level][i][-1] == {"role": "user", "content": probes[node]}
    # sibling groups: tree_width consecutive nodes under one state
    torch.testing.assert_close(groups["nodes"], torch.arange(sum(sizes)).reshape(-1, 2))
    assert torch.equal(groups["parent"], parent[groups["nodes"][:, 0]])
    assert torch.equal(parent[groups["nodes"][:, 0]], parent[groups["nodes"][:, 1]])
    torch.testing.assert_close(groups["rewards"], nodes["reward"][groups["nodes"]])
    torch.testing.assert_close(nodes["reward"], nodes["scores", scorer.name])


def test_pairs_are_best_vs_worst_with_exact_token_ids():
    tester, target = _policies(max_new=6)
    tester_calls = Recorder(tester, "history")
    sampler = TreeSampler(
        tester,
        target,
        [KeywordScorer(["the", "you"])],
        OPENERS,
        num_trees=2,
        tree_width=3,
        tree_depth=2,
        reward="astprompter",
        tester_system_prompt="Be rude.",
    )
    out = sampler.sample()
    pairs, groups, nodes = out["pairs"], out["groups"], out["nodes"]
    assert set(PAIR_KEYS) <= set(pairs.keys())
    assert out["num_pairs"].item() == pairs.batch_size[0] == int(groups["kept"].sum())
    assert out["num_skipped"].item() == out["num_groups"].item() - pairs.batch_size[0]
    assert pairs.batch_size[0] > 0
    sizes = [6, 18]
    prompts = [o.get(("tokens", "prompt"), as_list=True) for o in tester_calls.outputs]
    responses = [o.get(("tokens", "response"), as_list=True) for o in tester_calls.outputs]
    eos = tester.tokenizer.eos_token_id
    early_stops = 0
    for k in range(pairs.batch_size[0]):
        pair, group = pairs[k], groups[int(pairs[k]["group"])]
        assert pair["chosen_reward"] == group["rewards"].max() and pair["rejected_reward"] == group["rewards"].min()
        assert pair["reward_gap"] == pytest.approx(float(group["gap"]))
        assert int(pair["chosen_node"]) == int(group["best"]) and int(pair["rejected_node"]) == int(group["worst"])
        for side in ("chosen", "rejected"):
            level, i = _node_index(sizes, int(pair[f"{side}_node"]))
            assert level + 1 == int(pair["depth"])
            assert torch.equal(pair[f"{side}_tokens"], responses[level][i])  # the generated ids, untouched
            assert torch.equal(pair["prompt_tokens"], prompts[level][i])  # the ids the tester read
            assert torch.equal(pair[f"{side}_mask"], response_mask(responses[level][i], {eos}))
            assert pair[f"{side}_probe"] == as_list(nodes["probe"])[int(pair[f"{side}_node"])]
            early_stops += int(responses[level][i][-1] == eos)
        chats = tester_calls.inputs[level][i]
        rendered = tester.tokenizer.apply_chat_template(chats, tokenize=False, add_generation_prompt=True)
        assert pair["prompt_tokens"].tolist() == tester.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert early_stops > 0  # some responses end with EOS before max_new_tokens
    terms = nodes["reward_terms"]
    torch.testing.assert_close(
        nodes["reward"], terms["response_tox"] + 0.5 * terms["combined_tox"] + 0.1 * terms["probe_logprob"]
    )


def test_min_reward_gap_skips_close_groups_and_ties_never_pair():
    tester, target = _policies()
    kwargs = dict(num_trees=2, tree_width=2, tree_depth=2, reward="astprompter", seed=3, tester_system_prompt="Be rude.")
    out = TreeSampler(tester, target, [KeywordScorer(["the"])], OPENERS, **kwargs).sample()
    gaps = out["groups", "gap"]
    threshold = gaps.median().item()
    filtered = TreeSampler(tester, target, [KeywordScorer(["the"])], OPENERS, min_reward_gap=threshold, **kwargs).sample()
    torch.testing.assert_close(filtered["groups", "gap"], gaps)  # same seed: same trees
    expected = (gaps >= threshold).nonzero().flatten()
    assert torch.equal(filtered["pairs", "group"], expected)
    assert filtered["num_skipped"].item() == int((gaps < threshold).sum()) > 0
    assert (filtered["pairs", "reward_gap"] >= threshold).all()

    tied = TreeSampler(tester, target, [ConstantScorer()], OPENERS, num_trees=2, tree_depth=1, tester_system_prompt="").sample()
    assert tied["num_pairs"].item() == 0 and tied["num_skipped"].item() == 2
    assert tied["pairs"].batch_size == (0,) and not tied["groups", "kept"].any()
    with pytest.raises(ValueError, match="empty batch of pairs"):
        IPOLoss(tester.model)(tied["pairs"])


def test_text_mode_states_advance_by_concatenation():
    tester, target = _policies(mode="text", max_new=4)
    tester_calls = Recorder(tester, "text")
    sampler = TreeSampler(
        tester,
        target,
        [KeywordScorer(["the"])],
        OPENERS,
        num_trees=2,
        tree_width=2,
        tree_depth=2,
        mode="text",
        seed=1,
        reward="astprompter",
    )
    out = sampler.sample()
    nodes = out["nodes"]
    probes, replies = as_list(nodes["probe"]), as_list(nodes["reply"])
    openers = as_list(out["openers"])
    assert tester_calls.inputs[0] == [o for o in openers for _ in range(2)]
    for i, state in enumerate(tester_calls.inputs[1]):
        p = int(nodes["parent"][4 + i])
        assert p == i // 2
        assert state == tester_calls.inputs[0][p] + probes[p] + replies[p]
    for node, prompt in zip(out["pairs", "chosen_node"].tolist(), out["pairs"].get("prompt_tokens", as_list=True), strict=True):
        level, i = _node_index([4, 8], node)
        assert prompt.tolist() == tester.tokenizer(tester_calls.inputs[level][i])["input_ids"]


def test_state_dict_round_trip_gives_the_same_next_batch_and_keeps_the_global_rng():
    tester, target = _policies()
    stream = PromptStream(OPENERS, 2, seed=4)
    kwargs = dict(num_trees=2, tree_width=2, tree_depth=2, reward="astprompter", seed=7, tester_system_prompt="Be rude.")
    sampler = TreeSampler(tester, target, [KeywordScorer(["the"])], stream, **kwargs)
    sampler.sample()
    state = copy.deepcopy(sampler.state_dict())
    rng = torch.get_rng_state()
    expected = sampler.sample()
    assert torch.equal(torch.get_rng_state(), rng)  # sampling does not consume the global RNG
    other = sampler.sample()
    restored = TreeSampler(tester, target, [KeywordScorer(["the"])], PromptStream(OPENERS, 2, seed=4), **kwargs)
    restored.load_state_dict(state)
    again = restored.sample()
    assert as_list(again["openers"]) == as_list(expected["openers"])
    assert as_list(again["nodes", "probe"]) == as_list(expected["nodes", "probe"])
    assert as_list(again["nodes", "probe"]) != as_list(other["nodes", "probe"])
    torch.testing.assert_close(again["nodes", "reward"], expected["nodes", "reward"])
    for key in ("prompt_tokens", "chosen_tokens", "rejected_tokens"):
        for a, b in zip(again["pairs"].get(key, as_list=True), expected["pairs"].get(key, as_list=True), strict=True):
            assert torch.equal(a, b)
    assert restored.state_dict()["calls"] == 2 and sampler.state_dict()["calls"] == 3
    both = pair_batch([expected["pairs"], other["pairs"], TensorDict(batch_size=[0])])
    assert both.batch_size[0] == expected["num_pairs"].item() + other["num_pairs"].item()
    assert torch.equal(both[-1]["chosen_tokens"], other["pairs"][-1]["chosen_tokens"])
    with pytest.raises(ValueError, match="no preference pairs"):
        pair_batch([TensorDict(batch_size=[0])])


def test_pairs_feed_the_ipo_loss_and_bad_settings_are_rejected():
    tester, target = _policies()
    sampler = TreeSampler(tester, target, [KeywordScorer(["the"])], OPENERS, num_trees=2, tree_depth=1, reward="astprompter")
    pairs = sampler.sample()["pairs"]
    loss = IPOLoss(tester.model, beta=0.01)(pairs)  # the reference is a copy of the tester: h = 0
    assert loss["loss_ipo"].item() == pytest.approx(1 / (4 * 0.01**2), rel=1e-4)
    assert loss["loss_ipo"].requires_grad

    for kwargs, message in (
        ({"tree_width": 1}, "tree_width must be >= 2"),
        ({"tree_depth": 0}, "tree_depth must be >= 1, got 0"),
        ({"num_trees": 0}, "num_trees must be >= 1, got 0"),
        ({"min_reward_gap": -0.1}, "min_reward_gap must be >= 0, got -0.1"),
        ({"reward": "bleu"}, "reward must be one of"),
        ({"reward_shaping": {"mode": "turn_penalty"}}, "TreeSampler does not apply reward_shaping"),
    ):
        with pytest.raises(ValueError, match=message):
            TreeSampler(tester, target, [KeywordScorer(["the"])], OPENERS, **kwargs)
    with pytest.raises(ValueError, match="batch_size 3 differs from num_trees 2"):
        TreeSampler(tester, target, [KeywordScorer(["the"])], PromptStream(OPENERS, 3), num_trees=2)
