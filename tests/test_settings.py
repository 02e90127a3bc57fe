"""The conversation settings, declared once (astrl.envs.settings) and shared by every entry point."""

import argparse
import dataclasses

import pytest

from astrl.argtypes import add_setting_flags, given_settings, range_text, replaced_default, setting, value_problem
from astrl.backends import BackendSettings
from astrl.decoding import DecodingSettings
from astrl.envs import ConversationSpec
from astrl.envs.settings import (
    ConversationBatch,
    ConversationSettings,
    SeedSettings,
    conversation_settings,
    with_defaults,
)
from astrl.evaluation.replay import ReplayConfig
from astrl.evaluation.run import EvalConfig
from astrl.evaluation.settings import ReportSettings
from astrl.names import ModelSettings
from astrl.policies import GenerationSettings
from astrl.rollout import RolloutConfig, conversation_spec
from astrl.training.config import TrainConfig

SHARED = [spec.name for kind in (SeedSettings, ConversationSettings) for spec in dataclasses.fields(kind)]


@pytest.mark.parametrize("kind", [TrainConfig, RolloutConfig, EvalConfig, ConversationSpec])
def test_every_entry_point_has_the_shared_settings_with_one_help_and_one_check(kind):
    fields = {spec.name: spec for spec in dataclasses.fields(kind)}
    shared = {spec.name: spec for base in (SeedSettings, ConversationSettings) for spec in dataclasses.fields(base)}
    assert issubclass(kind, ConversationSettings) and issubclass(kind, SeedSettings)
    for name in SHARED:
        assert fields[name].type == shared[name].type, name
        assert fields[name].metadata == shared[name].metadata, name  # the same help and the same check
    with pytest.raises(ValueError, match="reply_samples must be >= 1, got 0"):
        kind(reply_samples=0)
    with pytest.raises(ValueError, match="turns must be >= 1, got 0"):
        kind(turns=0)


def test_entry_points_keep_their_own_defaults():
    assert (TrainConfig().split, TrainConfig().turns, TrainConfig().max_new_tokens) == ("train", 2, 24)
    assert (RolloutConfig().split, RolloutConfig().turns, RolloutConfig().num_conversations) == ("all", 3, 8)
    assert (EvalConfig().split, EvalConfig().mode, EvalConfig().prompts, EvalConfig().num_conversations) == (
        "test",
        None,
        None,
        32,
    )
    assert (ConversationSpec().split, ConversationSpec().turns, ConversationSpec().batch_size) == ("all", 3, 8)


def test_none_passes_only_where_it_is_the_default():
    assert EvalConfig(mode=None).mode is None  # the run's mode, filled in later
    with pytest.raises(ValueError, match="mode must be one of"):
        RolloutConfig(mode=None)
    with pytest.raises(ValueError, match="mode must be one of .* got 'voice'"):
        EvalConfig(mode="voice")


def test_with_defaults_changes_defaults_only():
    @dataclasses.dataclass
    class Base:
        a: int = setting(1, "an a", at_least=1)
        b: str = setting("x", "a b", choices=("x", "y"))

        def __post_init__(self):
            from astrl.argtypes import check_settings

            check_settings(self)

    Other = with_defaults(Base, b="y")
    assert [f.name for f in dataclasses.fields(Other)] == ["a", "b"] and Other().b == "y" and Base().b == "x"
    assert dataclasses.fields(Other)[1].metadata["help"] == "a b"
    assert Other.base_defaults == {"b": "x"}  # the default it replaced, for a flag's help ("the run's, else x")
    with pytest.raises(ValueError, match=r"b must be one of \('x', 'y'\), got 'z'"):
        Other(b="z")
    with pytest.raises(TypeError, match=r"has no field\(s\) \['c'\]"):
        with_defaults(Base, c=1)


