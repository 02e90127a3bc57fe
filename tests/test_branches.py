"""RL branches of one step 0 (``branches``, ``branch_steps``): scores, the choice, exactness, resume."""

import csv
import json
import math
import shutil

import pytest
import yaml
from test_training import _config, _tiny_tester, _trainer

from astrl.errors import ConfigError
from astrl.training.branches import branch_score, branch_seed, choose
from astrl.training.setup import build_models
from astrl.training.trainer import Trainer, resume

KEYS = ("step", "reward_mean", "loss", "lr")


def _rows(path) -> list[dict]:
    with path.open() as handle:
        return [{k: r[k] for k in KEYS} for r in csv.DictReader(handle)]


def _rows_of(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in KEYS} for r in rows]


def test_the_score_is_the_mean_reward_of_the_second_half_and_the_choice_its_highest():
    rows = [{"step": str(t), "reward_mean": str(v)} for t, v in enumerate([0.9, 0.9, 0.1, 0.3, -5.0], start=1)]
    assert branch_score(rows, 4) == pytest.approx((0.1 + 0.3) / 2)  # steps 3 and 4: after 4 // 2, up to 4
    assert branch_score(rows, 5) == pytest.approx((0.1 + 0.3 - 5.0) / 3)  # steps 3, 4 and 5
    assert branch_score([{"step": "3", "reward_mean": "nan"}], 4) == -math.inf  # nothing to score
    assert branch_score([{"step": "3", "reward_mean": "nan"}, {"step": "4", "reward_mean": "0.5"}], 4) == 0.5
    assert choose([-0.4, -0.38, -0.39]) == 1
    assert choose([0.2, 0.2, 0.1]) == 0  # a tie goes to the lower index (branch 0: the run's own draws)
    assert choose([-math.inf, -1.0]) == 1
    assert [branch_seed(3, b) for b in range(3)] == [3, 103, 203]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(branches=0), "branches must be >= 1"),
        (dict(branches=2, branch_steps=1), "branch_steps must be >= 2, got 1"),
        (dict(branches=2, branch_steps=4), "branch_steps must be below total_steps \\(4\\)"),
        (dict(branches=2, branch_steps=2, harden_every=1), "set collector: local and harden_every: 0"),
    ],
)
def test_bad_branch_settings_are_one_clear_error(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, **settings)


def test_branches_train_from_step_0_and_the_run_goes_on_with_the_best_exactly(tmp_path):
    settings = dict(reward="astprompter", total_steps=4, save_every=2, warmup_steps=1)
    plain = _trainer(_config(tmp_path / "plain", **settings)).train()
    run = tmp_path / "run" / "run"
    (run / "branches" / "seed_100").mkdir(parents=True)  # what an earlier run in this folder left
    (run / "branches" / "seed_100" / "stale").write_text("x")
    (run / "branches.json").write_text('{"seed": 55}')
    trainer = _trainer(_config(tmp_path / "run", branches=3, branch_steps=2, **settings))
    rows = trainer.train()
    assert not (run / "branches" / "seed_100" / "stale").exists()  # a new run (no resume) starts its branches anew
    record = json.loads((run / "branches.json").read_text())
    seeds = [b["seed"] for b in record["branches"]]
    assert seeds == [0, 100, 200] and record["branch_steps"] == 2
    branch_rows = {seed: _rows(run / "branches" / f"seed_{seed}" / "metrics.csv") for seed in seeds}
    for seed, branch in zip(seeds, record["branches"], strict=True):  # each scored by its step 2 (the second half)
        assert [r["step"] for r in branch_rows[seed]] == ["1", "2"]
        # no copy of step 0 (its draws are the run's seed's): a branch stopped before its first checkpoint
        # starts again from the run's step 0, reseeded
        assert [p.name for p in (run / "branches" / f"seed_{seed}" / "checkpoints").iterdir()] == ["step_000002"]
        assert branch["score"] == pytest.approx(float(branch_rows[seed][1]["reward_mean"]))
    assert record["chosen"] == choose([b["score"] for b in record["branches"]])
    chosen = seeds[record["chosen"]]
    # branch 0 is the run's own first steps, draw for draw; the others draw otherwise
    assert branch_rows[0] == [{k: str(r[k]) for k in KEYS} for r in plain[:2]]
    assert branch_rows[100] != branch_rows[0] and branch_rows[200] != branch_rows[100]
    # the run is the chosen branch continued: its logs up to step 2, then steps 3 and 4 as a resume of it
    assert _rows(run / "metrics.csv")[:2] == branch_rows[chosen]
    assert [r["step"] for r in rows] == [3, 4] and trainer.step == 4
    copy = tmp_path / "chosen"
    shutil.copytree(run / "branches" / f"seed_{chosen}", copy)
    continued = resume(copy, ["total_steps=4"], progress=False, tester_lm=_tiny_tester()).train()
    assert [{k: r[k] for k in KEYS} for r in continued] == [{k: r[k] for k in KEYS} for r in rows]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]  # keep_checkpoints 2
    saved = yaml.safe_load((run / "config.yaml").read_text())  # a resume goes on as the branch, on the run's split
    assert (saved["seed"], saved["split_seed"]) == (chosen, 0)


