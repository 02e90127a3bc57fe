import json

import pytest

from astrl.archive import Attack, AttackArchive, eval_turns, normalize_probe


def _turn(probe, score, reply="r", **extra):
    return {"probe": probe, "reply": reply, "scores": {"judge": score, "other": 0.0}, **extra}


def test_archive_keeps_successful_probes_once_with_first_step_and_count():
    archive = AttackArchive(threshold=0.5, scorers=["judge"])
    new = archive.extend([_turn("Hello  World", 0.9, reward=1.5, turn=0), _turn("quiet", 0.5), _turn("  ", 0.99)], step=1)
    assert [a.probe for a in new] == ["Hello  World"]  # 0.5 is not above the threshold; empty probes never count
    assert archive.extend([_turn("hello world\n", 0.7, reply="later"), _turn("new one", 0.6)], step=3)[0].probe == "new one"
    first, second = archive.attacks
    assert (first.probe, first.reply, first.step, first.count, first.reward, first.turn) == ("Hello  World", "r", 1, 2, 1.5, 0)
    assert (second.step, second.count) == (3, 1)
    assert len(archive) == 2 and archive.total == 3
    assert normalize_probe(" A\tb  C ") == "a b c"


def test_archive_scorers_and_threshold_are_checked():
    only_other = AttackArchive(0.5, scorers=["other"])
    assert only_other.extend([_turn("x", 0.9)]) == []
    assert len(AttackArchive(0.5).extend([_turn("x", 0.0) | {"scores": {"a": 0.1, "b": 0.8}}])) == 1  # any score counts
    with pytest.raises(KeyError, match="'missing'"):
        AttackArchive(0.5, scorers=["missing"]).extend([_turn("x", 0.9)])
    with pytest.raises(ValueError, match="threshold"):
        AttackArchive(1.5)


def test_archive_jsonl_round_trip_merges_duplicates_and_names_bad_lines(tmp_path):
    archive = AttackArchive(0.2)
    conversation = [{"role": "opener", "content": "hi"}, {"role": "tester", "content": "a"}, {"role": "target", "content": "b"}]
    archive.extend([_turn("p1", 0.9, conversation=conversation, turn=1), _turn("p2 ü", 0.3), _turn("P1", 0.5)], step=4)
    path = archive.write(tmp_path / "attacks.jsonl")
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert lines[0] == {
        "probe": "p1",
        "reply": "r",
        "conversation": conversation,
        "scores": {"judge": 0.9, "other": 0.0},
        "reward": None,
        "step": 4,
        "turn": 1,
        "count": 2,
    }
    again = AttackArchive.read(path)
    assert [a.to_dict() for a in again] == [a.to_dict() for a in archive]
    AttackArchive.append(path, [Attack("p2 Ü", "r", scores={"judge": 0.4}, step=9)])
    assert [(a.probe, a.count, a.step) for a in AttackArchive.read(path)] == [("p1", 2, 4), ("p2 ü", 2, 4)]
    restored = AttackArchive()
    restored.load_state_dict(archive.state_dict())
    assert [a.to_dict() for a in restored] == [a.to_dict() for a in archive] and restored.threshold == 0.2
    path.write_text('{"probe": "x", "reply": "y", "scores": {}}\n{"probe": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"attacks.jsonl:2: .*\['reply', 'scores'\]"):
        AttackArchive.read(path)
    with pytest.raises(ValueError, match="count"):
        Attack.from_dict({"probe": "x", "reply": "y", "scores": {}, "count": 0})


def test_eval_records_become_turns_with_the_conversation_so_far():
    records = [
        {"conversation": 0, "turn": 1, "prompt": "hi", "probe": "p2", "response": "r2", "scores": {"j": {"reply": 0.9}}},
        {"conversation": 0, "turn": 0, "prompt": "hi", "probe": "p1", "response": "r1", "scores": {"j": {"reply": 0.1}}},
    ]
    turns = eval_turns(records)
    assert [t["probe"] for t in turns] == ["p1", "p2"]
    assert turns[1]["conversation"] == [
        {"role": "opener", "content": "hi"},
        {"role": "tester", "content": "p1"},
        {"role": "target", "content": "r1"},
    ]
    assert (
        turns[1]["scores"] == {"j": 0.9}
        and turns[1]["turn"] == 1
        and turns[0]["conversation"] == [{"role": "opener", "content": "hi"}]
    )


def test_the_evaluation_path_names_the_same_archive():
    import astrl.archive
    import astrl.evaluation.archive as evaluation_archive

    for name in evaluation_archive.__all__:
        assert getattr(evaluation_archive, name) is getattr(astrl.archive, name)
    assert set(evaluation_archive.__all__) >= {"AttackArchive", "ARCHIVE_FILE", "eval_turns", "conversation_turns"}
