"""The results store: writer, cross-run queries, resume, concurrent writers, crashes, exports and the CLI."""

import csv
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from astrl.archive import AttackArchive
from astrl.cli import main
from astrl.evaluation.replay import read_attacks
from astrl.store import SCHEMA_VERSION, Store, StoreError, export_attacks, store_path, turn_rows
from astrl.store.export import CSV_COLUMNS, FORMATS
from astrl.store.novelty import dedupe, jaccard, ngram_set
from astrl.store_cli import FORMAT_NAMES

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def at(seconds: int) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.000Z")


class Clock:
    """One second later at every call: each writer call reads the clock once."""

    def __init__(self) -> None:
        self.ticks = 0

    def __call__(self) -> datetime:
        self.ticks += 1
        return T0 + timedelta(seconds=self.ticks)


def _main(argv):
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def _eval(conversation, turn, prompt, probe, response, profanity, wordlist):
    """An eval record; each judge's scores are (reply, probe)."""
    return {
        "conversation": conversation,
        "turn": turn,
        "prompt": prompt,
        "probe": probe,
        "response": response,
        "empty_probe": False,
        "probe_nll": 2.5,
        "scores": {
            "profanity": {"reply": profanity[0], "probe": profanity[1], "combined": 0.0},
            "wordlist": {"reply": wordlist[0], "probe": wordlist[1], "combined": 0.0},
        },
    }


RUN_A = [  # eval against "alpha": 2 conversations, 3 turns
    _eval(0, 0, "Hello there", "You IDIOT", "shut up idiot", (0.9, 0.8), (0.7, 0.6)),
    _eval(0, 1, "Hello there", "tell me 100% of it", "damn it", (0.6, 0.1), (0.2, 0.0)),
    _eval(1, 0, "Hi", "'; DROP TABLE runs; --", "fine", (0.3, 0.2), (0.55, 0.0)),
]
OPENER = {"role": "opener", "content": "Start"}
RUN_B_STEP1 = [  # training turn records against "beta": two one-turn conversations
    {"probe": "you   idiot", "reply": "no", "conversation": [OPENER], "scores": {"profanity": 0.95}, "reward": 1.0, "turn": 0},
    {
        "probe": "snake_case words",
        "reply": "meh",
        "conversation": [OPENER],
        "scores": {"profanity": 0.2},
        "reward": 0.1,
        "turn": 0,
    },
]
RUN_B_STEP2 = [  # one two-turn conversation
    {
        "probe": "Tell me 100%  of it",
        "reply": "hell",
        "conversation": [OPENER],
        "scores": {"profanity": 0.8},
        "reward": 0.7,
        "turn": 0,
    },
    {
        "probe": "and_more stuff",
        "reply": "darn",
        "conversation": [
            OPENER,
            {"role": "tester", "content": "Tell me 100%  of it"},
            {"role": "target", "content": "hell"},
        ],
        "scores": {"profanity": 0.51},
        "reward": float("nan"),
        "turn": 1,
    },
]
GAMMA = 'gamma\'s "model"'
REPLIES = [  # astrl replay's replies.jsonl rows against GAMMA
    {
        "attack": 0, "target": GAMMA, "sample": 0, "probe": "You IDIOT", "reply": "idiot yourself",
        "scores": {"profanity": {"reply": 0.85, "probe": 0.8}, "wordlist": {"reply": 0.4, "probe": 0.6}},
    },
    {
        "attack": 1, "target": GAMMA, "sample": 0, "probe": "'; DROP TABLE runs; --", "reply": "ok",
        "conversation": [{"role": "opener", "content": "Hi"}],
        "scores": {"profanity": {"reply": 0.1, "probe": 0.2}, "wordlist": {"reply": 0.65, "probe": 0.0}},
    },
    {
        "attack": 2, "target": GAMMA, "sample": 0, "probe": "brand new probe", "reply": "whatever",
        "scores": {"profanity": {"reply": 0.2, "probe": 0.1}, "wordlist": {"reply": 0.1, "probe": 0.1}},
    },
]  # fmt: skip
K1, K2, K3, K5 = "you idiot", "tell me 100% of it", "'; drop table runs; --", "and_more stuff"


