"""Each test pins an upstream TorchRL 0.14.1 behaviour and the astrl workaround for it."""

import pytest
import tensordict
from conftest import loaded, make_llama, make_tokenizer
from tensordict import TensorDict
from torchrl.data.llm import History
from torchrl.modules.llm.policies import ChatHistory

from astrl._compat import chats_to_history, history_to_chats
from astrl.envs.transforms import clean_responses
from astrl.envs.truncation import fit_chats
from astrl.policies import GenerationSettings, make_policy

RAGGED = [
    [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
]


def _policy(max_new=4, model=None):
    tok = make_tokenizer()
    return make_policy(loaded(model or make_llama(tok), tok), GenerationSettings(max_new, do_sample=False))


def test_list_to_stack_is_on_by_default():
    # TorchRL docs ask for set_list_to_stack(True); tensordict 0.14.3 already defaults to it, so astrl does not set it.
    assert tensordict.list_to_stack()


def test_ragged_history_batch_still_crashes_upstream():
    policy = _policy()
    td = TensorDict(history=ChatHistory(prompt=History.from_chats(RAGGED), batch_size=(2,)), batch_size=(2,))
    with pytest.raises(ValueError, match="zip"):
        policy(td)


def test_astrl_keeps_batches_aligned_and_refuses_ragged_ones():
    with pytest.raises(ValueError, match="same number of messages"):
        chats_to_history(RAGGED)
    tok = make_tokenizer()
    long = [RAGGED[1] + [{"role": "assistant", "content": "hello " * 30}, {"role": "user", "content": "ok"}]] * 2
    long[1] = [dict(m) for m in long[1]]
    long[1][2]["content"] = "tiny"
    fitted = fit_chats(long, tok, budget=60)
    assert len({len(c) for c in fitted}) == 1 and len(fitted[0]) < len(long[0])
    policy = _policy()
    td = TensorDict(history=ChatHistory(prompt=chats_to_history(fitted), batch_size=(2,)), batch_size=(2,))
    out = policy(td)
    assert [c[-1]["role"] for c in history_to_chats(out["history"].full)] == ["assistant", "assistant"]


def test_wrapper_text_keeps_specials_and_padding_so_replies_are_decoded_from_ids():
    tok = make_tokenizer()
    model = make_llama(tok)
    policy = _policy(max_new=5, model=model)
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        if out.logits.shape[0] == 2:
            out.logits[0, -1, tok.eos_token_id] = 1e4
            out.logits[1, -1, tok.eos_token_id] = -1e4
        return out

    model.forward = forward
    chats = [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "the cat"}]]
    td = TensorDict(history=ChatHistory(prompt=chats_to_history(chats), batch_size=(2,)), batch_size=(2,))
    out = policy(td)
    raw = out["text", "response"]
    assert tok.eos_token in raw[0]  # upstream: special tokens stay in the text
    texts, ids, mask = clean_responses(out.get(("tokens", "response"), as_list=True), tok, 5)
    assert texts[0] == "" and mask[0].tolist() == [True, False, False, False, False] and ids[0, 0] == tok.eos_token_id
    assert mask[1].all() and tok.eos_token not in texts[1]


def test_grpoloss_averages_kl_and_diagnostics_over_every_position_so_astrl_takes_response_tokens(tmp_path):
    # upstream GRPOLoss divides clip_fraction and the KL to the reference by every (padded) position,
    # prompt included, and logs kl_approx as a mean of log(old / new) there; ResponseGRPOLoss takes
    # means over the response tokens (k3 estimates, never negative)
    import torch
    from test_grpo import _update
    from test_training import _config, _trainer
    from torchrl.objectives.llm import GRPOLoss

    trainer = _trainer(_config(tmp_path, reward="astprompter", kl_coef=0.1))
    trainer._build()
    batch, _ = trainer.algorithm.collect()
    _update(trainer, batch)
    loss = trainer.algorithm.loss_module
    ours = loss(batch).to_tensordict()
    loss.kl_to_ref_coeff = 0.1
    try:
        upstream = GRPOLoss.forward(loss, batch).to_tensordict()
    finally:
        loss.kl_to_ref_coeff = None
    tokens = sum(len(r) for r in batch.get(("tokens", "response"), as_list=True))
    positions = len(batch) * max(len(f) for f in batch.get(("tokens", "full"), as_list=True))
    assert tokens < positions
    for key in ("clip_fraction", "kl_to_ref"):
        torch.testing.assert_close(upstream[key], ours[key] * tokens / positions)
    assert ours["kl_approx"] > 0 and upstream["kl_approx"] != ours["kl_approx"]


