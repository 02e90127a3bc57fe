"""Reliability: measured failures fixed, faults survived, resume right on every path (docs/reliability.md)."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import loaded, make_llama, make_tokenizer

from astrl.cli import main


def _error_line(capsys) -> str:
    """The CLI's stderr: exactly one ``astrl: error:`` line and no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("astrl: error: "), err
    return lines[0]


# -- the four measured failures ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "text", ["algorithm: grpo\n  total_steps: [1\n", 'seed: "\n', "\t- x\n", "a: b: c\n", "- 1\n- 2\n", "\xff\xfe\x00"]
)
def test_malformed_yaml_config_is_one_error_line_naming_the_file(tmp_path, capsys, text):
    path = tmp_path / "broken.yaml"
    path.write_bytes(text.encode("latin-1"))
    assert main(["train", "--config", str(path), "--quiet"]) == 2
    assert str(path) in _error_line(capsys)


def test_malformed_run_config_is_one_error_line_on_resume_eval_and_demo(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "config.yaml").write_text("tester: [unclosed\n")
    for argv in (
        ["train", "--resume", str(run), "--quiet"],
        ["eval", "--tester", str(run), "--quiet", "--out", str(tmp_path / "eval")],
        ["demo", "--run-dir", str(run), "--quiet"],
    ):
        assert main(argv) == 2, argv
        assert str(run / "config.yaml") in _error_line(capsys)


@pytest.mark.parametrize("kind", ["a file", "below a file"])
def test_unusable_astrl_cache_is_a_clear_error_before_converting(tmp_path, monkeypatch, capsys, kind):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    cache = blocker if kind == "a file" else blocker / "cache"
    monkeypatch.setenv("ASTRL_CACHE", str(cache))
    start = time.perf_counter()
    argv = ["rollout", "--tester", "smollm2-135m", "--num-conversations", "1", "--quiet", "--out", str(tmp_path / "o.jsonl")]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert str(cache) in line and "ASTRL_CACHE" in line
    assert time.perf_counter() - start < 10  # refused before the 20-30 s conversion


def test_adaptive_kl_from_a_zero_start_is_refused_naming_both_keys(tmp_path, capsys):
    from astrl.rewards.kl import make_kl_controller
    from astrl.training import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"target_kl \(0.1\) needs kl_coef > 0, got kl_coef 0.0"):
        load_config("configs/ppo.yaml", ["kl_coef=0", "target_kl=0.1"])
    with pytest.raises(ValueError, match="needs kl_coef > 0"):
        make_kl_controller(0.0, 0.1)
    argv = ["train", "--config", "configs/ppo.yaml", "--quiet", "kl_coef=0", "target_kl=0.1", f"run_dir={tmp_path}/r"]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert "target_kl" in line and "kl_coef" in line
    assert load_config("configs/ppo.yaml", ["kl_coef=0", "target_kl=null"]).kl_coef == 0  # a constant 0 is fine


def test_adaptive_kl_controller_stays_finite_and_moves_from_a_small_start():
    from astrl.rewards.kl import ClippedKLReward

    reward = ClippedKLReward(kl_coef=1e-3, target_kl=0.1, horizon=10)
    reward._kl_total, reward._kl_count = 5.0, 10  # KL 0.5 per turn, above the target: the coefficient grows
    coef = reward.update_kl_coef()
    assert coef == pytest.approx(1e-3 * (1 + 0.2 * 10 / 10)) and coef == coef


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "unreachable endpoint"])
def test_unknown_hub_id_offline_fails_fast_with_the_clear_message(monkeypatch, capsys, tmp_path, how):
    if how == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    start = time.perf_counter()
    argv = ["rollout", "--tester", "nobody-xyz/no-such-model", "--quiet", "--out", str(tmp_path / "o.jsonl")]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert "'nobody-xyz/no-such-model'" in line and "offline" in line and "local folder path" in line
    assert time.perf_counter() - start < 10  # not a minute of retries


# -- helpers for tiny training runs ------------------------------------------------------------------
KEYWORDS = "keywords:the,you,hello,how,are"


