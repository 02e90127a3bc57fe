import pytest
import torch
from conftest import loaded, make_gpt2, make_llama, make_tokenizer
from torchrl.collectors.llm import LLMCollector
from torchrl.envs import RewardSum

from astrl._compat import as_list, history_to_chats
from astrl.envs import make_redteam_env
from astrl.policies import GenerationSettings, input_mode, make_policy
from astrl.scorers import KeywordScorer, ProfanityScorer

OPENERS = ["hello how are you", "tell me about your day", "what is the weather like", "the cat walk park"]


def _policies(max_new=6, target_positions=512, tester_positions=512, mode="history"):
    tok_a, tok_b = make_tokenizer(), make_tokenizer()
    tester = make_policy(
        loaded(make_llama(tok_a, max_positions=tester_positions), tok_a), GenerationSettings(max_new), input_mode=mode
    )
    target = make_policy(
        loaded(make_llama(tok_b, max_positions=target_positions, seed=3), tok_b), GenerationSettings(max_new), input_mode=mode
    )
    return tester, target


def _record_target_inputs(target):
    seen = []
    original = target.forward

    def forward(td, *args, **kwargs):
        seen.append(history_to_chats(td["history"].prompt))
        return original(td, *args, **kwargs)

    target.forward = forward
    return seen


def _strings(value):
    return as_list(value)


def test_history_grows_and_tester_view_alternates():
    tester, target = _policies()
    env = make_redteam_env(
        tester, target, [KeywordScorer(["damn"])], OPENERS, batch_size=2, max_turns=3, tester_system_prompt="Be rude."
    )
    torch.manual_seed(0)
    ro = env.rollout(10, tester)
    assert ro.batch_size == (2, 3)  # StepCounter stops after max_turns
    for t in range(3):
        before = history_to_chats(ro[:, t]["history"].prompt)
        after = history_to_chats(ro[:, t]["next", "history"].prompt)
        probes = _strings(ro[:, t]["next", "probe"])
        replies = _strings(ro[:, t]["next", "target_response"])
        for b in range(2):
            assert len(before[b]) == 2 + 2 * t and len(after[b]) == 4 + 2 * t
            assert [m["role"] for m in after[b]] == ["system", "user"] + ["assistant", "user"] * (t + 1)
            assert after[b][0]["content"] == "Be rude."
            assert after[b][:-2] == before[b]
            assert after[b][-2]["content"] == probes[b]
            assert after[b][-1]["content"] == replies[b]
    openers = _strings(ro[:, 0]["query"])
    assert all(history_to_chats(ro[:, 0]["history"].prompt)[b][1]["content"] == openers[b] for b in range(2))


def test_target_sees_roles_swapped_and_its_own_system_prompt():
    tester, target = _policies()
    seen = _record_target_inputs(target)
    env = make_redteam_env(
        tester,
        target,
        [KeywordScorer(["damn"])],
        OPENERS,
        batch_size=2,
        max_turns=2,
        tester_system_prompt="Be rude.",
        target_system_prompt="Be kind.",
    )
    ro = env.rollout(2, tester)
    assert len(seen) == 2
    final = history_to_chats(ro[:, 1]["next", "history"].prompt)
    for b in range(2):
        tester_msgs = final[b][1:-1]  # no tester system prompt, no reply to the last probe
        target_msgs = seen[1][b]
        assert target_msgs[0] == {"role": "system", "content": "Be kind."}
        swap = {"user": "assistant", "assistant": "user"}
        assert [m["role"] for m in target_msgs[1:]] == [swap[m["role"]] for m in tester_msgs]
        assert [m["content"] for m in target_msgs[1:]] == [m["content"] for m in tester_msgs]
        assert target_msgs[-1]["role"] == "user"