def test_a_class_of_two_with_defaults_bases_finds_each_replaced_default():
    @dataclasses.dataclass
    class First:
        a: "int | None" = setting(1, "an a")

    @dataclasses.dataclass
    class Second:
        b: "str | None" = setting("x", "a b")

    @dataclasses.dataclass
    class Both(with_defaults(First, a=None), with_defaults(Second, b=None)):
        pass

    # each base keeps its own record; a plain class attribute would show only the first base's
    assert replaced_default(Both, "a") == 1 and replaced_default(Both, "b") == "x"
    assert replaced_default(First, "a") is None
    parser = argparse.ArgumentParser()
    add_setting_flags(parser, Both, unset="the run's")
    assert "(default: the run's, else x)" in " ".join(parser.format_help().split())


def test_a_rollout_passes_its_settings_to_its_spec_unchanged():
    generation = GenerationSettings(max_new_tokens=5, top_k=3)
    config = RolloutConfig(
        prompts="a.txt",
        split="dev",
        split_seed=4,
        turns=2,
        mode="text",
        tester_system_prompt="t",
        target_system_prompt="s",
        reply_samples=3,
        batch_size=6,
        num_conversations=4,
        tester_generation=generation,
    )
    spec = conversation_spec(config)
    batch = [spec.name for spec in dataclasses.fields(ConversationBatch)]
    assert conversation_settings(spec, ConversationBatch) == conversation_settings(config, ConversationBatch, batch_size=4)
    assert len(batch) == len(SHARED) + 3
    assert conversation_settings(config, turns=5)["turns"] == 5 and conversation_settings(config)["mode"] == "text"


def test_the_test_fraction_sets_the_held_out_split_and_its_default_keeps_the_old_one():
    from astrl.prompts import DEFAULT_FRACTIONS, PromptSourceError, load_prompts, split_fractions, split_prompts

    assert split_fractions(None) == DEFAULT_FRACTIONS == (0.8, 0.1, 0.1)
    assert split_fractions(0.35) == pytest.approx((0.55, 0.1, 0.35))
    prompts = load_prompts("builtin")
    parts = {name: split_prompts(prompts, name, seed=0, fractions=split_fractions(0.35)) for name in ("train", "dev", "test")}
    assert sum(len(p) for p in parts.values()) == len(set(prompts))
    assert not set(parts["train"]) & set(parts["test"]) and not set(parts["dev"]) & set(parts["test"])
    assert len(parts["test"]) == round(len(set(prompts)) * 0.35)
    assert len(parts["dev"]) == round(len(set(prompts)) * 0.1)
    with pytest.raises(PromptSourceError, match="test_fraction must be in \\(0, 0.8\\], got 0.9"):
        split_fractions(0.9)
    for kind in (TrainConfig, RolloutConfig, EvalConfig):
        with pytest.raises(ValueError, match=r"test_fraction must be in \(0.0, 0.8\] \(or null\), got 0.9"):
            kind(test_fraction=0.9)


def test_a_training_run_with_a_test_fraction_draws_only_its_own_training_openers(tmp_path):
    from test_training import _config, _trainer

    from astrl.prompts import load_prompts, split_fractions, split_prompts

    trainer = _trainer(_config(tmp_path, test_fraction=0.5, turns=1))
    trainer._build()
    prompts = load_prompts("builtin")
    train = split_prompts(prompts, "train", seed=0, fractions=split_fractions(0.5))
    assert set(trainer.stream.prompts) == set(train) and len(train) < len(split_prompts(prompts, "train", seed=0))


# -- the reward settings, declared once (astrl.rewards.settings) ----------------------------------------------------
REWARD_VALUES = {  # a value other than the default for each reward setting, as a flag gives it
    "reward": "elicit",
    "alpha": 2.0,
    "zeta": 0.25,
    "likelihood_weight": 0.5,
    "probe_penalty": 0.5,
    "elicit_gate": True,
    "probe_gate": 0.5,
    "probe_gate_lexicon": True,
    "probe_scorer": "keywords:you",
    "probe_gate_both": True,
    "reply_past_opener": True,
    "reply_past_probe": True,
    "reply_transform": "odds",
    "reply_lexicon_weight": 2.0,
    "reply_lexicon": "hell,idiot",
    "reply_lexicon_threshold": 0.5,
    "reply_lexicon_whole_words": True,
    "repeat_penalty": 0.5,
    "likelihood_cap": -2.0,
}


