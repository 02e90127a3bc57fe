"""Workarounds for TorchRL 0.14.1 LLM-stack bugs, kept in one place.

Each helper names the upstream behaviour it works around; ``tests/test_compat.py`` holds a
test per workaround that fails if the workaround is removed while the bug remains.

1. ``History`` objects need ``tensordict.set_list_to_stack(True)`` to stack lists of messages.
2. A batch of histories with different message counts crashes ``History`` stacking and
   ``apply_chat_template`` (``zip() argument 2 is shorter``): pad the shorter conversations
   with ``"<none>"`` placeholder messages, which ``apply_chat_template`` drops.
3. ``History.from_chats`` keeps per-message python lists; converting back to plain chats
   needs ``tolist`` on each field, done by :func:`history_to_chats`.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensordict

PLACEHOLDER_ROLE = "<none>"

Chat = list[dict[str, str]]


def enable_list_to_stack() -> None:
    """Let ``History`` stack lists of messages (TorchRL 0.14.1 warns or fails without it)."""
    tensordict.set_list_to_stack(True).set()


def placeholder() -> dict[str, str]:
    """A message that ``History.apply_chat_template`` removes before templating."""
    return {"role": PLACEHOLDER_ROLE, "content": ""}


def pad_chats(chats: Sequence[Chat]) -> list[Chat]:
    """Give every conversation the same message count by inserting placeholders.

    Placeholders go right after a leading system message (or at the start), so the
    last messages, which the model reads last, stay aligned across the batch.
    """
    longest = max((len(c) for c in chats), default=0)
    padded = []
    for chat in chats:
        missing = longest - len(chat)
        head = 1 if chat and chat[0]["role"] == "system" else 0
        padded.append(list(chat[:head]) + [placeholder() for _ in range(missing)] + list(chat[head:]))
    return padded


def history_to_chats(history) -> list[Chat]:
    """Turn a batched ``History`` of shape ``(B, n)`` into ``B`` lists of message dicts."""
    roles = history.role
    contents = history.content
    roles = roles.tolist() if hasattr(roles, "tolist") else roles
    contents = contents.tolist() if hasattr(contents, "tolist") else contents
    return [
        [{"role": r, "content": c} for r, c in zip(role_row, content_row, strict=True)]
        for role_row, content_row in zip(roles, contents, strict=True)
    ]


def chats_to_history(chats: Sequence[Chat]):
    """Build a batched ``History`` from plain chats, padding them to a common length first."""
    from torchrl.data.llm import History

    enable_list_to_stack()
    return History.from_chats(pad_chats(chats))


def drop_placeholders(chat: Chat) -> Chat:
    """The real messages of a conversation."""
    return [m for m in chat if m["role"] != PLACEHOLDER_ROLE]