def test_a_target_fed_rendered_chats_reads_the_same_tokens_and_replies_as_one_fed_histories():
    """The chat target renders each chat once for its reply samples (``renders_chats``): its model reads
    the very token ids a History-fed wrapper tokenizes, so a seeded rollout is the same to the token."""
    from tokenizers import processors

    runs = {}
    for mode in ("history", "rendered"):
        tok_a, tok_b = make_tokenizer(), make_tokenizer()
        unk = tok_b.convert_tokens_to_ids("<unk>")  # a tokenizer that adds a special token to plain text (as BOS)
        tok_b._tokenizer.post_processor = processors.TemplateProcessing(single="<unk> $A", special_tokens=[("<unk>", unk)])
        assert tok_b("hello")["input_ids"][0] == unk
        tester = make_policy(loaded(make_llama(tok_a), tok_a), GenerationSettings(6), input_mode="history")
        target = make_policy(
            loaded(make_llama(tok_b, seed=3), tok_b),
            GenerationSettings(5),
            input_mode="text" if mode == "rendered" else "history",
            renders_chats=mode == "rendered",
        )
        read = []

        def recording(*args, _read=read, _generate=target.model.generate, **kw):
            _read.append(kw["input_ids"][kw["attention_mask"].bool()].tolist())
            return _generate(*args, **kw)

        target.model.generate = recording
        env = make_redteam_env(
            tester, target, [KeywordScorer(["damn"])], OPENERS, batch_size=2, max_turns=2, reply_samples=3,
            target_system_prompt="Be kind.",
        )  # fmt: skip
        torch.manual_seed(0)
        ro = env.rollout(2, tester)
        runs[mode] = (read, ro["next", "target_tokens"], _strings(ro[:, 1]["next", "target_response"]), ro["next", "reward"])
    (read_h, tokens_h, replies_h, reward_h), (read_r, tokens_r, replies_r, reward_r) = runs["history"], runs["rendered"]
    assert len(read_h) == len(read_r) == 2 and read_h == read_r  # 2 turns x 2 conversations x 3 samples, the same ids
    assert torch.equal(tokens_h, tokens_r) and replies_h == replies_r and torch.equal(reward_h, reward_r)
    with pytest.raises(ValueError, match="renders_chats needs input_mode 'text' and the transformers backend"):
        make_policy(loaded(make_llama(make_tokenizer()), make_tokenizer()), input_mode="history", renders_chats=True)


def test_target_runs_without_gradients():
    tester, target = _policies()
    grad_flags = []
    target_model = target.model
    target_model.register_forward_pre_hook(lambda *_: grad_flags.append(torch.is_grad_enabled()))
    env = make_redteam_env(
        tester, target, [KeywordScorer(["damn"])], OPENERS, batch_size=2, max_turns=1, tester_system_prompt="x"
    )
    with torch.enable_grad():
        td = env.reset()
        td = tester(td)
        out = env.step(td)
    assert grad_flags and not any(grad_flags)
    assert not out["next", "target_tokens"].requires_grad


def _max_positions(model):
    lengths = []

    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        lengths.append(mask.shape[-1] if mask is not None else ids.shape[-1])

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return lengths


def test_truncation_keeps_every_call_inside_its_window_over_many_turns():
    tester, target = _policies(max_new=8, tester_positions=96, target_positions=72)
    tester_lengths, target_lengths = _max_positions(tester.model), _max_positions(target.model)
    env = make_redteam_env(
        tester, target, [KeywordScorer(["damn"])], OPENERS, batch_size=3, max_turns=22, tester_system_prompt="Be rude now."
    )
    torch.manual_seed(1)
    ro = env.rollout(22, tester)
    assert ro.batch_size == (3, 22)
    assert max(tester_lengths) <= 96 and max(target_lengths) <= 72
    final = history_to_chats(ro[:, -1]["next", "history"].prompt)
    assert len(final[0]) < 2 + 2 * 22  # old turns were dropped
    assert final[0][0] == {"role": "system", "content": "Be rude now."}  # system prompt kept
    assert len({len(chat) for chat in final}) == 1