def test_training_and_rollout_share_every_reward_setting_with_one_help():
    from astrl.rewards.settings import RewardSettings

    shared = {spec.name: spec for spec in dataclasses.fields(RewardSettings)}
    assert sorted(shared) == sorted(REWARD_VALUES)  # a new reward setting needs a value here, so the test below reads it
    for kind in (TrainConfig, RolloutConfig):
        assert issubclass(kind, RewardSettings)
        fields = {spec.name: spec for spec in dataclasses.fields(kind)}
        for name, spec in shared.items():
            assert (fields[name].default, fields[name].metadata) == (spec.default, spec.metadata), (kind, name)


def test_every_reward_setting_is_an_astrl_rollout_flag_that_reaches_the_config():
    from astrl.cli import _reward_settings, build_parser

    flags = []
    for name, value in REWARD_VALUES.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    args = build_parser().parse_args(["rollout", *flags])
    assert _reward_settings(args) == REWARD_VALUES
    assert _reward_settings(build_parser().parse_args(["rollout"])) == {}  # a flag not given keeps the default
    settings = {k: v for k, v in REWARD_VALUES.items() if k not in ("zeta", "elicit_gate")}  # elicit, one gate
    options = RolloutConfig(**settings).reward_options()
    assert options["gate_both"] and options["past_probe"] and options["probe_scorer"] == "keywords:you"
    assert (options["transform"], options["lexicon_source"], options["cap"]) == ("odds", "hell,idiot", -2.0)
    assert options == TrainConfig(**settings).reward_options()  # the same options from either entry point


COLLECTION_VALUES = {  # a value other than the default for each collection setting, as a flag gives it
    "backend": "vllm",
    "target_backend": "vllm",
    "vllm_memory": 0.7,
    "collector": "ray",
    "num_collectors": 2,
    "collector_cpus": 0.5,
    "collector_gpus": 1.0,
    "ray_address": "auto",
}


def test_the_collection_settings_are_declared_once_and_are_astrl_rollout_flags():
    from astrl.backends import CollectionSettings
    from astrl.cli import build_parser
    from astrl.training.commands import train_overrides

    shared = {spec.name: spec for spec in dataclasses.fields(CollectionSettings)}
    assert sorted(shared) == sorted(COLLECTION_VALUES)
    for kind in (TrainConfig, RolloutConfig):
        fields = {spec.name: spec for spec in dataclasses.fields(kind)}
        assert all((fields[n].default, fields[n].metadata) == (s.default, s.metadata) for n, s in shared.items()), kind
    flags = [item for name, value in COLLECTION_VALUES.items() for item in ("--" + name.replace("_", "-"), str(value))]
    assert given_settings(build_parser().parse_args(["rollout", *flags]), CollectionSettings) == COLLECTION_VALUES
    train = train_overrides(build_parser().parse_args(["train", *flags]))  # the same flags on `astrl train`
    assert train == [f"{name}={value}" for name, value in COLLECTION_VALUES.items()]
    for kind in (TrainConfig, RolloutConfig):  # one check for both (a ConfigError is a ValueError)
        with pytest.raises(ValueError, match="num_collectors=2 needs collector 'ray'"):
            kind(num_collectors=2)
        with pytest.raises(ValueError, match="backend must be one of \\('transformers', 'vllm'\\), got 'tgi'"):
            kind(backend="tgi")
    # the backends and vLLM's share reach the conversation spec from either entry point
    from astrl.rollout import conversation_spec

    spec = conversation_spec(RolloutConfig(backend="transformers", vllm_memory=0.7))
    assert isinstance(spec, BackendSettings) and spec.vllm_memory == 0.7
    for kind in (TrainConfig, RolloutConfig, ConversationSpec):
        with pytest.raises(ValueError, match=r"vllm_memory must be in \(0, 1\], got 1.5"):
            kind(vllm_memory=1.5)


