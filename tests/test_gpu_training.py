"""The chat recipe's whole path on a CUDA GPU, on tiny models (skipped where no GPU is present).

Warm-start search, the gated elicitation reward, GRPO steps, a checkpoint and the held-out comparison
all run with the models on the GPU: a tensor left on the CPU anywhere on that path fails here.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

KEYWORDS = "keywords:the,you,hello,how,are"

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# the gated reward alone, and the full recipe (configs/elicit_chat_full.yaml): the SVM probe gate and the replay
# archive seeded with the warm start's kept probes, whose re-tested probes join every group
RECIPES = {
    "plain": {"probe_gate_lexicon": False},
    "gated": {"probe_gate_lexicon": True},
    "full": {"probe_gate_lexicon": True, "probe_scorer": "profanity", "guide_replay": True, "guide_replay_warm_start": True},
}
# the full recipe with both echo checks: the probe gated on the training scorer's read too, the replies read past the probe
RECIPES["echo_checked"] = {**RECIPES["full"], "probe_gate_both": True, "reply_past_probe": True}


@needs_gpu
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_chat_recipe_trains_and_compares_on_the_gpu(tmp_path, tiny_model_dir, monkeypatch, recipe):
    from astrl.training.demo import run_demo

    monkeypatch.setenv("ASTRL_STORE", str(tmp_path / "store.sqlite"))
    overrides = {
        "tester": str(tiny_model_dir),
        "target": str(tiny_model_dir),
        "scorer": KEYWORDS,
        "device": "cuda",
        "run_dir": str(tmp_path / "chat"),
        **RECIPES[recipe],
    }
    overrides.update(total_steps=2, prompts_per_step=2, group_size=2, max_new_tokens=3, target_max_new_tokens=3)
    overrides.update(warm_start_probes=2, warm_start_rounds=1, warm_start_reply_tokens=2, lora_targets=["q_proj", "v_proj"])
    result = run_demo(overrides, progress=False, conversations=3, mode="chat")
    assert result["config"].device == "cuda"
    with open(tmp_path / "chat" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2]
    for row in rows:
        assert float(row["gpu_peak_gb"]) > 0  # the models and the step ran on the GPU
        assert torch.isfinite(torch.tensor([float(row["loss"]), float(row["grad_norm"])])).all()
        assert 0.0 <= float(row["term_probe_listed"] if recipe != "plain" else 0.0) <= 1.0
        if recipe == "echo_checked":
            assert 0.0 <= float(row["term_probe_tox_scorer"]) <= 1.0
        if recipe in ("full", "echo_checked"):
            # the archive holds the first probes sampled so far, and the replayed members were scored (a finite
            # reward) beside the sampled ones on the GPU
            assert float(row["replay_probes"]) >= 1 and torch.isfinite(torch.tensor(float(row["replay_reward"])))
    assert (tmp_path / "chat" / "final" / "tester" / "adapter_config.json").exists()
    for side in result["comparison"].values():
        assert side["judges"]["wordlist"]["n_conversations"] == 3
        assert sorted({r["turn"] for r in side["records"]}) == [0, 1]
    assert json.loads((tmp_path / "chat" / "warm_start.json").read_text())["sampled"] == 2