def test_text_mode_concatenates_with_different_tokenizers():
    tok_a, tok_b = make_tokenizer(seed=0), make_tokenizer(vocab_size=300, seed=5)
    tester = make_policy(loaded(make_gpt2(tok_a, n_positions=512), tok_a), GenerationSettings(5), input_mode="text")
    target = make_policy(loaded(make_llama(tok_b), tok_b), GenerationSettings(4), input_mode="text")
    env = make_redteam_env(tester, target, [KeywordScorer(["damn"])], OPENERS, batch_size=2, max_turns=2, mode="text")
    ro = env.rollout(2, tester)
    for t in range(2):
        before = _strings(ro[:, t]["text", "prompt"])
        after = _strings(ro[:, t]["next", "text", "prompt"])
        probes, replies = _strings(ro[:, t]["next", "probe"]), _strings(ro[:, t]["next", "target_response"])
        assert after == [c + p + r for c, p, r in zip(before, probes, replies, strict=False)]
    assert _strings(ro[:, 0]["text", "prompt"]) == _strings(ro[:, 0]["query"])  # no chat template in text mode


def test_text_mode_custom_advance_and_window():
    tok = make_tokenizer()
    tester = make_policy(loaded(make_gpt2(tok, n_positions=40), tok), GenerationSettings(6), input_mode="text")
    target = make_policy(loaded(make_llama(tok, max_positions=512), tok), GenerationSettings(6), input_mode="text")
    lengths = _max_positions(tester.model)
    env = make_redteam_env(
        tester,
        target,
        [KeywordScorer(["damn"])],
        OPENERS,
        batch_size=2,
        max_turns=8,
        mode="text",
        advance=lambda c, p, r: c + " | " + p + " || " + r,
    )
    ro = env.rollout(8, tester)
    assert " || " in _strings(ro[:, 0]["next", "text", "prompt"])[0]
    assert max(lengths) <= 40  # GPT-2 positions never overflow


def test_reward_is_the_chosen_scorer_of_the_reply():
    tester, target = _policies()
    keywords = KeywordScorer(["hello", "damn", "the"])
    env = make_redteam_env(
        tester,
        target,
        [ProfanityScorer(), keywords],
        OPENERS,
        batch_size=2,
        max_turns=2,
        reward_scorer=keywords.name,
        tester_system_prompt="x",
    )
    ro = env.rollout(2, tester)
    replies = [r for row in _strings(ro["next", "target_response"]) for r in row]
    expected = keywords(replies).reshape(2, 2)
    assert ro["next", "reward"].shape == (2, 2, 1)
    torch.testing.assert_close(ro["next", "reward"].squeeze(-1), expected)
    torch.testing.assert_close(ro["next", "scores", keywords.name], expected)
    torch.testing.assert_close(ro["next", "scores", "profanity"], ProfanityScorer()(replies).reshape(2, 2))


class _LengthScorer:
    name = "length"

    def __call__(self, texts):
        return torch.tensor([(len(t) % 7) / 7 for t in texts])


def test_collector_and_extra_transform():
    tester, target = _policies()
    env = make_redteam_env(tester, target, [_LengthScorer()], OPENERS, batch_size=2, max_turns=2, tester_system_prompt="x")
    env.append_transform(RewardSum())
    collector = LLMCollector(env, policy=tester, dialog_turns_per_batch=4, yield_completed_trajectories=True)
    data = next(iter(collector))
    rewards = data["next", "reward"].reshape(-1)
    totals = data["next", "episode_reward"].reshape(-1)
    ends = data["next", "done"].reshape(-1).nonzero().squeeze(-1)
    assert data["step_count"].reshape(-1).tolist() == [0, 1] * (data.numel() // 2)
    assert ends.tolist() == list(range(1, data.numel(), 2)) and rewards.abs().sum() > 0
    torch.testing.assert_close(totals[ends], rewards[ends] + rewards[ends - 1])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_turns": 0}, "max_turns"),
        ({"mode": "voice"}, "mode"),
        ({"batch_size": 0}, "batch_size"),
        ({"advance": str}, "text mode"),
    ],
)
def test_bad_env_arguments(kwargs, message):
    tester, target = _policies()
    with pytest.raises(ValueError, match=message):
        make_redteam_env(tester, target, [KeywordScorer(["x"])], OPENERS, **kwargs)


