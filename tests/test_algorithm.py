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
from astrl.training.trainer import latest_checkpoint

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