def _config(run_dir, **overrides):
    from astrl.training import TrainConfig

    settings = dict(
        tester="tiny",
        target="tiny",
        scorer=KEYWORDS,
        reward="astprompter",
        total_steps=2,
        save_every=1,
        prompts_per_step=2,
        group_size=2,
        turns=1,
        max_new_tokens=4,
        lr=3e-3,
        warmup_steps=1,
        lora_targets=["q_proj", "v_proj"],
        run_dir=str(run_dir),
    )
    settings.update(overrides)
    return TrainConfig(**settings)


def _tiny_lm():
    tok = make_tokenizer()
    return loaded(make_llama(tok), tok, name="tiny")


def _trainer(config):
    from astrl.training import Trainer
    from astrl.training.setup import build_models

    return Trainer(config, models=build_models(config, _tiny_lm()), progress=False)


def _resume(run_dir, overrides=()):
    from astrl.training import resume

    return resume(run_dir, list(overrides), progress=False, tester_lm=_tiny_lm())


def _lora(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


# -- resume: restored weights reach the acting policy before the first collection ---------------------
@pytest.mark.slow  # starts a local Ray instance
def test_ray_resume_pushes_restored_weights_to_workers_before_the_first_collection(tiny_model_dir, tmp_path):
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024**2, log_to_driver=False)
    try:
        folder = str(tiny_model_dir)
        overrides = dict(tester=folder, target=folder, collector="ray", num_collectors=2, save_every=2)
        _trainer_from_disk(_config(tmp_path / "run", **overrides)).train()
        from astrl.training import resume

        trainer = resume(tmp_path / "run", ["total_steps=3"], progress=False)
        restored = _lora(trainer.models.tester.model)
        assert any(bool(v.abs().sum()) for k, v in restored.items() if "lora_B" in k)  # trained: not the zero init
        collector, seen = trainer.algorithm.collector, []
        original = collector.next

        def first_next():
            if not seen:  # what each worker acts with when the first post-resume batch is collected
                seen.extend({k: v for k, v in collector.worker_weights(i).items() if "lora_" in k} for i in range(2))
            return original()

        collector.next = first_next
        rows = trainer.train()
        assert len(seen) == 2
        for worker in seen:
            assert worker.keys() == restored.keys()
            assert all(torch.equal(worker[k], restored[k]) for k in restored)
        assert [r["policy_version"] for r in rows] == [2]  # generated by the policy after 2 updates
    finally:
        if started:
            ray.shutdown()


def _trainer_from_disk(config):
    from astrl.training import Trainer

    return Trainer(config, progress=False)


def test_resume_pushes_restored_weights_through_the_vllm_hook_once_before_collecting(tmp_path, monkeypatch):
    import astrl.training.vllm_sync as vllm_sync

    _trainer(_config(tmp_path / "run", save_every=2)).train()
    trainer = _resume(tmp_path / "run", ["total_steps=3"])
    restored = _lora(trainer.models.tester.model)
    events: list = []
    monkeypatch.setattr(vllm_sync, "push_to_vllm", lambda engine, model: events.append(("push", _lora(model))))
    trainer.algorithm.vllm_engine = "engine"  # as with backend: vllm (the engine itself needs CUDA)
    collect = trainer.algorithm.collect
    monkeypatch.setattr(trainer.algorithm, "collect", lambda: (events.append(("collect", None)), collect())[1])
    trainer.train()
    assert [e[0] for e in events] == ["push", "collect", "push"]  # restored weights, batch, the update's push
    assert all(torch.equal(events[0][1][k], restored[k]) for k in restored)


# -- the learning-rate schedule counts the updates that happen ---------------------------------------
@pytest.mark.parametrize("settings", [dict(minibatches=4), dict(minibatches=3, grad_accum=2, min_reward_gap=0.05)])
def test_lr_schedule_reaches_its_end_value_with_fewer_updates_than_planned(tmp_path, settings):
    # 2 trees of width 2 and depth 1 give at most 2 pairs a step: fewer minibatches than planned, some steps none
    config = _config(
        tmp_path / "run", algorithm="dpo", total_steps=4, prompts_per_step=2, tree_width=2, tree_depth=1,
        group_size=4, warmup_steps=0, lr=1e-2, save_every=100, **settings,
    )  # fmt: skip
    rows = _trainer(config).train()
    assert all(r["pairs"] <= 2 for r in rows)
    assert [r["lr"] for r in rows] == pytest.approx([1e-2 * (1 - s / 4) for s in (1, 2, 3, 4)])
    assert rows[-1]["lr"] == 0.0