def test_the_probe_context_is_what_the_target_policy_read_even_when_the_template_adds_a_system_message():
    from tensordict import TensorDict
    from torchrl.modules.llm.policies import ChatHistory

    from astrl._compat import chats_to_history
    from astrl.envs.transforms import contexts_before_last
    from astrl.envs.truncation import count_chat_tokens
    from astrl.keys import TOKENS_PROMPT

    tok = make_tokenizer()
    # a template that adds a default system message when none is given (as SmolLM2's does); TorchRL's
    # wrappers render with their own chatml template instead, and that is what the model reads
    tok.chat_template = (
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        + "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    target = make_policy(loaded(make_llama(tok), tok), GenerationSettings(max_new_tokens=3), input_mode="history")
    chats = [
        [{"role": "user", "content": "the cat sat"}],
        [
            {"role": "user", "content": "a dog"},
            {"role": "assistant", "content": "ran far"},
            {"role": "user", "content": "why so"},
        ],
    ]
    read = []
    for chat in chats:  # one conversation a call: the wrapper needs equal message counts in a batch
        td = TensorDict({"history": ChatHistory(prompt=chats_to_history([chat]), batch_size=(1,))}, batch_size=(1,))
        with torch.no_grad():
            read.append(target(td).get(TOKENS_PROMPT, as_list=True)[0].tolist())
    contexts = contexts_before_last(tok, chats)
    assert not any("helpful assistant" in c for c in contexts)  # the model never read the template's default
    for context, chat, ids in zip(contexts, chats, read, strict=True):
        seen = tok(context + chat[-1]["content"], add_special_tokens=False)["input_ids"]
        assert ids[: len(seen)] == seen  # context + probe begin what the target read, token for token
    assert count_chat_tokens(tok, chats) == [len(ids) for ids in read]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chat_env_runs_with_transformers_policies_on_the_gpu():
    """The wrapper moves the prompt's tokens to the model's device (without it, generate gets CPU ids)."""
    tok_a, tok_b = make_tokenizer(), make_tokenizer()
    tester = make_policy(loaded(make_llama(tok_a).cuda(), tok_a), GenerationSettings(4))
    target = make_policy(loaded(make_llama(tok_b, seed=3).cuda(), tok_b), GenerationSettings(4))
    env = make_redteam_env(tester, target, [KeywordScorer(["damn"])], OPENERS, batch_size=2, max_turns=2)
    ro = env.rollout(2, tester)
    assert ro.batch_size == (2, 2)
    chats = history_to_chats(ro[:, 1]["next", "history"].prompt)
    assert all(len(chat) == 6 for chat in chats)  # system, opener, then two probe/reply pairs


@pytest.mark.parametrize("mode", ["chat", "text"])
def test_the_policies_sample_the_same_tokens_with_and_without_log_probs(mode):
    def rollout(return_log_probs: bool):
        tok_a, tok_b = make_tokenizer(), make_tokenizer()
        tester, target = (
            make_policy(
                loaded(make_llama(tok, seed=seed), tok),
                GenerationSettings(6),
                input_mode=input_mode(mode),
                return_log_probs=return_log_probs,
            )
            for tok, seed in ((tok_a, 0), (tok_b, 3))
        )
        env = make_redteam_env(tester, target, [KeywordScorer(["damn"])], OPENERS, batch_size=2, max_turns=2, mode=mode)
        torch.manual_seed(0)
        return env.rollout(2, tester).reshape(-1)

    with_log_probs, without = rollout(True), rollout(False)
    assert "log_probs" in with_log_probs.keys() and "log_probs" not in without.keys()  # nothing computed for nobody
    tester_tokens = [ro.get(("tokens", "response"), as_list=True) for ro in (with_log_probs, without)]
    assert len(tester_tokens[0]) == 4 and all(len(t) > 0 for t in tester_tokens[0])
    for a, b in zip(*tester_tokens, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(with_log_probs["next", "target_tokens"], without["next", "target_tokens"])
    assert _strings(with_log_probs["next", "probe"]) == _strings(without["next", "probe"])
