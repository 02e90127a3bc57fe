"""The settings of a red-team conversation, declared once.

:class:`ConversationSettings` holds what every entry point asks of its conversations (openers, turns,
mode, system prompts, replies per probe), :class:`SeedSettings` the seeds (of everything drawn, of
the prompt split), :class:`SamplingSettings` the flat sampling keys of a YAML config (with greedy
decoding, :class:`RunSampling`: the sampling flags of rollout and eval). Each field
carries its help and its check (:func:`astrl.argtypes.setting`), so that one field is one declaration:
:class:`~astrl.training.TrainConfig`, :class:`~astrl.rollout.RolloutConfig`,
:class:`~astrl.evaluation.run.EvalConfig` and :class:`~astrl.envs.ConversationSpec` inherit them
(dataclass inheritance keeps their keys flat), :func:`with_defaults` gives an entry point its own
defaults, and :func:`conversation_settings` copies them from one to the other.

A new conversation setting is one :func:`~astrl.argtypes.setting` field here plus the code that reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astrl.argtypes import check_settings, setting
from astrl.decoding import DecodingSettings
from astrl.names import MODES
from astrl.prompts import SPLITS

if TYPE_CHECKING:
    from astrl.policies import GenerationSettings


def with_defaults(base: type, **defaults: Any) -> type:
    """``base`` with other defaults for some of its fields: same names, types, help and checks, in
    the same place among the fields. An entry point's own defaults (``split="train"``, ``turns=2``)."""
    fields = base.__dataclass_fields__
    unknown = sorted(set(defaults) - set(fields))
    if unknown:
        raise TypeError(f"{base.__name__} has no field(s) {unknown}")
    namespace = {name: dataclasses.field(default=value, metadata=fields[name].metadata) for name, value in defaults.items()}
    namespace["__annotations__"] = {name: fields[name].type for name in defaults}
    namespace["__module__"] = base.__module__
    namespace["__doc__"] = base.__doc__
    namespace["base_defaults"] = {name: fields[name].default for name in defaults}  # read by argtypes.replaced_default
    return dataclass(type(base.__name__, (base,), namespace))


def conversation_settings(obj: Any, settings: type | None = None, **changes: Any) -> dict:
    """The fields of ``settings`` (default: those of :class:`SeedSettings` and :class:`ConversationSettings`)
    read from ``obj``, with ``changes`` replacing some: keywords of another class that has them (a
    :class:`~astrl.envs.ConversationSpec`)."""
    kinds = (settings,) if settings is not None else (SeedSettings, ConversationSettings)
    values = {spec.name: getattr(obj, spec.name) for kind in kinds for spec in dataclasses.fields(kind)}
    return {**values, **changes}


@dataclass
class SeedSettings:
    """The seeds of a run: of everything it draws, and of its prompt split."""

    seed: int = setting(
        0, "Seed of the prompt split (unless split_seed), prompt order, sampling, minibatch order and initialisation."
    )
    split_seed: int | None = setting(
        None,
        "Seed of the train/dev/test prompt split (null: seed). Replicate runs with other seeds keep the same "
        "held-out openers when they share it.",
    )

    @property
    def prompt_split_seed(self) -> int:
        """The seed of the prompt split: ``split_seed``, else ``seed``."""
        return self.seed if self.split_seed is None else self.split_seed


