"""TrainConfig keys: help text, the ``astrl train --keys`` listing, and the renamed ``gamma`` key."""

import dataclasses
import re
import warnings

import pytest
import yaml

from astrl.cli import main
from astrl.training.config import ConfigError, TrainConfig, load_config, read_yaml_mapping
from astrl.training.demo import check_same_demo, demo_config

FIELDS = dataclasses.fields(TrainConfig)


def _default(spec: dataclasses.Field):
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default


def test_every_config_key_has_help():
    missing = [spec.name for spec in FIELDS if not str(spec.metadata.get("help", "")).strip()]
    assert missing == []


def test_train_keys_lists_every_key_with_its_default_and_help(capsys):
    assert main(["train", "--keys"]) == 0
    out = capsys.readouterr().out
    listed = dict(re.findall(r"^  (\w+) = (.*)  \(.*\)$", out, flags=re.MULTILINE))
    assert list(listed) == [spec.name for spec in FIELDS]
    for spec in FIELDS:
        assert yaml.safe_load(listed[spec.name]) == _default(spec), spec.name  # written as a YAML file would say it
    assert "weight of the probe's mean per-token log-prob under the target" in out
    assert "gamma -> likelihood_weight" in out
    # each key's declared range or choices beside its type, as its error message writes it
    assert "  clip_epsilon = 0.2  (float, in (0, 1])\n" in out and "  harden_threshold = 0.5  (float, in [0, 1))\n" in out
    assert "  total_steps = 100  (int, >= 1)\n" in out and "  likelihood_cap = null  (float | None, <= 0)\n" in out
    assert "  optimizer = adamw  (str, one of adamw, adam, sgd, rmsprop, adagrad)\n" in out and "  alpha = 1.0  (float)\n" in out


