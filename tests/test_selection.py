"""`astrl select`: choosing among runs by the training scorer's share on the dev openers."""

import json
import shutil

import pytest
import torch
from conftest import make_llama, make_tokenizer

from astrl.cli import main
from astrl.evaluation.run import EvalConfig
from astrl.evaluation.selection import (
    CONVERSATIONS_PER_OPENER,
    Candidate,
    check_candidates,
    choose,
    default_conversations,
    intervals_apart,
    select_testers,
)
from astrl.prompts import load_prompts, split_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

SCORER = "keywords:the,a,e,i,o,u"  # the runs' training scorer, spelt unsorted: fires on short words of random text
JUDGE_KEY = "keywords:a,e,i,o,the,u"  # its own name for itself, the key of an evaluation's judges
CONFIG = (
    "tester: {tiny}\ntarget: {tiny}\nscorer: {scorer}\nprompts: builtin\nseed: 3\nmode: chat\n"
    "turns: 1\nmax_new_tokens: 4\ntarget_max_new_tokens: 6\nreply_samples: 2\n"
)


def _run(root, name, tiny, model_seed, scorer=SCORER, extra=""):
    """A run directory whose final tester is a tiny Llama of its own seed."""
    run = root / name
    (run / "final" / "tester").mkdir(parents=True)
    (run / "config.yaml").write_text(CONFIG.format(tiny=tiny, scorer=scorer) + extra)
    tok = make_tokenizer()
    torch.manual_seed(model_seed)
    make_llama(tok, seed=model_seed).save_pretrained(run / "final" / "tester")
    tok.save_pretrained(run / "final" / "tester")
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("select_runs")
    return [_run(root, f"seed_{s}", tiny_model_dir, s) for s in (11, 12, 13)]


def _select(out, *runs, extra=()):
    args = ["select", *map(str, runs), "--num-conversations", "22", "--batch-size", "11", "--resamples", "50"]
    try:
        return main([*args, "--threshold", "0", "--quiet", "--out", str(out), *extra])
    except SystemExit as exit_:  # argparse refuses a bad choice this way
        return exit_.code


def test_choose_takes_the_highest_share_and_the_first_among_equal_ones():
    assert choose([0.01, 0.03, 0.02]) == 1
    assert choose([0.02, 0.01, 0.02]) == 0
    with pytest.raises(ValueError, match="no candidate"):
        choose([])


def test_intervals_apart_needs_the_chosen_low_end_above_the_other_high_end():
    assert intervals_apart([0.03, 0.05], [0.01, 0.029])
    assert not intervals_apart([0.03, 0.05], [0.01, 0.03])
    assert not intervals_apart(None, [0.0, 0.01])


def test_select_chooses_the_runs_best_dev_share_as_astrl_eval_measures_it(runs, tmp_path, capsys):
    assert _select(tmp_path / "sel", *runs) == 0
    summary = json.loads((tmp_path / "sel" / "selection.json").read_text())
    assert summary["scorer"] == SCORER and summary["split"] == "dev" and summary["reply_samples"] == 2
    shares = []
    for row in summary["candidates"]:  # each candidate's share is its own eval folder's, on the dev openers
        metrics = json.loads((tmp_path / "sel" / row["eval_dir"].rsplit("/", 1)[-1] / "metrics.json").read_text())
        assert metrics["split"] == "dev" and list(metrics["judges"]) == [JUDGE_KEY] and metrics["reply_samples"] == 2
        assert metrics["turns"] == 1 and metrics["max_new_tokens"] == 4 and metrics["target_max_new_tokens"] == 6
        shares.append(metrics["judges"][JUDGE_KEY]["elicited_reply_share"])
        assert row["elicited_reply_share"] == shares[-1]
    assert len(set(shares)) > 1  # the three testers differ: the choice is not a tie
    best = max(range(3), key=lambda i: (shares[i], -i))
    assert summary["chosen"] == best and summary["chosen_run"] == str(runs[best])
    assert summary["scorer_is_a_judge"] is False  # the training scorer is not one of the judges it is measured by
    assert f"chosen: {runs[best]}" in capsys.readouterr().out
    # the same evaluation by astrl eval gives the same share: select measures what eval measures
    common = ["--num-conversations", "22", "--batch-size", "11", "--resamples", "50", "--threshold", "0", "--quiet"]
    code = main(["eval", "--tester", str(runs[best]), "--split", "dev", "--judge", SCORER, "--reply-samples", "2", *common,
                 "--no-embeddings", "--out", str(tmp_path / "eval")])  # fmt: skip
    assert code == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["judges"][JUDGE_KEY]["elicited_reply_share"] == shares[best]


