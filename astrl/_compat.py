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
"""

from __future__ import annotations

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


def render_chats(tokenizer, chats: Sequence[Chat], *, add_generation_prompt: bool = True) -> list[str]:
    """Each chat as TorchRL's LLM wrappers render it for ``tokenizer``'s model (``History.apply_chat_template``).

    The wrappers choose the template by model family: their own ``chatml_format`` (no default system
    message) unless the model's template marks generations, so a tokenizer's own template can differ
    from what the model reads (SmolLM2's adds a default system prompt). Counting a prompt's tokens or
    locating a probe in it must use this rendering."""
    from torchrl.data.llm import History

    return [
        History.from_chats([list(c)]).apply_chat_template(
            tokenizer=tokenizer, add_generation_prompt=add_generation_prompt, tokenize=False
        )[0]
        for c in chats
    ]
