"""Build the models of a training run and describe its conversations (:func:`conversation_spec`);
:func:`astrl.envs.build_conversation` makes the policies, scorers and env from them.

With ``lora: true`` and the same base for tester and target, one copy of the base weights
serves all three roles: the tester (adapters on), the reference and the target (adapters off).
With ``kl_reference: warm_start`` the reference is a :class:`~astrl.rewards.reference.PinnedReference`:
the untrained tester until the warm start ends, then a frozen copy of the tester it left.
With target hardening (``harden_every > 0``) the target is its own model with its own LoRA
adapter (a second copy of the base when it shares the tester's), and ``original_target`` is that
model with its adapter off.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from astrl.envs.recipe import Conversation, ConversationSpec, build_conversation, opener_stream
from astrl.envs.settings import conversation_settings
from astrl.models import LoadedModel, add_lora, load_model
from astrl.policies import GenerationSettings
from astrl.prompts import PromptStream
from astrl.rewards import make_reference
from astrl.rewards.reference import AdaptersDisabled, PinnedReference
from astrl.training.config import TrainConfig


@dataclass
class RunModels:
    """The tester (trainable), its frozen reference and the target, plus their tokenizers."""

    tester: LoadedModel
    reference: torch.nn.Module
    target: LoadedModel
    shared_base: bool
    original_target: torch.nn.Module | None = None  # the target before hardening (adapter off), with harden_every > 0

    @property
    def untrained(self) -> torch.nn.Module:
        """The tester before any training: its base with the adapters off, or (without LoRA) the
        reference as it was built, before a ``kl_reference: warm_start`` pin."""
        if hasattr(self.tester.model, "disable_adapter"):
            return AdaptersDisabled(self.tester.model)
        return self.reference.base if isinstance(self.reference, PinnedReference) else self.reference


def lora_settings(config: TrainConfig) -> dict:
    """The config's LoRA settings as :func:`astrl.models.add_lora` keywords."""
    return {"rank": config.lora_rank, "alpha": config.lora_alpha, "dropout": config.lora_dropout, "targets": config.lora_targets}


def build_models(config: TrainConfig, tester_lm: LoadedModel | None = None) -> RunModels:
    """Load (or take) the tester, wrap it with LoRA, and derive the reference and the target."""
    from astrl.backends import check_backend

    check_backend(config.backend, config.device)
    check_backend(config.target_backend, config.device)
    tester_lm = tester_lm or load_model(config.tester, dtype=config.dtype, device=config.device)
    base = tester_lm.model
    same_base = config.target == config.tester
    if config.harden_every > 0 and same_base:  # a target of its own, copied before the tester's adapter goes in
        target_lm = LoadedModel(tester_lm.name, copy.deepcopy(base), tester_lm.tokenizer, tester_lm.context_window)
    elif config.harden_every > 0:
        target_lm = load_model(config.target, dtype=config.dtype, device=config.device)
    model = add_lora(base, **lora_settings(config)) if config.lora else base
    model.eval()  # no dropout: behaviour and training log-probs must agree
    tester = LoadedModel(tester_lm.name, model, tester_lm.tokenizer, tester_lm.context_window)
    untrained = make_reference(model)  # also the target when the target shares the tester's base
    reference = PinnedReference(untrained) if config.kl_reference == "warm_start" else untrained
    if config.harden_every > 0:
        target_model = add_lora(target_lm.model, **lora_settings(config)).eval()
        target = LoadedModel(target_lm.name, target_model, target_lm.tokenizer, target_lm.context_window)
        return RunModels(tester, reference, target, shared_base=False, original_target=AdaptersDisabled(target_model))
    if same_base:  # one adapters-off view: what the target reads is what the reference would score
        target = LoadedModel(tester_lm.name, untrained, tester_lm.tokenizer, tester_lm.context_window)
    else:
        target = load_model(config.target, dtype=config.dtype, device=config.device)
        target.model.requires_grad_(False)
    return RunModels(tester, reference, target, shared_base=same_base)


def generation(config: TrainConfig, target: bool = False) -> GenerationSettings:
    """The tester's (or the target's) sampling settings (:meth:`~astrl.envs.settings.SamplingSettings.generation`)."""
    return config.generation(target)


def conversation_spec(config: TrainConfig) -> ConversationSpec:
    """The run's conversations as a :class:`~astrl.envs.ConversationSpec`.

    GRPO / PPO run ``prompts_per_step`` openers ``group_size`` times for ``turns`` turns; DPO / IPO
    grow ``prompts_per_step`` trees of depth ``tree_depth``."""
    trees = config.algorithm in ("dpo", "ipo")
    return ConversationSpec(
        **conversation_settings(config, split_seed=config.prompt_split_seed, turns=config.tree_depth if trees else config.turns),
        tester=config.tester,
        target=config.target,
        scorers=[config.scorer, *config.judges],
        batch_size=config.prompts_per_step if trees else config.batch_size,
        group_size=1 if trees else config.group_size,
        tester_generation=config.generation(),
        target_generation=config.generation(target=True),
        reward=config.reward,
        reward_options=config.reward_options(),
        novelty=config.novelty_options(),
        lora=lora_settings(config) if config.lora else None,
        backend=config.backend,
        target_backend=config.target_backend,
        vllm_memory=config.vllm_memory,
        turn_cache=config.turn_cache,
        dtype=config.dtype,
        device=config.device,
    )


def build_stream(config: TrainConfig) -> PromptStream:
    return opener_stream(conversation_spec(config))


def training_conversation(
    config: TrainConfig, models: RunModels, stream: PromptStream | None = None, *, env: bool = True
) -> Conversation:
    """The run's tester and target policies over its loaded models, its scorers and, with ``env``,
    the red-team env over ``stream``. ``env=False``: no env (the tree sampler builds its own from
    the same settings; Ray workers build theirs from :func:`worker_spec`)."""
    spec = conversation_spec(config)
    return build_conversation(spec, tester=models.tester, target=models.target, stream=stream, env=env)


def worker_spec(config: TrainConfig, stream_state: dict | None = None):
    """The recipe from which each Ray worker builds the env and tester policy of this run."""
    from astrl.distributed import WorkerSpec

    return WorkerSpec.for_collectors(conversation_spec(config), config, stream_state)


def build_env(config: TrainConfig, models: RunModels, stream: PromptStream):
    """The red-team env and the tester policy that acts in it."""
    conversation = training_conversation(config, models, stream)
    return conversation.env, conversation.tester
