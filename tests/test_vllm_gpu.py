"""The vLLM backend on a CUDA GPU: generation in the env, weight pushes, and a GRPO run.

These tests run only where vllm is installed and a CUDA GPU is visible (they are skipped on CI's
CPU machines). The model is a small random Llama with 64-dimensional heads, the head size of
SmolLM2, so vLLM uses the attention kernels a real run uses.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import make_tokenizer

HAS_VLLM = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="needs vllm and a CUDA GPU")

KEYWORDS_SCORER = "keywords:the,you,hello"
TEXT = "hello there how are you the cat sat on the mat and the dog ran after it"
# bf16 weights on both sides, different kernels: per-token log-probs agree to a few hundredths
TOLERANCE = 0.08
ENGINE = {"enforce_eager": True, "seed": 0}


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper than the initial near-uniform distribution: log-probs that mean something
        model.lm_head.weight.mul_(4)
    folder = tmp_path_factory.mktemp("gpu-llama")
    model.to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _trainer_log_probs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits.float()
    return logits[0, :-1].log_softmax(-1).gather(-1, torch.tensor(ids[1:], device=model.device)[:, None])[:, 0].cpu()


def _engine_log_probs(engine, ids: list[int]) -> torch.Tensor:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = engine.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    rows = out[0].prompt_logprobs[1:]
    return torch.tensor([row[token].logprob for row, token in zip(rows, ids[1:], strict=True)])


def test_engine_log_probs_follow_the_trainer_after_a_weight_push(gpu_model_dir):
    from peft import LoraConfig, get_peft_model

    from astrl.models import load_model
    from astrl.policies import make_vllm_engine
    from astrl.training.vllm_sync import push_to_vllm

    lm = load_model(str(gpu_model_dir), device="cuda", dtype="bfloat16")
    engine = make_vllm_engine(lm, 0.2, **ENGINE)
    ids = lm.tokenizer(TEXT)["input_ids"]
    before = _trainer_log_probs(lm.model, ids)
    assert (_engine_log_probs(engine, ids) - before).abs().max() < TOLERANCE

    model = get_peft_model(lm.model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)  # a trained adapter
    after = _trainer_log_probs(model, ids)
    assert (after - before).abs().max() > 10 * TOLERANCE  # the update changed the distribution
    stale = _engine_log_probs(engine, ids)
    assert (stale - before).abs().max() < TOLERANCE  # nothing reaches the engine before a push

    push_to_vllm(engine, model)
    pushed = _engine_log_probs(engine, ids)
    assert (pushed - after).abs().max() < TOLERANCE, (pushed - after).abs().max()


def test_vllm_tester_talks_to_a_transformers_target_in_the_env(gpu_model_dir):
    from astrl.envs import make_redteam_env
    from astrl.models import load_model
    from astrl.policies import GenerationSettings, make_policy
    from astrl.scorers import make_scorers

    lm = load_model(str(gpu_model_dir), device="cuda", dtype="bfloat16")
    tester = make_policy(lm, GenerationSettings(8), backend="vllm", vllm_memory=0.2, vllm_options=ENGINE)
    target = make_policy(lm, GenerationSettings(8))
    env = make_redteam_env(tester, target, make_scorers([KEYWORDS_SCORER]), ["hello there"], batch_size=2, max_turns=2)
    rollout = env.rollout(2, tester)
    assert rollout.shape == (2, 2)
    replies = rollout.get(("next", "reward"))
    assert torch.isfinite(replies).all()


def test_grpo_with_the_vllm_backend_trains_and_keeps_the_engine_in_sync(gpu_model_dir, tmp_path):
    from astrl.training import TrainConfig, Trainer
    from astrl.training.vllm_sync import merged_weights

    config = TrainConfig(
        tester=str(gpu_model_dir),
        target=str(gpu_model_dir),
        scorer=KEYWORDS_SCORER,
        entropy_coef=0.1,  # a gradient even when every reward ties (a random model's replies score alike)
        device="cuda",
        dtype="bfloat16",
        backend="vllm",
        vllm_memory=0.2,
        total_steps=2,
        save_every=2,
        prompts_per_step=2,
        group_size=2,
        turns=2,
        max_new_tokens=8,
        lr=1e-2,
        warmup_steps=0,
        lora_targets=["q_proj", "v_proj"],
        run_dir=str(tmp_path / "run"),
    )
    trainer = Trainer(config, progress=False)
    rows = trainer.train()
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(float(r["loss"]))) for r in rows)
    engine = trainer.policy.engine
    tester = trainer.models.tester
    ids = tester.tokenizer(TEXT)["input_ids"]
    merged = dict(merged_weights(tester.model))
    checkpoint = _checkpoint(gpu_model_dir)
    moved = [float((merged[n].float().cpu() - v.float()).abs().max()) for n, v in checkpoint.items() if n in merged]
    assert len(moved) == len(checkpoint) and max(moved) > 1e-3  # the two updates moved the weights
    assert (_engine_log_probs(engine, ids) - _trainer_log_probs(tester.model, ids)).abs().max() < TOLERANCE


def _checkpoint(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))
