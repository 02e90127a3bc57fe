"""The conversation recipe: one plain spec of a red-team conversation and the builder that makes it.

::

    ConversationSpec (plain data: model names, settings)          training, rollout, eval, demo, Ray workers
      -> build_conversation(spec, [loaded models, scorers, stream])
           preflight what needs no model: names, prompt source (before anything is loaded)
           models    loaded from the spec's names unless the caller passes them
           policies  tester and target (astrl.policies.make_policy)
           scorers   by name (astrl.scorers.make_scorers), the first gives the reward
           stream    the seeded opener stream of the spec's prompt split
           env       make_redteam_env(...) over that stream
      -> Conversation(spec, tester, target, scorers, stream, env)

Every entry point describes its conversations as a :class:`ConversationSpec` and calls
:func:`build_conversation` once; the tree sampler of DPO / IPO takes the same policies and
settings (:meth:`astrl.sampling.TreeSampler.from_conversation`). The spec pickles, so a Ray worker
receives it and builds its own part of the batch (``shard``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from astrl.argtypes import setting
from astrl.backends import BackendSettings, check_backend
from astrl.envs.redteam import DEFAULT_TESTER_SYSTEM_PROMPT, make_redteam_env
from astrl.envs.settings import ConversationBatch
from astrl.models import LoadedModel, add_lora, load_model
from astrl.names import ModelSettings, check_names
from astrl.policies import input_mode, make_policy, vllm_share
from astrl.prompts import PromptStream, load_prompts, split_fractions, split_prompts
from astrl.rewards.weights import LIKELIHOOD_REWARDS, REWARDS, check_reward_options
from astrl.scorers import Scorer, make_scorers

if TYPE_CHECKING:
    from torchrl.envs import TransformedEnv
    from torchrl.modules.llm import LLMWrapperBase


@dataclass
class ConversationSpec(ModelSettings, BackendSettings, ConversationBatch):  # bases in reverse: conversation first
    """A red-team conversation set-up as plain, picklable data.

    The conversation settings (``seed``, ``split_seed``, ``prompts``, ``split``, ``turns``, ``mode``,
    the system prompts, ``reply_samples``, ``batch_size`` and each side's generation) are those of
    :class:`~astrl.envs.settings.ConversationBatch`, the backends and vLLM's GPU share those of
    :class:`~astrl.backends.BackendSettings`, and ``dtype`` and ``device`` (of the models loaded here and the
    scorers) those of :class:`~astrl.names.ModelSettings`, declared and checked there; the fields
    below with a range or choices declare it (:func:`~astrl.argtypes.setting`).

    Args:
        tester / target: model names, folders or hub ids; loaded by :func:`build_conversation`
            unless the caller passes loaded models. A target named like the tester shares the
            tester's weights (its base, adapters off, under ``lora``).
        scorers: scorer names (:func:`astrl.scorers.make_scorer`); the first gives the reward.
        prompts / split: the opener source and its split; ``split_seed`` seeds the split
            (``None``: ``seed``).
        batch_size: conversations run together (``batch_size / group_size`` openers, each
            ``group_size`` times in a row); for a tree sampler, the trees per call.
        turns: tester turns per conversation; for a tree sampler, the tree depth.
        mode: ``"chat"`` or ``"text"``.
        tester_generation / target_generation: sampling settings of each side.
        tester_system_prompt: ``None`` keeps the env's default red-teaming prompt.
        target_system_prompt: the target's system prompt (chat mode), ``None`` for none.
        reward / reward_options / novelty / reply_samples: as in :func:`~astrl.envs.make_redteam_env`.
        lora: :func:`astrl.models.add_lora` keywords for a tester loaded from ``tester``.
        backend / target_backend / vllm_memory: generation backends, and the GPU share all vLLM
            engines take together.
        turn_cache: Transformers policies keep each model's KV cache between ``generate`` calls
            (:class:`astrl.prefill.TurnCache`).
        seed: seeds the opener order (and the split, unless ``split_seed``) and the vLLM engines.
    """

    tester: str = "smollm2-135m"
    target: str = "smollm2-135m"
    scorers: list[str] = field(default_factory=lambda: ["profanity"])
    group_size: int = setting(1, "Conversations per opener, in a row of the batch.", at_least=1)
    reward: str = setting("score", "The reward (astrl.rewards.weights.REWARDS).", choices=REWARDS)
    reward_options: dict | None = None
    novelty: dict | None = None
    lora: dict | None = None
    turn_cache: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()  # every field's declared check (astrl.argtypes.check_settings)
        if self.batch_size % self.group_size:
            raise ValueError(f"group_size {self.group_size} must divide batch_size {self.batch_size}")
        if isinstance(self.scorers, str) or not self.scorers:
            raise ValueError(f"scorers must be a non-empty list of scorer names, got {self.scorers!r}")
        check_reward_options(self.reward, self.reward_options)

    def env_options(self) -> dict:
        """The conversation keywords of :func:`~astrl.envs.make_redteam_env` (and of the tree sampler)."""
        tester_prompt = self.tester_system_prompt
        return {
            "mode": self.mode,
            "tester_system_prompt": DEFAULT_TESTER_SYSTEM_PROMPT if tester_prompt is None else tester_prompt,
            "target_system_prompt": self.target_system_prompt,
            "reward": self.reward,
            "reward_options": self.reward_options,
            "novelty": self.novelty,
            "reply_samples": self.reply_samples,
        }


@dataclass
class Conversation:
    """What :func:`build_conversation` makes of a spec. ``stream`` and ``env`` are ``None`` when no
    env was asked for (and no stream passed)."""

    spec: ConversationSpec
    tester: LLMWrapperBase
    target: LLMWrapperBase
    scorers: dict[str, Scorer]
    stream: PromptStream | None
    env: TransformedEnv | None


def opener_stream(spec: ConversationSpec) -> PromptStream:
    """The seeded stream of the spec's openers: ``batch_size`` a draw, ``group_size`` repeats each."""
    prompts = split_prompts(
        load_prompts(spec.prompts), spec.split, seed=spec.prompt_split_seed, fractions=split_fractions(spec.test_fraction)
    )
    return PromptStream(prompts, spec.batch_size, seed=spec.seed, group_size=spec.group_size)


def preflight(
    spec: ConversationSpec, *, tester: bool = True, target: bool = True, scorers: bool = True, prompts: bool = True
) -> None:
    """Every check of ``spec`` that needs no model (:func:`astrl.names.check_names`), so that a bad
    name fails in milliseconds, before any model is loaded or converted: the ``tester`` and ``target``
    names, the ``scorers`` names, and the ``prompts`` source with its split."""
    roles = {"tester": spec.tester} if tester else {}
    if target:
        roles["target"] = spec.target
    check_names(
        roles,
        spec.scorers if scorers else None,
        spec.prompts if prompts else None,
        split=spec.split,
        split_seed=spec.prompt_split_seed,
        test_fraction=spec.test_fraction,
    )


def load_models(spec: ConversationSpec, tester: LoadedModel | None = None) -> tuple[LoadedModel, LoadedModel]:
    """The spec's tester (with its LoRA adapters) and target. A target named like the tester shares
    its weights (adapters off) when the tester is loaded here; a passed ``tester`` never shares."""
    if tester is None:
        tester = load_model(spec.tester, dtype=spec.dtype, device=spec.device)
        if spec.lora is not None:
            tester = LoadedModel(tester.name, add_lora(tester.model, **spec.lora).eval(), tester.tokenizer, tester.context_window)
        if spec.target == spec.tester and spec.lora is None:
            return tester, tester
        if spec.target == spec.tester:
            from astrl.rewards.reference import AdaptersDisabled

            return tester, LoadedModel(tester.name, AdaptersDisabled(tester.model), tester.tokenizer, tester.context_window)
    return tester, load_model(spec.target, dtype=spec.dtype, device=spec.device)


def build_conversation(
    spec: ConversationSpec,
    *,
    tester: LoadedModel | None = None,
    target: LoadedModel | None = None,
    scorers: Mapping[str, Scorer] | None = None,
    stream: PromptStream | None = None,
    shard: tuple[int, int] | None = None,
    env: bool = True,
) -> Conversation:
    """Build the policies, scorers, opener stream and env of ``spec``; what the caller passes is used as is.

    Args:
        spec: the conversation set-up.
        tester / target: loaded models (e.g. a training run's LoRA tester and its adapters-off
            target); missing ones are loaded from the spec (:func:`load_models`).
        scorers: built scorers, keyed by name; default ``make_scorers(spec.scorers)``.
        stream: the opener stream; default :func:`opener_stream`.
        shard: ``(index, count)``: build worker ``index`` of ``count``'s part: slice ``index`` of
            every batch of openers, ``batch_size / count`` conversations, its vLLM engines seeded
            ``seed + index``.
        env: ``False``: policies and scorers only (for a tree sampler, or a trainer whose Ray
            workers build their own envs); ``stream`` is kept as passed.
    """
    check_backend(spec.backend, spec.device)
    check_backend(spec.target_backend, spec.device)
    preflight(spec, tester=tester is None, target=target is None, scorers=scorers is None, prompts=env and stream is None)
    index, count = shard or (0, 1)
    if target is None:
        tester, target = load_models(spec, tester)
    elif tester is None:
        raise TypeError("a passed target model needs its tester model passed too")
    memory = vllm_share(spec.vllm_memory, spec.backend, spec.target_backend)
    # vLLM reseeds the process at start: engines take the run's seed
    engine = {"vllm_memory": memory, "vllm_options": {"seed": spec.seed + index}, "turn_cache": spec.turn_cache}
    mode = input_mode(spec.mode)
    tester_policy = make_policy(tester, spec.tester_generation, input_mode=mode, backend=spec.backend, **engine)
    # the likelihood term scores the probe the target has just read: from the states its prefill keeps
    reads_probe = spec.reward in LIKELIHOOD_REWARDS
    # a chat target on the Transformers backend reads its chats rendered once each (not once per reply sample)
    renders = spec.mode == "chat" and spec.target_backend == "transformers"
    target_policy = make_policy(
        target,
        spec.target_generation,
        input_mode="text" if renders else mode,
        backend=spec.target_backend,
        keep_prompt_states=reads_probe,
        renders_chats=renders,
        **engine,
    )
    scorers = dict(scorers) if scorers is not None else make_scorers(spec.scorers, device=spec.device)
    if not env:
        return Conversation(spec, tester_policy, target_policy, scorers, stream, None)
    stream = stream if stream is not None else opener_stream(spec)
    if shard is not None:
        stream = stream.shard(index, count)
    red_team = make_redteam_env(
        tester_policy,
        target_policy,
        scorers,
        stream,
        batch_size=spec.batch_size // count,
        max_turns=spec.turns,
        seed=spec.seed,
        **spec.env_options(),
    )
    return Conversation(spec, tester_policy, target_policy, scorers, stream, red_team)
