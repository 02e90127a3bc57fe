import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from conftest import loaded, make_llama, make_tokenizer

from astrl.scorers import make_scorer
from astrl.training import ConfigError, TrainConfig, Trainer, load_config, resume
from astrl.training.grpo import returns_to_go
from astrl.training.setup import build_models
from astrl.training.trainer import earlier_run, latest_checkpoint

KEYWORDS = "keywords:the,you,hello,how,are"


def _config(tmp_path, **overrides) -> TrainConfig:
    settings = dict(
        tester="tiny",
        target="tiny",
        scorer=KEYWORDS,
        prompts="builtin",
        total_steps=4,
        save_every=2,
        prompts_per_step=2,
        group_size=2,
        turns=2,
        max_new_tokens=4,
        lr=3e-3,
        warmup_steps=1,
        lora_targets=["q_proj", "v_proj"],
        run_dir=str(tmp_path / "run"),
    )
    settings.update(overrides)
    return TrainConfig(**settings)


def _tiny_tester():
    """The tiny Llama the ``tester: tiny`` configs name, as a loaded model (for a trainer or a resume)."""
    tok = make_tokenizer()
    return loaded(make_llama(tok), tok, name="tiny")


def _trainer(config: TrainConfig) -> Trainer:
    return Trainer(config, models=build_models(config, _tiny_tester()), progress=False)


def _rows(path) -> list[dict]:
    return list(csv.DictReader(path.open()))


