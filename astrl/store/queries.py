"""Reading the store: attacks across runs under a filter, and the runs with their headline numbers.

An attack's *evidence* is every judged reply to its probe that a filter lets through: a turn of a
run (its reply score under a judge, ``scores.what = 'reply'``) or a replayed reply (``replays``),
whose score is above the threshold. :func:`find_attacks` groups the evidence by normalised probe
and reports each attack's best piece (highest score; a turn before a replay; then the oldest),
how many turns and replies matched, and in which runs, on which targets and under which judges.
The archive columns (``count``, ``first_seen``, ``last_seen``) are those the writers recorded at
their own threshold, whatever the query's.

Every statement is a fixed string: filters are parameters (``:judge IS NULL OR ...``), and the text
search compares normalised probes with ``instr``, so ``%``, ``_`` and quotes are plain characters.
JSON columns are read with :func:`json.loads` only.
"""

from __future__ import annotations

import json
import math
import sqlite3
from dataclasses import asdict, dataclass, field
from datetime import datetime

from astrl.archive import normalize_probe
from astrl.store.database import StoreError

_EVIDENCE = """
WITH evidence AS (
    SELECT t.probe_key AS key, t.probe AS probe, 'turn' AS source, t.id AS turn_id, NULL AS replay_id,
           't' || t.id AS item, t.run_id AS run_id, r.target AS target, s.judge AS judge, s.value AS score,
           p.value AS probe_score, t.reply AS reply, t.context AS context, t.step AS step, t.turn AS turn,
           t.reward AS reward
    FROM scores AS s
    JOIN turns AS t ON t.id = s.turn_id
    JOIN runs AS r ON r.id = t.run_id
    LEFT JOIN scores AS p ON p.turn_id = s.turn_id AND p.judge = s.judge AND p.what = 'probe'
    WHERE s.what = 'reply' AND s.value > :threshold AND t.probe_key != ''
      AND (:judge IS NULL OR s.judge = :judge)
      AND (:elicited = 0 OR (p.value IS NOT NULL AND p.value <= :threshold))
      AND (:target IS NULL OR r.target = :target)
      AND (:run IS NULL OR t.run_id = :run)
      AND (:text IS NULL OR instr(t.probe_key, :text) > 0)
    UNION ALL
    SELECT a.key, a.probe, 'replay', NULL, x.id,
           'r' || x.run_id || char(31) || x.item || char(31) || x.target || char(31) || x.sample, x.run_id, x.target,
           x.judge, x.score, x.probe_score, x.reply, x.context, NULL, NULL, NULL
    FROM replays AS x
    JOIN attacks AS a ON a.id = x.attack_id
    WHERE x.score > :threshold
      AND (:judge IS NULL OR x.judge = :judge)
      AND (:elicited = 0 OR (x.probe_score IS NOT NULL AND x.probe_score <= :threshold))
      AND (:target IS NULL OR x.target = :target)
      AND (:run IS NULL OR x.run_id = :run)
      AND (:text IS NULL OR instr(a.key, :text) > 0)
),
ranked AS (
    SELECT *, row_number() OVER (PARTITION BY key ORDER BY score DESC, source DESC, turn_id, replay_id) AS rank
    FROM evidence
),
summary AS (
    SELECT key, count(DISTINCT item) AS matches, json_group_array(DISTINCT run_id) AS runs,
           json_group_array(DISTINCT target) AS targets, json_group_array(DISTINCT judge) AS judges
    FROM evidence
    GROUP BY key
)
SELECT b.key, coalesce(a.probe, b.probe), b.source, b.turn_id, b.replay_id, b.run_id, b.target, b.judge, b.score,
       b.probe_score, b.reply, b.context, b.step, b.turn, b.reward, s.matches, s.runs, s.targets, s.judges,
       coalesce(a.count, 0), a.first_seen, a.last_seen
FROM ranked AS b
JOIN summary AS s ON s.key = b.key
LEFT JOIN attacks AS a ON a.key = b.key
WHERE b.rank = 1
ORDER BY b.score DESC, b.key
LIMIT :limit
"""
# "+what": look the turn up by the primary key; SQLite would otherwise scan the scores_by_value index
_TURN_SCORES = "SELECT judge, value FROM scores WHERE turn_id = ? AND +what = 'reply' ORDER BY judge"
_REPLAY_SCORES = (
    "SELECT o.judge, o.score FROM replays AS x JOIN replays AS o ON o.run_id = x.run_id AND o.item = x.item "
    "AND o.target = x.target AND o.sample = x.sample WHERE x.id = ? ORDER BY o.judge"
)


