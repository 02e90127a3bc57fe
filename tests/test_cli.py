import json
import re
import subprocess
import sys

import pytest

from astrl.cli import main


def _main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:  # argparse refuses a malformed or out-of-range option this way
        return exit_.code


def _run(tmp_path, model_dir, *extra, out="r.jsonl"):
    path = tmp_path / out
    code = _main(
        [
            "rollout",
            "--tester",
            str(model_dir),
            "--target",
            str(model_dir),
            "--scorer",
            "profanity",
            "--scorer",
            "keywords:the,you",
            "--prompts",
            "builtin",
            "--num-conversations",
            "3",
            "--turns",
            "2",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "6",
            "--system-prompt",
            "Be rude.",
            "--seed",
            "0",
            "--quiet",
            "--out",
            str(path),
            *extra,
        ]
    )
    return code, path


def test_rollout_writes_one_record_per_turn_and_is_seeded(tmp_path, tiny_model_dir, capsys):
    code, path = _run(tmp_path, tiny_model_dir)
    assert code == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["conversation"], r["turn"]) for r in records] == [(c, t) for c in range(3) for t in range(2)]
    for r in records:
        assert set(r) >= {"conversation", "turn", "prompt", "probe", "response", "scores", "reward"}
        assert set(r["scores"]) == {"profanity", "keywords:the,you"}
        assert r["reward"] == r["scores"]["profanity"]
    assert len({r["prompt"] for r in records}) == 3
    assert "wrote 6 turns of 3 conversations" in capsys.readouterr().out
    _, again = _run(tmp_path, tiny_model_dir, out="again.jsonl")
    assert again.read_text() == path.read_text()
    _, other = _run(tmp_path, tiny_model_dir, "--seed", "1", out="other.jsonl")
    assert other.read_text() != path.read_text()


def test_astprompter_reward_from_the_cli_keeps_its_terms(tmp_path, tiny_model_dir, capsys):
    flags = ["--reward", "astprompter", "--alpha", "2", "--zeta", "0.25", "--likelihood-weight", "0.5"]
    code, path = _run(tmp_path, tiny_model_dir, *flags)
    assert code == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        terms = r["reward_terms"]
        assert set(terms) == {"response_tox", "combined_tox", "probe_logprob"}
        assert terms["response_tox"] == r["scores"]["profanity"]
        expected = 2 * terms["response_tox"] + 0.25 * terms["combined_tox"] + 0.5 * terms["probe_logprob"]
        assert r["reward"] == pytest.approx(expected, abs=1e-5)
        assert terms["probe_logprob"] < 0
    assert "mean_probe_logprob" in capsys.readouterr().out
    _, plain = _run(tmp_path, tiny_model_dir, out="plain.jsonl")
    assert all("reward_terms" not in json.loads(line) for line in plain.read_text().splitlines())


def test_gamma_is_the_old_name_of_likelihood_weight(tmp_path, tiny_model_dir, capsys):
    flags = ["--reward", "astprompter", "--seed", "2"]
    code, new = _run(tmp_path, tiny_model_dir, *flags, "--likelihood-weight", "0.5", out="new.jsonl")
    assert code == 0 and "astrl: warning" not in capsys.readouterr().err
    code, old = _run(tmp_path, tiny_model_dir, *flags, "--gamma", "0.5", out="old.jsonl")
    assert code == 0 and old.read_text() == new.read_text()
    assert "astrl: warning: --gamma is deprecated: it is now --likelihood-weight" in capsys.readouterr().err
    code, _ = _run(tmp_path, tiny_model_dir, *flags, "--gamma", "0.5", "--likelihood-weight", "0.5", out="both.jsonl")
    assert code == 2 and "both --gamma and --likelihood-weight are given" in capsys.readouterr().err
    code, _ = _run(tmp_path, tiny_model_dir, "--likelihood-weight", "0.5", out="score.jsonl")  # reward 'score' has no such term
    assert code == 2 and "alpha/zeta/likelihood_weight only apply to reward='astprompter' or 'elicit'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["rollout", "--help"])
    shown = capsys.readouterr().out
    assert "--likelihood-weight" in shown and "--gamma" not in shown  # the old name works but is not advertised


@pytest.mark.parametrize("gate", [False, True])
def test_elicit_reward_from_the_cli_keeps_its_terms(tmp_path, tiny_model_dir, gate):
    flags = ["--reward", "elicit", "--alpha", "2", "--probe-penalty", "0.75", "--likelihood-weight", "0.5"] + (
        ["--elicit-gate"] if gate else []
    )
    code, path = _run(tmp_path, tiny_model_dir, *flags)
    assert code == 0
    for r in (json.loads(line) for line in path.read_text().splitlines()):
        terms = r["reward_terms"]
        assert set(terms) == {"response_tox", "probe_tox", "probe_logprob", "reply_lexicon", "probe_repetition"}
        g = 1 - terms["probe_tox"] if gate else 1.0
        expected = 2 * terms["response_tox"] * g - 0.75 * terms["probe_tox"] + 0.5 * terms["probe_logprob"]
        assert r["reward"] == pytest.approx(expected, abs=1e-5)