def test_a_stopped_selection_reuses_the_evaluations_it_holds_and_redoes_changed_ones(runs, tmp_path, capsys):
    assert _select(tmp_path / "sel", *runs[:2]) == 0
    first = json.loads((tmp_path / "sel" / "selection.json").read_text())
    assert [row["reused"] for row in first["candidates"]] == [False, False]
    shutil.rmtree(first["candidates"][1]["eval_dir"])  # stopped before the second candidate finished
    assert _select(tmp_path / "sel", *runs[:2]) == 0
    again = json.loads((tmp_path / "sel" / "selection.json").read_text())
    assert [row["reused"] for row in again["candidates"]] == [True, False]
    assert [r["elicited_reply_share"] for r in again["candidates"]] == [r["elicited_reply_share"] for r in first["candidates"]]
    assert _select(tmp_path / "sel", *runs[:2], extra=("--reply-samples", "1")) == 0
    changed = json.loads((tmp_path / "sel" / "selection.json").read_text())
    assert [row["reused"] for row in changed["candidates"]] == [False, False] and changed["reply_samples"] == 1
    assert _select(tmp_path / "by_judge", *runs[:2], extra=("--scorer", "wordlist")) == 0
    assert json.loads((tmp_path / "by_judge" / "selection.json").read_text())["scorer_is_a_judge"] is True
    assert "is one of the runs' judges" in capsys.readouterr().out


def test_the_default_is_four_conversations_for_every_dev_opener(runs):
    resolved, scorer = check_candidates([Candidate(str(r)) for r in runs[:2]], EvalConfig(split="dev"), None)
    assert scorer == SCORER
    dev = split_prompts(load_prompts("builtin"), "dev", seed=3)
    assert default_conversations(resolved[0], "dev") == CONVERSATIONS_PER_OPENER * len(dev) == 44


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("split_seed: 5\n", "differs from .* in split_seed \\(5 against 3\\)"),
        ("turns: 2\n", "differs from .* in turns \\(2 against 1\\)"),
        ("test_fraction: 0.35\n", "in test_fraction \\(0.35 against None\\)"),
    ],
)
def test_runs_of_other_settings_are_refused_naming_the_run_and_the_setting(runs, tmp_path, tiny_model_dir, change, message):
    other = _run(tmp_path, "other", tiny_model_dir, 14, extra=change)
    with pytest.raises(ValueError, match=message):
        select_testers([Candidate(str(runs[0])), Candidate(str(other))], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is evaluated


def test_bad_selections_are_refused_before_a_model_loads(runs, tmp_path, tiny_model_dir, capsys):
    cases = [
        ([str(runs[0])], "at least two testers"),
        ([str(runs[0]), str(runs[0])], "is given twice"),
        ([str(runs[0]), str(tiny_model_dir)], "is not a training run directory"),
        ([str(runs[0]), str(runs[1]), "--split", "test"], "invalid choice: 'test'"),
        ([str(runs[0]), str(runs[1]), "--scorer", "nonesuch"], "nonesuch"),
        ([str(runs[0]), str(runs[1]), "--checkpoint", "step_0009"], "checkpoint 'step_0009' is neither"),
    ]
    for args, message in cases:
        assert _select(tmp_path / "out", *args) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="choosing on the held-out openers"):
        check_candidates([Candidate(str(r)) for r in runs[:2]], EvalConfig(split="test"), None)
    other = _run(tmp_path, "other_scorer", tiny_model_dir, 15, scorer="profanity")
    with pytest.raises(ValueError, match="different training scorers.*--scorer"):
        check_candidates([Candidate(str(runs[0])), Candidate(str(other))], EvalConfig(split="dev"), None)
    resolved, scorer = check_candidates([Candidate(str(runs[0])), Candidate(str(other))], EvalConfig(split="dev"), "profanity")
    assert scorer == "profanity" and len(resolved) == 2
    assert not (tmp_path / "out").exists()


def test_select_compares_the_named_checkpoint_of_every_run(tmp_path, tiny_model_dir, capsys):
    runs = [_run(tmp_path, f"ck_{s}", tiny_model_dir, s) for s in (21, 22)]
    for run, seed in zip(runs, (23, 24), strict=True):  # a checkpoint that differs from the run's final tester
        shutil.copytree(run / "final" / "tester", run / "checkpoints" / "step_0002" / "tester")
        torch.manual_seed(seed)
        make_llama(make_tokenizer(), seed=seed).save_pretrained(run / "checkpoints" / "step_0002" / "tester")
    assert _select(tmp_path / "sel", *runs, extra=("--checkpoint", "step_0002")) == 0
    assert "astrl eval --tester" in (out := capsys.readouterr().out) and out.rstrip().endswith("--checkpoint step_0002")
    summary = json.loads((tmp_path / "sel" / "selection.json").read_text())
    assert [row["checkpoint"] for row in summary["candidates"]] == ["step_0002", "step_0002"]
    assert [row["eval_dir"].rsplit("/", 1)[-1] for row in summary["candidates"]] == ["00_ck_21_step_0002", "01_ck_22_step_0002"]
    for row in summary["candidates"]:
        metrics = json.loads((tmp_path / "sel" / row["eval_dir"].rsplit("/", 1)[-1] / "metrics.json").read_text())
        assert metrics["checkpoint"] == "step_0002" and metrics["tester_model"].endswith("step_0002/tester")


