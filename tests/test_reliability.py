"""Reliability: measured failures fixed, faults survived, resume right on every path (docs/reliability.md)."""

from __future__ import annotations

import time

import pytest

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