def test_train_help_points_to_the_key_listing(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "astrl train --keys" in capsys.readouterr().out


# -- gamma, the old name of likelihood_weight ------------------------------------------------------------------
def test_gamma_in_a_file_or_an_override_loads_as_likelihood_weight_with_a_warning(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("reward: elicit\ngamma: 0.25\n")
    with pytest.warns(DeprecationWarning, match=r"'gamma' in config file .*old\.yaml.* now 'likelihood_weight'"):
        config = load_config(old)
    assert config.likelihood_weight == 0.25 and config == load_config(None, ["reward=elicit", "likelihood_weight=0.25"])
    assert {k: config.reward_options()[k] for k in ("alpha", "penalty", "gamma", "gate")} == {
        "alpha": 1.0,
        "penalty": 1.0,
        "gamma": 0.25,
        "gate": False,
    }
    with pytest.warns(DeprecationWarning, match="'gamma' in the overrides .* now 'likelihood_weight'"):
        assert load_config(None, ["gamma=0.5"]).likelihood_weight == 0.5
    new = tmp_path / "new.yaml"
    new.write_text("likelihood_weight: 0.25\n")
    notes = []
    assert load_config(new, ["gamma=0.75"], on_warning=notes.append).likelihood_weight == 0.75  # the override wins
    assert len(notes) == 1 and "'gamma'" in notes[0] and "'likelihood_weight'" in notes[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name alone warns about nothing
        assert load_config(new).likelihood_weight == 0.25


def test_gamma_beside_likelihood_weight_is_an_error_naming_both(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text("gamma: 0.2\nlikelihood_weight: 0.1\n")
    with pytest.raises(ConfigError, match=r"both 'gamma' and 'likelihood_weight' are set in config file .*both\.yaml"):
        load_config(both)
    with pytest.raises(ConfigError, match="both 'gamma' and 'likelihood_weight' are set in the overrides"):
        load_config(None, ["gamma=0.2", "likelihood_weight=0.1"])


def test_a_saved_config_uses_the_new_name(tmp_path):
    with pytest.warns(DeprecationWarning):
        config = load_config(None, ["gamma=0.3"])
    config.save(tmp_path / "config.yaml")
    saved = read_yaml_mapping(tmp_path / "config.yaml")
    assert saved["likelihood_weight"] == 0.3 and "gamma" not in saved


def test_the_cli_prints_the_warning_for_files_overrides_and_resume(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text("gamma: 0.2\n")
    assert main(["train", "--config", str(old), "total_steps=0"]) == 2  # stops at the invalid total_steps
    err = capsys.readouterr().err
    assert re.search(r"astrl: warning: config key 'gamma' in config file .* now 'likelihood_weight'", err)
    assert "total_steps must be >= 1" in err
    assert main(["train", "--resume", str(tmp_path / "nowhere"), "gamma=0.2"]) == 2
    err = capsys.readouterr().err
    assert "astrl: warning: config key 'gamma' in the overrides" in err and "is not a run directory" in err
    assert main(["train", "gamma=0.2", "likelihood_weight=0.1"]) == 2
    assert "both 'gamma' and 'likelihood_weight'" in capsys.readouterr().err


def test_the_demo_reads_a_run_saved_under_the_old_name(tmp_path):
    config = demo_config({"run_dir": str(tmp_path)})
    saved = config.to_dict()
    saved["gamma"] = saved.pop("likelihood_weight")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    check_same_demo(config)  # the same settings under the old name
    saved["gamma"] = 0.5
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match="likelihood_weight: 0.5 there, 0.1 here"):
        check_same_demo(config)


def test_split_seed_keeps_the_held_out_openers_of_replicate_runs():
    from astrl.evaluation.run import _run_split_seed

    assert TrainConfig(seed=3).prompt_split_seed == 3
    assert TrainConfig(seed=3, split_seed=0).prompt_split_seed == 0
    assert _run_split_seed({"seed": 3, "split_seed": 0}, 9) == 0  # astrl eval of a run: the run's held-out split
    assert _run_split_seed({"seed": 3, "split_seed": None}, 9) == 3
    assert _run_split_seed({}, 9) == 9


def test_config_error_and_the_yaml_reader_live_on_the_ground_floor_and_keep_their_training_names(tmp_path):
    import astrl.errors
    import astrl.training
    import astrl.yaml_data

    assert ConfigError is astrl.errors.ConfigError is astrl.training.ConfigError
    assert read_yaml_mapping is astrl.yaml_data.read_yaml_mapping
    (tmp_path / "bad.yaml").write_text("- a\n- b\n")
    with pytest.raises(astrl.errors.ConfigError, match="must hold a mapping"):
        astrl.yaml_data.read_yaml_mapping(tmp_path / "bad.yaml")


# -- sections, and config.yaml files written before them -------------------------------------------------------
def test_a_config_yaml_written_before_the_sections_loads_as_an_equal_config(tmp_path):
    """tests/data/config_v0.yaml was saved by the flat TrainConfig (keys in their old order); it
    loads to the same settings, and saving it again writes the same keys and values."""
    old = read_yaml_mapping("tests/data/config_v0.yaml")
    config = load_config("tests/data/config_v0.yaml")
    added = {spec.name: spec.default for spec in FIELDS if spec.name not in old}  # keys added since, at their defaults
    assert added == {
        "test_fraction": None,
        "guide_search": False,
        "guide_replay": False,
        "guide_replay_warm_start": False,
        "guide_replay_retest": 0,
        "guide_replay_retest_keep": 0.5,
        "guide_replay_bonus": 0.0,
        "guide_replay_rank": "return",
        "guide_replay_members": 1,
        "guide_advantage": "signed",
        "branches": 1,
        "branch_steps": 16,
        "kl_reference": "base",
        "probe_gate_lexicon": False,
        "probe_scorer": None,
        "reply_past_opener": False,
        "reply_past_probe": False,
        "probe_gate_both": False,
        "reply_lexicon_whole_words": False,
        "warm_start_scorer": None,
        "warm_start_retest": 0,
        "warm_start_retest_keep": 0.5,
        "warm_start_turns": 1,
    }
    assert config.to_dict() == {**old, **added} and list(old) != [spec.name for spec in FIELDS]  # same values, other order
    assert config == TrainConfig(**old)
    config.save(tmp_path / "config.yaml")
    assert read_yaml_mapping(tmp_path / "config.yaml") == {**old, **added}
    assert load_config(tmp_path / "config.yaml") == config


def test_every_key_sits_in_one_section_and_the_sections_keep_the_key_order():
    from astrl.training.config import SECTIONS

    by_section = [spec.name for section in SECTIONS.values() for spec in dataclasses.fields(section)]
    assert by_section == [spec.name for spec in FIELDS]
    assert all(issubclass(TrainConfig, section) for section in SECTIONS.values())
    assert "reply_samples" in {spec.name for spec in dataclasses.fields(SECTIONS["conversation"])}
    assert {"warm_start_probes", "warm_start_lr"} <= {spec.name for spec in dataclasses.fields(SECTIONS["warm start"])}


def test_train_keys_lists_the_keys_under_their_sections(capsys):
    from astrl.training.config import SECTIONS

    assert main(["train", "--keys"]) == 0
    out = capsys.readouterr().out
    titles = re.findall(r"^(\w[\w -]*):$", out, flags=re.MULTILINE)
    assert titles == list(SECTIONS)
    conversation = out.split("\nconversation:\n")[1].split("\nreward:\n")[0]
    assert re.findall(r"^  (\w+) = ", conversation, flags=re.MULTILINE) == [
        spec.name for spec in dataclasses.fields(SECTIONS["conversation"])
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["turns=0"], "turns must be >= 1, got 0"),
        (["mode=voice"], r"mode must be one of \('chat', 'text'\), got 'voice'"),
        (["split=holdout"], "split must be one of .* got 'holdout'"),
        (["max_new_tokens=0"], "max_new_tokens must be >= 1, got 0"),
        (["top_p=1.5"], r"top_p must be in \(0, 1\], got 1.5"),
        (["temperature=0"], "temperature must be > 0, got 0"),
        (["lora_rank=0"], "lora_rank must be >= 1, got 0"),
        (["dtype=int8"], r"dtype must be one of \('float32', 'bfloat16', 'float16'\), got 'int8'"),
        (["novelty_history=0"], "novelty_history must be >= 1, got 0"),
        (["harden_steps=0"], "harden_steps must be >= 1, got 0"),
        (["save_every=0"], "save_every must be >= 1, got 0"),
        # keys that had no check before each declared its own range
        (["clip_epsilon=-1"], r"clip_epsilon must be in \(0, 1\], got -1"),
        (["gae_lambda=3"], r"gae_lambda must be in \[0, 1\], got 3"),
        (["value_coef=-1"], "value_coef must be >= 0, got -1"),
        (["harden_threshold=1"], r"harden_threshold must be in \[0, 1\), got 1"),
        (["lora_dropout=1"], r"lora_dropout must be in \[0, 1\), got 1"),
        (["log_every=0"], "log_every must be >= 1, got 0"),
        (["keep_checkpoints=0"], "keep_checkpoints must be >= 1, got 0"),
        # nan passes no range and inf none either; a weight with no range must still be a number
        (["temperature=.nan"], "temperature must be a finite number, got nan"),
        (["lr=.inf"], "lr must be a finite number, got inf"),
        (["reward=elicit", "alpha=.nan"], "alpha must be a finite number, got nan"),
        (["kl_token_cap=.nan"], r"kl_token_cap must be a finite number \(or null\), got nan"),
    ],
)
def test_each_section_checks_its_keys_with_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


# numeric keys with no range of their own: seeds, and the reward weights a user may set to any number
UNBOUNDED = {"seed", "split_seed", "alpha", "zeta", "likelihood_weight"}


def test_every_numeric_key_declares_its_range_and_its_edges_load():
    """Each int or float key but :data:`UNBOUNDED` declares a range, and a value on an inclusive edge loads
    while one past it is refused: the declaration is the check."""
    numeric = [spec for spec in FIELDS if spec.type.split(" ")[0] in ("int", "float")]
    bounds = ("at_least", "above", "at_most", "below")
    unbounded = {spec.name for spec in numeric if not set(bounds) & set(spec.metadata)}
    assert unbounded == UNBOUNDED
    context = {  # the keys a value on an edge needs beside it (the checks of keys that must fit together)
        "probe_gate": {"reward": "elicit"},
        "likelihood_cap": {"reward": "elicit"},
        "group_size": {"algorithm": "ppo"},
        "weak_supervision": {"algorithm": "dpo"},
        "warm_start_reply_tokens": {"warm_start_select": "best_of", "reward": "elicit", "reply_lexicon_weight": 1.0},
        "warm_start_retest_keep": {"warm_start_retest": 4, "warm_start_probes": 8},
        "guide_replay_retest": {"guide_replay": True, "guide_replay_warm_start": True, "warm_start_probes": 8},
        "guide_replay_retest_keep": {
            "guide_replay": True,
            "guide_replay_warm_start": True,
            "warm_start_probes": 8,
            "guide_replay_retest": 4,
        },
    }
    for spec in numeric:
        kind = spec.type.split(" ")[0]
        for edge, inside in (("at_least", True), ("at_most", True), ("above", False), ("below", False)):
            if edge not in spec.metadata:
                continue
            value = spec.metadata[edge]
            step = 1 if kind == "int" else 0.5
            past = value - step if edge in ("at_least", "above") else value + step
            with pytest.raises(ConfigError, match=f"^{spec.name} must be"):
                TrainConfig(**context.get(spec.name, {}), **{spec.name: past})
            if inside:
                assert getattr(TrainConfig(**context.get(spec.name, {}), **{spec.name: value}), spec.name) == value


def _header_eval_commands(path) -> list[list[str]]:
    """The ``astrl eval`` commands in a config's comment header (continuation lines joined), as argv."""
    import shlex

    header = "\n".join(line[1:] for line in path.read_text().splitlines() if line.startswith("#"))
    joined = header.replace("\\\n", " ")
    return [shlex.split(line.split("astrl ", 1)[1]) for line in joined.splitlines() if "astrl eval " in line]


def test_the_eval_command_in_a_config_header_measures_the_setting_the_config_trains():
    from pathlib import Path

    from astrl.cli import build_parser

    configs = Path(__file__).resolve().parents[1] / "configs"
    checked = untrained = 0
    for path in sorted(configs.glob("*.yaml")):
        config = load_config(path)
        for argv in _header_eval_commands(path):
            args = build_parser().parse_args(argv)
            shape = (args.turns, args.max_new_tokens, args.target_max_new_tokens or args.max_new_tokens)
            trained = (config.turns, config.max_new_tokens, config.target_max_new_tokens or config.max_new_tokens)
            assert shape == trained, f"{path.name}: eval header measures {shape}, the config trains {trained}"
            if not args.tester.startswith("runs/"):  # an untrained tester: nothing to take the openers from
                openers = (args.prompts, args.test_fraction, args.split_seed, args.mode)
                held_out = (config.prompts, config.test_fraction, config.prompt_split_seed, config.mode)
                assert openers == held_out, f"{path.name}: untrained eval draws from {openers}, the run holds out {held_out}"
                untrained += 1
            checked += 1
    assert checked >= 7 and untrained >= 3  # elicit, elicit_chat, elicit_chat_rl, elicit_guided, and 3 baselines
