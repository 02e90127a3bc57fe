"""An exported tester (``astrl export``) as a PyRIT prompt target, for the adversarial chat of a
PyRIT red-teaming attack (PyRIT 1.1.0, ``pip install -c constraints.txt -e ".[pyrit]"``).

PyRIT's own ``HuggingFaceChatTarget`` loads the folder offline, but a red-teaming attack reads every
adversarial-chat reply as a JSON object with a ``next_message`` field (PyRIT's ``adversarial_chat``
schema) and an astrl tester writes plain text. :class:`TesterChatTarget` runs the tester on the
conversation as it was trained to read it and, when PyRIT asks for JSON, puts the probe it writes in
``next_message``. Nothing in astrl imports this module; it needs ``pyrit`` only when imported.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from astrl.evaluation.tester import EXPORT_SETTINGS

try:
    from pyrit.exceptions import EmptyResponseException, pyrit_target_retry
    from pyrit.models import ComponentIdentifier, Message, construct_response_from_request
    from pyrit.prompt_target import PromptTarget, TargetCapabilities, TargetConfiguration
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError(f"astrl.training.pyrit_target needs PyRIT ({err}): pip install -c constraints.txt -e '.[pyrit]'") from err

NEXT_MESSAGE = "next_message"  # the field of PyRIT's adversarial_chat schema that the attack sends on


def read_export(folder: str | Path) -> dict:
    """The settings ``astrl export`` wrote to ``FOLDER/astrl_tester.json``; a clear error for any other folder."""
    path = Path(folder).expanduser() / EXPORT_SETTINGS
    if not path.is_file():
        raise ValueError(f"{str(Path(folder))!r} is not an 'astrl export' folder (no {EXPORT_SETTINGS})")
    settings = json.loads(path.read_text(encoding="utf-8"))
    if settings.get("mode") not in ("chat", "text"):
        raise ValueError(f"{str(path)!r}: mode {settings.get('mode')!r} is neither 'chat' nor 'text'")
    return settings


def probe_of(text: str) -> str:
    """The probe in one of the tester's stored replies: its ``next_message`` when the reply is the JSON
    object this target writes for PyRIT, else the text itself."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return str(value[NEXT_MESSAGE]) if isinstance(value, dict) and NEXT_MESSAGE in value else text


def tester_messages(conversation: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    """The conversation as the tester reads it in chat mode: its own system prompt instead of any
    other (PyRIT sets one that asks for JSON and names the objective), the other side's turns as
    ``user``, its probes as ``assistant`` (as in training, where the roles are swapped)."""
    turns = [{"role": m["role"], "content": probe_of(m["content"]) if m["role"] == "assistant" else m["content"]}
             for m in conversation if m["role"] in ("user", "assistant")]  # fmt: skip
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + turns


def json_reply(probe: str, schema: dict | None) -> str:
    """A reply in PyRIT's adversarial-chat JSON: the probe as ``next_message``, every other field the
    schema requires empty (the tester writes no rationale)."""
    required = (schema or {}).get("required", [])
    return json.dumps({key: "" for key in required} | {NEXT_MESSAGE: probe}, ensure_ascii=False)


class TesterChatTarget(PromptTarget):
    """A PyRIT prompt target that runs an ``astrl export`` folder with transformers, offline.

    Chat mode: the tester reads the conversation through its chat template with its own system
    prompt (``astrl_tester.json``), the other side's messages as user turns and its earlier probes as
    its own; text mode: ``document_start`` and the conversation's texts joined, as astrl's text mode
    grows its state. It samples with the folder's ``generation_config.json`` (the settings it was
    trained with); ``generation`` overrides any of them (``{"do_sample": False}`` for greedy).
    The oldest turns are dropped when the conversation outgrows the model's window.

    Args:
        folder: the exported folder.
        device: where the model runs (``"cpu"``, ``"cuda"``).
        generation: ``generate`` keyword arguments that replace the folder's settings.
        max_requests_per_minute: PyRIT's rate limit (None: none).
    """

    _DEFAULT_CONFIGURATION = TargetConfiguration(
        capabilities=TargetCapabilities(
            supports_multi_turn=True,
            supports_editable_history=True,
            supports_system_prompt=True,
            supports_json_output=True,
            supports_json_schema=True,  # met by construction: else PyRIT writes the schema into the message the tester reads
        )
    )

    def __init__(
        self,
        *,
        folder: str | Path,
        device: str = "cpu",
        generation: dict[str, Any] | None = None,
        max_requests_per_minute: int | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.folder = Path(folder).expanduser().resolve()
        self.settings = read_export(self.folder)
        super().__init__(max_requests_per_minute=max_requests_per_minute, model_name=self.folder.name)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(self.folder, local_files_only=True).to(device).eval()
        self.device = device
        self.generation = dict(generation or {})
        self.max_new_tokens = self.generation.get("max_new_tokens", self.model.generation_config.max_new_tokens)

    def _build_identifier(self) -> ComponentIdentifier:
        return self._create_identifier(params={"mode": self.settings["mode"], "generation": json.dumps(self.generation)})

    # -- what the tester reads -------------------------------------------------------------------------

    def prompt_text(self, conversation: list[dict[str, str]]) -> str:
        """The text the tester continues for ``conversation`` (role/content dicts, oldest first)."""
        if self.settings["mode"] == "chat":
            messages = tester_messages(conversation, self.settings["system_prompt"])
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        texts = [probe_of(m["content"]) if m["role"] == "assistant" else m["content"] for m in conversation
                 if m["role"] in ("user", "assistant")]  # fmt: skip
        return self.settings["document_start"] + "".join(texts)

    def _fitted_ids(self, conversation: list[dict[str, str]]):
        """Token ids of :meth:`prompt_text`, the oldest turns dropped (two at a time) until they leave
        ``max_new_tokens`` free in the model's window; the last turn alone is clipped from the left."""
        window = getattr(self.model.config, "max_position_embeddings", None) or self.tokenizer.model_max_length
        budget = window - self.max_new_tokens
        if budget <= 0:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} leaves no room in the tester's window of {window}")
        head = [m for m in conversation if m["role"] == "system"]
        turns = [m for m in conversation if m["role"] != "system"]
        while True:
            ids = self.tokenizer(self.prompt_text(head + turns), add_special_tokens=self.settings["mode"] == "text")
            ids = ids["input_ids"]
            if len(ids) <= budget or len(turns) <= 1:
                return ids[-budget:]
            turns = turns[2:] if len(turns) > 2 else turns[-1:]

    def generate(self, conversation: list[dict[str, str]]) -> str:
        """The tester's next probe for ``conversation``: new tokens only, special tokens left out."""
        import torch

        ids = torch.tensor([self._fitted_ids(conversation)], device=self.device)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **self.generation)
        return self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()

    # -- PyRIT ----------------------------------------------------------------------------------------

    @pyrit_target_retry  # as PyRIT's own targets: an empty reply is sampled again
    async def _send_prompt_to_target_async(self, *, normalized_conversation: list[Message]) -> list[Message]:
        request = normalized_conversation[-1].message_pieces[0]
        conversation = [
            {"role": m.message_pieces[0].api_role, "content": m.message_pieces[0].converted_value or ""}
            for m in normalized_conversation
        ]
        probe = await asyncio.to_thread(self.generate, conversation)
        if not probe:
            raise EmptyResponseException(message="the tester wrote no text (only special tokens or whitespace)")
        json_config = self._get_json_response_config(message_piece=request)
        text = json_reply(probe, json_config.json_schema) if json_config.enabled else probe
        return [construct_response_from_request(request=request, response_text_pieces=[text])]