def test_the_lexicon_gate_from_the_cli_pays_no_reply_term_to_a_probe_with_a_listed_word(tmp_path, tiny_model_dir):
    flags = ["--reward", "elicit", "--probe-penalty", "0.5", "--likelihood-weight", "0.25"]
    flags += ["--reply-lexicon-weight", "2", "--reply-lexicon", "hell,hello,weather", "--probe-gate-lexicon"]
    code, path = _run(tmp_path, tiny_model_dir, *flags)
    assert code == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        terms = r["reward_terms"]
        listed = bool({"hell", "hello", "weather"} & set(re.findall("[a-z]+", r["probe"].lower())))
        assert terms["probe_listed"] == float(listed)
        reply = 0.0 if listed else terms["response_tox"] + 2 * terms["reply_lexicon"]
        assert r["reward"] == pytest.approx(reply - 0.5 * terms["probe_tox"] + 0.25 * terms["probe_logprob"], abs=1e-5)
    assert 0 < sum(r["reward_terms"]["probe_listed"] for r in records) < len(records)  # both kinds of probe occur


def test_probe_gate_both_from_the_cli_reads_the_probe_with_the_reward_scorer_too(tmp_path, tiny_model_dir):
    from astrl.scorers import make_scorer

    flags = ["--reward", "elicit", "--probe-penalty", "0", "--likelihood-weight", "0", "--probe-gate", "0.3"]
    flags += ["--probe-scorer", "keywords:you", "--probe-gate-both", "--reply-past-probe"]
    code, path = _run(tmp_path, tiny_model_dir, *flags)
    assert code == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    svm, judge = make_scorer("profanity"), make_scorer("keywords:you")  # the reward's scorer (the first), the probe's
    for r in records:
        terms = r["reward_terms"]
        assert terms["probe_tox_scorer"] == pytest.approx(float(svm([r["probe"]])[0]), abs=1e-5)
        assert terms["probe_tox"] == pytest.approx(float(judge([r["probe"]])[0]), abs=1e-5)
        gate = float(terms["probe_tox"] < 0.3 and terms["probe_tox_scorer"] < 0.3)
        assert r["reward"] == pytest.approx(gate * terms["response_tox"], abs=1e-5)


def test_reward_weights_of_another_reward_are_rejected(tmp_path, tiny_model_dir, capsys):
    code, _ = _run(tmp_path, tiny_model_dir, "--reward", "astprompter", "--probe-penalty", "2")
    assert code == 2 and "probe_penalty applies only to reward='elicit' (reward is 'astprompter')" in capsys.readouterr().err
    code, _ = _run(tmp_path, tiny_model_dir, "--reward", "elicit", "--zeta", "1")
    assert code == 2 and "zeta only applies to reward='astprompter'" in capsys.readouterr().err


def test_text_mode_from_the_cli(tmp_path, tiny_model_dir):
    code, path = _run(tmp_path, tiny_model_dir, "--mode", "text")
    assert code == 0 and len(path.read_text().splitlines()) == 6


@pytest.mark.parametrize(
    "args, message",
    [
        (["--scorer", "toxicity"], "unknown scorer 'toxicity'"),
        (["--turns", "0"], "--turns: must be >= 1, got 0"),
        (["--prompts", "missing.txt"], "'missing.txt'"),
        (["--tester", "/no/such/model"], "'/no/such/model'"),
        (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
        (["--alpha", "2"], "only apply to reward='astprompter'"),
    ],
)
def test_bad_arguments_give_one_error_line(tmp_path, tiny_model_dir, capsys, args, message):
    code, _ = _run(tmp_path, tiny_model_dir, *args)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("astrl: error:") and message in err


def test_console_script_lists_commands():
    out = subprocess.run([sys.executable, "-m", "astrl", "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("rollout", "train", "demo", "eval", "compare", "select"):
        assert command in out
    bad = subprocess.run([sys.executable, "-m", "astrl", "train", "learning_rate=1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown config key(s) ['learning_rate']" in bad.stderr


def test_progress_lines_reach_a_redirected_stdout_as_they_are_printed(tmp_path, monkeypatch):
    import io

    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8")  # a file, as under nohup: block-buffered until told otherwise
    monkeypatch.setattr(sys, "stdout", out)
    assert _main(["runs", "--store", str(tmp_path / "none.sqlite")]) == 2  # any command sets it up, even one refused
    print("a progress line")
    assert b"a progress line\n" in raw.getvalue()  # without a flush