@dataclass
class FoundAttack:
    """One attack that a filter matched, with its best piece of evidence.

    ``key`` is the normalised probe and ``probe`` its text as first archived; ``score``, ``judge``,
    ``probe_score`` (same judge), ``reply``, ``target``, ``run``, ``source`` (``turn`` or ``replay``),
    ``step``, ``turn``, ``reward``, ``context`` (the messages before the probe) and ``scores`` (the
    reply's score under every judge) belong to the best piece; ``matches`` counts the matching turns
    and replayed replies; ``runs``, ``targets`` and ``judges`` list where they matched; ``count``,
    ``first_seen`` and ``last_seen`` are the archive's (successful turns across all runs).
    """

    key: str
    probe: str
    score: float
    judge: str
    reply: str
    target: str | None
    run: str
    source: str
    probe_score: float | None = None
    step: int | None = None
    turn: int | None = None
    reward: float | None = None
    context: list[dict] = field(default_factory=list)
    scores: dict[str, float] = field(default_factory=dict)
    matches: int = 1
    runs: list[str] = field(default_factory=list)
    targets: list[str | None] = field(default_factory=list)
    judges: list[str] = field(default_factory=list)
    count: int = 0
    first_seen: str | None = None
    last_seen: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunSummary:
    """A run with its counts: ``turns`` stored, distinct training ``steps`` among them, replayed
    ``replies``; ``seconds`` from start to end (None while running); ``elicited_asr`` per judge as
    its metrics give it (:func:`elicited_asr`)."""

    id: str
    kind: str
    folder: str | None
    config: dict | None
    astrl_version: str
    git_commit: str | None
    seed: int | None
    tester: str | None
    target: str | None
    started_at: str
    ended_at: str | None
    status: str
    metrics: dict | None
    turns: int = 0
    steps: int = 0
    replies: int = 0
    seconds: float | None = None
    elicited_asr: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def from_json(text: str | None, where: str):
    """A JSON column's value (None for NULL); a value that is not JSON raises a :class:`StoreError` naming ``where``."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        raise StoreError(f"{where} is not valid JSON: the store is damaged") from None


def check_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        raise ValueError(f"threshold must be in [0, 1), got {threshold!r}")
    return float(threshold)


def check_limit(limit: int | None) -> int | None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an integer >= 1, got {limit!r}")
    return limit


def find_attacks(
    connection: sqlite3.Connection,
    *,
    judge: str | None = None,
    threshold: float = 0.5,
    elicited_only: bool = False,
    target: str | None = None,
    run: str | None = None,
    text: str | None = None,
    limit: int | None = None,
) -> list[FoundAttack]:
    """Attacks whose evidence passes the filters, best score first (ties: by normalised probe).

    ``judge``: only that judge's scores (None: any judge); ``threshold``: a reply scored above it
    counts; ``elicited_only``: and the probe itself scored at most ``threshold`` by the same judge
    (turns without a probe score, e.g. training turns, never count then); ``target``: the run's
    target (turns) or the replay's target label; ``run``: a run id; ``text``: a substring of the
    probe, compared after :func:`~astrl.archive.normalize_probe` (case and runs of whitespace
    ignored); ``limit``: at most that many attacks.
    """
    threshold, limit = check_threshold(threshold), check_limit(limit)
    params = {
        "threshold": threshold,
        "judge": judge,
        "elicited": 1 if elicited_only else 0,
        "target": target,
        "run": run,
        "text": None if text is None else normalize_probe(text),
        "limit": -1 if limit is None else limit,
    }
    found = []
    for row in connection.execute(_EVIDENCE, params).fetchall():
        (key, probe, source, turn_id, replay_id, run_id, target_, judge_, score, probe_score, reply, context, step, turn,
         reward, matches, runs, targets, judges, count, first_seen, last_seen) = row  # fmt: skip
        where = f"attack {key!r}"
        if source == "turn":
            scores = dict(connection.execute(_TURN_SCORES, (turn_id,)))
        else:
            scores = dict(connection.execute(_REPLAY_SCORES, (replay_id,)))
        found.append(
            FoundAttack(
                key=key,
                probe=probe,
                score=score,
                judge=judge_,
                reply=reply,
                target=target_,
                run=run_id,
                source=source,
                probe_score=probe_score,
                step=step,
                turn=turn,
                reward=reward,
                context=from_json(context, f"the context of {where}") or [],
                scores=scores,
                matches=matches,
                runs=sorted(from_json(runs, where)),
                targets=sorted(from_json(targets, where), key=lambda t: (t is None, t or "")),
                judges=sorted(from_json(judges, where)),
                count=count,
                first_seen=first_seen,
                last_seen=last_seen,
            )
        )
    return found


def parse_time(text: str | None) -> datetime | None:
    """A stored timestamp (ISO 8601, UTC) as a datetime; None for NULL or an unreadable one."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def _rate(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def elicited_asr(metrics) -> dict[str, float]:
    """Elicited ASR per judge from a run's metrics: ``judges.J.elicited_asr`` (``astrl eval``'s
    metrics.json), else ``after.judges.J.elicited_asr`` (the demo's trained side), else
    ``transfer.TARGET.J.elicited_any_rate`` as ``"J on TARGET"`` (``astrl replay``'s transfer.json)."""
    if not isinstance(metrics, dict):
        return {}
    for source in (metrics, metrics.get("after")):
        judges = source.get("judges") if isinstance(source, dict) else None
        if isinstance(judges, dict):
            out = {j: _rate(v.get("elicited_asr")) for j, v in judges.items() if isinstance(v, dict)}
            out = {j: v for j, v in out.items() if v is not None}
            if out:
                return out
    transfer = metrics.get("transfer")
    out = {}
    if isinstance(transfer, dict):
        for target, per_judge in transfer.items():
            for judge, cell in per_judge.items() if isinstance(per_judge, dict) else ():
                value = _rate(cell.get("elicited_any_rate")) if isinstance(cell, dict) else None
                if value is not None:
                    out[f"{judge} on {target}"] = value
    return out