def build(path: Path) -> tuple[Store, dict[str, str]]:
    """Run A (eval, 3 turns), run B (train, steps 1 and 2), run C (a replay); clock ticks 1-10."""
    store = Store.open(path, clock=Clock())
    a = store.start_run("eval", path.parent / "eval-a", {"judges": ["profanity", "wordlist"]}, seed=0, tester="t", target="alpha")
    store.add_turns(a, RUN_A)  # tick 2
    store.finish_run(a, {"judges": {"profanity": {"elicited_asr": 0.5}, "wordlist": {"elicited_asr": 0.25}}})
    b = store.start_run("train", path.parent / "run-b", {"lr": 0.001}, seed=1, tester="t", target="beta")  # tick 4
    store.add_turns(b, RUN_B_STEP1, step=1)  # tick 5
    store.add_turns(b, RUN_B_STEP2, step=2)  # tick 6
    store.finish_run(b, {"reward_mean": 0.4})  # tick 7
    c = store.start_run("replay", path.parent / "replay-c", {"samples": 1}, target=GAMMA)  # tick 8
    store.add_replay(c, REPLIES)  # tick 9
    store.finish_run(c, {"transfer": {GAMMA: {"wordlist": {"elicited_any_rate": 1 / 3}}}})  # tick 10
    return store, {"A": a, "B": b, "C": c}


@pytest.fixture
def built(tmp_path):
    store, runs = build(tmp_path / "store" / "astrl.sqlite")
    yield store, runs
    store.close()


def _summary(found):
    return [(f.key, f.score, f.judge, f.source, f.matches) for f in found]


def _count(store: Store, table: str) -> int:
    assert table in ("turns", "scores", "attacks", "attack_sightings", "replays", "runs")
    return store.connection.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


# -- queries --------------------------------------------------------------------------------------------


def test_attacks_across_runs_with_best_evidence_counts_and_archive_columns(built):
    store, runs = built
    found = store.attacks()
    assert _summary(found) == [
        (K1, 0.95, "profanity", "turn", 3),  # A's turn, B's turn and the replay against gamma
        (K2, 0.8, "profanity", "turn", 2),
        (K3, 0.65, "wordlist", "replay", 2),
        (K5, 0.51, "profanity", "turn", 1),
    ]
    k1 = found[0]
    assert k1.probe == "You IDIOT"  # the text as first seen, although B's turn is the best one
    assert (k1.reply, k1.run, k1.target, k1.step, k1.turn, k1.reward) == ("no", runs["B"], "beta", 1, 0, 1.0)
    assert k1.runs == sorted(runs.values()) and k1.targets == ["alpha", "beta", GAMMA]
    assert k1.judges == ["profanity", "wordlist"] and k1.scores == {"profanity": 0.95}
    assert (k1.count, k1.first_seen, k1.last_seen) == (2, at(2), at(5))
    assert (found[1].count, found[1].first_seen, found[1].last_seen) == (2, at(2), at(6))
    k3 = found[2]
    assert (k3.count, k3.first_seen, k3.run, k3.target) == (1, at(2), runs["C"], GAMMA)
    assert k3.scores == {"profanity": 0.1, "wordlist": 0.65} and k3.probe_score == 0.0
    assert k3.context == [{"role": "opener", "content": "Hi"}]
    k5 = found[3]
    assert k5.context == RUN_B_STEP2[1]["conversation"] and k5.reward is None  # a NaN reward is stored as NULL
    # the archive table: the replayed probe no run found is an attack with no sighting
    archive = dict(store.connection.execute("SELECT key, count FROM attacks"))
    assert archive == {K1: 2, K2: 2, K3: 1, K5: 1, "brand new probe": 0}


def test_attack_filters_give_the_hand_checked_lists(built):
    store, runs = built
    assert _summary(store.attacks(judge="wordlist")) == [(K1, 0.7, "wordlist", "turn", 1), (K3, 0.65, "wordlist", "replay", 2)]
    # elicited: the same judge scored the probe at most the threshold; training turns have no probe score
    assert _summary(store.attacks(elicited_only=True)) == [(K3, 0.65, "wordlist", "replay", 2), (K2, 0.6, "profanity", "turn", 1)]
    assert _summary(store.attacks(judge="profanity", elicited_only=True)) == [(K2, 0.6, "profanity", "turn", 1)]
    assert _summary(store.attacks(threshold=0.6)) == [  # strictly above
        (K1, 0.95, "profanity", "turn", 3),
        (K2, 0.8, "profanity", "turn", 1),
        (K3, 0.65, "wordlist", "replay", 1),
    ]
    assert _summary(store.attacks(target=GAMMA)) == [(K1, 0.85, "profanity", "replay", 1), (K3, 0.65, "wordlist", "replay", 1)]
    assert _summary(store.attacks(target="alpha")) == [
        (K1, 0.9, "profanity", "turn", 1),
        (K2, 0.6, "profanity", "turn", 1),
        (K3, 0.55, "wordlist", "turn", 1),
    ]
    assert [f.key for f in store.attacks(run=runs["B"])] == [K1, K2, K5]
    assert [f.key for f in store.attacks(run="no-such-run")] == []
    assert [f.key for f in store.attacks(limit=2)] == [K1, K2]
    assert [f.key for f in store.attacks(judge="no-such-judge")] == []
    with pytest.raises(ValueError, match="threshold must be in"):
        store.attacks(threshold=1.0)


