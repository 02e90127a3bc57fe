"""The vLLM backend: clear errors without vllm or CUDA, the merged weights it is sent, and (with CUDA) a real run."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from conftest import loaded, make_llama, make_tokenizer

from astrl.backends import MissingExtraError, check_backend, require_vllm
from astrl.policies import make_policy
from astrl.training import ConfigError, TrainConfig
from astrl.training.vllm_sync import merged_weights

HAS_VLLM = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


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


@pytest.mark.skipif(not HAS_VLLM, reason="needs vllm and a CUDA GPU")
def test_vllm_policy_generates_in_the_red_team_env(tiny_model_dir):
    from astrl.envs import make_redteam_env
    from astrl.models import load_model
    from astrl.policies import GenerationSettings
    from astrl.scorers import make_scorers

    lm = load_model(str(tiny_model_dir), device="cuda")
    tester = make_policy(lm, GenerationSettings(8), backend="vllm", vllm_memory=0.2)
    target = make_policy(loaded(lm.model, lm.tokenizer), GenerationSettings(8))
    env = make_redteam_env(tester, target, make_scorers(["keywords:the"]), ["hello there"], batch_size=2, max_turns=2)
    rollout = env.rollout(2, tester)
    assert rollout.shape == (2, 2)