# -- config ----------------------------------------------------------------------------------------
def test_config_file_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"algorithm": "grpo", "total_steps": 7, "lr": 1e-3}))
    config = load_config(path, ["total_steps=9", "loggers=csv", "judges=keywords:a,profanity"])
    assert (config.total_steps, config.lr, config.loggers) == (9, 1e-3, ["csv"])
    unknown = r"unknown config key\(s\) \['learning_rate'\]; valid keys: seed, split_seed, dtype, device, algorithm"
    with pytest.raises(ConfigError, match=unknown):
        load_config(path, ["learning_rate=1"])
    with pytest.raises(ConfigError, match="'total_steps' must be int, got 'many'"):
        load_config(None, ["total_steps=many"])
    with pytest.raises(ConfigError, match="algorithm must be one of"):
        load_config(None, ["algorithm=reinforce"])
    with pytest.raises(ConfigError, match="grpo needs group_size >= 2"):
        load_config(None, ["group_size=1"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_shipped_configs_load_and_demo_matches_its_yaml():
    from pathlib import Path

    from astrl.training.demo import CHAT_DEMO_CONFIG, CHAT_FULL_DEMO_CHANGES, DEMO_CONFIG, FULL_DEMO_CHANGES

    folder = Path(__file__).resolve().parents[1] / "configs"
    names = sorted(p.name for p in folder.glob("*.yaml"))
    assert "demo.yaml" in names and "grpo.yaml" in names
    for path in folder.glob("*.yaml"):
        load_config(path)
    assert yaml.safe_load((folder / "demo.yaml").read_text()) == DEMO_CONFIG
    assert yaml.safe_load((folder / "demo_full.yaml").read_text()) == {**DEMO_CONFIG, **FULL_DEMO_CHANGES}
    assert yaml.safe_load((folder / "elicit_chat.yaml").read_text()) == CHAT_DEMO_CONFIG
    # the guided text recipe is the demo's warm start and reward with these changes only
    guided = yaml.safe_load((folder / "elicit_guided.yaml").read_text())
    changed = {k for k in {*guided, *DEMO_CONFIG} if guided.get(k) != DEMO_CONFIG.get(k)}
    assert changed == {
        "split_seed", "judges", "likelihood_cap", "guide_search", "test_fraction", "prompts_per_step", "total_steps", "lr",
        "kl_coef", "kl_reference", "save_every", "keep_checkpoints", "sample_every", "run_dir",
    }  # fmt: skip
    # the chat RL recipe is the chat demo's warm start with another scorer for its RL steps and these changes only
    chat_rl = yaml.safe_load((folder / "elicit_chat_rl.yaml").read_text())
    changed = {k for k in {*chat_rl, *CHAT_DEMO_CONFIG} if chat_rl.get(k) != CHAT_DEMO_CONFIG.get(k)}
    assert changed == {
        "split_seed", "scorer", "warm_start_scorer", "judges", "likelihood_cap", "reply_past_opener", "probe_gate_lexicon",
        "kl_reference", "total_steps", "lr", "save_every", "keep_checkpoints", "run_dir", "reply_lexicon_whole_words",
    }  # fmt: skip
    assert chat_rl["warm_start_scorer"] == CHAT_DEMO_CONFIG["scorer"] and chat_rl["judges"] == [CHAT_DEMO_CONFIG["scorer"]]
    # astrl demo --mode chat --full: that recipe with the probe gated by the judge and the best probes replayed
    chat_full = yaml.safe_load((folder / "elicit_chat_full.yaml").read_text())
    assert chat_full == {**CHAT_DEMO_CONFIG, **CHAT_FULL_DEMO_CHANGES}
    changed = {k for k in {*chat_rl, *chat_full} if chat_rl.get(k) != chat_full.get(k)}
    assert changed == {"probe_scorer", "guide_replay", "guide_replay_warm_start", "run_dir"}
    # the CPU-sized configs: one per algorithm, each smaller than its GPU-sized namesake
    cpu = {p.stem: load_config(p) for p in (folder / "cpu").glob("*.yaml")}
    assert sorted(cpu) == ["dpo", "grpo", "ipo", "ppo"]
    for name, config in cpu.items():
        assert config.algorithm == name and config.tester == "smollm2-135m"
        big = load_config(folder / f"{'ipo' if name == 'dpo' else name}.yaml")
        assert config.max_new_tokens < big.max_new_tokens
        if name in ("ipo", "dpo"):
            assert (
                config.prompts_per_step * config.tree_width**config.tree_depth
                < big.prompts_per_step * big.tree_width**big.tree_depth
            )
        else:
            assert config.prompts_per_step * config.group_size * config.turns < big.prompts_per_step * big.group_size * big.turns


# -- GRPO pieces -----------------------------------------------------------------------------------
def test_returns_to_go_within_trajectories():
    rewards = torch.tensor([[1.0], [2.0], [3.0], [0.5], [4.0]])
    done = torch.tensor([False, False, True, False, True])
    assert returns_to_go(rewards, done).reshape(-1).tolist() == [6.0, 5.0, 3.0, 4.5, 4.0]


def test_grpo_ratio_is_one_before_the_update_and_the_loss_is_the_token_mean_advantage(tmp_path):
    trainer = _trainer(_config(tmp_path, clip_epsilon=0.2))
    trainer._build()
    batch, rollout = trainer.algorithm.collect()
    assert batch.numel() == 2 * 2 * 2  # prompts x group x turns
    advantages = batch["advantage"].reshape(-1)  # per (opener, turn) cell: tests/test_grpo.py
    assert rollout.numel() == batch.numel()
    out = trainer.algorithm.loss(batch)
    assert out["ESS"].item() == pytest.approx(1.0, abs=1e-5) and out["clip_fraction"].item() == 0.0
    lengths = torch.tensor([len(r) for r in batch.get(("tokens", "response"), as_list=True)], dtype=torch.float)
    expected = -(advantages * lengths).sum() / lengths.sum()
    assert out["loss_objective"].item() == pytest.approx(expected.item(), abs=1e-5)
    # responses are cut after their first EOS: no padding is trained on
    eos = trainer.models.tester.tokenizer.eos_token_id
    for response in batch.get(("tokens", "response"), as_list=True):
        assert eos not in response[:-1].tolist()


def test_shared_base_target_and_reference_stay_frozen_while_lora_trains(tmp_path):
    trainer = _trainer(_config(tmp_path, total_steps=2, save_every=5, reward="astprompter"))  # never an all-zero reward
    ids = torch.randint(5, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        target_before = trainer.models.target.model(input_ids=ids).logits.clone()
        tester_before = trainer.models.tester.model(input_ids=ids).logits.clone()
    base_ptrs = {p.data_ptr() for n, p in trainer.models.tester.model.named_parameters() if "lora" not in n}
    assert {p.data_ptr() for p in trainer.models.target.model.parameters()} <= base_ptrs | {
        p.data_ptr() for p in trainer.models.tester.model.parameters()
    }
    trainer.train()
    with torch.no_grad():
        torch.testing.assert_close(trainer.models.target.model(input_ids=ids).logits, target_before)
        torch.testing.assert_close(trainer.models.reference(input_ids=ids).logits, target_before)
        assert not torch.allclose(trainer.models.tester.model(input_ids=ids).logits, tester_before)


# -- trainer ---------------------------------------------------------------------------------------
def _interrupt_after(trainer: Trainer, steps: int, monkeypatch) -> None:
    original, calls = trainer.train_step, []

    def step():
        calls.append(1)
        if len(calls) > steps:
            raise KeyboardInterrupt
        return original()

    monkeypatch.setattr(trainer, "train_step", step)


def _run_twice(tmp_path, monkeypatch, stop_after: int, **settings) -> tuple[list[dict], list[dict], list[dict]]:
    """An uninterrupted run (a) and a run (b) stopped by Ctrl-C after ``stop_after`` steps, then resumed.

    Returns the rows ``train()`` gave for (a), and the metrics.csv rows of (a) and of (b)."""
    rows = _trainer(_config(tmp_path / "a", **settings)).train()
    interrupted = _trainer(_config(tmp_path / "b", **settings))
    _interrupt_after(interrupted, stop_after, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    tok = make_tokenizer()
    resumed = resume(tmp_path / "b" / "run", progress=False, tester_lm=loaded(make_llama(tok), tok, name="tiny"))
    assert resumed.step == stop_after
    resumed.train()
    return rows, _rows(tmp_path / "a" / "run" / "metrics.csv"), _rows(tmp_path / "b" / "run" / "metrics.csv")


def test_run_directory_and_exact_resume(tmp_path, monkeypatch):
    _, uninterrupted, after = _run_twice(tmp_path, monkeypatch, 2, reward="astprompter")
    run_a = tmp_path / "a" / "run"
    assert (run_a / "config.yaml").is_file() and (run_a / "final" / "tester" / "adapter_config.json").is_file()
    assert sorted(p.name for p in (run_a / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert [r["step"] for r in uninterrupted] == ["1", "2", "3", "4"]
    assert len({r["loss"] for r in uninterrupted}) > 1  # the run does learn something
    keys = ["reward_mean", "loss", "loss_objective", "grad_norm", "lr"] + [k for k in uninterrupted[0] if k.startswith("score_")]
    assert [{k: r[k] for k in keys} for r in after] == [{k: r[k] for k in keys} for r in uninterrupted]


def test_until_stops_with_a_checkpoint_on_the_whole_schedule_and_a_resume_goes_on_exactly(tmp_path):
    settings = dict(reward="astprompter", total_steps=4, save_every=4, warmup_steps=1)
    uninterrupted = _trainer(_config(tmp_path / "a", **settings)).train()
    stopped = _trainer(_config(tmp_path / "b", **settings))
    first = stopped.train(until=2)
    run = tmp_path / "b" / "run"
    assert [r["step"] for r in first] == [1, 2] and stopped.step == 2
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]  # written at the stop, not at save_every
    assert not (run / "final").exists()  # not finished: no final tester
    # the rates are the 4-step schedule's (warm-up, then down to 0 at step 4), not a 2-step schedule's
    assert [r["lr"] for r in first] == [r["lr"] for r in uninterrupted[:2]] and first[1]["lr"] > 0
    with pytest.raises(ValueError, match="until must be a step at or after the run's step 2, got 1"):
        stopped.train(until=1)
    tok = make_tokenizer()
    again = resume(run, progress=False, tester_lm=loaded(make_llama(tok), tok, name="tiny"))
    rest = again.train()
    keys = ("step", "reward_mean", "loss", "lr")
    assert [{k: r[k] for k in keys} for r in rest] == [{k: r[k] for k in keys} for r in uninterrupted[2:]]
    assert (run / "final" / "tester" / "adapter_config.json").is_file()


def test_a_new_run_in_a_used_folder_leaves_nothing_of_the_earlier_run_for_a_resume_to_pick(tmp_path):
    _trainer(_config(tmp_path, reward="astprompter", total_steps=4, save_every=2, warmup_steps=1)).train()
    run = tmp_path / "run"
    (run / "warm_start.json").write_text("{}")  # as an earlier run with a warm start leaves it
    assert earlier_run(run) == "checkpoints up to step 4" and (run / "final").is_dir()
    settings = dict(reward="astprompter", seed=3, total_steps=3, save_every=1, keep_checkpoints=5, warmup_steps=1)
    new = _trainer(_config(tmp_path, **settings))
    new.train(until=1)
    # the earlier run's step 2 and step 4, final tester and warm-start record are gone: a resume finds step 1
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]
    assert not (run / "final").exists() and not (run / "warm_start.json").exists()
    assert latest_checkpoint(run).name == "step_000001" and earlier_run(run) == "checkpoints up to step 1"
    assert [r["step"] for r in _rows(run / "metrics.csv")] == ["1"]
    new.train()  # the same trainer going on does not remove its own checkpoints
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002", "step_000003"]


def test_a_resume_that_changes_the_learning_rates_trains_at_them_from_the_saved_position(tmp_path):
    import shutil

    config = _config(tmp_path, algorithm="ppo", reward="astprompter", turns=1, total_steps=2, save_every=2, warmup_steps=2)
    _trainer(replace(config, value_lr=1e-2)).train()
    tok = make_tokenizer()
    rows, rates = {}, {}
    for label, overrides in (("same", []), ("changed", ["lr=1e-3", "value_lr=5e-3"])):
        run = tmp_path / label
        shutil.copytree(tmp_path / "run", run)
        again = resume(run, ["total_steps=4", *overrides], progress=False, tester_lm=loaded(make_llama(tok), tok, name="tiny"))
        rows[label] = [float(r["lr"]) for r in again.train()]
        rates[label] = [group["initial_lr"] for group in again.optimizer.param_groups]
    assert rates == {"same": [3e-3, 1e-2], "changed": [1e-3, 5e-3]}
    assert len(rows["same"]) == 2 and rows["same"][0] > 0  # the schedule goes on from step 2, not from its start
    assert rows["changed"] == pytest.approx([lr / 3 for lr in rows["same"]])  # the same schedule, at the new rate


def test_a_resume_that_changes_the_seed_branches_the_run_and_one_that_keeps_it_goes_on_exactly(tmp_path):
    import shutil

    config = _config(tmp_path, total_steps=2, save_every=1, reward="astprompter")
    uninterrupted = _trainer(config).train()
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000002")  # stopped after step 1
    tok = make_tokenizer()
    steps, generators = {}, {}
    for label, overrides in (("same", []), ("seed", ["seed=7"]), ("seed, again", ["seed=7"])):
        run = tmp_path / label
        shutil.copytree(tmp_path / "run", run)
        again = resume(run, overrides, progress=False, tester_lm=loaded(make_llama(tok), tok, name="tiny"))
        generators[label] = again.generator.get_state()
        steps[label] = {k: v for k, v in again.train()[0].items() if k in ("step", "reward_mean", "loss")}
    assert steps["same"] == {k: uninterrupted[1][k] for k in steps["same"]}  # the same seed: exactly as if never stopped
    assert steps["seed"]["step"] == 2 and steps["seed"] != steps["same"]  # another seed: other draws from the checkpoint on
    assert steps["seed, again"] == steps["seed"]  # and a branch is itself reproducible
    assert torch.equal(generators["seed"], torch.Generator().manual_seed(7).get_state())
    assert load_config(tmp_path / "seed" / "config.yaml").seed == 7
    # the branch's own checkpoint now holds the new seed's draws: resuming it with its saved seed restores them
    shutil.rmtree(tmp_path / "seed" / "final")
    saved = torch.load(tmp_path / "seed" / "checkpoints" / "step_000002" / "state.pt", weights_only=True)["generator"]
    again = resume(tmp_path / "seed", ["total_steps=3"], progress=False, tester_lm=loaded(make_llama(tok), tok, name="tiny"))
    assert again.step == 2 and torch.equal(again.generator.get_state(), saved)


def test_a_step_0_checkpoint_goes_on_under_another_algorithm_of_its_family_and_a_later_one_refuses(tmp_path):
    import shutil

    from astrl.training.state_io import trainable_state

    config = _config(tmp_path, total_steps=2, save_every=1, reward="astprompter", turns=1)
    first = _trainer(config)
    first._build()
    first.save_checkpoint()  # step 0: what a warm start leaves (the tester before any RL step)
    config.save(tmp_path / "run" / "config.yaml")
    saved = {k: v.clone() for k, v in trainable_state(first.models.tester.model).items()}
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_000000" / "state.pt", weights_only=True)
    assert state["algorithm_name"] == "grpo" and state["step"] == 0
    shutil.copytree(tmp_path / "run", tmp_path / "ppo")
    shutil.copytree(tmp_path / "run", tmp_path / "dpo")
    first.train()  # the GRPO run goes on: steps 1 and 2 are GRPO's

    ppo = resume(tmp_path / "ppo", ["algorithm=ppo", "kl_coef=0.1"], progress=False, tester_lm=_tiny_tester())
    assert ppo.step == 0 and ppo.algorithm.name == "ppo" and hasattr(ppo.algorithm, "value_head")
    restored = trainable_state(ppo.models.tester.model)
    assert all(torch.equal(restored[k], v) for k, v in saved.items())  # the warm-started tester, not a fresh one
    rows = ppo.train()
    assert [r["step"] for r in rows] == [1, 2] and all("loss_critic" in r for r in rows)
    later = torch.load(tmp_path / "ppo" / "checkpoints" / "step_000001" / "state.pt", weights_only=True)
    assert later["algorithm_name"] == "ppo" and "value_head" in later["algorithm"]
    assert load_config(tmp_path / "ppo" / "config.yaml").algorithm == "ppo"

    # a step-0 checkpoint of an earlier release names no algorithm: config.yaml's, but a PPO config over a
    # state without a value head is the GRPO warm start a switched run left before its first checkpoint
    from astrl.training.trainer import saved_algorithm

    assert saved_algorithm({"algorithm": {}}, "ppo") == "grpo" and saved_algorithm({"algorithm": {}}, "dpo") == "dpo"
    assert saved_algorithm({"algorithm": {"value_head": {}}}, "ppo") == "ppo"
    with pytest.raises(ConfigError, match=r"algorithm='dpo': checkpoint .* was saved by 'grpo'; .* within grpo/ppo or dpo/ipo"):
        resume(tmp_path / "dpo", ["algorithm=dpo"], progress=False, tester_lm=_tiny_tester())
    shutil.rmtree(tmp_path / "run" / "final")
    with pytest.raises(ConfigError, match=r"algorithm='ppo': checkpoint .*step_000002.* \(step 2\) was saved by 'grpo'"):
        resume(tmp_path / "run", ["algorithm=ppo", "total_steps=3"], progress=False, tester_lm=_tiny_tester())


def test_a_dpo_step_0_checkpoint_goes_on_as_ipo_and_not_as_grpo(tmp_path):
    import shutil

    from astrl.training.state_io import trainable_state

    trees = dict(prompts_per_step=2, tree_width=2, tree_depth=1, beta=0.1, epochs=1)
    config = _config(tmp_path, algorithm="dpo", total_steps=1, save_every=1, reward="astprompter", turns=1, **trees)
    first = _trainer(config)
    first._build()
    first.save_checkpoint()  # the warm-started tester, before any preference step
    config.save(tmp_path / "run" / "config.yaml")
    saved = {k: v.clone() for k, v in trainable_state(first.models.tester.model).items()}
    shutil.copytree(tmp_path / "run", tmp_path / "grpo")

    ipo = resume(tmp_path / "run", ["algorithm=ipo"], progress=False, tester_lm=_tiny_tester())
    assert ipo.step == 0 and ipo.algorithm.name == "ipo"
    restored = trainable_state(ipo.models.tester.model)
    assert all(torch.equal(restored[k], v) for k, v in saved.items())
    assert [r["step"] for r in ipo.train()] == [1]
    later = torch.load(tmp_path / "run" / "checkpoints" / "step_000001" / "state.pt", weights_only=True)
    assert later["algorithm_name"] == "ipo" and load_config(tmp_path / "run" / "config.yaml").algorithm == "ipo"
    with pytest.raises(ConfigError, match=r"algorithm='grpo': checkpoint .* was saved by 'dpo'; .* within grpo/ppo or dpo/ipo"):
        resume(tmp_path / "grpo", ["algorithm=grpo"], progress=False, tester_lm=_tiny_tester())


LEARNING = {  # per algorithm: settings under which a tiny model learns to say the keywords
    "grpo": dict(group_size=4, lr=3e-3, total_steps=24),
    "ppo": dict(prompts_per_step=4, group_size=4, lr=1e-2, value_lr=1e-2, epochs=4, total_steps=24, kl_coef=0.01),
    "ipo": dict(prompts_per_step=8, tree_width=4, tree_depth=1, beta=0.1, lr=1e-2, epochs=2, total_steps=24),
    "dpo": dict(prompts_per_step=8, tree_width=4, tree_depth=1, beta=0.5, lr=1e-2, epochs=2, total_steps=24),
}


@pytest.mark.parametrize("algorithm", sorted(LEARNING))
def test_every_algorithm_raises_a_trivially_learnable_reward(tmp_path, algorithm):
    # reward = share of keyword words in probe + reply: the tester can raise it by itself
    settings = dict(save_every=100, turns=1, lora=False, reward="astprompter", alpha=0.0, zeta=1.0, likelihood_weight=0.0)
    trainer = _trainer(_config(tmp_path, algorithm=algorithm, **{**settings, **LEARNING[algorithm]}))
    rewards = [r["reward_mean"] for r in trainer.train()]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.05, rewards


def test_ppo_trains_the_policy_and_its_value_head_and_checkpoints_both(tmp_path):
    config = _config(
        tmp_path, algorithm="ppo", reward="astprompter", total_steps=2, save_every=2, turns=1, kl_coef=0.1, value_lr=1e-2
    )
    trainer = _trainer(config)
    trainer._build()
    head_before = [p.detach().clone() for p in trainer.algorithm.value_head.parameters()]
    rows = trainer.train()
    assert {"loss_objective", "loss_critic", "loss_entropy", "kl_coef", "explained_variance"} <= set(rows[-1])
    assert rows[-1]["kl_coef"] == 0.1
    lrs = [group["lr"] for group in trainer.optimizer.param_groups]
    assert len(lrs) == 2  # the value head has its own learning rate
    head_after = list(trainer.algorithm.value_head.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(head_before, head_after, strict=True))
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_000002" / "state.pt", weights_only=True)
    for key, value in state["algorithm"]["value_head"].items():
        assert torch.equal(value, trainer.algorithm.value_head.state_dict()[key])


def test_ppo_resumes_exactly(tmp_path, monkeypatch):
    settings = dict(algorithm="ppo", reward="astprompter", total_steps=3, save_every=100, turns=1, kl_coef=0.1, target_kl=1.0)
    _, uninterrupted, after = _run_twice(tmp_path, monkeypatch, 1, **settings)
    keys = ["reward_mean", "loss", "loss_critic", "kl_coef", "grad_norm", "lr"]
    assert len({r["kl_coef"] for r in uninterrupted}) > 1  # the adaptive controller moved and was restored
    assert [{k: r[k] for k in keys} for r in after] == [{k: r[k] for k in keys} for r in uninterrupted]


@pytest.mark.parametrize("algorithm", ["ipo", "dpo"])
def test_tree_preference_training_runs_and_resumes_exactly(tmp_path, monkeypatch, algorithm):
    settings = dict(
        algorithm=algorithm,
        reward="astprompter",
        total_steps=3,
        save_every=100,
        prompts_per_step=2,
        tree_width=2,
        tree_depth=2,
        beta=0.1,
        lr=1e-2,
    )
    rows, uninterrupted, after = _run_twice(tmp_path, monkeypatch, 1, **settings)
    assert all(r["pairs"] + r["pairs_skipped"] == 2 * (1 + 2) for r in rows)  # groups per step: trees x (1 + width)
    loss_key = f"loss_{algorithm}"
    assert {loss_key, "preference_accuracy", "reward_margin"} <= set(rows[0])
    keys = ["reward_mean", "loss", loss_key, "pairs", "grad_norm", "lr"]
    assert [{k: r[k] for k in keys} for r in after] == [{k: r[k] for k in keys} for r in uninterrupted]


def _tiny_overrides(model_dir, run_dir) -> list[str]:
    return [
        f"tester={model_dir}",
        f"target={model_dir}",
        f"scorer={KEYWORDS}",
        "total_steps=2",
        "save_every=1",
        "prompts_per_step=2",
        "group_size=2",
        "turns=1",
        "max_new_tokens=4",
        "lora_targets=q_proj,v_proj",
        f"run_dir={run_dir}",
    ]


def test_train_command_writes_a_run_and_resumes(tmp_path, tiny_model_dir, capsys):
    from astrl.cli import main

    run_dir = tmp_path / "cli_run"
    assert main(["train", "--config", "configs/grpo.yaml", "--quiet", *_tiny_overrides(tiny_model_dir, run_dir)]) == 0
    out = capsys.readouterr().out
    assert "trained 2 steps" in out and (run_dir / "final" / "tester" / "adapter_config.json").is_file()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["turns"] == 1 and saved["returns"] == "to_go"  # file values, then overrides
    assert main(["train", "--resume", str(run_dir), "--quiet", "--until", "1", "total_steps=4"]) == 2  # at step 2 already
    assert "--until 1 is before the run's newest checkpoint, step 2" in capsys.readouterr().err
    assert main(["train", "--resume", str(run_dir), "--quiet", "--until", "3", "total_steps=4"]) == 0
    assert "stopped at step 3 of 4; continue with: astrl train --resume" in capsys.readouterr().out
    assert [r["step"] for r in _rows(run_dir / "metrics.csv")] == ["1", "2", "3"]
    assert main(["train", "--resume", str(tmp_path / "nowhere"), "--quiet"]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_train_command_refuses_a_used_run_dir_unless_told_to_overwrite(tmp_path, tiny_model_dir, capsys, monkeypatch):
    from astrl.cli import main

    run_dir = tmp_path / "cli_run"
    args = ["train", "--config", "configs/grpo.yaml", "--quiet", *_tiny_overrides(tiny_model_dir, run_dir)]
    assert main(args) == 0
    capsys.readouterr()
    import astrl.models

    def no_model(*_, **__):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(astrl.models, "load_model", no_model)
    assert main([*args, "seed=5"]) == 2  # refused before any model loads
    err = capsys.readouterr().err
    assert f"run_dir {str(run_dir)!r} holds an earlier run (checkpoints up to step 2)" in err
    assert f"astrl train --resume {run_dir}" in err and "--overwrite" in err
    assert main(["train", "--resume", str(run_dir), "--overwrite", "--quiet"]) == 2
    assert "--overwrite starts a new run; --resume continues one" in capsys.readouterr().err
    monkeypatch.undo()
    (run_dir / "checkpoints" / "step_000002").rename(run_dir / "checkpoints" / "step_000009")  # a stale later one
    assert main([*args, "seed=5", "--overwrite"]) == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["seed"] == 5


def test_demo_trains_then_compares_and_reuses_a_finished_run(tmp_path, tiny_model_dir, monkeypatch):
    from astrl.store import Store
    from astrl.training.demo import run_demo

    monkeypatch.setenv("ASTRL_STORE", str(tmp_path / "store.sqlite"))

    overrides = {k: v for k, v in (o.split("=", 1) for o in _tiny_overrides(tiny_model_dir, tmp_path / "demo"))}
    overrides = {k: yaml.safe_load(v) if k not in ("lora_targets",) else v.split(",") for k, v in overrides.items()}
    overrides = {k: str(v) if k in ("tester", "target", "run_dir") else v for k, v in overrides.items()}
    first = run_demo(overrides, progress=False, conversations=3)
    assert len(first["rows"]) == 2
    before, after = first["comparison"]["before"], first["comparison"]["after"]
    assert set(before) == set(after) >= {"mean_reward", "probe_nll", "judges", "best_probe", "best_reply"}
    assert before["probe_nll"] > 0
    assert list(before["judges"]) == [make_scorer(KEYWORDS).name, "wordlist"]  # the training scorer and a distinct judge
    for side in (before, after):
        for metrics in side["judges"].values():
            assert metrics["n_conversations"] == 3
            for name in ("elicited_success_rate", "elicited_asr", "toxic_probe_rate", "toxic_reply_rate"):
                low, high = metrics[f"{name}_ci"]
                assert 0 <= low <= metrics[name] <= high <= 1
            assert metrics["elicited_success_rate"] <= metrics["toxic_reply_rate"]
            assert metrics["reply_samples"] == 4  # the held-out probes are answered 4 times each
            for name in ("elicited_reply_share", "toxic_reply_share"):
                low, high = metrics[f"{name}_ci"]
                assert 0 <= low <= metrics[name] <= high <= 1
            assert metrics["elicited_reply_share"] <= metrics["toxic_reply_share"]
    summary = json.loads((tmp_path / "demo" / "demo_summary.json").read_text())
    assert summary["judge"] == "wordlist" and summary["conversations"] == 3
    assert summary["after"]["mean_reward"] == after["mean_reward"] and "best_probe" not in summary["after"]
    with Store.open(tmp_path / "store.sqlite", create=False) as store:  # the training run, then each side as an eval
        runs = store.runs()
    assert [(r.kind, r.status, r.steps, r.turns) for r in runs] == [("demo", "finished", 2, 8), *[("eval", "finished", 0, 3)] * 2]
    assert [Path(r.folder).name for r in runs[1:]] == ["before", "after"]
    assert runs[2].elicited_asr["wordlist"] == after["judges"]["wordlist"]["elicited_asr"]
    again = run_demo(overrides, progress=False, conversations=3)
    assert again["rows"] == [] and again["comparison"]["before"] == before  # the untrained side is seeded
    from astrl.training.demo import compare_testers

    partial = compare_testers(resume(tmp_path / "demo", progress=False), conversations=17)  # one full batch of 16 + 1
    assert all(side["judges"]["wordlist"]["n_conversations"] == 17 for side in partial.values())
    assert all(side["judges"]["wordlist"]["n_turns"] == 17 for side in partial.values())  # one turn each
    with pytest.raises(ConfigError, match="holds a run with other settings than this demo .* lr: 0.0002 there, 0.003 here"):
        run_demo({**overrides, "lr": 0.003}, progress=False, conversations=3)  # e.g. a run of an older demo


def test_chat_demo_trains_in_a_chat_env_and_compares_on_the_held_out_test_openers(tmp_path, tiny_model_dir, monkeypatch):
    from astrl.prompts import load_prompts, split_fractions, split_prompts
    from astrl.training.demo import run_demo

    monkeypatch.setenv("ASTRL_STORE", str(tmp_path / "store.sqlite"))
    overrides = {
        "tester": str(tiny_model_dir),
        "target": str(tiny_model_dir),
        "scorer": KEYWORDS,
        "run_dir": str(tmp_path / "chat"),
    }
    overrides.update(total_steps=1, prompts_per_step=2, group_size=2, max_new_tokens=3, target_max_new_tokens=3)
    overrides.update(warm_start_probes=2, warm_start_rounds=1, warm_start_reply_tokens=2, lora_targets=["q_proj", "v_proj"])
    result = run_demo(overrides, progress=False, conversations=3, mode="chat")
    config = result["config"]
    assert (config.mode, config.turns, config.test_fraction) == ("chat", 2, 0.35) and len(result["rows"]) == 1
    test_openers = set(split_prompts(load_prompts("rtp"), "test", seed=0, fractions=split_fractions(0.35)))
    for side in result["comparison"].values():
        records = side["records"]
        assert {r["prompt"] for r in records} <= test_openers  # the 218 held-out openers, not dev's 62
        assert sorted({r["turn"] for r in records}) == [0, 1] and side["judges"]["wordlist"]["n_conversations"] == 3
    assert json.loads((tmp_path / "chat" / "warm_start.json").read_text())["sampled"] == 2


def test_chat_demo_full_trains_the_chat_rl_recipe_and_judges_by_the_svm(tmp_path, tiny_model_dir, monkeypatch):
    from astrl.training.demo import run_demo

    monkeypatch.setenv("ASTRL_STORE", str(tmp_path / "store.sqlite"))
    overrides = {"tester": str(tiny_model_dir), "target": str(tiny_model_dir), "run_dir": str(tmp_path / "chat_full")}
    overrides.update(total_steps=2, prompts_per_step=2, group_size=2, max_new_tokens=3, target_max_new_tokens=3)
    overrides.update(warm_start_probes=2, warm_start_rounds=1, warm_start_reply_tokens=2, lora_targets=["q_proj", "v_proj"])
    overrides.update(warm_start_min_toxic=0.0, warm_start_max_nll=None, reply_lexicon="hell,idiot,the,you")  # tiny vocab
    result = run_demo(overrides, progress=False, conversations=3, mode="chat", full=True)
    config, rows = result["config"], result["rows"]
    assert (config.scorer, config.probe_scorer, config.guide_replay_warm_start) == ("wordlist:strict", "profanity", True)
    assert len(rows) == 2 and all("replay_untested" in row for row in rows)  # the replay archive ran
    for side in result["comparison"].values():
        assert list(side["judges"]) == ["wordlist:strict", "profanity"]  # the training scorer, then the SVM judge
        assert side["judges"]["profanity"]["reply_samples"] == 4
    summary = json.loads((tmp_path / "chat_full" / "demo_summary.json").read_text())
    assert (summary["judge"], summary["scorer"]) == ("profanity", "wordlist:strict")


def test_demo_table_shows_both_judges_with_intervals():
    from astrl.training.commands import format_comparison

    metrics = {"elicited_success_rate": 0.25, "elicited_asr": 0.5, "toxic_probe_rate": 0.0, "toxic_reply_rate": 0.25}
    metrics.update({f"{k}_ci": [0.0, 0.5] for k in list(metrics)})
    side = {"mean_reward": 0.1, "probe_nll": 2.5, "judges": {"profanity": metrics, "wordlist": metrics}}
    table = format_comparison(side, {**side, "probe_nll": 3.0})
    assert "judged by profanity:" in table and "judged by wordlist:" in table
    assert "0.250 [0.00, 0.50]" in table and "3.000" in table
    assert "elicited_reply_share" not in table  # one reply a probe: no shares
    shares = {**metrics, "elicited_reply_share": 0.125, "elicited_reply_share_ci": [0.05, 0.2]}
    table = format_comparison({**side, "judges": {"wordlist": shares}}, {**side, "judges": {"wordlist": shares}})
    assert "elicited_reply_share" in table and "0.125 [0.05, 0.20]" in table
    # the chat demo's rates near 2%: bounds to three decimals, so [0.013, 0.024] does not print as [0.01, 0.02]
    near = {**shares, "elicited_reply_share": 0.018, "elicited_reply_share_ci": [0.0132, 0.0235]}
    table = format_comparison({**side, "judges": {"profanity": near}}, {**side, "judges": {"profanity": near}}, interval_digits=3)
    assert "0.018 [0.013, 0.024]" in table and "0.250 [0.000, 0.500]" in table


# -- novelty bonuses -------------------------------------------------------------------------------
def test_novelty_config_keys_are_checked_and_mapped():
    assert TrainConfig().novelty_options() is None
    config = TrainConfig(novelty_ngram=0.5, novelty_history=7, novelty_ngram_n=3, novelty_embedding_reduce="mean")
    assert config.novelty_options() == {
        "ngram": 0.5,
        "embedding": 0.0,
        "history": 7,
        "ngram_n": 3,
        "embedding_reduce": "mean",
        "device": "cpu",
    }
    for key, value in [
        ("novelty_ngram", -1.0),
        ("novelty_history", 0),
        ("novelty_ngram_n", 1),
        ("novelty_embedding_reduce", "min"),
    ]:
        with pytest.raises(ConfigError, match=key):
            TrainConfig(**{key: value})


@pytest.mark.parametrize("algorithm", ["grpo", "ipo"])
def test_novelty_history_is_checkpointed_and_resumes_exactly(tmp_path, monkeypatch, algorithm):
    settings = dict(algorithm=algorithm, novelty_ngram=0.5, novelty_history=6, total_steps=3, save_every=100, turns=2)
    if algorithm == "ipo":
        settings.update(tree_width=2, tree_depth=2, beta=0.1)
    rows, uninterrupted, after = _run_twice(tmp_path, monkeypatch, 1, **settings)
    if algorithm == "grpo":
        assert "term_ngram_novelty" in rows[0] and 0.0 < rows[-1]["term_ngram_novelty"] < 1.0
        keys = ["reward_mean", "term_ngram_novelty", "loss", "grad_norm"]
    else:
        keys = ["reward_mean", "loss", "pairs"]
    assert [{k: r[k] for k in keys} for r in after] == [{k: r[k] for k in keys} for r in uninterrupted]
    state = torch.load(tmp_path / "a" / "run" / "checkpoints" / "step_000003" / "state.pt", weights_only=True)
    novelty = state["algorithm"]["novelty"] if algorithm == "grpo" else state["algorithm"]["sampler"]["novelty"]
    assert len(novelty) == 1 and 0 < len(novelty[0]["_extra_state"]["history"]) <= 6


# the tiny model's replies are mostly byte soup: any single letter or common fragment is a hit
LOOSE_SCORER = "keywords:" + ",".join([*"abcdefghijklmnopqrstuvwxyz", "en", "he", "ho", "ll", "hell", "at", "ot", "the", "you"])


def test_attack_archive_is_written_while_training_and_restored_on_resume(tmp_path, monkeypatch):
    settings = dict(archive_threshold=0.0, total_steps=3, save_every=100, turns=2, scorer=LOOSE_SCORER)
    _run_twice(tmp_path, monkeypatch, 1, **settings)
    archive_a = [json.loads(line) for line in (tmp_path / "a" / "run" / "attacks.jsonl").open()]
    assert archive_a, "a keyword reward above 0 is easy: some turns must be archived"
    keys = [" ".join(a["probe"].casefold().split()) for a in archive_a]
    assert len(keys) == len(set(keys))
    assert {a["step"] for a in archive_a} <= {1, 2, 3} and all(a["count"] >= 1 for a in archive_a)
    for attack in archive_a:
        assert attack["scores"][attack_scorer(attack)] > 0.0
        assert attack["conversation"][0]["role"] == "opener" and len(attack["conversation"]) == 1 + 2 * attack["turn"]
    rows = _rows(tmp_path / "a" / "run" / "metrics.csv")
    assert int(rows[-1]["attacks_unique"]) == len(archive_a)
    archive_b = [json.loads(line) for line in (tmp_path / "b" / "run" / "attacks.jsonl").open()]
    assert archive_b == archive_a  # interrupted, resumed: the same archive, nothing twice


def test_resume_drops_attacks_archived_after_the_checkpoint(tmp_path, monkeypatch):
    config = _config(tmp_path, archive_threshold=0.0, total_steps=2, save_every=1, turns=2, scorer=LOOSE_SCORER)
    _trainer(config).train()
    path = tmp_path / "run" / "attacks.jsonl"
    before = path.read_text(encoding="utf-8")
    assert before
    with path.open("a", encoding="utf-8") as handle:  # as if a step after the last checkpoint had been archived
        handle.write(json.dumps({"probe": "zzz lost", "reply": "", "scores": {"x": 1.0}, "step": 3}) + "\n")
    tok = make_tokenizer()
    resumed = resume(tmp_path / "run", ["total_steps=2"], progress=False, tester_lm=loaded(make_llama(tok), tok, name="tiny"))
    resumed.train()
    assert path.read_text(encoding="utf-8") == before


def attack_scorer(attack: dict) -> str:
    return next(iter(attack["scores"]))


def test_train_scale_out_flags_are_config_overrides():
    from astrl.cli import build_parser
    from astrl.training.commands import train_overrides

    args = build_parser().parse_args(["train", "--collector", "ray", "--num-collectors", "2", "lr=0.1", "num_collectors=4"])
    overrides = train_overrides(args)
    assert overrides == ["collector=ray", "num_collectors=2", "lr=0.1", "num_collectors=4"]
    config = load_config(None, overrides)
    assert (config.collector, config.num_collectors, config.lr) == ("ray", 4, 0.1)  # an explicit override wins
    with pytest.raises(SystemExit):  # not one of the collector's choices: refused as the flags are parsed
        build_parser().parse_args(["train", "--collector", "slurm"])


def test_each_optimizer_choice_builds_its_torch_class_and_an_unknown_one_is_refused():
    from astrl.training.config import OPTIMIZERS
    from astrl.training.trainer import make_optimizer

    weight = torch.nn.Parameter(torch.zeros(2))
    built = {name: type(make_optimizer(name, [{"params": [weight]}], lr=0.1, weight_decay=0.01)) for name in OPTIMIZERS}
    assert built == {
        "adamw": torch.optim.AdamW,
        "adam": torch.optim.Adam,
        "sgd": torch.optim.SGD,
        "rmsprop": torch.optim.RMSprop,
        "adagrad": torch.optim.Adagrad,
    }
    assert TrainConfig.__dataclass_fields__["optimizer"].metadata["choices"] == tuple(OPTIMIZERS)
    with pytest.raises(ConfigError, match="optimizer must be one of .*got 'lion'"):
        make_optimizer("lion", [{"params": [weight]}], lr=0.1, weight_decay=0.0)
