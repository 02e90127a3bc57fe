"""The vLLM backend on CPU: clear errors without vllm or CUDA, the merged weights a push sends (GPU: test_vllm_gpu.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import make_llama, make_tokenizer

from astrl.backends import MissingExtraError, check_backend, require_vllm
from astrl.policies import make_policy
from astrl.training import ConfigError, TrainConfig
from astrl.training.vllm_sync import merged_weights, push_to_vllm


def test_vllm_without_the_package_or_a_gpu_fails_early_with_the_fix(monkeypatch, tiny_lm):
    import astrl.backends as backends

    monkeypatch.setattr(backends, "_has", lambda package: False)
    with pytest.raises(MissingExtraError, match=r"pip install 'astrl\[vllm\]'"):
        require_vllm()
    with pytest.raises(MissingExtraError, match=r"astrl\[vllm\]"):
        make_policy(tiny_lm, backend="vllm")
    monkeypatch.setattr(backends, "_has", lambda package: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MissingExtraError, match="needs a CUDA GPU and none is visible"):
        check_backend("vllm")
    with pytest.raises(ValueError, match="unknown backend 'jax'"):
        check_backend("jax")


def test_train_config_scale_settings_are_checked():
    with pytest.raises(ConfigError, match="backend must be one of .* got 'sglang'"):
        TrainConfig(backend="sglang")
    with pytest.raises(ConfigError, match="num_collectors=2 needs collector 'ray'"):
        TrainConfig(num_collectors=2)
    with pytest.raises(ConfigError, match=r"prompts_per_step \(3\) must be a multiple of num_collectors \(2\)"):
        TrainConfig(collector="ray", num_collectors=2, prompts_per_step=3)
    with pytest.raises(ConfigError, match="apply to grpo and ppo"):
        TrainConfig(algorithm="ipo", collector="ray", group_size=1)
    with pytest.raises(ConfigError, match="use target_backend 'transformers'"):
        TrainConfig(target_backend="vllm", reward="astprompter")


def test_trainer_with_vllm_backend_fails_before_loading_anything(monkeypatch, tmp_path):
    import astrl.backends as backends
    from astrl.training import Trainer

    monkeypatch.setattr(backends, "_has", lambda package: package != "vllm")
    config = TrainConfig(tester="never-loaded", backend="vllm", run_dir=str(tmp_path / "run"))
    with pytest.raises(MissingExtraError, match=r"astrl\[vllm\]"):
        Trainer(config, progress=False)


def test_merged_weights_equal_merge_and_unload_and_leave_the_adapters_alone():
    from peft import LoraConfig, get_peft_model

    tok = make_tokenizer()
    model = get_peft_model(make_llama(tok), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # a trained adapter (B starts at zero)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = dict(merged_weights(model))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(merged[name], value)
    assert any(not torch.equal(merged[n], make_llama(tok).state_dict()[n]) for n in merged if "q_proj" in n)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


def test_merged_weights_leave_out_a_pad_row_the_engine_never_had():
    tok = make_tokenizer()
    model = make_llama(tok)
    engine_vocab = model.config.vocab_size
    tok.add_special_tokens({"pad_token": "<|new_pad|>"})
    model.resize_token_embeddings(len(tok), mean_resizing=False)  # what prepare_tokenizer does without a pad token
    assert model.get_input_embeddings().weight.shape[0] == engine_vocab + 1
    merged = dict(merged_weights(model, vocab_size=engine_vocab))
    assert merged["model.embed_tokens.weight"].shape[0] == engine_vocab
    torch.testing.assert_close(merged["model.embed_tokens.weight"], model.get_input_embeddings().weight[:engine_vocab])
    assert merged["model.layers.0.self_attn.q_proj.weight"].shape == model.model.layers[0].self_attn.q_proj.weight.shape


class _Engine:
    """The two ``vllm.LLM`` calls a push makes, over a plain Transformers copy of the model."""

    def __init__(self, model) -> None:
        self.model = model
        self.prefix_cache_resets = 0
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(hf_config=model.config))

    def apply_model(self, fn):
        return [fn(SimpleNamespace(load_weights=self._load))]

    def _load(self, weights) -> None:
        state = self.model.state_dict()
        for name, value in weights:
            state[name].copy_(value)

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return True


def test_push_to_vllm_loads_the_merged_weights_and_drops_the_prefix_cache():
    from peft import LoraConfig, get_peft_model

    tok = make_tokenizer()
    engine = _Engine(make_llama(tok))
    model = get_peft_model(make_llama(tok), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    push_to_vllm(engine, model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    for name, value in engine.model.state_dict().items():
        torch.testing.assert_close(value, reference[name])
    assert engine.prefix_cache_resets == 1