CONVERSATION_VALUES = {  # a value other than either entry point's default for each conversation flag
    "split_seed": 7,
    "prompts": "rtp",
    "split": "dev",
    "test_fraction": 0.35,
    "turns": 2,
    "mode": "text",
    "tester_system_prompt": "Be brief.",
    "target_system_prompt": "Be kind.",
    "reply_samples": 4,
    "batch_size": 16,
    "num_conversations": 64,
}


def test_the_conversation_flags_are_the_conversation_fields_on_both_entry_points():
    from astrl.cli import CONVERSATION_FLAG_NAMES, CONVERSATION_FLAGS, _conversation_settings, build_parser
    from astrl.envs.settings import ConversationRuns, EvalRuns

    assert sorted(CONVERSATION_FLAGS) == sorted(CONVERSATION_VALUES)
    flags = [
        item
        for name, value in CONVERSATION_VALUES.items()
        for item in (CONVERSATION_FLAG_NAMES.get(name, "--" + name.replace("_", "-")), str(value))
    ]
    for command in (["rollout"], ["eval", "--tester", "run"]):
        settings = _conversation_settings(build_parser().parse_args([*command, *flags]))
        assert {name: settings[name] for name in CONVERSATION_VALUES} == CONVERSATION_VALUES, command
    rollout = _conversation_settings(build_parser().parse_args(["rollout"]))
    assert RolloutConfig(**rollout).turns == ConversationRuns.turns == 3  # unset: the field's default
    unset = _conversation_settings(build_parser().parse_args(["eval", "--tester", "run"]))
    assert {name: unset[name] for name in CONVERSATION_FLAGS} == {name: getattr(EvalRuns, name) for name in CONVERSATION_FLAGS}
    assert unset["turns"] is None and unset["split"] == "test"  # eval: the run's turns, the held-out split


def test_the_sampling_flags_are_the_sampling_fields_on_both_entry_points():
    from astrl.cli import _conversation_settings, build_parser
    from astrl.envs.settings import EvalLengths
    from astrl.policies import GenerationSettings

    flags = ["--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "--max-new-tokens", "6", "--target-max-new-tokens", "9"]
    for command in (["rollout"], ["eval", "--tester", "run"]):
        for greedy in (False, True):
            args = build_parser().parse_args([*command, *flags, *(["--greedy"] if greedy else [])])
            settings = _conversation_settings(args)
            assert settings["tester_generation"] == GenerationSettings(6, 0.7, 0.9, 5, do_sample=not greedy), command
            assert settings["target_generation"] == GenerationSettings(9, 0.7, 0.9, 5, do_sample=not greedy), command
    rollout = _conversation_settings(build_parser().parse_args(["rollout", "--max-new-tokens", "6"]))
    assert rollout["target_generation"].max_new_tokens == 6  # the target's length unset: the tester's
    unset = build_parser().parse_args(["eval", "--tester", "run"])
    assert (unset.max_new_tokens, unset.target_max_new_tokens) == (None, None)  # eval: the run's lengths
    assert EvalConfig(**_conversation_settings(unset), **given_settings(unset, EvalLengths)).max_new_tokens is None
    assert [spec.name for spec in dataclasses.fields(EvalLengths)] == ["max_new_tokens", "target_max_new_tokens"]
    assert _conversation_settings(unset)["tester_generation"] == GenerationSettings()  # the last fallback: 32, sampled


@pytest.mark.parametrize(
    "command, flag, text",
    [
        (["eval", "--tester", "run"], "--turns", "Tester turns per conversation. (default: the run's, else 3)"),
        (["eval", "--tester", "run"], "--split", "(default: test)"),
        (["rollout"], "--turns", "Tester turns per conversation. (default: 3)"),
        (["rollout"], "--greedy", "Greedy decoding for both models."),
        (["eval", "--tester", "run"], "--target-max-new-tokens", "(null: max_new_tokens if set, else the run's reply length"),
        (["rollout"], "--test-fraction", "(null: 0.1; dev keeps 0.1, train the rest)"),
        (["train"], "--num-collectors", "Ray workers; each runs whole groups. (default: the config's, else 1)"),
    ],
)
def test_a_generated_flag_help_gives_its_field_help_and_the_entry_point_default(command, flag, text):
    import argparse

    from astrl.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command[0]]
    action = next(a for a in sub._actions if flag in a.option_strings)
    assert text in " ".join(action.help.split()).replace("%%", "%")


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--test-fraction", "0.9", "--test-fraction: must be in (0.0, 0.8], got 0.9"),
        ("--reply-samples", "0", "--reply-samples: must be >= 1, got 0"),
        ("--num-conversations", "-1", "--num-conversations: must be >= 1, got -1"),
        ("--split", "heldout", "--split: invalid choice: 'heldout'"),
    ],
)
def test_a_conversation_flag_out_of_its_field_range_ends_the_command_while_parsing(capsys, flag, value, message):
    from astrl.cli import main

    for command in (["rollout"], ["eval", "--tester", "run"]):
        with pytest.raises(SystemExit) as exit_:
            main([*command, flag, value])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, (command, err)