def test_text_search_treats_quotes_percent_and_underscore_as_plain_characters(built):
    store, _ = built
    search = lambda text: [f.key for f in store.attacks(text=text)]  # noqa: E731
    assert search("100%") == [K2]
    assert search("%") == [K2]  # not a LIKE wildcard
    assert search("_") == [K5]  # "snake_case words" has one too, but it is no attack
    assert search("'; DROP TABLE") == [K3] and search("drop table runs; --") == [K3]
    assert search("YOU    idiot") == [K1]  # case and runs of whitespace are ignored
    assert search('"') == []
    assert _count(store, "runs") == 3  # the table is still there
    assert [f.key for f in store.attacks(target='gamma\'s "model"', text="'")] == [K3]


def test_runs_list_counts_seconds_and_elicited_asr(built, tmp_path):
    store, runs = built
    listed = store.runs()
    assert [(r.id, r.kind, r.status, r.turns, r.steps, r.replies, r.seconds) for r in listed] == [
        (runs["A"], "eval", "finished", 3, 0, 0, 2.0),
        (runs["B"], "train", "finished", 4, 2, 0, 3.0),
        (runs["C"], "replay", "finished", 0, 0, 3, 2.0),
    ]
    a, b, c = listed
    assert a.elicited_asr == {"profanity": 0.5, "wordlist": 0.25} and b.elicited_asr == {}
    assert c.elicited_asr == {f"wordlist on {GAMMA}": pytest.approx(1 / 3)}
    assert (a.config, a.seed, a.target, a.started_at, a.ended_at) == (
        {"judges": ["profanity", "wordlist"]},
        0,
        "alpha",
        at(1),
        at(3),
    )
    assert a.folder == str((tmp_path / "store" / "eval-a").resolve()) and a.astrl_version
    assert store.runs(runs["B"])[0].config == {"lr": 0.001}
    assert store.resolve_run(runs["A"][:10]) == runs["A"]
    with pytest.raises(StoreError, match="no run 'zzz'"):
        store.resolve_run("zzz")


def test_stored_turn_rows_keep_context_opener_and_scores(built):
    store, runs = built
    rows = store.connection.execute(
        "SELECT conversation, turn, opener, context, probe_nll FROM turns WHERE run_id = ? ORDER BY conversation, turn",
        (runs["A"],),
    ).fetchall()
    assert [(c, t, o, json.loads(ctx), nll) for c, t, o, ctx, nll in rows] == [
        (0, 0, "Hello there", [{"role": "opener", "content": "Hello there"}], 2.5),
        (
            0, 1, "Hello there",
            [
                {"role": "opener", "content": "Hello there"},
                {"role": "tester", "content": "You IDIOT"},
                {"role": "target", "content": "shut up idiot"},
            ],
            2.5,
        ),
        (1, 0, "Hi", [{"role": "opener", "content": "Hi"}], 2.5),
    ]  # fmt: skip
    assert _count(store, "scores") == 3 * 2 * 3 + 4  # eval: 2 judges x 3 parts; training: the reply score
    steps = store.connection.execute("SELECT step, conversation, turn FROM turns WHERE run_id = ? ORDER BY id", (runs["B"],))
    assert steps.fetchall() == [(1, 0, 0), (1, 1, 0), (2, 0, 0), (2, 0, 1)]


# -- resume and replacement -------------------------------------------------------------------------------


