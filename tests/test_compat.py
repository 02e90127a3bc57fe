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
