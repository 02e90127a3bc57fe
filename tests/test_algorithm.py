"""The trainer's algorithm contract: required methods, default hooks, the order of the calls, metrics.csv."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from astrl import Trainer, TrainingConfig
from astrl.prompts import PromptStream
from astrl.training.algorithm import Algorithm
from astrl.training.trainer import append_csv_row, latest_checkpoint, trim_csv

WORDS = 4  # the bandit's actions; action 0 is rewarded


class Bandit(Algorithm):
    """The least an algorithm implements: REINFORCE on a 4-armed bandit, one pull per drawn opener."""

    def __init__(self, stream: PromptStream, logits: torch.nn.Parameter) -> None:
        self.stream, self.logits = stream, logits

    def collect(self):
        n = len(self.stream.next_batch())
        actions = torch.multinomial(self.logits.detach().softmax(-1), n, replacement=True)
        batch = TensorDict(action=actions, reward=(actions == 0).float(), batch_size=[n])
        return batch, batch

    def loss(self, minibatch):
        log_prob = self.logits.log_softmax(-1)[minibatch["action"]]
        return TensorDict(loss_reinforce=-(log_prob * (minibatch["reward"] - 0.5)).mean())

    def parameter_groups(self, lr):
        return [{"params": [self.logits], "lr": lr}]


class Solver:
    """A solver as ``Trainer(config, sampler, algorithm)`` takes it: ``system.parameters()`` and ``bind``."""

    def __init__(self, algorithm_class=Bandit) -> None:
        self.logits = torch.nn.Parameter(torch.zeros(WORDS))
        self.system = SimpleNamespace(parameters=lambda: iter([self.logits]))
        self.algorithm_class = algorithm_class

    def bind(self, sampler, config):
        self.algorithm = self.algorithm_class(sampler.prompt_stream, self.logits)
        return self.algorithm


def _sampler():
    return SimpleNamespace(prompt_stream=PromptStream(["a", "b", "c"], 8, seed=0))


def _config(run_dir, steps, **options):
    return TrainingConfig(lr=0.5, batch_size=None, training_steps=steps, run_dir=str(run_dir), seed=0, **options)


def _rows(path):
    return list(csv.DictReader(path.open(encoding="utf-8")))


def test_an_algorithm_implements_collect_loss_and_parameter_groups_and_the_rest_defaults():
    class NoLoss(Algorithm):
        def collect(self):
            raise NotImplementedError

        def parameter_groups(self, lr):
            return []

    with pytest.raises(TypeError, match="loss"):
        NoLoss()
    bandit = Bandit(PromptStream(["a"], 2), torch.nn.Parameter(torch.zeros(WORDS)))
    batch, rollout = bandit.collect()
    assert list(bandit.minibatches(batch, torch.Generator())) == [batch]
    assert list(bandit.minibatches(batch[:0], torch.Generator())) == []
    assert bandit.metrics(rollout) == bandit.step_metrics() == bandit.state_dict() == {}
    assert bandit.samples(rollout) == bandit.turn_records(rollout) == []
    assert bandit.reward_scorer is None and bandit.data_policy_version(rollout) is None
    assert bandit.push_weights() is None and bandit.sync_weights() is None and bandit.shutdown() is None


def test_a_minimal_algorithm_trains_checkpoints_and_logs_through_the_trainer(tmp_path):
    solver = Solver()
    rows = Trainer(_config(tmp_path, 30, save_every=10), _sampler(), solver).train()
    assert len(rows) == 30
    assert float(solver.logits.softmax(-1)[0]) > 0.9  # it learned the rewarded arm
    logged = _rows(tmp_path / "metrics.csv")
    assert [r["step"] for r in logged] == [str(s) for s in range(1, 31)]
    assert [r["policy_version"] for r in logged] == [str(s) for s in range(30)]
    assert {"loss", "loss_reinforce", "grad_norm", "lr"} <= set(logged[0])
    saved = torch.load(tmp_path / "final" / "tester" / "parameters.pt")
    torch.testing.assert_close(saved[0], solver.logits.detach())
    assert latest_checkpoint(tmp_path).name == "step_000030"


HOOKS = (
    "parameter_groups", "collect", "minibatches", "loss", "push_weights", "turn_records", "metrics",
    "data_policy_version", "step_metrics", "samples", "sync_weights", "state_dict", "load_state_dict",
)  # fmt: skip


class Recording(Bandit):
    """The bandit, recording each call the trainer makes to it."""

    calls: list[str] = []

    def __getattribute__(self, name):
        if name in HOOKS:
            Recording.calls.append(name)
        return super().__getattribute__(name)


def test_the_trainer_calls_each_hook_in_order_and_syncs_weights_once_on_resume(tmp_path):
    Recording.calls = []
    Trainer(_config(tmp_path, 1, save_every=1), _sampler(), Solver(Recording)).train()
    step = ["state_dict", "collect", "minibatches", "loss", "push_weights", "turn_records", "metrics",
            "data_policy_version", "step_metrics", "samples"]  # fmt: skip
    assert Recording.calls == ["parameter_groups", *step, "state_dict"]  # the last: the checkpoint's
    Recording.calls = []
    trainer = Trainer(_config(tmp_path, 2, save_every=1), _sampler(), Solver(Recording))
    trainer.load_checkpoint(latest_checkpoint(tmp_path))
    trainer.train()
    assert Recording.calls == ["parameter_groups", "load_state_dict", "sync_weights", *step, "state_dict"]


def test_the_trainer_refuses_a_solver_whose_algorithm_breaks_the_contract(tmp_path):
    class Duck:
        def collect(self):
            raise AssertionError("never called")

    solver = Solver(lambda stream, logits: Duck())
    with pytest.raises(TypeError, match="astrl.training.algorithm.Algorithm, got Duck"):
        Trainer(_config(tmp_path, 1), _sampler(), solver).train()


# -- metrics.csv: one appended line a step ----------------------------------------------------------------
def test_metrics_rows_are_appended_and_new_columns_rewrite_the_file_once(tmp_path):
    path = tmp_path / "metrics.csv"
    columns = append_csv_row(path, None, {"step": "1", "loss": "0.5"})
    inode, first = path.stat().st_ino, path.read_text()
    assert first == "step,loss\n1,0.5\n"
    columns = append_csv_row(path, columns, {"step": "2", "loss": "0.25"})
    columns = append_csv_row(path, columns, {"step": "3"})  # a column missing: left empty
    assert path.stat().st_ino == inode  # appended in place, not replaced
    assert path.read_text() == first + "2,0.25\n3,\n"
    columns = append_csv_row(path, columns, {"step": "4", "asr": "0.1", "loss": "0.125"})
    assert columns == ["step", "loss", "asr"]
    assert path.read_text() == "step,loss,asr\n1,0.5,\n2,0.25,\n3,,\n4,0.125,0.1\n"
    append_csv_row(path, columns, {"step": "5", "loss": "1"})
    assert path.read_text().endswith("4,0.125,0.1\n5,1,\n")


def test_trimming_keeps_whole_rows_up_to_the_step_and_drops_a_cut_short_line(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("step,loss\n1,0.5\n2,0.25\n3,0.1\n1")  # the row of step 12 cut short by a kill
    assert trim_csv(path, 2) == ["step", "loss"]
    assert path.read_text() == "step,loss\n1,0.5\n2,0.25\n"
    path.write_text(path.read_text() + "3,0.1,9\n")  # a row that does not fit the header
    assert trim_csv(path, 5) == ["step", "loss"]
    assert path.read_text() == "step,loss\n1,0.5\n2,0.25\n"
    assert trim_csv(path, 0) is None and not path.exists()
    assert trim_csv(path, 3) is None


def test_a_resumed_run_has_each_step_once_in_metrics(tmp_path, monkeypatch):
    Trainer(_config(tmp_path / "a", 4, save_every=2), _sampler(), Solver()).train()
    step = Trainer.train_step

    def interrupted(self):
        if self.step == 3:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Trainer(_config(tmp_path / "b", 4, save_every=2), _sampler(), Solver()).train()
    monkeypatch.setattr(Trainer, "train_step", step)
    assert [r["step"] for r in _rows(tmp_path / "b" / "metrics.csv")] == ["1", "2", "3"]
    trainer = Trainer(_config(tmp_path / "b", 4, save_every=2), _sampler(), Solver())
    trainer.load_checkpoint(tmp_path / "b" / "checkpoints" / "step_000002")  # not the newest: step 3 is redone
    trainer.train()

    def logged(run):
        return [{k: r[k] for k in ("step", "loss", "grad_norm")} for r in _rows(run / "metrics.csv")]

    assert [r["step"] for r in logged(tmp_path / "b")] == ["1", "2", "3", "4"]
    assert logged(tmp_path / "b") == logged(tmp_path / "a")