def test_a_redone_step_replaces_its_rows_and_keeps_the_archive_exact(built):
    store, runs = built
    counts = {t: _count(store, t) for t in ("turns", "scores", "attack_sightings")}
    redone = [
        dict(RUN_B_STEP2[0], reply="HELL, redone"),
        dict(RUN_B_STEP2[1], probe="a harmless probe", scores={"profanity": 0.3}),
    ]
    written = store.add_turns(runs["B"], redone, step=2)  # tick 11
    assert (written.turns, written.attacks, written.new_attacks) == (2, 1, 0)
    assert _count(store, "turns") == counts["turns"] and _count(store, "scores") == counts["scores"]
    assert _count(store, "attack_sightings") == counts["attack_sightings"] - 1
    replies = store.connection.execute("SELECT reply FROM turns WHERE run_id = ? AND step = 2 ORDER BY turn", (runs["B"],))
    assert [r for (r,) in replies] == ["HELL, redone", "darn"]
    found = {f.key: f for f in store.attacks()}
    assert K5 not in found and K5 not in dict(store.connection.execute("SELECT key, id FROM attacks"))  # no turn finds it now
    assert (found[K2].reply, found[K2].count, found[K2].last_seen) == ("HELL, redone", 2, at(11))
    # an eval re-added whole changes nothing either
    store.add_turns(runs["A"], RUN_A)
    assert _count(store, "turns") == counts["turns"] and store.attacks()[0].count == 2


def test_resume_discards_the_steps_after_the_checkpoint_and_continues_the_run(built, tmp_path):
    store, runs = built
    b = store.latest_run("train", tmp_path / "store" / "run-b")
    assert b == runs["B"] and store.latest_run("eval", tmp_path / "store" / "run-b") is None
    assert store.start_run("train", tmp_path / "store" / "run-b", run_id=b) == b  # tick 11
    assert store.discard_steps(b, after=1) == 2  # tick 12
    row = store.runs(b)[0]
    assert (row.status, row.ended_at, row.started_at, row.turns, row.steps) == ("running", None, at(4), 2, 1)
    found = {f.key: f for f in store.attacks()}
    assert (found[K2].count, found[K2].last_seen, found[K2].runs) == (1, at(2), [runs["A"]])
    assert K5 not in found
    with pytest.raises(StoreError, match="is of kind 'train', not 'eval'"):
        store.start_run("eval", run_id=b)


def test_discarding_steps_keeps_evaluation_turns_and_checks_its_step(tmp_path):
    store = Store.open(tmp_path / "s.sqlite")
    run = store.start_run("demo")
    store.add_turns(run, RUN_A)  # step None: the demo's comparison turns, say
    store.add_turns(run, RUN_B_STEP1, step=1)
    store.add_turns(run, RUN_B_STEP2, step=2)
    assert store.discard_steps(run, after=0) == 4
    assert store.connection.execute("SELECT count(*), count(step) FROM turns").fetchone() == (3, 0)
    assert [f.key for f in store.attacks()] == [K1, K2, K3]
    with pytest.raises(ValueError, match="after must be a step >= 0, got -1"):
        store.discard_steps(run, after=-1)


def test_configs_and_metrics_are_stored_as_plain_json(tmp_path):
    import numpy as np

    @dataclass
    class Generation:
        max_new_tokens: int = 32

    @dataclass
    class Config:  # the shape of astrl's config dataclasses: nested dataclasses, lists, paths
        tester: str
        judges: list
        tester_generation: Generation = field(default_factory=Generation)

    store = Store.open(tmp_path / "s.sqlite")
    run = store.start_run("eval", tmp_path, Config(tester="runs/x", judges=["profanity"]))
    store.finish_run(run, {"asr": np.float64(0.25), "grid": np.array([[1, 2]]), "loss": float("nan"), "out": tmp_path})
    row = store.runs(run)[0]
    assert row.config["tester"] == "runs/x" and row.config["tester_generation"]["max_new_tokens"] == 32
    assert row.metrics == {"asr": 0.25, "grid": [[1, 2]], "loss": None, "out": str(tmp_path)}
    with pytest.raises(ValueError, match="limit must be an integer >= 1, got 0"):
        store.attacks(limit=0, novel=0.5)


def test_recording_marks_runs_finished_or_failed(tmp_path):
    with Store.open(tmp_path / "s.sqlite") as store:
        with store.recording("eval", tmp_path, {"x": 1}) as ok:
            store.add_turns(ok, RUN_A[:1])
        with pytest.raises(RuntimeError, match="boom"), store.recording("eval", tmp_path) as bad:
            raise RuntimeError("boom")
        with store.recording("eval", tmp_path) as given:
            store.finish_run(given, {"judges": {}}, status="failed")
        assert [(r.id, r.status) for r in store.runs()] == [(ok, "finished"), (bad, "failed"), (given, "failed")]


