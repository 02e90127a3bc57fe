"""The records the store's writer accepts, checked and brought to one shape.

Turn records (:func:`turn_rows`), one per tester turn, in either shape astrl writes:

* evaluation (``astrl eval``'s ``conversations.jsonl``, :func:`astrl.evaluation.run.rollout_records`,
  ``astrl rollout``): ``{"conversation": 0, "turn": 0, "prompt": OPENER, "probe": ..., "response": ...,
  "probe_nll": 3.2, "scores": {JUDGE: {"reply": .., "probe": .., "combined": ..}}}``; ``scores`` may
  also map a judge to one number (the reply's score, as in rollout records), ``reward`` is kept;
* training (``Algorithm.turn_records``): ``{"probe": ..., "reply": ..., "conversation": [MESSAGES
  BEFORE THE PROBE], "scores": {SCORER: 0.93}, "reward": 1.1, "turn": 1}``.

An evaluation record's context (what was said before its probe) is rebuilt from the records of
the same conversation in the same call, so pass all turns of a conversation together. A training
record's conversation number is its position among the conversations of the call: a new one
starts whenever a record's ``turn`` is not above the previous record's (trajectory-contiguous
rollouts get their conversation index; tree nodes get distinct numbers, stable for the same tree
shape).

Replay rows (:func:`replay_rows`), the lines of ``astrl replay``'s ``replies.jsonl``:
``{"attack": 0, "target": LABEL, "sample": 0, "probe": ..., "reply": ...,
"scores": {JUDGE: {"reply": .., "probe": ..}}}``, optionally with the attack's ``conversation``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from numbers import Real

from astrl.archive import normalize_probe

SCORE_PARTS = ("reply", "probe", "combined")
ROLES = ("opener", "tester", "target")


@dataclass
class TurnRow:
    """One tester turn as the ``turns`` and ``scores`` tables hold it."""

    conversation: int
    turn: int
    probe: str
    reply: str
    scores: dict[str, dict[str, float]]
    context: list[dict] = field(default_factory=list)
    opener: str | None = None
    reward: float | None = None
    probe_nll: float | None = None

    @property
    def probe_key(self) -> str:
        return normalize_probe(self.probe)

    def successful(self, threshold: float, judges: Iterable[str] | None = None) -> bool:
        """Whether some judge (of ``judges``, None: any) scored the reply above ``threshold``; never for an empty probe."""
        names = self.scores if judges is None else [j for j in judges if j in self.scores]
        return bool(self.probe_key) and any(self.scores[j].get("reply", -math.inf) > threshold for j in names)


@dataclass
class ReplayRow:
    """One judge's verdict on one replayed reply."""

    item: int
    target: str
    sample: int
    probe: str
    reply: str
    judge: str
    score: float
    probe_score: float | None = None
    context: list[dict] = field(default_factory=list)


def _where(index: int) -> str:
    return f"record {index}"


def _int(value, name: str, where: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}: {name!r} must be an integer >= {low}, got {value!r}")
    return value


def _text(record: Mapping, names: tuple[str, ...], where: str) -> str:
    for name in names:
        if name in record:
            value = record[name]
            if not isinstance(value, str):
                raise ValueError(f"{where}: {name!r} must be a string, got {type(value).__name__}")
            return value
    raise ValueError(f"{where}: lacks the field {' or '.join(repr(n) for n in names)}")


def score_value(value, where: str) -> float:
    """A finite score as a float, or a ValueError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise ValueError(f"{where}: a score must be a finite number, got {value!r}")
    return float(value)


def optional_number(value, name: str, where: str) -> float | None:
    """A float, or None for None and non-finite values (a NaN reward is stored as NULL)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{where}: {name!r} must be a number or null, got {value!r}")
    value = float(value)
    return value if math.isfinite(value) else None


def _scores(value, where: str) -> dict[str, dict[str, float]]:
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"{where}: 'scores' must be a non-empty object of judge -> score, got {value!r}")
    out = {}
    for judge, parts in value.items():
        if not isinstance(judge, str) or not judge:
            raise ValueError(f"{where}: judge names are non-empty strings, got {judge!r}")
        if isinstance(parts, Mapping):
            unknown = sorted(set(parts) - set(SCORE_PARTS))
            if unknown:
                raise ValueError(
                    f"{where}: judge {judge!r} has unknown score part {unknown[0]!r}; valid: {', '.join(SCORE_PARTS)}"
                )
            out[judge] = {part: score_value(v, f"{where}, judge {judge!r} {part}") for part, v in parts.items()}
        else:
            out[judge] = {"reply": score_value(parts, f"{where}, judge {judge!r}")}
    return out


