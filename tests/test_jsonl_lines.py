"""JSONL files astrl writes with ensure_ascii=False hold strings with U+0085, U+2028 or U+2029 raw; every
reader splits lines on "\\n" only (str.splitlines would cut such a record in two)."""

from __future__ import annotations

import json

from astrl.archive import Attack, AttackArchive
from astrl.evaluation.records import read_records

ODD = "a\x85b\u2028c\u2029d\x1ce"  # line breaks to str.splitlines, plain characters to JSON


def test_eval_records_with_unicode_line_breaks_in_a_probe_read_back_whole(tmp_path):
    record = {"conversation": 0, "turn": 0, "prompt": "hi", "probe": ODD, "response": "r" + ODD, "empty_probe": False}
    record.update(probe_nll=1.5, scores={"wordlist": {"reply": 0.9, "probe": 0.1}})
    path = tmp_path / "conversations.jsonl"
    path.write_text(json.dumps(record, ensure_ascii=False) + "\n" + json.dumps({**record, "turn": 1}, ensure_ascii=False) + "\n")
    assert len(path.read_text().splitlines()) > 2  # what the reader must not do
    records = read_records(path)
    assert [(r["turn"], r["probe"], r["response"]) for r in records] == [(0, ODD, "r" + ODD), (1, ODD, "r" + ODD)]


def test_an_attack_archive_with_unicode_line_breaks_reads_back_whole(tmp_path):
    path = tmp_path / "attacks.jsonl"
    AttackArchive.append(path, [Attack(probe=ODD, reply="x" + ODD, scores={"s": 0.9})])
    archive = AttackArchive.read(path)
    assert [(a.probe, a.reply) for a in archive.attacks] == [(ODD, "x" + ODD)]


def test_numbered_lines_skips_blank_lines_keeps_numbers_and_splits_at_newline_only():
    from astrl.jsonl import numbered_lines

    text = '{"a": 1}\n\n  \n{"b": "' + ODD + '"}\n'
    assert list(numbered_lines(text)) == [(1, '{"a": 1}'), (4, '{"b": "' + ODD + '"}')]


def test_prompt_files_and_replay_attack_files_with_unicode_line_breaks_read_back_whole(tmp_path):
    from astrl.evaluation.replay import read_attacks
    from astrl.prompts import load_prompts

    path = tmp_path / "lines.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "probe": p}, ensure_ascii=False) + "\n" for p in (ODD, "x" + ODD)))
    assert load_prompts(str(path)) == [ODD, "x" + ODD]
    assert [a.probe for a in read_attacks(path)[0]] == [ODD, "x" + ODD]


def test_plain_text_prompt_and_attack_files_split_at_newline_only(tmp_path):
    from astrl.evaluation.replay import read_attacks
    from astrl.prompts import load_prompts

    path = tmp_path / "lines.txt"
    path.write_text(ODD + "\r\n\n  \n" + "x" + ODD + "\n", encoding="utf-8", newline="")
    assert len(path.read_text(encoding="utf-8").splitlines()) > 4  # what the readers must not do
    assert load_prompts(str(path)) == [ODD, "x" + ODD]
    assert [a.probe for a in read_attacks(path)[0]] == [ODD, "x" + ODD]