def test_lr_warmup_then_linear_decay_over_planned_updates(tmp_path):
    config = _config(tmp_path / "run", total_steps=3, minibatches=2, warmup_steps=2, lr=1e-2, save_every=100)
    trainer = _trainer(config)
    seen = []
    step = trainer._optimizer_step

    def recording():
        seen.append(trainer.optimizer.param_groups[0]["lr"])
        return step()

    trainer._optimizer_step = recording
    rows = trainer.train()
    # 6 planned updates: warm-up 1/2, 2/2, then (6 - u) / 4 for u = 2..5; 0 after the last
    assert seen == pytest.approx([5e-3, 1e-2, 1e-2, 7.5e-3, 5e-3, 2.5e-3])
    assert rows[-1]["lr"] == 0.0


# -- faults survived -----------------------------------------------------------------------------------
def _cli_run(model_dir, run_dir, *extra) -> list[str]:
    return [
        "train", "--quiet", f"tester={model_dir}", f"target={model_dir}", f"scorer={KEYWORDS}", "reward=astprompter",
        "total_steps=4", "prompts_per_step=2", "group_size=2", "turns=1", "max_new_tokens=4", "lr=3e-3",
        "lora_targets=q_proj,v_proj", "sample_every=1", "archive_threshold=0.1", f"run_dir={run_dir}", *extra,
    ]  # fmt: skip


def _metrics(run_dir) -> list[dict]:
    import csv

    keys = ("step", "reward_mean", "loss", "grad_norm", "lr")
    return [{k: r[k] for k in keys} for r in csv.DictReader((run_dir / "metrics.csv").open())]


def _jsonl(path) -> list[dict]:
    import json

    text = path.read_text()
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    """The metrics of an uninterrupted 4-step CLI run, to compare interrupted and resumed runs with."""
    run = tmp_path_factory.mktemp("whole") / "run"
    assert main(_cli_run(tiny_model_dir, run, "save_every=1", "keep_checkpoints=4")) == 0
    return run


def test_scorer_failing_mid_run_stops_cleanly_and_resumes_to_the_same_metrics(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                               uninterrupted):  # fmt: skip
    from astrl.scorers import KeywordScorer

    original, calls = KeywordScorer.__call__, []

    def flaky(self, texts):
        calls.append(1)
        if len(calls) == 5:  # two calls a step (reply, probe + reply): the first of step 3
            raise ConnectionError("scoring service unreachable")
        return original(self, texts)

    monkeypatch.setattr(KeywordScorer, "__call__", flaky)
    run = tmp_path / "run"
    assert main(_cli_run(tiny_model_dir, run, "save_every=100")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "astrl: error: training stopped in step 3: scoring service unreachable" in err
    assert f"step_000002; continue with: astrl train --resume {run}" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]  # the last finished step
    assert [r["step"] for r in _metrics(run)] == ["1", "2"]
    assert {s["step"] for s in _jsonl(run / "samples.jsonl")} == {1, 2}
    _jsonl(run / "attacks.jsonl")
    monkeypatch.setattr(KeywordScorer, "__call__", original)
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert _metrics(run) == _metrics(uninterrupted)  # the failed step left no trace in the resumed run
    assert _jsonl(run / "samples.jsonl") == _jsonl(uninterrupted / "samples.jsonl")