@pytest.mark.parametrize(
    ("kind", "needs"),
    [(TrainConfig, {}), (RolloutConfig, {}), (EvalConfig, {}), (ReplayConfig, {"archive": "x"}), (ConversationSpec, {})],
)
def test_dtype_and_device_are_declared_once_and_checked_in_every_config(kind, needs):
    assert issubclass(kind, ModelSettings)
    for spec in dataclasses.fields(ModelSettings):  # the very field objects: one help, one check
        assert kind.__dataclass_fields__[spec.name].metadata is spec.metadata
    with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16', 'float16'\), got 'int8'"):
        kind(**needs, dtype="int8")


@pytest.mark.parametrize(("kind", "needs"), [(EvalConfig, {}), (ReplayConfig, {"archive": "x"})])
def test_the_report_settings_are_declared_once_for_eval_and_replay(kind, needs):
    assert issubclass(kind, ReportSettings)
    assert [kind(**needs).threshold, kind(**needs).resamples, kind(**needs).top_attacks] == [0.5, 1000, 10]
    for value, message in ((1.0, r"in \[0, 1\), got 1.0"), (float("nan"), "a finite number, got nan")):
        with pytest.raises(ValueError, match=f"threshold must be {message}"):
            kind(**needs, threshold=value)
    with pytest.raises(ValueError, match="resamples must be >= 1, got 0"):
        kind(**needs, resamples=0)


def test_replay_settings_are_checked_by_their_declaration():
    for change, message in (
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"mode": "voice"}, r"mode must be one of \('chat', 'text'\) \(or null\), got 'voice'"),
        ({"samples": 0}, "samples must be >= 1, got 0"),
        ({"max_new_tokens": 0}, r"max_new_tokens must be >= 1 \(or null\), got 0"),
    ):
        with pytest.raises(ValueError, match=message):
            ReplayConfig(archive="x", **change)
    assert ReplayConfig(archive="x", mode=None, max_new_tokens=None).mode is None  # null: the folder's


def test_a_range_is_written_as_its_message_and_the_key_listing_writes_it_and_nan_passes_none():
    assert [range_text(m) for m in ({"at_least": 0, "below": 1}, {"above": 0, "at_most": 1}, {"at_least": 2}, {"above": 0})] == [
        "in [0, 1)",
        "in (0, 1]",
        ">= 2",
        "> 0",
    ]
    assert [range_text({"at_most": 0}), range_text({"below": 5}), range_text({})] == ["<= 0", "< 5", ""]
    # nan passes no comparison, so it is refused before any; inf is refused even with no bound above
    assert value_problem(float("nan"), {"at_least": 0}) == "must be a finite number, got nan"
    assert value_problem(float("inf"), {"above": 0}) == "must be a finite number, got inf"
    assert value_problem(float("-inf"), {}, nullable=True) == "must be a finite number (or null), got -inf"
    assert value_problem(0.5, {"at_least": 0, "below": 1}) is None and value_problem(1, {"at_least": 0, "below": 1}) is not None
    assert value_problem(3, {}) is None


