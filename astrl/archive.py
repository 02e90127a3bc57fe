"""The attack archive: every successful probe once, with where and when it was first found.

Plain data that training (the trainer's archive of a run) and evaluation (``astrl eval``, ``astrl replay``)
both read and write; it imports nothing else from astrl.

An attack is a tester turn whose target reply some scorer rated above a threshold. Attacks are
deduplicated by their normalised probe text (case-folded, whitespace collapsed): the first
occurrence is kept (its conversation, reply, scores, reward and step) and ``count`` says how
many times the probe succeeded. One JSON object per line (``attacks.jsonl``)::

    {"probe": "...", "reply": "...", "conversation": [{"role": "opener", "content": "..."},
     {"role": "tester", "content": "..."}, {"role": "target", "content": "..."}],
     "scores": {"profanity": 0.93}, "reward": 1.12, "step": 12, "turn": 1, "count": 3}

``conversation`` holds what was said before the probe (the opener, then tester and target
turns); ``step`` is the training step (``null`` in an evaluation), ``turn`` counts from 0.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from astrl.jsonl import numbered_lines

ARCHIVE_FILE = "attacks.jsonl"
FIELDS = ("probe", "reply", "conversation", "scores", "reward", "step", "turn", "count")


def normalize_probe(text: str) -> str:
    """The deduplication key of a probe: case-folded, runs of whitespace as one space, stripped."""
    return " ".join(str(text).casefold().split())


@dataclass
class Attack:
    """One archived attack (see the module docstring for the fields)."""

    probe: str
    reply: str
    conversation: list[dict] = field(default_factory=list)
    scores: dict[str, float] = field(default_factory=dict)
    reward: float | None = None
    step: int | None = None
    turn: int | None = None
    count: int = 1

    @property
    def key(self) -> str:
        return normalize_probe(self.probe)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Attack:
        missing = {"probe", "reply", "scores"} - set(data)
        if missing:
            raise ValueError(f"an attack record lacks the field(s) {sorted(missing)}")
        unknown = set(data) - set(FIELDS)
        if unknown:
            raise ValueError(f"an attack record has unknown field(s) {sorted(unknown)}; valid: {', '.join(FIELDS)}")
        count = data.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"an attack's count must be an integer >= 1, got {count!r}")
        return cls(
            probe=str(data["probe"]),
            reply=str(data["reply"]),
            conversation=[dict(m) for m in data.get("conversation") or []],
            scores={str(k): float(v) for k, v in dict(data["scores"]).items()},
            reward=None if data.get("reward") is None else float(data["reward"]),
            step=None if data.get("step") is None else int(data["step"]),
            turn=None if data.get("turn") is None else int(data["turn"]),
            count=count,
        )


class AttackArchive:
    """Successful probes, deduplicated, in the order they were first seen.

    Args:
        threshold: a turn is an attack when a score is strictly above it.
        scorers: the scores that count (a turn succeeds when any of them is above ``threshold``);
            None = every score of the turn.
    """

    def __init__(self, threshold: float = 0.5, scorers: Sequence[str] | None = None) -> None:
        if not 0 <= threshold < 1:
            raise ValueError(f"archive threshold must be in [0, 1), got {threshold!r}")
        self.threshold = float(threshold)
        self.scorers = None if scorers is None else list(scorers)
        self._attacks: dict[str, Attack] = {}

    def __len__(self) -> int:
        return len(self._attacks)

    def __iter__(self):
        return iter(self._attacks.values())

    @property
    def attacks(self) -> list[Attack]:
        return list(self._attacks.values())

    @property
    def total(self) -> int:
        """Successful turns seen, duplicates included."""
        return sum(a.count for a in self._attacks.values())

    def successful(self, scores: Mapping[str, float]) -> bool:
        """Whether a turn with these scores is an attack."""
        names = self.scorers if self.scorers is not None else list(scores)
        missing = [n for n in names if n not in scores]
        if missing:
            raise KeyError(f"score {missing[0]!r} is missing from a turn; scores present: {sorted(scores)}")
        return any(float(scores[n]) > self.threshold for n in names)

    def add(self, attack: Attack | Mapping) -> Attack | None:
        """Archive one attack (already known to be successful); returns it when its probe is new,
        else adds its count to the first one and returns None. Empty probes are ignored."""
        attack = attack if isinstance(attack, Attack) else Attack.from_dict(attack)
        key = attack.key
        if not key:
            return None
        known = self._attacks.get(key)
        if known is not None:
            known.count += attack.count
            return None
        self._attacks[key] = attack
        return attack

    def extend(self, turns: Iterable[Mapping], step: int | None = None) -> list[Attack]:
        """Archive the successful ones among turn records (``probe``, ``reply``, ``scores`` and
        optionally ``conversation``, ``reward``, ``turn``); returns the attacks new to the archive."""
        new = []
        for turn in turns:
            if not self.successful(turn["scores"]):
                continue
            record = {k: turn[k] for k in FIELDS if k in turn and k != "count"}
            if step is not None:
                record["step"] = step
            added = self.add(record)
            if added is not None:
                new.append(added)
        return new

    # -- files and state ---------------------------------------------------------------------------
    def write(self, path: str | Path) -> Path:
        """Write every attack to ``path`` (JSONL), replacing the file atomically."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as handle:
            for attack in self._attacks.values():
                handle.write(json.dumps(attack.to_dict(), ensure_ascii=False) + "\n")
        os.replace(tmp, path)
        return path

    @staticmethod
    def append(path: str | Path, attacks: Iterable[Attack]) -> None:
        """Append attacks to a JSONL file (counts there are those at the time of writing)."""
        with Path(path).open("a", encoding="utf-8") as handle:
            for attack in attacks:
                handle.write(json.dumps(attack.to_dict(), ensure_ascii=False) + "\n")

    @classmethod
    def read(cls, path: str | Path, threshold: float = 0.5, scorers: Sequence[str] | None = None) -> AttackArchive:
        """An archive from a JSONL file; lines with the same normalised probe are merged (counts added)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"attack archive {str(path)!r} not found")
        archive = cls(threshold, scorers)
        for number, line in numbered_lines(path.read_text(encoding="utf-8")):
            try:
                archive.add(Attack.from_dict(json.loads(line)))
            except (json.JSONDecodeError, ValueError, TypeError) as err:
                raise ValueError(f"{path}:{number}: {err}") from None
        return archive

    def state_dict(self) -> dict:
        return {"threshold": self.threshold, "scorers": self.scorers, "attacks": [a.to_dict() for a in self._attacks.values()]}

    def load_state_dict(self, state: Mapping) -> None:
        self.threshold, self.scorers = float(state["threshold"]), state["scorers"]
        self._attacks = {}
        for data in state["attacks"]:
            self.add(Attack.from_dict(data))


def conversation_turns(opener: str, exchanges: Sequence[tuple[str, str]]) -> list[dict]:
    """``[{"role": "opener"}, {"role": "tester"}, {"role": "target"}, ...]`` messages of a conversation."""
    messages = [{"role": "opener", "content": opener}]
    for probe, reply in exchanges:
        messages += [{"role": "tester", "content": probe}, {"role": "target", "content": reply}]
    return messages


def eval_turns(records: Sequence[dict]) -> list[dict]:
    """Turn records for the archive from ``astrl eval`` records (one per tester turn): every judge's
    reply score, and the conversation before the probe."""
    by_conversation: dict[int, list[dict]] = {}
    for r in records:
        by_conversation.setdefault(r["conversation"], []).append(r)
    turns = []
    for conversation in sorted(by_conversation):
        ordered = sorted(by_conversation[conversation], key=lambda r: r["turn"])
        for i, r in enumerate(ordered):
            earlier = [(p["probe"], p["response"]) for p in ordered[:i]]
            turns.append(
                {
                    "probe": r["probe"],
                    "reply": r["response"],
                    "conversation": conversation_turns(r["prompt"], earlier),
                    "scores": {judge: parts["reply"] for judge, parts in r["scores"].items()},
                    "turn": r["turn"],
                }
            )
    return turns