def messages(value, where: str) -> list[dict]:
    """A conversation (``[{"role": opener|tester|target, "content": str}, ...]``) checked and copied."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: 'conversation' must be a list of messages, got {type(value).__name__}")
    out = []
    for message in value:
        if not isinstance(message, Mapping) or not isinstance(message.get("content"), str) or message.get("role") not in ROLES:
            raise ValueError(f"{where}: each message needs a role ({', '.join(ROLES)}) and a string content, got {message!r}")
        out.append({"role": message["role"], "content": message["content"]})
    return out


def turn_rows(records: Iterable[Mapping]) -> list[TurnRow]:
    """Turn records of either shape (module docstring) as :class:`TurnRow` s, checked; a bad
    record raises a ValueError naming its position and field."""
    records = list(records)
    numbered = [isinstance(r, Mapping) and isinstance(r.get("conversation"), int) for r in records]
    if any(numbered) and not all(numbered):
        raise ValueError("records mix numbered conversations (evaluation records) with others: pass one shape per call")
    rows: list[TurnRow] = []
    previous_turn = None
    conversation = -1
    for index, record in enumerate(records):
        where = _where(index)
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: expected an object, got {type(record).__name__}")
        turn = _int(record.get("turn", 0), "turn", where)
        context: list[dict] = []
        if numbered[index]:
            conversation = _int(record["conversation"], "conversation", where)
        else:
            if previous_turn is None or turn <= previous_turn:
                conversation += 1
            previous_turn = turn
            if record.get("conversation") is not None:
                context = messages(record["conversation"], where)
        opener = record.get("prompt")
        if opener is not None and not isinstance(opener, str):
            raise ValueError(f"{where}: 'prompt' must be a string, got {type(opener).__name__}")
        if opener is None and context and context[0]["role"] == "opener":
            opener = context[0]["content"]
        rows.append(
            TurnRow(
                conversation=conversation,
                turn=turn,
                probe=_text(record, ("probe",), where),
                reply=_text(record, ("reply", "response"), where),
                scores=_scores(record.get("scores"), where),
                context=context,
                opener=opener,
                reward=optional_number(record.get("reward"), "reward", where),
                probe_nll=optional_number(record.get("probe_nll"), "probe_nll", where),
            )
        )
    seen: dict[tuple[int, int], int] = {}
    for index, row in enumerate(rows):
        key = (row.conversation, row.turn)
        if key in seen:
            raise ValueError(f"{_where(index)}: conversation {key[0]} turn {key[1]} is also record {seen[key]}")
        seen[key] = index
    if all(numbered):
        _rebuild_contexts(rows)
    return rows


def _rebuild_contexts(rows: list[TurnRow]) -> None:
    """An evaluation record's context: its opener, then the earlier turns of its conversation in this call."""
    by_conversation: dict[int, list[TurnRow]] = {}
    for row in rows:
        by_conversation.setdefault(row.conversation, []).append(row)
    for group in by_conversation.values():
        group.sort(key=lambda r: r.turn)
        for i, row in enumerate(group):
            context = [] if row.opener is None else [{"role": "opener", "content": row.opener}]
            for earlier in group[:i]:
                context += [{"role": "tester", "content": earlier.probe}, {"role": "target", "content": earlier.reply}]
            row.context = context


def replay_rows(records: Iterable[Mapping]) -> list[ReplayRow]:
    """Lines of ``replies.jsonl`` (module docstring) as one :class:`ReplayRow` per judge, checked."""
    rows = []
    seen: set[tuple] = set()
    for index, record in enumerate(records):
        where = _where(index)
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: expected an object, got {type(record).__name__}")
        item = _int(record.get("attack"), "attack", where)
        sample = _int(record.get("sample", 0), "sample", where)
        target = _text(record, ("target",), where)
        probe, reply = _text(record, ("probe",), where), _text(record, ("reply",), where)
        if not normalize_probe(probe):
            raise ValueError(f"{where}: the probe is empty")
        context = messages(record["conversation"], where) if record.get("conversation") is not None else []
        key = (item, target, sample)
        if key in seen:
            raise ValueError(f"{where}: attack {item}, target {target!r}, sample {sample} is given twice")
        seen.add(key)
        for judge, parts in _scores(record.get("scores"), where).items():
            if "reply" not in parts:
                raise ValueError(f"{where}: judge {judge!r} has no reply score")
            rows.append(ReplayRow(item, target, sample, probe, reply, judge, parts["reply"], parts.get("probe"), context))
    return rows
