"""The warm start's partial save (astrl.training.warm_start_state): save, load, remove."""

from __future__ import annotations

import random

import numpy as np
import torch

from astrl.training.state_io import load_trainable_state, trainable_state
from astrl.training.warm_start_state import WARM_START_PARTIAL, WarmStartCheckpoint


def _handle(run_dir, model: torch.nn.Module, *, resumed: bool) -> WarmStartCheckpoint:
    return WarmStartCheckpoint(
        run_dir, lambda: trainable_state(model), lambda state: load_trainable_state(model, state), resumed=resumed
    )


def _draws() -> tuple[list[float], float, float]:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_a_resumed_run_loads_the_saved_rounds_with_the_trainable_state_and_rng_states_they_left(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    done = {"rounds": [{"sampled": 4, "kept": 1}], "kept": [{"probe": "hi", "round": 0}], "shares": [0.5, 0.0]}
    _handle(tmp_path, model, resumed=False).save(done)
    assert (tmp_path / WARM_START_PARTIAL).is_file() and not list(tmp_path.glob("*.tmp"))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    expected = _draws()  # what the run would have drawn after the saved round
    with torch.no_grad():
        model.weight.add_(1.0)  # a later round changed the tester before the stop

    other = torch.nn.Linear(3, 2)  # the resumed process's fresh tester
    loaded = _handle(tmp_path, other, resumed=True).load()
    assert loaded == done
    assert all(torch.equal(other.state_dict()[k], v) for k, v in saved.items())
    assert _draws() == expected


def test_a_new_run_removes_another_runs_rounds_and_remove_deletes_the_file(tmp_path):
    model = torch.nn.Linear(3, 2)
    (tmp_path / WARM_START_PARTIAL).write_bytes(b"another run's rounds")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert _handle(tmp_path, model, resumed=False).load() is None
    assert not (tmp_path / WARM_START_PARTIAL).exists()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())  # nothing restored
    handle = _handle(tmp_path, model, resumed=True)
    assert handle.load() is None  # resumed, nothing saved: the warm start starts at round 0
    handle.save({"rounds": [], "kept": [], "shares": []})
    handle.remove()
    assert not handle.path.exists()
    handle.remove()  # already gone: nothing to do
