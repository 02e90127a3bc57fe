"""Workarounds for TorchRL 0.14.1 LLM-stack behaviour, kept in one place.

``tests/test_compat.py`` checks both that each upstream behaviour is still there and that the
workaround handles it, so each workaround can go when upstream changes.

1. ``TransformersWrapper`` (history mode) crashes with ``zip() argument 2 is longer`` when the
   conversations of a batch have different message counts, and ``"<none>"`` placeholder padding
   makes it lose the generated reply when it parses the decoded text back into a ``History``.
   astrl therefore keeps every batch aligned: conversations advance in lockstep and
   :func:`astrl.envs.truncation.fit_chats` drops the same number of messages from each.
   :func:`chats_to_history` refuses a ragged batch with a clear error instead of a crash later.
2. ``TransformersWrapper`` text outputs keep special tokens and the padding that follows an early
   EOS; astrl decodes replies from the generated ids, cut at the first EOS
   (:func:`astrl.envs.transforms.clean_responses`).
3. ``GRPOLoss`` averages its KL to the reference, ``kl_approx`` and ``clip_fraction`` over every
   padded position, prompt included (and logs ``kl_approx`` as a plain log-ratio mean, which can be
   negative). :class:`astrl.training.grpo.ResponseGRPOLoss` keeps GRPOLoss's surrogate and takes
   these as means over the response tokens.

Other upstream behaviours are handled where they bite; ``tests/test_compat.py`` pins each of them
too, in a test named after it:

4. ``TransformersWrapper`` sets the first generated token's log-prob to 0: behaviour and reference
   log-probs are recomputed on the exact ids (:func:`astrl.lm_scoring.token_logprobs`).
5. vLLM weight sync: ``LocalLLMWrapper.update_weights`` does nothing, and ``vLLMUpdaterV2`` calls
   ``merge_and_unload()`` on the trainer's model, which takes its adapters away;
   :mod:`astrl.training.vllm_sync` merges beside the model and loads the weights into the engine.
6. ``MCAdvantage`` normalises over every turn of a group: GRPO uses
   :func:`astrl.training.grpo.turn_group_advantages` (per opener and turn index).
7. ``SFTLoss`` reads a chat ``History`` and its assistant masks: target hardening has its own NLL
   (:mod:`astrl.training.hardening`).
8. ``AdaptiveKLController.update`` takes penalties and divides them by its coefficient (0 gives NaN):
   :class:`astrl.rewards.kl.ClippedKLReward` feeds ``-kl_coef * KL`` and ``make_kl_controller``
   refuses an adaptive controller that starts at 0.
9. Private hooks: ``RayLLMCollector._collector`` / ``._next_remote`` (:mod:`astrl.distributed`),
   ``ChatEnv._reset_text`` (text-mode openers stay plain text, :class:`astrl.envs.redteam.RedTeamEnv`),
   ``ChatEnv._reset`` / ``_step`` and ``Transform._reset`` / ``_step`` (:mod:`astrl.sampling.tree`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

Chat = list[dict[str, str]]


def as_list(value) -> list:
    """A python list from a ``NonTensorStack`` / ``LinkedList`` of strings or a plain sequence."""
    return value.tolist() if hasattr(value, "tolist") else list(value)


def history_to_chats(history) -> list[Chat]:
    """Turn a batched ``History`` of shape ``(B, n)`` into ``B`` lists of message dicts."""
    roles, contents = as_list(history.role), as_list(history.content)
    return [
        [{"role": r, "content": c} for r, c in zip(role_row, content_row, strict=True)]
        for role_row, content_row in zip(roles, contents, strict=True)
    ]


def chats_to_history(chats: Sequence[Chat]):
    """Build a batched ``History`` from plain chats that all have the same message count."""
    from torchrl.data.llm import History

    counts = sorted({len(c) for c in chats})
    if len(counts) > 1:
        raise ValueError(
            f"conversations in a batch must have the same number of messages (got {counts}); "
            "TorchRL 0.14.1 TransformersWrapper cannot generate from a ragged History batch"
        )
    return History.from_chats([list(c) for c in chats])


class _TemplateProbe:
    """Stands in for a tokenizer in ``History.apply_chat_template``: records the template TorchRL picks."""

    def __init__(self, tokenizer) -> None:
        self.name_or_path = getattr(tokenizer, "name_or_path", "")  # what TorchRL reads to pick a template
        self.chat_template = getattr(tokenizer, "chat_template", None)
        self.picked: str | None = None

    def apply_chat_template(self, conversation=None, chat_template=None, **_) -> str:
        self.picked = chat_template
        return ""


_WRAPPER_TEMPLATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wrapper_chat_template(tokenizer) -> str:
    """The chat template TorchRL's LLM wrappers render ``tokenizer``'s model's chats with.

    They choose it by model family (``History.apply_chat_template``): their own ``chatml_format`` (no
    default system message) unless the model's template marks generations, so it can differ from the
    tokenizer's own (SmolLM2's adds a default system prompt that the model never reads). Found once
    per tokenizer, by letting TorchRL pick it for a stand-in tokenizer."""
    template = _WRAPPER_TEMPLATES.get(tokenizer)
    if template is None:
        from torchrl.data.llm import History

        probe = _TemplateProbe(tokenizer)
        History.from_chats([[{"role": "user", "content": "x"}]]).apply_chat_template(
            tokenizer=probe, add_generation_prompt=True, tokenize=False
        )
        if not isinstance(probe.picked, str):
            raise RuntimeError("TorchRL's History.apply_chat_template passed no chat template to the tokenizer")
        template = _WRAPPER_TEMPLATES[tokenizer] = probe.picked
    return template


def render_chats(tokenizer, chats: Sequence[Chat], *, add_generation_prompt: bool = True) -> list[str]:
    """Each chat as TorchRL's LLM wrappers render it for ``tokenizer``'s model (:func:`wrapper_chat_template`).

    Counting a prompt's tokens or locating a probe in it must use this rendering, not the tokenizer's
    own template."""
    template = wrapper_chat_template(tokenizer)
    return [
        tokenizer.apply_chat_template(
            list(c), chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        for c in chats
    ]
