"""The conversation recipe: ConversationSpec -> build_conversation, and each entry point's spec."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch
from conftest import loaded, make_llama, make_tokenizer
from torchrl.envs import StepCounter

from astrl._compat import as_list
from astrl.envs import (
    DEFAULT_TESTER_SYSTEM_PROMPT,
    ConversationSpec,
    ScoreReward,
    TargetTurn,
    build_conversation,
    make_redteam_env,
)
from astrl.envs.recipe import load_models, opener_stream
from astrl.errors import ConfigError
from astrl.policies import GenerationSettings, input_mode, make_policy
from astrl.prefill import clear_turn_caches
from astrl.rewards import ASTPrompterReward
from astrl.rewards.novelty import NoveltyReward
from astrl.rewards.reference import AdaptersDisabled
from astrl.sampling import TreeSampler
from astrl.scorers import make_scorers
from astrl.training import TrainConfig
from astrl.training.setup import build_env, build_models, build_stream, conversation_spec, generation, training_conversation

KEYWORDS = "keywords:the,you,hello,how,are"
SMALL = GenerationSettings(max_new_tokens=4)
pytestmark = pytest.mark.usefixtures("one_thread")


def _config(**overrides) -> TrainConfig:
    settings = dict(tester="tiny", target="tiny", scorer=KEYWORDS, prompts_per_step=2, group_size=2, turns=2, max_new_tokens=4)
    return TrainConfig(**{**settings, "lora_targets": ["q_proj", "v_proj"], **overrides})


def _models(config: TrainConfig):
    tok = make_tokenizer()
    return build_models(config, loaded(make_llama(tok), tok, name="tiny"))


def _summary(env) -> dict:
    """What an entry point's env is made of: shape, prompts, scorers and the reward transforms' settings."""
    return {
        "batch_size": tuple(env.batch_size),
        "max_turns": next(t.max_steps for t in env.transform if isinstance(t, StepCounter)),
        "mode": env.base_env.mode,
        "tester_system_prompt": env.base_env.system_prompt,
        "target_system_prompt": next(t.target_system_prompt for t in env.transform if isinstance(t, TargetTurn)),
        "scorers": list(next(t.scorers for t in env.transform if isinstance(t, ScoreReward))),
        "rewards": [repr(t) for t in env.transform if isinstance(t, (ASTPrompterReward, NoveltyReward))],
        "transforms": [type(t).__name__ for t in env.transform],
    }


def _rollout(env, tester, turns: int) -> tuple[list, list, list]:
    torch.manual_seed(0)
    with torch.no_grad():
        out = env.rollout(turns, tester)
    return as_list(out["next", "probe"]), as_list(out["next", "target_response"]), out["next", "reward"].tolist()


# -- the spec ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mode": "voice"}, "mode must be one of .* got 'voice'"),
        ({"reward": "toxicity"}, "reward must be one of .* got 'toxicity'"),
        ({"split": "holdout"}, "split must be one of .* got 'holdout'"),
        ({"backend": "tpu"}, "backend must be one of .* got 'tpu'"),
        ({"target_backend": "onnx"}, "target_backend must be one of .* got 'onnx'"),
        ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
        ({"turns": 0}, "turns must be >= 1, got 0"),
        ({"batch_size": 4, "group_size": 3}, "group_size 3 must divide batch_size 4"),
        ({"scorers": []}, r"scorers must be a non-empty list of scorer names, got \[\]"),
        ({"scorers": "profanity"}, "scorers must be a non-empty list of scorer names, got 'profanity'"),
        ({"vllm_memory": 0.0}, r"vllm_memory must be in \(0, 1\], got 0.0"),
        ({"reward_options": {"alpha": 2.0}}, r"reward_options \['alpha'\] only apply to reward='astprompter' or 'elicit'"),
        ({"reward": "elicit", "reward_options": {"zeta": 1.0}}, r"unknown reward_options \['zeta'\] for reward='elicit'"),
    ],
)
def test_bad_spec_values_are_refused_with_the_value_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        ConversationSpec(**overrides)


def test_generation_settings_must_be_settings():
    with pytest.raises(TypeError, match="tester_generation must be a GenerationSettings, got dict"):
        ConversationSpec(tester_generation={"max_new_tokens": 4})


def test_the_spec_is_plain_data_that_pickles_inside_a_worker_spec():
    from astrl.distributed import WorkerSpec
    from astrl.training.setup import worker_spec

    config = _config(reward="elicit", novelty_ngram=0.5, tester_system_prompt="Be rude.", num_collectors=2, collector="ray")
    spec = worker_spec(config, {"epoch": 1, "position": 2, "seed": 0})
    assert pickle.loads(pickle.dumps(spec)) == spec and isinstance(spec, WorkerSpec)
    assert spec.conversation == conversation_spec(config)  # the workers run the run's own conversations
    assert spec.conversation.novelty == config.novelty_options() and spec.worker_batch_size == config.batch_size // 2


def test_an_unset_tester_prompt_is_the_default_red_teaming_prompt():
    assert ConversationSpec().env_options()["tester_system_prompt"] == DEFAULT_TESTER_SYSTEM_PROMPT
    assert ConversationSpec(tester_system_prompt="").env_options()["tester_system_prompt"] == ""
    assert ConversationSpec(tester_system_prompt="Be rude.").env_options()["tester_system_prompt"] == "Be rude."


# -- each entry point's spec ------------------------------------------------------------------------
def test_training_specs_hold_the_run_batch_or_its_trees():
    config = _config(reward="astprompter", judges=["wordlist"], target_max_new_tokens=7, split="dev", seed=3)
    spec = conversation_spec(config)
    assert (spec.batch_size, spec.group_size, spec.turns) == (4, 2, 2)
    assert spec.scorers == [KEYWORDS, "wordlist"] and (spec.split, spec.seed, spec.split_seed) == ("dev", 3, 3)
    assert conversation_spec(_config(seed=3, split_seed=0)).split_seed == 0  # replicate seeds, one held-out split
    assert spec.reward_options == config.reward_options() and spec.lora["rank"] == config.lora_rank
    assert spec.tester_generation == generation(config) and spec.target_generation.max_new_tokens == 7
    trees = conversation_spec(_config(algorithm="ipo", group_size=1, tree_depth=3))
    assert (trees.batch_size, trees.group_size, trees.turns) == (2, 1, 3)
    assert conversation_spec(_config(lora=False)).lora is None


def test_rollout_spec_runs_one_batch_of_at_most_num_conversations():
    from astrl.rollout import RolloutConfig, conversation_spec

    config = RolloutConfig(num_conversations=3, batch_size=8, reward="elicit", probe_penalty=2.0, target_system_prompt="Be kind.")
    spec = conversation_spec(config)
    assert (spec.batch_size, spec.group_size, spec.split, spec.novelty) == (3, 1, "all", None)
    assert spec.reward_options == config.reward_options() and spec.reward_options["penalty"] == 2.0
    assert spec.env_options()["target_system_prompt"] == "Be kind."


def test_eval_spec_takes_the_resolved_run_settings_and_the_astprompter_terms():
    from astrl.evaluation.run import EvalConfig, Resolved, conversation_spec
    from astrl.evaluation.tester import TesterSource
    from astrl.policies import GenerationSettings

    config = EvalConfig(num_conversations=5, batch_size=8, split="test", seed=9)  # turns and lengths: the run's
    lengths = {"tester_generation": GenerationSettings(12), "target_generation": GenerationSettings(16)}
    source = TesterSource("run", "tiny")
    resolved = Resolved(source, "target", ["profanity"], "builtin", 3, "text", None, "Be kind.", [], 2, **lengths)
    spec = conversation_spec(config, resolved, ["profanity", "wordlist"])
    assert (spec.tester, spec.target, spec.batch_size, spec.turns, spec.mode) == ("tiny", "target", 5, 2, "text")
    assert (spec.tester_generation.max_new_tokens, spec.target_generation.max_new_tokens) == (12, 16)
    assert (spec.split, spec.split_seed, spec.seed, spec.reward, spec.reward_options) == ("test", 3, 9, "astprompter", None)
    assert spec.scorers == ["profanity", "wordlist"] and spec.target_system_prompt == "Be kind."


def test_demo_comparison_spec_runs_dev_openers_without_novelty():
    from astrl.training.demo import comparison_spec, demo_config

    config = demo_config()
    spec = comparison_spec(config, conversations=40, seed=1234, judge="wordlist")
    assert (spec.split, spec.split_seed, spec.seed, spec.batch_size, spec.group_size) == ("dev", 0, 1234, 40, 1)
    assert (spec.reward, spec.reward_options, spec.novelty) == ("elicit", config.reward_options(), None)
    assert spec.reply_samples == 4  # 4 replies a held-out probe: the first for the usual rates, all for the shares
    assert comparison_spec(config, conversations=40, seed=1234, judge="wordlist", replies=1).reply_samples == 1
    assert spec.scorers == ["profanity", "wordlist"] and spec.mode == "text" and spec.turns == config.turns
    assert comparison_spec(config, conversations=100, seed=1234, judge="wordlist").batch_size == 64  # at most 64 at once
    score_only = {"reward": "score", "scorer": "wordlist", "probe_gate": None, "likelihood_cap": None}
    score_only.update(repeat_penalty=0.0, reply_lexicon_weight=0.0)  # the elicitation reward's own settings off
    plain = comparison_spec(demo_config(score_only), conversations=3, seed=1, judge="wordlist")
    assert (plain.reward, plain.scorers, plain.batch_size) == ("astprompter", ["wordlist"], 3)


def test_chat_demo_compares_on_its_declared_held_out_openers():
    from astrl.training.demo import comparison_spec, demo_config, demo_judge, held_out_split

    chat = demo_config(mode="chat")
    assert (chat.mode, chat.turns, chat.test_fraction, chat.warm_start_select) == ("chat", 2, 0.35, "search")
    spec = comparison_spec(chat, conversations=436, seed=1234, judge="wordlist")
    assert (spec.split, spec.test_fraction, spec.mode, spec.turns, spec.batch_size) == ("test", 0.35, "chat", 2, 64)
    assert held_out_split(demo_config()) == "dev" and held_out_split(demo_config({"test_fraction": 0.35})) == "test"
    full = demo_config(full=True, mode="chat")  # the chat RL recipe, judged by the SVM it never pays replies by
    assert (full.scorer, full.probe_scorer, full.guide_replay_warm_start, full.test_fraction) == (
        "wordlist:strict", "profanity", True, 0.35,
    )  # fmt: skip
    assert demo_judge(full) == "profanity" and str(full.run_dir) == "runs/elicit_chat_full"
    assert comparison_spec(full, conversations=436, seed=1234, judge="profanity").scorers == ["wordlist:strict", "profanity"]
    with pytest.raises(ConfigError, match=r"the demo's mode must be one of \('text', 'chat'\), got 'voice'"):
        demo_config(mode="voice")


# -- the builder ------------------------------------------------------------------------------------
def test_training_env_is_the_env_a_direct_make_redteam_env_call_builds():
    config = _config(
        reward="elicit", novelty_ngram=0.5, tester_system_prompt="Be rude.", target_system_prompt="Be kind.", judges=["wordlist"]
    )
    models = _models(config)
    env, tester = build_env(config, models, build_stream(config))
    mode = input_mode(config.mode)
    tester_direct = make_policy(models.tester, generation(config), input_mode=mode)
    target_direct = make_policy(models.target, generation(config, target=True), input_mode=mode)
    direct = make_redteam_env(
        tester_direct,
        target_direct,
        make_scorers([config.scorer, *config.judges]),
        build_stream(config),
        batch_size=config.batch_size,
        max_turns=config.turns,
        mode=config.mode,
        tester_system_prompt="Be rude.",
        target_system_prompt="Be kind.",
        reward="elicit",
        reward_options=config.reward_options(),
        novelty=config.novelty_options(),
    )
    summary = _summary(env)
    assert summary == _summary(direct)
    assert summary["batch_size"] == (4,) and summary["max_turns"] == 2 and "NgramNovelty" in summary["transforms"]
    assert env.observation_spec == direct.observation_spec and env.full_reward_spec == direct.full_reward_spec
    assert _rollout(env, tester, config.turns) == _rollout(direct, tester_direct, config.turns)


def test_tree_sampler_from_a_conversation_samples_what_a_direct_one_does():
    config = _config(algorithm="ipo", group_size=1, tree_depth=2, reward="astprompter", tester_system_prompt="Be rude.", seed=4)
    models = _models(config)
    conversation = training_conversation(config, models, opener_stream(conversation_spec(config)), env=False)
    assert conversation.env is None and conversation.stream is not None
    sampler = TreeSampler.from_conversation(conversation, tree_width=2)
    assert (sampler.num_trees, sampler.tree_depth, sampler.seed) == (2, 2, 4) and sampler.prompt_stream is conversation.stream
    mode = input_mode(config.mode)
    direct = TreeSampler(
        make_policy(models.tester, generation(config), input_mode=mode),
        make_policy(models.target, generation(config, target=True), input_mode=mode),
        make_scorers([config.scorer]),
        opener_stream(conversation_spec(config)),
        num_trees=2,
        tree_width=2,
        tree_depth=2,
        tester_system_prompt="Be rude.",
        reward="astprompter",
        reward_options=config.reward_options(),
        seed=4,
    )
    ours = sampler.sample()
    clear_turn_caches(models.tester.model, models.target.model)  # both start from nothing read
    theirs = direct.sample()
    assert as_list(ours["nodes", "probe"]) == as_list(theirs["nodes", "probe"])
    assert torch.equal(ours["nodes", "reward"], theirs["nodes", "reward"])


def test_models_named_alike_share_weights_and_passed_models_are_used_as_is(tiny_model_dir):
    spec = ConversationSpec(tester=str(tiny_model_dir), target=str(tiny_model_dir), scorers=[KEYWORDS])
    tester, target = load_models(spec)
    assert target is tester
    lora = {"rank": 2, "alpha": 4, "dropout": 0.0, "targets": ["q_proj"]}
    tester, target = load_models(replace(spec, lora=lora))
    assert isinstance(target.model, AdaptersDisabled) and hasattr(tester.model, "disable_adapter")
    tok = make_tokenizer()
    mine = loaded(make_llama(tok), tok)
    tester, target = load_models(spec, mine)
    assert tester is mine and target.model is not mine.model  # a passed tester is never shared with the target
    with pytest.raises(TypeError, match="a passed target model needs its tester model passed too"):
        build_conversation(spec, target=mine)


def test_the_builder_uses_what_is_passed_and_builds_the_rest():
    tok = make_tokenizer()
    lm = loaded(make_llama(tok), tok)
    spec = ConversationSpec(scorers=[KEYWORDS], batch_size=2, turns=1, tester_generation=SMALL, target_generation=SMALL)
    bare = build_conversation(spec, tester=lm, target=lm, env=False)
    assert bare.env is None and bare.stream is None and list(bare.scorers) == list(make_scorers([KEYWORDS]))
    scorers = make_scorers(["wordlist"])
    stream = opener_stream(spec)
    built = build_conversation(spec, tester=lm, target=lm, scorers=scorers, stream=stream)
    assert built.stream is stream and built.env.prompt_stream is stream
    assert next(t for t in built.env.transform if isinstance(t, ScoreReward)).scorers == scorers
    assert _summary(built.env)["tester_system_prompt"] == DEFAULT_TESTER_SYSTEM_PROMPT


def test_a_shard_runs_its_slice_of_every_batch(tiny_model_dir):
    from astrl.distributed import WorkerSpec, build_worker

    conversation = ConversationSpec(
        tester=str(tiny_model_dir),
        target=str(tiny_model_dir),
        scorers=[KEYWORDS],
        batch_size=4,
        group_size=2,
        turns=1,
        tester_generation=SMALL,
        target_generation=SMALL,
    )
    env, _ = build_worker(WorkerSpec(conversation, num_workers=2, worker=1))
    assert tuple(env.batch_size) == (2,) and _summary(env)["max_turns"] == 1
    full = opener_stream(conversation).next_batch()
    assert as_list(env.reset()["query"]) == full[2:]


def test_a_tree_sampler_refuses_a_conversation_whose_env_drew_from_its_stream():
    tok = make_tokenizer()
    lm = loaded(make_llama(tok), tok)
    spec = ConversationSpec(scorers=[KEYWORDS], batch_size=2, turns=1, tester_generation=SMALL, target_generation=SMALL)
    with pytest.raises(ValueError, match="build the conversation with env=False"):
        TreeSampler.from_conversation(build_conversation(spec, tester=lm, target=lm))