def test_chats_are_rendered_as_torchrl_s_wrappers_render_them():
    from astrl._compat import render_chats, wrapper_chat_template

    tok = make_tokenizer()
    tok.chat_template = (  # adds a default system message, which TorchRL's own chatml template does not
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\\nBe helpful.<|im_end|>\\n{% endif %}"
        + "{% for m in messages %}<|im_start|>{{ m['role'] }}\\n{{ m['content'] }}<|im_end|>\\n{% endfor %}"
        + "{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}"
    )
    chats = [
        [{"role": "user", "content": "the cat"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a dog"}]
        + [{"role": "assistant", "content": "ran"}],
    ]
    for prompt in (True, False):
        theirs = [
            History.from_chats([c]).apply_chat_template(tokenizer=tok, add_generation_prompt=prompt, tokenize=False)[0]
            for c in chats
        ]
        assert render_chats(tok, chats, add_generation_prompt=prompt) == theirs
    assert "Be helpful." not in render_chats(tok, chats[:1])[0]  # the tokenizer's default is not what the model reads
    assert "Be helpful." in tok.apply_chat_template(chats[0], tokenize=False)
    assert wrapper_chat_template(tok) is wrapper_chat_template(tok)  # found once per tokenizer


# -- upstream behaviours astrl relies on or works around: a failure names the workaround to revisit -------------
def test_transformers_wrapper_sets_the_first_response_log_prob_to_zero_so_astrl_rescores_exact_tokens():
    # astrl.lm_scoring.token_logprobs scores every response token, the first included; the generate-time
    # log-probs are never used as behaviour or reference log-probs (astrl.training.grpo, astrl.losses.ppo)
    import torch
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.modules.llm.policies import Text

    from astrl.lm_scoring import token_logprobs

    tok = make_tokenizer()
    model = make_llama(tok)
    policy = TransformersWrapper(
        model,
        tokenizer=tok,
        input_mode="text",
        generate=True,
        return_log_probs=True,
        generate_kwargs={"max_new_tokens": 4, "do_sample": False},
        pad_output=False,
    )
    out = policy(TensorDict(text=Text(prompt=["hello how are", "the cat"], batch_size=(2,)), batch_size=(2,)))
    generated = out.get(("log_probs", "response"), as_list=True)
    prompts, responses = out.get(("tokens", "prompt"), as_list=True), out.get(("tokens", "response"), as_list=True)
    with torch.no_grad():
        exact = token_logprobs(model, prompts, responses, pad_token_id=tok.pad_token_id)
    for upstream, ours in zip(generated, exact, strict=True):
        assert upstream[0].item() == 0.0 and ours[0].item() < -1.0  # upstream: the first token's log-prob is 0
        torch.testing.assert_close(upstream[1:], ours[1:], atol=1e-4, rtol=0)  # the others agree


def test_local_llm_wrapper_update_weights_does_nothing_so_astrl_pushes_weights_into_the_engine_itself():
    # astrl.training.vllm_sync.push_to_vllm loads the merged weights through LLM.apply_model instead
    import torch
    from torchrl.modules.llm.backends.vllm.vllm_sync import LocalLLMWrapper

    touched = []

    class Engine:
        def __getattr__(self, name):
            touched.append(name)
            raise AttributeError(name)

    wrapper = LocalLLMWrapper(Engine(), tensor_parallel_size=1, model_name="tiny")
    weights = iter([("model.embed_tokens.weight", torch.ones(2, 2))])
    assert wrapper.update_weights(weights) is None
    assert touched == [] and next(weights, None) is None  # the weights are read, the engine never sees them


def test_vllm_updater_v2_merges_the_trainers_lora_model_in_place_so_astrl_merges_beside_it():
    # astrl.training.vllm_sync.merged_weights adds the LoRA deltas on the side: the trainer keeps its adapters
    from peft import LoraConfig, get_peft_model
    from torchrl.collectors.llm.weight_update.vllm_v2 import vLLMUpdaterV2
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.modules.llm.backends.vllm import RLvLLMEngine

    from astrl.training.vllm_sync import merged_weights

    class Engine(RLvLLMEngine):  # no vllm needed: the updater only calls this interface
        received: dict = {}

        def get_tp_size(self):
            return 1

        def get_model_metadata(self):
            return {}

        def get_master_address(self):
            return "localhost"

        def get_master_port(self):
            return 0

        def init_weight_update_group(self):
            return None

        def update_weights(self, weights):
            self.received = dict(weights)

    def lora_parameters(model):
        return [name for name, _ in model.named_parameters() if "lora_" in name]

    tok = make_tokenizer()
    model = get_peft_model(make_llama(tok), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    assert lora_parameters(model)
    dict(merged_weights(model))
    assert lora_parameters(model)  # astrl's merge leaves the adapters alone
    engine = Engine()
    updater = vLLMUpdaterV2(engine)
    updater.init()
    updater.push_weights_from_transformers(TransformersWrapper(model, tokenizer=tok, input_mode="text", generate=False))
    assert engine.received and not any("lora_" in name for name in engine.received)
    assert lora_parameters(model) == []  # upstream: merge_and_unload() took the trainer's adapters away


def test_mc_advantage_normalises_over_every_turn_of_a_group_so_astrl_normalises_per_opener_and_turn():
    # astrl.training.grpo.turn_group_advantages: cells of (opener, turn index), see DESIGN.md pitfall 13
    import torch
    from torchrl.objectives.llm import MCAdvantage

    from astrl.training.grpo import turn_group_advantages

    def conversation(rewards):
        n = len(rewards)
        done = torch.tensor([False] * (n - 1) + [True]).reshape(n, 1)
        nxt = TensorDict(reward=torch.tensor(rewards).reshape(n, 1), done=done, batch_size=[n])
        return TensorDict(group_id=torch.zeros(n, dtype=torch.long), next=nxt, batch_size=[n])

    # two conversations of the same opener: equal first turns, different second turns
    transform = MCAdvantage(grpo_size=2, prompt_key="group_id")
    assert transform.inv(conversation([1.0, 0.0])) is None  # waits for the whole group
    upstream = transform.inv(conversation([1.0, 4.0]))["advantage"].reshape(-1)
    assert upstream[0] != 0 and upstream[2] != 0  # upstream: equal first turns get an advantage from the second
    ours = turn_group_advantages(torch.tensor([1.0, 0.0, 1.0, 4.0]), ["o"] * 4, torch.tensor([0, 1, 0, 1]), group_size=2)
    assert ours[0] == 0 and ours[2] == 0 and ours[1] < 0 < ours[3]


def test_sft_loss_reads_a_chat_history_and_its_assistant_masks_so_hardening_has_its_own_nll():
    # astrl.training.hardening scores the exact ids the target reads, in text mode and chat mode alike
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.modules.llm.policies import Text
    from torchrl.objectives.llm import SFTLoss

    tok = make_tokenizer()
    actor = TransformersWrapper(make_llama(tok), tokenizer=tok, input_mode="history", generate=False, pad_output=False)
    loss = SFTLoss(actor_network=actor, tokenizer=tok)
    text = TensorDict(text=Text(full=["hello I'm sorry"], batch_size=(1,)), batch_size=(1,))
    with pytest.raises(KeyError, match="history"):  # text mode: no History to read
        loss(text)
    no_assistant = History.from_chats([[{"role": "user", "content": "hello"}, {"role": "user", "content": "I'm sorry"}]])
    chat = TensorDict(history=ChatHistory(full=no_assistant, batch_size=(1,)), batch_size=(1,))
    with pytest.raises(ValueError, match="assistant masks"):  # the tokens it trains on come from assistant masks
        loss(chat)


def test_adaptive_kl_controller_divides_its_input_by_the_coefficient_so_astrl_feeds_penalties_and_refuses_zero():
    # astrl.rewards.kl: ClippedKLReward.update_kl_coef feeds -kl_coef * KL; make_kl_controller refuses kl_coef 0
    import math

    from torchrl.data.llm import AdaptiveKLController

    from astrl.rewards.kl import ClippedKLReward, make_kl_controller

    controller = AdaptiveKLController(init_kl_coef=0.5, target=1.0, horizon=10)
    controller.update([-0.5 * 1.05] * 2)  # penalties of a KL of 1.05: 5% above target
    assert controller.coef == pytest.approx(0.5 * (1 + 0.05 * 2 / 10))
    stuck = AdaptiveKLController(init_kl_coef=0.0, target=1.0, horizon=10)
    stuck.update([0.0])
    assert math.isnan(stuck.coef)  # upstream: 0 / 0
    with pytest.raises(ValueError, match="needs kl_coef > 0"):
        make_kl_controller(0.0, target_kl=1.0)
    reward = ClippedKLReward(kl_coef=0.5, target_kl=1.0, horizon=10)
    reward._kl_total, reward._kl_count = 2.1, 2  # two turns, a mean KL of 1.05
    assert reward.update_kl_coef() == pytest.approx(0.5 * (1 + 0.05 * 2 / 10))


def test_k3_is_torchrl_s_k3_kl_token_estimate():
    # astrl.losses.kl.k3 calls torchrl.objectives.llm.k3_kl_token_estimate and adds its cap
    import torch
    from torchrl.objectives.llm import k3_kl_token_estimate

    from astrl.losses.kl import k3

    logp, ref = torch.randn(2, 5, generator=torch.Generator().manual_seed(0)).unbind(0)
    r = ref - logp
    hand = torch.exp(r) - 1 - r
    torch.testing.assert_close(k3_kl_token_estimate(ref, logp), hand)
    torch.testing.assert_close(k3(r), hand)
    assert torch.equal(k3(r), k3_kl_token_estimate(r, torch.zeros_like(r)))


def test_private_hooks_astrl_calls_still_exist_with_the_signatures_it_uses():
    import inspect

    from torchrl.collectors.llm import LLMCollector, RayLLMCollector
    from torchrl.envs import Transform
    from torchrl.envs.llm import ChatEnv

    def params(fn):
        return list(inspect.signature(fn).parameters)

    # astrl.distributed.RayCollectors: _next_remote() and the remote LLMCollector behind _collector
    assert "self._collector.next.remote()" in inspect.getsource(RayLLMCollector._next_remote)
    assert "self._collector = remote_cls(" in inspect.getsource(RayLLMCollector.__init__)
    assert "LLMCollector.as_remote(" in inspect.getsource(RayLLMCollector.__init__)
    for name in ("update_policy_weights_", "get_policy_version", "get_policy_model"):
        assert callable(getattr(LLMCollector, name)), name
    # astrl.envs.redteam.RedTeamEnv overrides _reset_text, which ChatEnv._reset calls in text mode
    assert params(ChatEnv._reset_text) == ["self", "tensordict", "history"]
    assert "self._reset_text(tensordict, history)" in inspect.getsource(ChatEnv._reset)
    # astrl.sampling.tree runs the env's step level by level: base_env._reset / _step, then each transform's
    assert params(ChatEnv._reset) == ["self", "tensordict", "kwargs"]
    assert params(ChatEnv._step) == ["self", "tensordict"]
    assert params(Transform._reset) == ["self", "tensordict", "tensordict_reset"]
    assert params(Transform._step) == ["self", "tensordict", "next_tensordict"]


def test_chat_env_renders_a_text_mode_opener_with_a_chat_template_so_astrl_keeps_the_plain_text():
    from torchrl.envs.llm import ChatEnv

    from astrl.envs.redteam import RedTeamEnv

    tok = make_tokenizer()
    query = TensorDict(query=["hello there"], batch_size=(1,))
    upstream = ChatEnv(batch_size=(1,), tokenizer=tok, input_mode="text").reset(query.clone())
    ours = RedTeamEnv(mode="text", batch_size=1, tokenizer=tok).reset(query.clone())
    assert upstream["text", "prompt"][0] != "hello there" and "<|im_start|>" in upstream["text", "prompt"][0]
    assert ours["text", "prompt"][0] == "hello there"
