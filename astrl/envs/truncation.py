"""Keep model inputs inside their context window: drop oldest turns, keep the system prompt.

Truncation is uniform across a batch (the same number of messages is dropped from every
conversation) so that all histories keep the same message count, which TorchRL's
``TransformersWrapper`` requires (see :mod:`astrl._compat`).
"""

from __future__ import annotations

from collections.abc import Sequence

from astrl._compat import Chat, render_chats


def count_chat_tokens(tokenizer, chats: Sequence[Chat], *, add_generation_prompt: bool = True) -> list[int]:
    """Token count of each conversation as the policy renders it (:func:`astrl._compat.render_chats`)."""
    texts = render_chats(tokenizer, chats, add_generation_prompt=add_generation_prompt)
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def clip_text_left(text: str, tokenizer, max_tokens: int) -> str:
    """The longest suffix of ``text`` that tokenizes to at most ``max_tokens`` tokens."""
    if max_tokens <= 0:
        return ""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    keep = max_tokens
    while len(ids) > max_tokens and keep > 0:
        text = tokenizer.decode(ids[-keep:], skip_special_tokens=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        keep -= max(1, len(ids) - max_tokens)
    return text if len(ids) <= max_tokens else ""


def fit_texts(texts: Sequence[str], tokenizer, budget: int, *, add_special_tokens: bool = True) -> list[str]:
    """Clip each text from the left so that it fits ``budget`` tokens (special tokens included)."""
    extra = len(tokenizer("", add_special_tokens=add_special_tokens)["input_ids"])
    lengths = [len(ids) for ids in tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]]
    return [t if n <= budget else clip_text_left(t, tokenizer, budget - extra) for t, n in zip(texts, lengths, strict=True)]


def fit_chats(chats: Sequence[Chat], tokenizer, budget: int, *, drop_unit: int = 2) -> list[Chat]:
    """Drop the oldest non-system messages (``drop_unit`` at a time, the same for the whole batch)
    until every templated conversation plus generation prompt fits in ``budget`` tokens.

    The last message is never dropped; if it alone is too long, its content is clipped from the left.
    """
    chats = [list(c) for c in chats]
    if not chats:
        return chats
    head = 1 if chats[0] and chats[0][0]["role"] == "system" else 0
    while True:
        lengths = count_chat_tokens(tokenizer, chats)
        if max(lengths) <= budget:
            return chats
        droppable = len(chats[0]) - head - 1
        if droppable <= 0:
            break
        n = min(drop_unit, droppable)
        chats = [c[:head] + c[head + n :] for c in chats]
    # Only the system prompt and one message are left: clip that message's content.
    clipped = []
    for chat, length in zip(chats, lengths, strict=True):
        if length > budget:
            last = chat[-1]
            overflow = length - budget
            content_len = len(tokenizer(last["content"], add_special_tokens=False)["input_ids"])
            chat = chat[:-1] + [
                {"role": last["role"], "content": clip_text_left(last["content"], tokenizer, content_len - overflow)}
            ]
        clipped.append(chat)
    if max(count_chat_tokens(tokenizer, clipped)) > budget:
        raise ValueError(
            f"context window too small: the chat template and system prompt alone exceed {budget} tokens; "
            "shorten the system prompt, lower max_new_tokens or use a model with a longer window"
        )
    return clipped
