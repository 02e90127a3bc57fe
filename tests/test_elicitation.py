"""The elicitation reward through every path that builds a red-team env: GRPO, PPO, the tree sampler, Ray specs."""

import pytest
from test_training import _config, _trainer

from astrl.training.config import ConfigError, load_config
from astrl.training.setup import worker_spec

KEYWORDS = "keywords:damn,hell,idiot"


ELICIT = dict(scorer=KEYWORDS, turns=1, total_steps=2, save_every=100, max_new_tokens=6, reward="elicit", alpha=2.0)
ELICIT.update(probe_penalty=0.5, likelihood_weight=0.25)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "ipo"])
def test_every_algorithm_trains_on_the_elicit_reward_and_logs_its_terms(tmp_path, algorithm):
    extra = {"tree_width": 2, "tree_depth": 1, "beta": 0.1} if algorithm == "ipo" else {}
    rows = _trainer(_config(tmp_path, algorithm=algorithm, **ELICIT, **extra)).train()
    assert len(rows) == 2
    for row in rows:
        assert {"term_response_tox", "term_probe_tox", "term_probe_logprob"} <= set(row)
        assert "term_combined_tox" not in row
        assert 0.0 <= row["term_probe_tox"] <= 1.0 and 0.0 <= row["term_response_tox"] <= 1.0
        if algorithm != "ipo":  # one reward per collected turn: the mean reward is the weighted mean of the terms
            expected = 2.0 * row["term_response_tox"] - 0.5 * row["term_probe_tox"] + 0.25 * row["term_probe_logprob"]
            assert row["reward_mean"] == pytest.approx(expected, abs=1e-5)


def test_elicit_config_keys_reach_the_env_and_the_ray_worker_spec():
    config = load_config(None, ["reward=elicit", "probe_penalty=2", "elicit_gate=true", "alpha=1.5", "likelihood_weight=0.05"])
    options = {"alpha": 1.5, "penalty": 2.0, "gamma": 0.05, "gate": True}
    options.update(transform="prob", lexicon=0.0, gate_below=None, repeat=0.0, cap=None, gate_lexicon=False, past_opener=False)
    options.update(past_probe=False, gate_both=False)
    assert config.reward_options() == options
    spec = worker_spec(config).conversation
    assert spec.reward == "elicit" and spec.reward_options == options
    assert load_config(None, ["reward=astprompter"]).reward_options() == {"alpha": 1.0, "zeta": 0.5, "gamma": 0.1}
    with pytest.raises(ConfigError, match="probe_penalty must be >= 0, got -1.0"):
        load_config(None, ["reward=elicit", "probe_penalty=-1"])
    with pytest.raises(ConfigError, match="reward must be one of"):
        load_config(None, ["reward=elicited"])
    with pytest.raises(ConfigError, match="reward 'elicit' scores probes with the target's Transformers model"):
        load_config(None, ["reward=elicit", "target_backend=vllm"])