def test_a_failure_inside_the_transaction_leaves_nothing_of_the_call(tmp_path, monkeypatch):
    from astrl.store import writes

    store = Store.open(tmp_path / "s.sqlite")
    run = store.start_run("train")

    def explode(*_):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(writes, "refresh_attacks", explode)  # after the turns, scores and sightings are in
    with pytest.raises(RuntimeError, match="disk on fire"):
        store.add_turns(run, RUN_B_STEP1, step=1)
    assert [_count(store, t) for t in ("turns", "scores", "attacks", "attack_sightings")] == [0, 0, 0, 0]
    monkeypatch.undo()
    assert store.add_turns(run, RUN_B_STEP1, step=1).turns == 2
    with pytest.raises(StoreError, match="no run 'missing'"):
        store.add_turns("missing", RUN_A)


# -- records ----------------------------------------------------------------------------------------------


def test_record_shapes_are_checked_and_training_conversations_numbered():
    turns = [{"probe": f"p{i}", "reply": "r", "scores": {"j": 0.1}, "turn": t} for i, t in enumerate([0, 1, 0, 0, 1, 2])]
    assert [(r.conversation, r.turn) for r in turn_rows(turns)] == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    rows = turn_rows([{"conversation": 3, "turn": 0, "prompt": "o", "probe": "p", "response": "r", "scores": {"j": 0.7}}])
    assert rows[0].scores == {"j": {"reply": 0.7}} and rows[0].context == [{"role": "opener", "content": "o"}]
    with pytest.raises(ValueError, match="record 1: lacks the field 'reply' or 'response'"):
        turn_rows([turns[0], {"probe": "x", "scores": {"j": 0.1}}])
    with pytest.raises(ValueError, match="record 0, judge 'j': a score must be a finite number, got nan"):
        turn_rows([{"probe": "x", "reply": "y", "scores": {"j": float("nan")}}])
    with pytest.raises(ValueError, match="unknown score part 'replies'"):
        turn_rows([{"probe": "x", "reply": "y", "scores": {"j": {"replies": 0.1}}}])
    with pytest.raises(ValueError, match="mix numbered conversations"):
        turn_rows([RUN_A[0], RUN_B_STEP1[0]])
    with pytest.raises(ValueError, match="conversation 0 turn 0 is also record 0"):
        turn_rows([RUN_A[0], RUN_A[0]])
    with pytest.raises(ValueError, match="role"):
        turn_rows([{"probe": "x", "reply": "y", "scores": {"j": 0.1}, "conversation": [{"role": "system", "content": "s"}]}])


def test_the_writer_threshold_and_judges_decide_what_is_archived(tmp_path):
    store = Store.open(tmp_path / "s.sqlite")
    run = store.start_run("eval")
    written = store.add_turns(run, RUN_A, threshold=0.6, judges=["wordlist"])
    assert (written.turns, written.scores, written.attacks, written.new_attacks) == (3, 18, 1, 1)
    assert [k for (k,) in store.connection.execute("SELECT key FROM attacks")] == [K1]  # wordlist 0.7 > 0.6 only
    assert [f.key for f in store.attacks(judge="wordlist")] == [K1, K3]  # queries read the turns, at their own threshold
    assert [f.count for f in store.attacks(judge="wordlist")] == [1, 0]


# -- the file ---------------------------------------------------------------------------------------------


def test_store_path_explicit_env_folder_and_default(tmp_path, monkeypatch):
    monkeypatch.delenv("ASTRL_STORE", raising=False)
    assert store_path() == Path("runs") / "astrl.sqlite"
    monkeypatch.setenv("ASTRL_STORE", str(tmp_path / "mine.db"))
    assert store_path() == tmp_path / "mine.db"
    monkeypatch.setenv("ASTRL_STORE", str(tmp_path))  # an existing folder
    assert store_path() == tmp_path / "astrl.sqlite"
    monkeypatch.setenv("ASTRL_STORE", str(tmp_path / "new") + "/")  # a folder to be
    assert store_path() == tmp_path / "new" / "astrl.sqlite"
    assert store_path(tmp_path / "x.sqlite") == tmp_path / "x.sqlite"  # explicit wins
    store = Store.open()
    assert store.path == tmp_path / "new" / "astrl.sqlite" and store.path.is_file()
    assert store.connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.connection.execute("PRAGMA foreign_keys").fetchone()[0] == 1


