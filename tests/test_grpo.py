"""GRPO: advantages per (opener, turn) cell, and the loss's per-response-token KL and diagnostics."""

import math

import pytest
import torch
from test_training import _config, _trainer

from astrl._compat import as_list
from astrl.training.grpo import turn_group_advantages

EPS = 1e-6


# -- advantages ------------------------------------------------------------------------------------
def test_turn_group_advantages_by_hand():
    openers = ["a", "a", "a", "a", "b", "b", "b", "b"]
    turns = torch.tensor([0, 1, 0, 1, 0, 0, 0, 0])
    returns = torch.tensor([1.0, 2.0, 3.0, 2.0, 0.0, 0.0, 0.0, 4.0])
    advantages = turn_group_advantages(returns, openers, turns, group_size=2, eps=EPS)
    # cell (a, 0): 1, 3 -> mean 2, std 1 -> -1, +1;  cell (a, 1): 2, 2 -> zero std -> 0, 0
    # cell (b, 0): an opener drawn twice (one group of 4): 0, 0, 0, 4 -> mean 1, std sqrt(3) -> -1, -1, -1, 3 over sqrt(3)
    s = math.sqrt(3.0)
    expected = [-1 / (1 + EPS), 0.0, 1 / (1 + EPS), 0.0, -1 / (s + EPS), -1 / (s + EPS), -1 / (s + EPS), 3 / (s + EPS)]
    torch.testing.assert_close(advantages, torch.tensor(expected))
    assert advantages[[1, 3]].tolist() == [0.0, 0.0]  # exactly 0, not eps-small


def test_turn_group_advantages_refuse_incomplete_groups():
    openers = ["a", "a", "a", "b", "b"]
    turns = torch.tensor([0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"group_size=2 turns; 1 of 2 cells do not \(\(opener 'a', turn 0\): 3\)"):
        turn_group_advantages(torch.zeros(5), openers, turns, group_size=2)


def _turn_dependent_rollouts(trainer, monkeypatch):
    """Collect through the real env, then give each turn a reward that grows with its turn index."""
    original = trainer.algorithm.next_rollout
    noise = torch.Generator().manual_seed(0)

    def next_rollout():
        data = original()
        turn = data["step_count"].reshape(-1).float()
        reward = 10.0 * turn + torch.rand(turn.shape, generator=noise)
        data.set(("next", "reward"), reward.reshape(data["next", "reward"].shape))
        return data

    monkeypatch.setattr(trainer.algorithm, "next_rollout", next_rollout)


@pytest.mark.parametrize("returns", ["turn", "to_go"])
def test_advantages_have_zero_mean_per_turn_position_and_group(tmp_path, monkeypatch, returns):
    trainer = _trainer(_config(tmp_path, prompts_per_step=2, group_size=3, turns=3, returns=returns))
    trainer._build()
    _turn_dependent_rollouts(trainer, monkeypatch)
    batch, rollout = trainer.algorithm.collect()
    advantage = batch["advantage"].reshape(-1)
    assert advantage.shape == (2 * 3 * 3,)
    torch.testing.assert_close(advantage, trainer.algorithm.advantages(rollout))  # same order as the rollout
    openers, turn = as_list(rollout["query"]), rollout["step_count"].reshape(-1)
    rewards = rollout["next", "reward"].reshape(-1)
    for t in range(3):
        at_t = turn == t
        assert advantage[at_t].mean().abs() < 1e-5
        assert (advantage[at_t].pow(2).mean() - 1).abs() < 1e-3  # unit population variance in each cell
        for opener in set(openers):
            cell = at_t & torch.tensor([o == opener for o in openers])
            assert cell.sum() == 3 and advantage[cell].sum().abs() < 1e-5
    for opener in set(openers):
        assert advantage[torch.tensor([o == opener for o in openers])].mean().abs() < 1e-5
    # the data does depend on the turn: normalising over a whole group (all turns) would carry it
    group_mean = rewards.mean()
    assert (rewards[turn == 2] - group_mean).mean() > 5
    # a per-turn shift of the rewards changes no advantage, in both return modes
    rollout.set(("next", "reward"), (rewards - 10.0 * turn.float()).reshape(rollout["next", "reward"].shape))
    torch.testing.assert_close(trainer.algorithm.advantages(rollout), advantage, atol=1e-4, rtol=0)
