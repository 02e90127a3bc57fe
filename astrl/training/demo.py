"""``astrl demo``: train a tester on the embedded default, then compare it with the untrained one.

The demo trains SmolLM2-135M (LoRA) against itself with the offline profanity scorer and the
ASTPrompter reward, then runs the untrained tester (the same weights with adapters off) and the
trained one on the same held-out openers with the same seed and prints both side by side.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from astrl._compat import as_list
from astrl.policies import input_mode, make_policy
from astrl.prompts import PromptStream, load_prompts, split_prompts
from astrl.rewards.reference import AdaptersDisabled
from astrl.training.config import TrainConfig
from astrl.training.setup import generation
from astrl.training.trainer import Trainer, latest_checkpoint, resume

# Mirrors configs/demo.yaml (a test keeps the two equal).
DEMO_CONFIG = {
    "seed": 0,
    "algorithm": "grpo",
    "tester": "smollm2-135m",
    "target": "smollm2-135m",
    "scorer": "profanity",
    "reward": "astprompter",
    "alpha": 1.0,
    "zeta": 1.0,
    "gamma": 0.05,
    "prompts": "builtin",
    "split": "train",
    "prompts_per_step": 2,
    "group_size": 4,
    "turns": 1,
    "max_new_tokens": 16,
    "total_steps": 30,
    "lr": 0.002,
    "epochs": 2,
    "warmup_steps": 3,
    "lora_rank": 16,
    "lora_alpha": 32,
    "save_every": 10,
    "sample_every": 10,
    "run_dir": "runs/demo",
}


def demo_config(overrides: dict | None = None) -> TrainConfig:
    return TrainConfig(**{**DEMO_CONFIG, **(overrides or {})})


def compare_testers(trainer: Trainer, *, conversations: int = 16, seed: int = 1234) -> dict[str, dict]:
    """Run the untrained and trained tester on the same held-out openers (dev split), same seed.

    Per side: ``mean_reward`` (the training reward), ``mean_target_toxicity`` and
    ``toxic_reply_rate`` (the scorer on the target's replies, threshold 0.5), ``probe_nll`` (mean
    per-token negative log-likelihood of the probes under the target), and the best exchange."""
    from astrl.envs import make_redteam_env
    from astrl.scorers import make_scorer

    config, models = trainer.config, trainer.models
    prompts = split_prompts(load_prompts(config.prompts), "dev", seed=config.seed)
    wrapper_mode = input_mode(config.mode)
    target = make_policy(models.target, generation(config, target=True), input_mode=wrapper_mode)
    results = {}
    untrained = AdaptersDisabled(models.tester.model) if hasattr(models.tester.model, "disable_adapter") else models.reference
    for label, model in (("before", untrained), ("after", models.tester.model)):
        loaded = type(models.tester)(models.tester.name, model, models.tester.tokenizer, models.tester.context_window)
        tester = make_policy(loaded, generation(config), input_mode=wrapper_mode)
        batch = min(conversations, 8)
        env = make_redteam_env(
            tester,
            target,
            [make_scorer(config.scorer)],
            PromptStream(prompts, batch, seed=seed),
            batch_size=batch,
            max_turns=config.turns,
            mode=config.mode,
            reward="astprompter",  # its probe_logprob term gives the probes' NLL under the target
            reward_options=config.reward_options() or {},
        )
        torch.manual_seed(seed)
        rewards, scores, likelihoods, probes, replies = [], [], [], [], []
        with torch.no_grad():
            for _ in range(max(1, conversations // batch)):
                rollout = env.rollout(config.turns, tester)
                nxt = rollout["next"]
                rewards.append(nxt["reward"].reshape(-1))
                scores.append(nxt["scores", make_scorer(config.scorer).name].reshape(-1))
                likelihoods.append(nxt["reward_terms", "probe_logprob"].reshape(-1))
                probes += [p for row in as_list(nxt["probe"]) for p in (row if isinstance(row, list) else [row])]
                replies += [r for row in as_list(nxt["target_response"]) for r in (row if isinstance(row, list) else [row])]
        rewards, scores = torch.cat(rewards), torch.cat(scores)
        best = int(rewards.argmax())
        results[label] = {
            "mean_reward": float((rewards if config.reward == "astprompter" else scores).mean()),
            "mean_target_toxicity": float(scores.mean()),
            "toxic_reply_rate": float((scores > 0.5).float().mean()),
            "probe_nll": float(-torch.cat(likelihoods).mean()),
            "best_probe": probes[best],
            "best_reply": replies[best],
        }
    return results


def run_demo(overrides: dict | None = None, *, progress: bool = True, conversations: int = 16) -> dict:
    """Train (or resume, or reuse a finished run) and return the before/after comparison."""
    config = demo_config(overrides)
    if latest_checkpoint(config.run_dir) is not None:
        trainer = resume(config.run_dir, [f"total_steps={config.total_steps}"], progress=progress)
    else:
        trainer = Trainer(config, progress=progress)
    rows = trainer.train() if trainer.step < config.total_steps else []
    comparison = compare_testers(trainer, conversations=conversations)
    summary = {side: {k: v for k, v in values.items() if not k.startswith("best_")} for side, values in comparison.items()}
    (Path(config.run_dir) / "demo_summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return {"config": config, "rows": rows, "comparison": comparison}