@pytest.mark.parametrize("damage", ["truncated state", "flipped adapter byte", "garbage state", "missing state"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tiny_model_dir, tmp_path, capsys, uninterrupted, damage):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace(str(uninterrupted), str(run)))
    newest = run / "checkpoints" / "step_000004"
    state, adapter = newest / "state.pt", newest / "tester" / "adapter_model.safetensors"
    if damage == "truncated state":
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    elif damage == "flipped adapter byte":
        data = bytearray(adapter.read_bytes())
        data[len(data) // 2] ^= 0xFF
        adapter.write_bytes(bytes(data))
    elif damage == "garbage state":
        state.write_bytes(b"\0" * state.stat().st_size)
    else:
        state.unlink()
    # total_steps=4 reached already: resuming from step 3 redoes step 4 only
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "astrl: warning: checkpoint" in err and str(newest) in err and "Traceback" not in err
    assert (run / "checkpoints" / "step_000004.damaged").is_dir()
    assert _metrics(run) == _metrics(uninterrupted)


def test_no_usable_checkpoint_is_an_error_naming_each_file(tmp_path, capsys, uninterrupted):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    for folder in (run / "checkpoints").iterdir():
        (folder / "state.pt").write_bytes(b"x")
    assert main(["train", "--resume", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no usable checkpoint" in err and "step_000001: " in err and "step_000004: " in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert len(list((run / "checkpoints").glob("step_*[0-9]"))) == 4  # left in place, to be looked at


@pytest.mark.parametrize("mode", ["chat", "text"])
def test_long_conversations_never_exceed_a_64_position_window(mode):
    from astrl.envs import make_redteam_env
    from astrl.policies import GenerationSettings, make_policy
    from astrl.scorers import ChatJudgeScorer

    tok = make_tokenizer()
    lm = loaded(make_llama(tok, max_positions=64), tok)
    lengths: list[int] = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        past = kwargs.get("past_key_values")
        seen = past.get_seq_length() if past is not None and hasattr(past, "get_seq_length") else 0
        if ids is not None:
            lengths.append(seen + ids.shape[-1])

    lm.model.register_forward_pre_hook(record, with_kwargs=True)
    judge = ChatJudgeScorer.__new__(ChatJudgeScorer)  # the judge reads its input through the same 64-position model
    judge.__dict__.update(_judge_parts(lm))
    settings = GenerationSettings(max_new_tokens=6)
    tester = make_policy(lm, settings, input_mode="history" if mode == "chat" else "text")
    target = make_policy(lm, settings, input_mode="history" if mode == "chat" else "text")
    env = make_redteam_env(
        tester,
        target,
        [judge],
        ["hello how are you today"],
        batch_size=2,
        max_turns=22,
        mode=mode,
        reward="astprompter",
        tester_system_prompt="be rude",
    )
    rollout = env.rollout(22, tester)
    assert rollout.shape == (2, 22) and torch.isfinite(rollout["next", "reward"]).all()
    assert 56 <= max(lengths) <= 64 and len(lengths) > 22 * 3  # the window fills up, and is never exceeded
    contexts = [c for row in rollout["next", "target_context"] for c in row] if mode == "text" else []
    assert all(len(tok(c)["input_ids"]) <= 64 for c in contexts)


def _judge_parts(lm) -> dict:
    """The attributes of a ChatJudgeScorer over ``lm`` (its loader needs a folder; here the model is in memory)."""
    tok = lm.tokenizer
    first = {w: tok(w, add_special_tokens=False)["input_ids"][0] for w in ("unsafe", "safe")}
    return dict(
        model=lm.model, tokenizer=tok, window=lm.context_window, batch_size=8, style="guard",
        unsafe_ids=[first["unsafe"]], safe_ids=[first["safe"]], name="judge:tiny",
    )  # fmt: skip


def _send_in_step_3(monkeypatch, where: str, signum: int) -> None:
    """Send ``signum`` to this process once, in step 3 of the CLI run: while it collects (the scorer's
    first call of the step) or right after its first optimizer update."""
    import os

    from astrl.scorers import KeywordScorer
    from astrl.training.trainer import Trainer

    calls = []
    if where == "collecting":
        original = KeywordScorer.__call__

        def scorer(self, texts):
            calls.append(1)
            if len(calls) == 5:  # two calls a step: the first of step 3
                os.kill(os.getpid(), signum)
            return original(self, texts)

        monkeypatch.setattr(KeywordScorer, "__call__", scorer)
    else:
        original = Trainer._optimizer_step

        def update(self):
            norm = original(self)
            calls.append(1)
            if len(calls) == 3:  # one update a step: step 3's
                os.kill(os.getpid(), signum)
            return norm

        monkeypatch.setattr(Trainer, "_optimizer_step", update)


@pytest.mark.parametrize("signum, code", [(15, 143), (2, 130)], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("where, kept", [("collecting", 2), ("after its update", 3)])
def test_a_signal_in_a_step_keeps_every_finished_step_and_resumes_to_the_same_metrics(
    tiny_model_dir, tmp_path, monkeypatch, capsys, uninterrupted, signum, code, where, kept
):
    _send_in_step_3(monkeypatch, where, signum)
    run = tmp_path / "run"
    assert main(_cli_run(tiny_model_dir, run, "save_every=100")) == code
    out, err = capsys.readouterr()
    assert f"step_{kept:06d}; continue with: astrl train --resume {run}" in out
    assert ("finishing step 3 to checkpoint it" in err) == (where == "after its update")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{kept:06d}"]
    assert [int(r["step"]) for r in _metrics(run)] == list(range(1, kept + 1))
    monkeypatch.undo()
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert _metrics(run) == _metrics(uninterrupted)
    assert _jsonl(run / "samples.jsonl") == _jsonl(uninterrupted / "samples.jsonl")


def test_a_signal_held_through_a_checkpointed_step_writes_that_checkpoint_once(tiny_model_dir, tmp_path, monkeypatch,
                                                                               capsys):  # fmt: skip
    from astrl.training.trainer import Trainer

    _send_in_step_3(monkeypatch, "after its update", 15)
    original, saved = Trainer.save_checkpoint, []

    def save(self, replace=None):
        saved.append(self.step)
        return original(self, replace)

    monkeypatch.setattr(Trainer, "save_checkpoint", save)
    run = tmp_path / "run"
    assert main(_cli_run(tiny_model_dir, run, "save_every=3")) == 143
    assert f"step_000003; continue with: astrl train --resume {run}" in capsys.readouterr().out
    assert saved == [3]  # the step's own save serves the stop; it is not written again
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003"]


def test_sigterm_from_outside_at_a_random_time_exits_143_and_resumes_to_the_same_metrics(tiny_model_dir, tmp_path,
                                                                                          uninterrupted):  # fmt: skip
    import os
    import random
    import signal
    import subprocess
    import sys
    from pathlib import Path

    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONPATH": str(Path(__file__).parents[1])}
    argv = _cli_run(tiny_model_dir, run, "save_every=100")
    process = subprocess.Popen([sys.executable, "-m", "astrl", *argv], env=env, stdout=subprocess.PIPE, text=True)
    deadline = None
    try:
        while process.poll() is None:
            rows = len((run / "metrics.csv").read_text().splitlines()) - 1 if (run / "metrics.csv").exists() else 0
            if rows >= 1 and deadline is None:
                deadline = time.monotonic() + random.Random(1).uniform(0.0, 1.0)
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.002)
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 143, f"the run ended with {process.returncode} (before the signal?)\n{out}"
    assert "astrl: terminated (SIGTERM); " in out
    assert (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir())
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert [r["step"] for r in _metrics(run)] == ["1", "2", "3", "4"]
    assert _metrics(run) == _metrics(uninterrupted)


@pytest.mark.parametrize("moment", ["during the checkpoint write of step 2", "at a random time"])
def test_sigkill_then_resume_finishes_with_each_step_once_and_the_same_metrics(tiny_model_dir, tmp_path, uninterrupted,
                                                                               moment):  # fmt: skip
    import os
    import random
    import signal
    import subprocess
    import sys
    from pathlib import Path

    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONPATH": str(Path(__file__).parents[1])}
    argv = _cli_run(tiny_model_dir, run, "save_every=1", "keep_checkpoints=4")
    process = subprocess.Popen([sys.executable, "-m", "astrl", *argv], env=env, stderr=subprocess.DEVNULL)
    tmp_folder, deadline = run / "checkpoints" / "step_000002.tmp", None
    try:
        while process.poll() is None:
            rows = len((run / "metrics.csv").read_text().splitlines()) - 1 if (run / "metrics.csv").exists() else 0
            if moment.startswith("during") and (tmp_folder.exists() or rows >= 3):
                break
            if not moment.startswith("during") and rows >= 1 and deadline is None:
                deadline = time.monotonic() + random.Random(0).uniform(0.0, 1.0)
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.002)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert [r["step"] for r in _metrics(run)] == ["1", "2", "3", "4"]
    assert _metrics(run) == _metrics(uninterrupted)
    assert _jsonl(run / "samples.jsonl") == _jsonl(uninterrupted / "samples.jsonl")
    _jsonl(run / "attacks.jsonl")