def test_a_run_stopped_after_its_branches_resumes_them_without_training_them_again(tmp_path):
    settings = dict(reward="astprompter", total_steps=3, save_every=1, warmup_steps=1, branches=2, branch_steps=2)
    config = _config(tmp_path, **settings)
    first = _trainer(config).train()
    run = tmp_path / "run"
    expected = _rows(run / "metrics.csv")
    branch_files = {p: p.read_bytes() for p in (run / "branches").rglob("metrics.csv")}
    for name in ("step_000002", "step_000003"):  # as if stopped before the choice was adopted
        shutil.rmtree(run / "checkpoints" / name)
    shutil.rmtree(run / "final")
    again = resume(run, progress=False, tester_lm=_tiny_tester())
    assert again.step == 0
    rows = again.train()
    assert [r["step"] for r in rows] == [3] and _rows(run / "metrics.csv") == expected
    assert {k: str(v) for k, v in rows[0].items() if k in KEYS} == {k: str(first[-1][k]) for k in KEYS}
    assert {p: p.read_bytes() for p in (run / "branches").rglob("metrics.csv")} == branch_files  # not trained again


def test_until_inside_the_branches_is_refused_and_0_stops_before_them(tmp_path):
    config = _config(tmp_path, reward="astprompter", total_steps=4, branches=2, branch_steps=2)
    trainer = Trainer(config, models=build_models(config, _tiny_tester()), progress=False)
    with pytest.raises(ValueError, match="until 1 stops inside the branches \\(branch_steps 2\\)"):
        trainer.train(until=1)
    assert trainer.train(until=0) == [] and not (tmp_path / "run" / "branches").exists()


def test_the_train_command_refuses_until_inside_the_branches_before_a_model_loads(tmp_path, capsys, monkeypatch):
    from astrl.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("astrl.training.trainer.build_models", no_load)
    overrides = ["tester=tiny", "target=tiny", "total_steps=4", "branches=2", "branch_steps=3", f"run_dir={tmp_path / 'run'}"]
    assert main(["train", "--quiet", "--until", "2", *overrides]) == 2
    assert "until 2 stops inside the branches (branch_steps 3): use 0 or >= it" in capsys.readouterr().err


def test_branches_start_from_the_warm_started_step_0(tmp_path):
    from test_kl_reference import WARM

    settings = dict(WARM, total_steps=3, save_every=1, warmup_steps=1, kl_reference="warm_start")
    plain = _trainer(_config(tmp_path / "plain", **settings)).train()
    _trainer(_config(tmp_path / "run", branches=2, branch_steps=2, **settings)).train()
    run = tmp_path / "run" / "run"
    assert json.loads((run / "warm_start.json").read_text())["kept"] > 0  # the warm start fine-tuned the tester
    assert _rows(run / "branches" / "seed_0" / "metrics.csv") == [{k: str(r[k]) for k in KEYS} for r in plain[:2]]