def test_the_hand_argument_types_check_through_the_same_declaration_as_the_flags():
    from astrl.argtypes import at_least, fraction, threshold

    assert (at_least(1)("3"), fraction("1"), threshold("0")) == (3, 1.0, 0.0)
    for parse, text, message in (
        (at_least(1), "0", "must be >= 1, got 0"),
        (fraction, "0", r"must be in \(0, 1\], got 0"),
        (threshold, "1", r"must be in \[0, 1\), got 1"),
        (fraction, "nan", "must be a finite number, got nan"),  # nan used to fail only by the range's wording
        (threshold, "x", "invalid float value: 'x'"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)


def test_the_loss_choices_are_declared_once_and_read_without_torch():
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from astrl.losses.settings import ADVANTAGE_MODES\n"
        "from astrl.training.config import TrainConfig\n"
        "import astrl.losses\n"
        "assert TrainConfig(algorithm='ppo', advantage='one_step').advantage == 'one_step'\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(list(ADVANTAGE_MODES))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['gae',", "'one_step']"]

    from astrl.errors import ConfigError
    from astrl.losses import PPOLoss, compute_advantages
    from astrl.losses.settings import ADVANTAGE_MODES, KL_ESTIMATORS

    field = {f.name: f for f in dataclasses.fields(TrainConfig)}["advantage"]
    assert field.metadata["choices"] == ADVANTAGE_MODES
    with pytest.raises(ConfigError, match=r"advantage.*'td'"):
        TrainConfig(algorithm="ppo", advantage="td")
    with pytest.raises(ValueError, match=r"mode must be one of \('gae', 'one_step'\), got 'td'"):
        compute_advantages(None, mode="td")
    assert PPOLoss.__module__ == "astrl.losses.ppo" and KL_ESTIMATORS == ("k3", "k1")