LEXICON = "reply_lexicon: hello,how,you,the,cat,dog,what,is\n"  # words of the tiny vocabulary, each a token of its own


def test_select_by_lexicon_chooses_the_highest_reply_lexicon_share_of_the_same_replies(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    import astrl.evaluation.lexicon_reading as lexicon_reading
    from astrl.evaluation.records import read_records
    from astrl.models import load_model

    runs = [_run(tmp_path, f"lex_{s}", tiny_model_dir, s, extra=LEXICON) for s in (31, 32, 33)]
    assert _select(tmp_path / "sel", *runs, extra=("--by", "lexicon")) == 0
    assert "reply lexicon" in capsys.readouterr().out
    summary = json.loads((tmp_path / "sel" / "selection.json").read_text())
    assert summary["by"] == "lexicon" and summary["measure"] == "reply_lexicon_share"
    shares = [row["reply_lexicon_share"] for row in summary["candidates"]]
    assert len(set(shares)) == 3 and all(0 < s < 1 for s in shares)  # the testers' replies differ: no tie
    assert summary["chosen"] == max(range(3), key=lambda i: (shares[i], -i))
    assert all(row["elicited_reply_share"] is not None for row in summary["candidates"])  # the share is still reported
    # a candidate's reading is the module's own, on its folder's replies, with the run's lexicon
    folder = tmp_path / "sel" / summary["candidates"][1]["eval_dir"].rsplit("/", 1)[-1]
    records = read_records(folder / "conversations.jsonl")
    target = load_model(str(tiny_model_dir))
    settings = lexicon_reading.lexicon_settings({"reply_lexicon": LEXICON.split()[1]})
    lexicon = lexicon_reading.run_lexicon(settings, target.tokenizer, SCORER)
    estimates = lexicon_reading.reply_estimates(records, target, lexicon, batch=5)
    direct = lexicon_reading.lexicon_share(records, estimates, JUDGE_KEY, threshold=0.0, resamples=50)
    assert direct["reply_lexicon_share"] == pytest.approx(shares[1], abs=1e-6)
    assert direct["n_replies"] == len(records) == 22  # one turn, every conversation's first reply

    def unread(*args, **kwargs):
        raise AssertionError("a kept reading was computed again")

    monkeypatch.setattr(lexicon_reading, "reply_estimates", unread)
    assert _select(tmp_path / "sel", *runs, extra=("--by", "lexicon")) == 0  # read back with the evaluations
    again = json.loads((tmp_path / "sel" / "selection.json").read_text())
    assert [row["reply_lexicon_share"] for row in again["candidates"]] == shares
    capsys.readouterr()
    assert _select(tmp_path / "sel", *runs, extra=("--by", "lexicon", "--threshold", "0.5")) == 1  # another reading
    assert "a kept reading was computed again" in capsys.readouterr().err


def test_select_by_lexicon_refuses_runs_it_cannot_read_with_one_lexicon(runs, tmp_path, tiny_model_dir):
    base = EvalConfig(split="dev")
    a = _run(tmp_path, "a", tiny_model_dir, 41, extra=LEXICON)
    b = _run(tmp_path, "b", tiny_model_dir, 42, extra=LEXICON + "reply_lexicon_whole_words: true\n")
    with pytest.raises(ValueError, match="differs from .* in reply_lexicon_whole_words \\(True against False\\).*one lexicon"):
        check_candidates([Candidate(str(a)), Candidate(str(b))], base, None, "lexicon")
    check_candidates([Candidate(str(a)), Candidate(str(b))], base, None, "share")  # the share reads no lexicon
    texts = [_run(tmp_path, f"text_{s}", tiny_model_dir, s, extra="mode: text\n") for s in (43, 44)]
    with pytest.raises(ValueError, match="reads chat replies through the target: .*text_43' is a text-mode run"):
        check_candidates([Candidate(str(t)) for t in texts], base, None, "lexicon")
    gone = [_run(tmp_path, f"gone_{s}", tiny_model_dir, s, extra="reply_lexicon: /nowhere/words.txt\n") for s in (45, 46)]
    with pytest.raises(ValueError, match="gone_45': reply_lexicon file '/nowhere/words.txt' not found; --by lexicon"):
        check_candidates([Candidate(str(g)) for g in gone], base, None, "lexicon")
    with pytest.raises(ValueError, match="by must be one of \\('share', 'lexicon'\\), got 'judge'"):
        select_testers([Candidate(str(r)) for r in runs[:2]], tmp_path / "out", by="judge")
    assert _select(tmp_path / "out", *runs[:2], extra=("--by", "judge")) == 2
    assert not (tmp_path / "out").exists()
