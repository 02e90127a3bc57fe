"""The commands write their runs into the results store: training step by step (a resumed run goes on
with its rows), evaluation and replay at their end; a store that cannot be opened stops a command
before any model loads, one that fails later is a warning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from astrl.archive import normalize_probe
from astrl.cli import main
from astrl.store import Store
from astrl.store.recorder import RunRecorder

KEYWORDS = "keywords:the,you,hello,how,are"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def store_file(tmp_path, monkeypatch):
    path = tmp_path / "store" / "astrl.sqlite"
    path.parent.mkdir()
    monkeypatch.setenv("ASTRL_STORE", str(path))
    return path


def _train(model_dir, run_dir, *extra) -> list[str]:
    return [
        "train", "--quiet", f"tester={model_dir}", f"target={model_dir}", f"scorer={KEYWORDS}", "reward=astprompter",
        "total_steps=4", "prompts_per_step=2", "group_size=2", "turns=1", "max_new_tokens=4", "lr=3e-3",
        "lora_targets=q_proj,v_proj", "archive_threshold=0.1", "save_every=1", f"run_dir={run_dir}", *extra,
    ]  # fmt: skip


def _steps(store: Store, run_id: str) -> dict[int, int]:
    rows = store.connection.execute("SELECT step, COUNT(*) FROM turns WHERE run_id = ? GROUP BY step", (run_id,))
    return dict(rows.fetchall())


def test_training_writes_every_step_and_a_resumed_run_replaces_the_steps_it_redoes(
    tiny_model_dir, tmp_path, store_file, monkeypatch
):
    from astrl.scorers import KeywordScorer

    original, calls = KeywordScorer.__call__, []

    def flaky(self, texts):
        calls.append(1)
        if len(calls) == 5:  # two scorer calls a step: the first of step 3
            raise ConnectionError("scoring service unreachable")
        return original(self, texts)

    monkeypatch.setattr(KeywordScorer, "__call__", flaky)
    run = tmp_path / "run"
    assert main(_train(tiny_model_dir, run)) == 1
    with Store.open(store_file, create=False) as store:
        (failed,) = store.runs()
        assert (failed.kind, failed.status, failed.folder) == ("train", "failed", str(run.resolve()))
        assert failed.config["scorer"] == KEYWORDS and failed.seed == 0
        assert _steps(store, failed.id) == {1: 4, 2: 4}  # 4 conversations a step; step 3 never finished
    monkeypatch.setattr(KeywordScorer, "__call__", original)
    shutil.rmtree(run / "checkpoints" / "step_000002")  # as if step 2 had finished without its checkpoint
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    with Store.open(store_file, create=False) as store:
        (done,) = store.runs()  # the same run, continued
        assert (done.id, done.status, done.steps) == (failed.id, "finished", 4)
        assert _steps(store, done.id) == {1: 4, 2: 4, 3: 4, 4: 4}  # step 2 was redone: replaced, not doubled
        redone = store.connection.execute("SELECT probe FROM turns WHERE step = 2 ORDER BY conversation").fetchall()
        samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
        assert {s["probe"] for s in samples if s["step"] == 2} <= {p for (p,) in redone}
        archived = [json.loads(line) for line in (run / "attacks.jsonl").read_text().splitlines()]
        keys = {k for (k,) in store.connection.execute("SELECT key FROM attacks WHERE count > 0")}
        assert keys == {normalize_probe(a["probe"]) for a in archived}  # the store's archive is the run's
        assert done.metrics["step"] == 4


def test_eval_and_replay_record_their_runs(tiny_model_dir, tmp_path, store_file):
    out = tmp_path / "eval"
    argv = ["eval", "--tester", str(tiny_model_dir), "--target", str(tiny_model_dir), "--judge", KEYWORDS, "--mode", "text"]
    argv += ["--num-conversations", "3", "--turns", "2", "--batch-size", "3", "--max-new-tokens", "4", "--no-embeddings"]
    assert main([*argv, "--resamples", "20", "--quiet", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    metrics = json.loads((out / "metrics.json").read_text())
    (judge,) = metrics["judges"]  # the scorer's own name for itself
    with Store.open(store_file, create=False) as store:
        (run,) = store.runs()
        assert (run.kind, run.status, run.turns, run.target) == ("eval", "finished", 6, str(tiny_model_dir))
        assert run.elicited_asr == {judge: metrics["judges"][judge]["elicited_asr"]}
        stored = store.connection.execute(
            "SELECT t.conversation, t.turn, t.probe, t.reply, s.value FROM turns t JOIN scores s ON s.turn_id = t.id "
            "WHERE s.judge = ? AND s.what = 'reply' ORDER BY t.conversation, t.turn",
            (judge,),
        ).fetchall()
    expected = [(r["conversation"], r["turn"], r["probe"], r["response"], r["scores"][judge]["reply"]) for r in records]
    assert stored == expected

    probes = tmp_path / "probes.txt"
    probes.write_text("hello how are you\nthe dog walk\n")
    replay = tmp_path / "replay"
    args = ["replay", str(probes), "--target", str(tiny_model_dir), "--judge", KEYWORDS, "--samples", "2", "--mode", "text"]
    assert main([*args, "--max-new-tokens", "4", "--resamples", "20", "--quiet", "--out", str(replay)]) == 0
    replies = [json.loads(line) for line in (replay / "replies.jsonl").read_text().splitlines()]
    with Store.open(store_file, create=False) as store:
        runs = {r.kind: r for r in store.runs()}
        assert runs["replay"].status == "finished" and runs["replay"].replies == len(replies) == 2 * 2
        stored = store.connection.execute("SELECT reply, score FROM replays ORDER BY item, sample").fetchall()
    assert stored == [(r["reply"], r["scores"][judge]["reply"]) for r in replies]


def test_a_store_that_cannot_be_opened_stops_eval_before_a_model_loads(tiny_model_dir, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "notes.sqlite"
    bad.write_text("not a database")
    monkeypatch.setenv("ASTRL_STORE", str(bad))
    monkeypatch.setattr("astrl.evaluation.run.load_tester", lambda *a, **k: pytest.fail("a model was loaded"))
    argv = ["eval", "--tester", str(tiny_model_dir), "--target", str(tiny_model_dir), "--judge", KEYWORDS, "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("astrl: error:") and str(bad) in err[0]


def test_the_store_can_be_turned_off_and_a_failing_write_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTRL_STORE", "off")
    off = RunRecorder.begin("eval", tmp_path / "e", {"a": 1})
    assert not off.active
    off.turns([{"conversation": 0, "turn": 0, "probe": "p", "response": "r", "scores": {"j": 0.9}}])
    off.finish({"x": 1})
    assert not (tmp_path / "runs").exists()

    path = tmp_path / "s.sqlite"
    warnings = []
    recorder = RunRecorder.begin("eval", tmp_path / "e", {"a": 1}, path=path, warn=warnings.append)
    recorder.turns([{"conversation": 0, "turn": 0, "probe": "p", "response": "r", "scores": {"j": float("nan")}}])
    assert len(warnings) == 1 and "was not written" in warnings[0] and not recorder.active
    recorder.turns([{"conversation": 0, "turn": 0, "probe": "p", "response": "r", "scores": {"j": 0.9}}])  # no more writes
    recorder.finish()
    with Store.open(path, create=False) as store:
        (run,) = store.runs()
        assert (run.status, run.turns) == ("running", 0)  # the run's own files are the record; the store says it never ended


def test_compare_takes_eval_run_ids_from_the_store(tiny_model_dir, tmp_path, store_file, capsys):
    argv = ["eval", "--tester", str(tiny_model_dir), "--target", str(tiny_model_dir), "--judge", KEYWORDS, "--mode", "text"]
    argv += ["--num-conversations", "2", "--turns", "1", "--max-new-tokens", "3", "--no-embeddings", "--resamples", "20"]
    for name, seed in (("a", "0"), ("b", "1")):
        assert main([*argv, "--seed", seed, "--quiet", "--out", str(tmp_path / name)]) == 0
    with Store.open(store_file, create=False) as store:
        ids = {Path(r.folder).name: r.id for r in store.runs()}
    capsys.readouterr()
    assert main(["compare", ids["a"][:8], ids["b"], "--resamples", "20"]) == 0
    out = capsys.readouterr().out
    assert f"A: {tmp_path / 'a'}" in out and f"B: {tmp_path / 'b'}" in out
    assert (tmp_path / "b" / "compare.md").is_file()
    assert main(["compare", "feedface", ids["b"]]) == 2
    assert "no run 'feedface' in the store" in capsys.readouterr().err


def test_a_preference_run_stores_every_node_of_its_trees(tiny_model_dir, tmp_path, store_file):
    run = tmp_path / "ipo"
    argv = _train(tiny_model_dir, run, "algorithm=ipo", "tree_width=2", "tree_depth=2", "total_steps=1")
    assert main([a for a in argv if a != "total_steps=4"]) == 0
    with Store.open(store_file, create=False) as store:
        (stored,) = store.runs()
        depths = dict(store.connection.execute("SELECT turn, COUNT(*) FROM turns GROUP BY turn").fetchall())
    assert stored.status == "finished" and depths == {0: 2 * 2, 1: 2 * 4}  # 2 trees: 2 probes, then 4


@pytest.mark.parametrize("command", ["train", "demo"])
def test_a_store_that_cannot_be_opened_stops_train_and_demo_before_a_model_loads(tmp_path, monkeypatch, capsys, command):
    bad = tmp_path / "notes.sqlite"
    bad.write_text("not a database")
    monkeypatch.setenv("ASTRL_STORE", str(bad))
    monkeypatch.setattr("astrl.training.setup.build_models", lambda *a, **k: pytest.fail("a model was loaded"))
    argv = (
        ["train", "--quiet", f"run_dir={tmp_path / 'run'}"]
        if command == "train"
        else ["demo", "--quiet", "--run-dir", str(tmp_path / "d")]
    )
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("astrl: error:") and str(bad) in err[0]