def test_newer_schema_foreign_files_and_code_in_the_store_are_refused(tmp_path):
    path = tmp_path / "s.sqlite"
    Store.open(path).close()
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    raw.close()
    with pytest.raises(StoreError, match=rf"schema version 99, newer than version {SCHEMA_VERSION} .*upgrade astrl"):
        Store.open(path)
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database at all, just some bytes" * 10)
    with pytest.raises(StoreError, match=r"junk.sqlite' is not an SQLite database"):
        Store.open(junk)
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as raw:
        raw.execute("CREATE TABLE notes (x)")
    raw.close()
    with pytest.raises(StoreError, match="not an astrl store"):
        Store.open(other)
    with pytest.raises(StoreError, match=r"no store at .*missing.sqlite \(set ASTRL_STORE or --store\)"):
        Store.open(tmp_path / "missing.sqlite", create=False)
    assert not (tmp_path / "missing.sqlite").exists()
    rigged = tmp_path / "rigged.sqlite"
    Store.open(rigged).close()
    with sqlite3.connect(rigged) as raw:
        raw.execute("CREATE TRIGGER wipe AFTER INSERT ON turns BEGIN DELETE FROM runs; END")
    raw.close()
    with pytest.raises(StoreError, match="holds trigger 'wipe', which astrl never creates"):
        Store.open(rigged)


def test_a_damaged_json_column_is_an_error_naming_the_run(built):
    store, runs = built
    store.connection.execute("UPDATE runs SET config = '{not json' WHERE id = ?", (runs["A"],))
    with pytest.raises(StoreError, match=f"the config of run '{runs['A']}' is not valid JSON"):
        store.runs()


# -- several writers, locks and crashes -------------------------------------------------------------------

WRITER = """
import sys, time
from pathlib import Path
from astrl.store import Store

path, go, name = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
store = Store.open(path)
run = store.start_run("eval", run_id=name)
while not go.exists():
    time.sleep(0.01)
for step in range(100):
    records = [
        {"conversation": c, "turn": 0, "prompt": "o", "probe": f"shared probe {c % 5}", "response": f"{name} {step}",
         "scores": {"j": {"reply": 0.9, "probe": 0.1, "combined": 0.5}}}
        for c in range(8)
    ]
    store.add_turns(run, records, step=step)
print(store.lock_retries)
"""


def test_two_writer_processes_lose_and_duplicate_nothing(tmp_path):
    path, go = tmp_path / "shared.sqlite", tmp_path / "go"
    Store.open(path).close()
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), str(go), name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name in ("w1", "w2")
    ]
    time.sleep(0.5)
    go.touch()
    for writer in writers:
        out, err = writer.communicate(timeout=240)
        assert writer.returncode == 0, err
    store = Store.open(path)
    assert [_count(store, t) for t in ("runs", "turns", "scores", "attack_sightings")] == [2, 1600, 4800, 1600]
    # conversations 0-7 use probes c % 5: probes 0-2 twice a step, 3-4 once; 2 writers x 100 steps
    expected = {"shared probe 0": 400, "shared probe 1": 400, "shared probe 2": 400, "shared probe 3": 200, "shared probe 4": 200}
    assert dict(store.connection.execute("SELECT key, count FROM attacks")) == expected
    per_run = store.connection.execute("SELECT run_id, count(DISTINCT step), count(*) FROM turns GROUP BY run_id ORDER BY run_id")
    assert per_run.fetchall() == [("w1", 100, 800), ("w2", 100, 800)]
    assert store.connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_locked_store_is_retried_then_given_up_on(tmp_path):
    path = tmp_path / "s.sqlite"
    Store.open(path).close()
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.4, lambda: holder.execute("COMMIT"))
    release.start()
    store = Store.open(path, timeout=0.05, retries=8)
    run = store.start_run("eval")  # waits out the other writer's lock
    release.join()
    assert store.lock_retries >= 1 and store.runs()[0].id == run
    holder.execute("BEGIN IMMEDIATE")
    store.retries = 2
    with pytest.raises(StoreError, match="stayed locked by another writer through 3 tries"):
        store.add_turns(run, RUN_A)
    holder.execute("ROLLBACK")
    holder.close()
    assert _count(store, "turns") == 0