_RUNS = """
SELECT r.id, r.kind, r.folder, r.config, r.astrl_version, r.git_commit, r.seed, r.tester, r.target, r.started_at,
       r.ended_at, r.status, r.metrics,
       (SELECT count(*) FROM turns AS t WHERE t.run_id = r.id),
       (SELECT count(DISTINCT t.step) FROM turns AS t WHERE t.run_id = r.id),
       (SELECT count(DISTINCT x.item || char(31) || x.target || char(31) || x.sample) FROM replays AS x WHERE x.run_id = r.id)
FROM runs AS r
WHERE :run IS NULL OR r.id = :run
ORDER BY r.started_at, r.rowid
"""


def list_runs(connection: sqlite3.Connection, run: str | None = None) -> list[RunSummary]:
    """Every run (or the one with id ``run``), oldest first."""
    out = []
    for row in connection.execute(_RUNS, {"run": run}).fetchall():
        (run_id, kind, folder, config, version, commit, seed, tester, target, started, ended, status, metrics, turns,
         steps, replies) = row  # fmt: skip
        metrics = from_json(metrics, f"the metrics of run {run_id!r}")
        start, end = parse_time(started), parse_time(ended)
        out.append(
            RunSummary(
                id=run_id,
                kind=kind,
                folder=folder,
                config=from_json(config, f"the config of run {run_id!r}"),
                astrl_version=version,
                git_commit=commit,
                seed=seed,
                tester=tester,
                target=target,
                started_at=started,
                ended_at=ended,
                status=status,
                metrics=metrics,
                turns=turns,
                steps=steps,
                replies=replies,
                seconds=(end - start).total_seconds() if start and end else None,
                elicited_asr=elicited_asr(metrics),
            )
        )
    return out


def resolve_run(connection: sqlite3.Connection, text: str) -> str:
    """The run id that ``text`` is, or the only one it begins; else a :class:`StoreError` naming it."""
    if connection.execute("SELECT 1 FROM runs WHERE id = ?", (text,)).fetchone():
        return text
    found = [r for (r,) in connection.execute("SELECT id FROM runs WHERE substr(id, 1, length(?)) = ? LIMIT 3", (text, text))]
    if not text or not found:
        raise StoreError(f"no run {text!r} in the store (see: astrl runs)")
    if len(found) > 1:
        raise StoreError(f"run {text!r} is ambiguous: it begins {', '.join(found[:2])}, ...; give more of the id")
    return found[0]