@dataclass
class ConversationSettings:
    """What a red-team conversation is asked to be: its openers, its length and shape, its system
    prompts and the replies sampled per probe. The checks run in ``__post_init__``."""

    prompts: str = setting("builtin", "Openers: builtin, rtp[:CATEGORY], harmbench, chatterbot, hf:ID or a .txt/.jsonl file.")
    split: str = setting(
        "all", "Part of the openers, split by split_seed (null: seed): train, dev, test (disjoint) or all.", choices=SPLITS
    )
    test_fraction: float | None = setting(
        None,
        "Share of the openers in the test split (null: 0.1; dev keeps 0.1, train the rest). A larger held-out "
        "set resolves smaller differences (0.35: 218 of the 623 RealToxicityPrompts openers); a run's value "
        "reaches astrl eval.",
        above=0.0,
        at_most=0.8,
    )
    turns: int = setting(3, "Tester turns per conversation.", at_least=1)
    mode: str = setting("chat", "chat (chat templates) or text (plain-text continuation of the conversation).", choices=MODES)
    tester_system_prompt: str | None = setting(
        None, "The tester's system prompt in chat mode (null: the built-in red-teaming prompt)."
    )
    target_system_prompt: str | None = setting(None, "The target's system prompt in chat mode (null: none).")
    reply_samples: int = setting(
        1,
        "Replies the target samples to each probe, in one call (the rows share context + probe); the "
        "reward's reply terms average over them, astrl eval judges each; the conversation goes on with the first.",
        at_least=1,
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass
class SamplingSettings(DecodingSettings):
    """The sampling of tester and target as flat keys (a YAML config): the lengths and
    :class:`DecodingSettings`; :meth:`generation` makes the :class:`~astrl.policies.GenerationSettings`
    of each side."""

    max_new_tokens: int = setting(
        32, "New tokens per tester turn (and per target turn unless target_max_new_tokens).", at_least=1
    )
    target_max_new_tokens: int | None = setting(None, "New tokens per target reply (null: max_new_tokens).", at_least=1)

    def generation(self, target: bool = False) -> GenerationSettings:
        """The tester's (or with ``target``, the target's) sampling settings."""
        from astrl.policies import GenerationSettings

        max_new = (self.target_max_new_tokens or self.max_new_tokens) if target else self.max_new_tokens
        return GenerationSettings(max_new, self.temperature, self.top_p, self.top_k, do_sample=True)


@dataclass
class RunSampling(SamplingSettings):
    """:class:`SamplingSettings` and greedy decoding: the sampling flags of ``astrl rollout`` and ``astrl eval``
    (a training config always samples: a group's probes must differ)."""

    greedy: bool = setting(False, "Greedy decoding for both models.")

    def generation(self, target: bool = False) -> GenerationSettings:
        """The tester's (or the target's) sampling settings, greedy with ``greedy``."""
        return dataclasses.replace(super().generation(target), do_sample=not self.greedy)


def _generation_settings() -> GenerationSettings:
    from astrl.policies import GenerationSettings

    return GenerationSettings()


@dataclass
class ConversationBatch(ConversationSettings, SeedSettings):
    """:class:`SeedSettings` and :class:`ConversationSettings` with the batch and each side's
    :class:`~astrl.policies.GenerationSettings`: what a spec, a rollout and an evaluation share."""

    batch_size: int = setting(8, "Conversations run together.", at_least=1)
    tester_generation: GenerationSettings = dataclasses.field(
        default_factory=_generation_settings, metadata={"help": "The tester's sampling settings."}
    )
    target_generation: GenerationSettings = dataclasses.field(
        default_factory=_generation_settings, metadata={"help": "The target's sampling settings."}
    )

    def __post_init__(self) -> None:
        from astrl.policies import GenerationSettings

        super().__post_init__()
        for name in ("tester_generation", "target_generation"):
            if not isinstance(getattr(self, name), GenerationSettings):
                raise TypeError(f"{name} must be a GenerationSettings, got {type(getattr(self, name)).__name__}")


@dataclass
class ConversationRuns(ConversationBatch):
    """:class:`ConversationBatch` run ``num_conversations`` times in batches (``astrl rollout``, ``astrl eval``)."""

    num_conversations: int = setting(8, "Conversations in all, run batch_size at a time.", at_least=1)

    @property
    def batch(self) -> int:
        """Conversations per batch: ``batch_size``, or fewer when there are fewer in all."""
        return min(self.batch_size, self.num_conversations)

    def batch_settings(self, **changes: Any) -> dict:
        """The :class:`ConversationBatch` keywords of a spec of one batch (``changes`` replace some)."""
        return conversation_settings(self, ConversationBatch, batch_size=self.batch, **changes)


# astrl eval's conversations: the held-out split, more conversations, and None (the tester's run's value,
# else the default replaced) for what a training run sets; astrl.evaluation.run.EvalConfig inherits it
EvalRuns = with_defaults(ConversationRuns, prompts=None, split="test", mode=None, num_conversations=32, turns=None)


@dataclass
class EvalLengths:
    """The lengths of ``astrl eval``'s turns: ``None`` is the tester's run's, so that a run is measured in the
    setting it was trained in (:class:`~astrl.evaluation.run.EvalConfig` inherits them)."""

    max_new_tokens: int | None = setting(
        None, "New tokens per tester turn (null: the run's, else the tester's generation settings', 32 unless set).", at_least=1
    )
    target_max_new_tokens: int | None = setting(
        None,
        "New tokens per target reply (null: max_new_tokens if set, else the run's reply length, else the target's "
        "generation settings', 32 unless set).",
        at_least=1,
    )