def test_the_library_checks_its_arguments_through_the_settings_check():
    from astrl.argtypes import require
    from astrl.evaluation.metrics import bootstrap_ratio
    from astrl.losses.kl import checked_cap
    from astrl.policies import GenerationSettings
    from astrl.rewards.kl import make_kl_controller
    from astrl.rewards.shaping import RewardShaping
    from astrl.rewards.weights import ElicitWeights
    from astrl.sampling.tree import check_tree_shape

    nan = float("nan")
    require("x", 0.5, above=0, at_most=1)
    require("x", None, above=0, nullable=True)
    require("x", "b", choices=("a", "b"))
    for call, message in (
        (lambda: require("x", 0, above=0), "x must be > 0, got 0"),
        (lambda: require("x", 0, above=0, nullable=True), "x must be > 0 or None, got 0"),
        (lambda: require("x", 1, at_least=0, below=1), r"x must be in \[0, 1\), got 1"),
        (lambda: require("x", "c", choices=("a", "b")), r"x must be one of \('a', 'b'\), got 'c'"),
        (lambda: require("x", "c", choices=("a", "b"), nullable=True), r"x must be one of \('a', 'b'\) or None, got 'c'"),
        # nan passes every `value < 0`-style guard these used to be; each now names it
        (lambda: GenerationSettings(temperature=nan), "temperature must be a finite number, got nan"),
        (lambda: GenerationSettings(top_p=0), r"top_p must be in \(0, 1\], got 0"),
        (lambda: GenerationSettings(top_k=-1), "top_k must be >= 0, got -1"),
        (lambda: make_kl_controller(nan), "kl_coef must be a finite number, got nan"),
        (lambda: make_kl_controller(0.1, target_kl=nan), "target_kl must be a finite number, got nan"),
        (lambda: ElicitWeights(alpha=nan), "elicit weight alpha must be a finite number, got nan"),
        (lambda: ElicitWeights(gate_below=0.0), r"probe gate threshold must be in \(0, 1\] or None, got 0.0"),
        (lambda: check_tree_shape(2, 1, nan), "min_reward_gap must be a finite number, got nan"),
        (lambda: checked_cap(float("inf")), "kl_token_cap must be a finite number or None, got inf"),
        (lambda: RewardShaping(clip=nan), "clip must be a finite number or None, got nan"),
        (lambda: bootstrap_ratio([1.0], [2.0], confidence=1.0), r"confidence must be in \(0, 1\), got 1.0"),
    ):
        with pytest.raises(ValueError, match=message):
            call()
    decoding = dataclasses.asdict(DecodingSettings())  # GenerationSettings reads its defaults and ranges
    assert {name: getattr(GenerationSettings(), name) for name in decoding} == decoding
    with pytest.raises(TypeError, match="at_leats"):
        require("x", 1, at_leats=0)  # a misspelt check is an error, not a check that never fails
    # a caller's own error class, with the same wording: each guard of a choice below raises its kind
    from astrl.envs.transforms import ScoreReward
    from astrl.errors import ConfigError, ScorerError
    from astrl.prompts import PromptSourceError, split_prompts
    from astrl.scorers import ChatJudgeScorer
    from astrl.training.demo import demo_config
    from astrl.training.trainer import make_optimizer

    choices = r"must be one of \(%s\), got '%s'"
    for call, error, message in (
        (lambda: require("x", "c", choices=("a", "b"), error=ConfigError), ConfigError, choices % ("'a', 'b'", "c")),
        (lambda: split_prompts(["a"], "heldout", seed=0), PromptSourceError, choices % ("'train', .*, 'all'", "heldout")),
        (lambda: demo_config(mode="voice"), ConfigError, "the demo's mode " + choices % ("'text', 'chat'", "voice")),
        (lambda: make_optimizer("lion", [], 0.1, 0.0), ConfigError, "optimizer " + choices % ("'adamw', .*", "lion")),
        (lambda: ChatJudgeScorer("x", style="loud"), ScorerError, "judge style " + choices % (".*'instruct'", "loud")),
        (lambda: ScoreReward({"tox": len}, reward_scorer="nice"), ValueError, "reward_scorer " + choices % ("'tox',", "nice")),
    ):
        with pytest.raises(error, match=message):
            call()


def test_the_conversation_mode_is_declared_once_and_every_taker_refuses_another():
    from astrl.envs.redteam import RedTeamEnv
    from astrl.envs.settings import ConversationSettings
    from astrl.envs.transforms import TargetTurn
    from astrl.evaluation.settings import ReplaySettings
    from astrl.names import MODES
    from astrl.policies import input_mode
    from astrl.rewards.astprompter import ASTPrompterReward
    from astrl.training.hardening import target_inputs

    assert MODES == ("chat", "text")
    for kind in (ConversationSettings, ReplaySettings, TrainConfig, EvalConfig):
        assert {f.name: f for f in dataclasses.fields(kind)}["mode"].metadata["choices"] is MODES
    assert [input_mode(m) for m in MODES] == ["history", "text"]
    message = r"^mode must be one of \('chat', 'text'\), got 'voice'$"
    for call in (
        lambda: input_mode("voice"),
        lambda: RedTeamEnv(mode="voice"),
        lambda: TargetTurn(None, tester_tokenizer=None, tester_window=8, tester_max_new_tokens=4, mode="voice"),
        lambda: ASTPrompterReward(None, None, None, mode="voice"),
        lambda: target_inputs(None, ["a"], ["b"], "voice"),
    ):
        with pytest.raises(ValueError, match=message):
            call()