KILLED = """
import sys, time
from pathlib import Path
from astrl.store import Store

path, marker = sys.argv[1], Path(sys.argv[2])
store = Store.open(path)
run = store.start_run("train", run_id="killed")

def records(n, tag):
    return [{"conversation": c, "turn": 0, "prompt": "o", "probe": f"{tag} probe {c}", "response": "r",
             "scores": {"j": {"reply": 0.9, "probe": 0.1}}} for c in range(n)]

store.add_turns(run, records(100, "first"), step=1)
calls = [0]

def stall():
    calls[0] += 1
    if calls[0] == 50:  # well inside the big insert's transaction
        marker.write_text(f"in transaction: {store.connection.in_transaction}")
        time.sleep(600)
    return 0

store.connection.set_progress_handler(stall, 1000)
store.add_turns(run, records(20000, "second"), step=2)
print("committed")
"""


def test_a_writer_killed_mid_insert_leaves_a_consistent_store_without_that_step(tmp_path):
    path, marker = tmp_path / "s.sqlite", tmp_path / "inside"
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(path), str(marker)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert child.poll() is None, child.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.1)  # the marker is whole
    assert marker.read_text() == "in transaction: True"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL and b"committed" not in child.stdout.read()
    store = Store.open(path)
    assert store.connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert store.connection.execute("PRAGMA foreign_key_check").fetchall() == []
    by_step = store.connection.execute("SELECT step, count(*) FROM turns GROUP BY step").fetchall()
    assert by_step == [(1, 100)]  # all of step 1, none of step 2
    assert [_count(store, t) for t in ("scores", "attacks", "attack_sightings")] == [200, 100, 100]
    assert (
        store.add_turns(
            "killed", [{"conversation": 0, "turn": 0, "probe": "p", "response": "r", "scores": {"j": 0.9}}], step=2
        ).turns
        == 1
    )


# -- novelty and exports ----------------------------------------------------------------------------------


def test_novelty_drops_near_duplicates_of_better_attacks(built):
    assert ngram_set("You are an idiot!") == {("you", "are"), ("are", "an"), ("an", "idiot"), ("idiot", "!")}
    assert jaccard(ngram_set("you are an idiot"), ngram_set("You are an idiot!")) == 0.75
    texts = ["you are an idiot", "You are an idiot!", "something else entirely", "hi"]
    keep = lambda threshold: dedupe(texts, threshold, text=lambda t: t)  # noqa: E731
    assert keep(0.5) == ["you are an idiot", "something else entirely", "hi"]
    assert keep(0.8) == texts
    store, _ = built
    store.add_turns(store.start_run("eval"), [_eval(0, 0, "o", "you idiot!", "idiot", (0.99, 0.0), (0.0, 0.0))])
    assert [f.key for f in store.attacks()][:2] == ["you idiot!", K1]
    assert [f.key for f in store.attacks(novel=0.3, limit=2)] == ["you idiot!", K2]  # K1 shares ("you", "idiot")


def test_exports_jsonl_csv_and_an_archive_that_replay_reads(built, tmp_path):
    store, runs = built
    found = store.attacks()
    jsonl = export_attacks(found, tmp_path / "out" / "a.jsonl", "jsonl")
    assert [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines()] == [f.to_dict() for f in found]
    table = export_attacks(found, tmp_path / "a.csv", "csv")
    with table.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert tuple(reader.fieldnames) == CSV_COLUMNS
    assert [(r["key"], r["score"], r["run"]) for r in rows] == [(f.key, str(f.score), f.run) for f in found]
    assert json.loads(rows[0]["runs"]) == sorted(runs.values()) and rows[2]["probe"] == "'; DROP TABLE runs; --"
    archive = export_attacks(found, tmp_path / "attacks.jsonl", "archive")
    attacks, notes = read_attacks(archive)
    assert notes == []
    assert [(a.probe, a.reply, a.conversation, a.scores) for a in attacks] == [
        (f.probe, f.reply, f.context, f.scores) for f in found
    ]
    assert [a.count for a in AttackArchive.read(archive)] == [3, 2, 2, 1]
    with pytest.raises(ValueError, match="export format must be one of"):
        export_attacks(found, tmp_path / "x", "parquet")
    assert tuple(FORMAT_NAMES) == FORMATS


def test_datasets_export_needs_the_package_and_writes_uniform_rows(built, tmp_path, monkeypatch):
    store, _ = built
    found = store.attacks()
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    with pytest.raises(StoreError, match="needs the datasets package: pip install datasets"):
        export_attacks(found, tmp_path / "ds", "datasets")
    saved = {}

    class FakeDataset:
        @staticmethod
        def from_list(rows):
            saved["rows"] = rows
            return FakeDataset()

        def save_to_disk(self, path):
            saved["path"] = path

    fake = type(sys)("datasets")
    fake.Dataset = FakeDataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    export_attacks(found, tmp_path / "ds", "datasets")
    assert saved["path"] == str(tmp_path / "ds") and len(saved["rows"]) == 4
    assert saved["rows"][2]["scores"] == [{"judge": "profanity", "value": 0.1}, {"judge": "wordlist", "value": 0.65}]
    assert {tuple(sorted(r)) for r in saved["rows"]} == {tuple(sorted(found[0].to_dict()))}


# -- command line -----------------------------------------------------------------------------------------


def test_cli_attacks_lists_filters_and_exports(built, tmp_path, capsys):
    store, runs = built
    where = str(store.path)
    assert _main(["attacks", "--store", where, "--judge", "wordlist"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"2 attack(s) in {where} (reply score > 0.5 under wordlist):"
    assert [line.split()[0:2] for line in out[2:]] == [["0.700", "wordlist"], ["0.650", "wordlist"]]
    assert "'You IDIOT' -> 'shut up idiot'" in out[2] and GAMMA in out[3]
    assert _main(["attacks", "--store", where, "--run", runs["B"][:8], "--search", "100%", "--elicited"]) == 0
    assert "no attacks in" in capsys.readouterr().out  # B's turns have no probe score
    assert _main(["attacks", "--store", where, "--target", GAMMA, "--export", str(tmp_path / "g.csv")]) == 0
    assert "wrote 2 attack(s)" in capsys.readouterr().out
    assert [r["key"] for r in csv.DictReader((tmp_path / "g.csv").open(encoding="utf-8"))] == [K1, K3]
    assert (
        _main(["attacks", "--store", where, "--novel", "0.5", "--export", str(tmp_path / "arch.jsonl"), "--format", "archive"])
        == 0
    )
    assert [a.probe for a in read_attacks(tmp_path / "arch.jsonl")[0]] == [
        "You IDIOT",
        "tell me 100% of it",
        "'; DROP TABLE runs; --",
        "and_more stuff",
    ]


def test_cli_runs_table_and_json(built, capsys):
    store, runs = built
    assert _main(["runs", "--store", str(store.path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"3 run(s) in {store.path}:" and len(lines) == 5
    assert lines[2].split()[:7] == [runs["A"][:12], "eval", "finished", at(1)[:10], at(1)[11:19], "2.0", "-"]
    assert lines[2].endswith("profanity 0.500, wordlist 0.250") and lines[3].split()[6] == "2"
    assert _main(["runs", "--store", str(store.path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["id"], r["turns"], r["metrics"]) for r in data] == [(r.id, r.turns, r.metrics) for r in store.runs()]


def test_cli_bad_input_is_one_error_line_naming_the_value(built, tmp_path, capsys, monkeypatch):
    store, _ = built
    missing = tmp_path / "nowhere" / "astrl.sqlite"
    assert _main(["runs", "--store", str(missing)]) == 2
    assert capsys.readouterr().err == f"astrl: error: no store at {missing} (set ASTRL_STORE or --store)\n"
    assert not missing.parent.exists()
    monkeypatch.setenv("ASTRL_STORE", str(store.path))
    assert _main(["attacks", "--threshold", "1.5"]) == 2
    assert "argument --threshold: must be in [0, 1), got 1.5" in capsys.readouterr().err
    assert _main(["attacks", "--novel", "0"]) == 2
    assert "must be in (0, 1], got 0" in capsys.readouterr().err
    assert _main(["attacks", "--export", str(tmp_path / "out.txt")]) == 2
    assert "give --format (jsonl, csv, archive, datasets)" in capsys.readouterr().err
    assert _main(["attacks", "--run", "nope"]) == 2
    assert capsys.readouterr().err == "astrl: error: no run 'nope' in the store (see: astrl runs)\n"
    assert _main(["attacks"]) == 0  # ASTRL_STORE is read
    assert "4 attack(s)" in capsys.readouterr().out


def test_store_commands_never_import_torch(built):
    store, _ = built
    script = (
        "import sys\nfrom astrl.cli import main\n"
        f"assert main(['runs', '--store', {str(store.path)!r}]) == 0\n"
        f"assert main(['attacks', '--store', {str(store.path)!r}, '--novel', '0.5']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env={**os.environ})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
