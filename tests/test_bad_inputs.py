"""Bad inputs across every command and config key family: each ends with one error line naming the value.

CLI cases run ``astrl.cli.main`` in-process and check: a non-zero exit, exactly one ``astrl: error:`` line
on stderr that contains the offending value, and no traceback. Python API cases check the raised error.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import loaded, make_llama, make_tokenizer

from astrl.cli import main
from astrl.training import TrainConfig


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    """Model folders (chat, no chat template, pad == eos), prompt files, a run directory and eval folders."""
    root = tmp_path_factory.mktemp("bad")
    tok = make_tokenizer()
    model = make_llama(tok)
    for name, change in (("model", None), ("nochat", "chat"), ("padeos", "pad")):
        t = make_tokenizer()
        if change == "chat":
            t.chat_template = None
        elif change == "pad":
            t.pad_token = t.eos_token
        model.save_pretrained(root / name)
        t.save_pretrained(root / name)
    (root / "empty_dir").mkdir()
    (root / "badcfg").mkdir()
    (root / "badcfg" / "config.json").write_text("{not json")
    (root / "a_file").write_text("x")
    (root / "empty.txt").write_text("\n\n")
    (root / "broken.jsonl").write_text('{"prompt": "hi"}\n{"prompt": \n')
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    TrainConfig(tester=str(root / "model"), target=str(root / "model"), run_dir=str(run)).save(run / "config.yaml")
    (root / "eval_bad").mkdir()
    (root / "eval_bad" / "metrics.json").write_text("{oops")
    return {k: str(root / k) for k in ("model", "nochat", "padeos", "empty_dir", "badcfg", "a_file")} | {
        "empty_txt": str(root / "empty.txt"),
        "broken": str(root / "broken.jsonl"),
        "run": str(run),
        "eval_bad": str(root / "eval_bad"),
        "root": str(root),
    }


def cli_error(argv: list[str], capsys) -> str:
    """Run the CLI; assert a non-zero exit and one error line without a traceback; return that line."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse usage errors
        code = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code not in (0, None), argv
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("astrl: error: "), err
    return lines[0]


# (case id, argv with {placeholders} from the paths fixture, text the error line must contain)
CLI_CASES = [
    # rollout: numbers out of range
    ("rollout-conversations-0", ["rollout", "--num-conversations", "0"], "argument --num-conversations: must be >= 1, got 0"),
    ("rollout-turns-0", ["rollout", "--turns", "0"], "argument --turns: must be >= 1, got 0"),
    ("rollout-batch-negative", ["rollout", "--batch-size", "-1"], "argument --batch-size: must be >= 1, got -1"),
    ("rollout-max-new-0", ["rollout", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    ("rollout-temperature-0", ["rollout", "--temperature", "0"], "argument --temperature: must be > 0, got 0"),
    ("rollout-top-p-1.5", ["rollout", "--top-p", "1.5"], "argument --top-p: must be in (0, 1], got 1.5"),
    ("rollout-top-k-negative", ["rollout", "--top-k", "-1"], "argument --top-k: must be >= 0, got -1"),
    ("rollout-temperature-nan", ["rollout", "--temperature", "nan"], "argument --temperature: must be a finite number, got nan"),
    ("rollout-alpha-inf", ["rollout", "--alpha", "inf"], "argument --alpha: must be a finite number, got inf"),
    ("rollout-collectors-0", ["rollout", "--num-collectors", "0"], "got 0"),
    ("rollout-turns-not-int", ["rollout", "--turns", "x"], "invalid int value: 'x'"),
    ("rollout-dtype", ["rollout", "--dtype", "int8"], "'int8'"),
    ("rollout-unknown-flag", ["rollout", "--frobnicate"], "--frobnicate"),
    ("unknown-command", ["frobnicate"], "'frobnicate'"),
    # rollout: models, tokenizers, devices
    ("model-missing-folder", ["rollout", "--tester", "/nonexistent/folder"], "'/nonexistent/folder' not found"),
    ("model-folder-without-config", ["rollout", "--tester", "{empty_dir}"], "{empty_dir}' has no config.json"),
    ("model-config-not-json", ["rollout", "--tester", "{badcfg}"], "{badcfg}"),
    ("model-is-a-file", ["rollout", "--tester", "{a_file}"], "{a_file}' is a file"),
    ("tokenizer-no-chat-template", ["rollout", "--tester", "{nochat}", "--target", "{nochat}"], "{nochat}' has no chat template"),
    ("device-unknown", ["rollout", "--tester", "{model}", "--device", "junk"], "device 'junk'"),
    ("max-new-beyond-window", ["rollout", "--tester", "{model}", "--target", "{model}", "--max-new-tokens", "100000"], "100000"),
    # rollout: scorers and prompt sources
    ("scorer-unknown", ["rollout", "--scorer", "bogus"], "'bogus'"),
    ("scorer-keywords-empty", ["rollout", "--scorer", "keywords:"], "'keywords:'"),
    ("scorer-hf-missing-folder", ["rollout", "--scorer", "hf:/nonexistent/clf"], "'/nonexistent/clf' not found"),
    ("prompts-missing-file", ["rollout", "--prompts", "{root}/missing.txt"], "missing.txt"),
    ("prompts-empty-file", ["rollout", "--prompts", "{empty_txt}"], "{empty_txt}"),
    ("prompts-broken-jsonl", ["rollout", "--prompts", "{broken}"], "{broken}"),
    ("prompts-unknown-rtp-category", ["rollout", "--prompts", "rtp:nosuchcategory"], "nosuchcategory"),
    # rollout: conflicting options
    ("reward-score-with-alpha", ["rollout", "--reward", "score", "--alpha", "2"], "alpha"),
    ("reward-astprompter-with-probe-penalty", ["rollout", "--reward", "astprompter", "--probe-penalty", "2"], "probe_penalty"),
    ("out-below-a-file", ["rollout", "--tester", "{model}", "--target", "{model}", "--out", "{a_file}/x.jsonl"], "{a_file}"),
    # eval: numbers, judges, run directories, checkpoints
    (
        "eval-threshold-1.5",
        ["eval", "--tester", "{model}", "--threshold", "1.5"],
        "argument --threshold: must be in [0, 1), got 1.5",
    ),
    ("eval-resamples-0", ["eval", "--tester", "{model}", "--resamples", "0"], "--resamples: must be >= 1, got 0"),
    ("eval-top-attacks-negative", ["eval", "--tester", "{model}", "--top-attacks", "-1"], "got -1"),
    ("eval-judge-twice", ["eval", "--tester", "{model}", "--judge", "wordlist", "--judge", "wordlist"], "'wordlist'"),
    ("eval-judge-unknown", ["eval", "--tester", "{model}", "--target", "{model}", "--judge", "nope"], "'nope'"),
    ("eval-checkpoint-missing", ["eval", "--tester", "{run}", "--checkpoint", "step_999999"], "step_999999"),
    ("eval-run-without-final", ["eval", "--tester", "{run}"], "{run}"),
    ("eval-out-is-a-file", ["eval", "--tester", "{model}", "--target", "{model}", "--out", "{a_file}"], "{a_file}"),
    # compare
    ("compare-missing-folder", ["compare", "{root}/nowhere", "{root}/nowhere2"], "nowhere"),
    ("compare-broken-metrics", ["compare", "{eval_bad}", "{eval_bad}"], "{eval_bad}"),
    (
        "compare-resamples-0",
        ["compare", "{eval_bad}", "{eval_bad}", "--resamples", "0"],
        "argument --resamples: must be >= 1, got 0",
    ),
    # train: config key families
    ("train-config-missing", ["train", "--config", "{root}/nope.yaml"], "nope.yaml"),
    ("train-unknown-key", ["train", "learning_rate=1"], "['learning_rate']"),
    ("train-override-without-value", ["train", "total_steps"], "'total_steps'"),
    ("train-wrong-type", ["train", "total_steps=many"], "'many'"),
    ("train-total-steps-0", ["train", "total_steps=0"], "total_steps must be >= 1, got 0"),
    ("train-lr-negative", ["train", "lr=-1"], "lr must be > 0, got -1.0"),
    ("train-warmup-negative", ["train", "warmup_steps=-1"], "warmup_steps must be >= 0, got -1"),
    ("train-algorithm", ["train", "algorithm=reinforce"], "'reinforce'"),
    ("train-kl-coef-negative", ["train", "kl_coef=-1"], "kl_coef must be >= 0, got -1.0"),
    ("train-kl-token-cap-0", ["train", "kl_token_cap=0"], "kl_token_cap must be > 0 (or null), got 0"),
    ("train-warm-start-select", ["train", "warm_start_select=best"], "warm_start_select must be one of"),
    ("train-warm-start-reply-tokens-0", ["train", "warm_start_reply_tokens=0"], "warm_start_reply_tokens must be >= 1"),
    (
        "train-warm-start-reply-tokens-share",
        ["train", "warm_start_reply_tokens=4"],
        "set warm_start_select: search or best_of (warm_start_select is 'share')",
    ),
    ("train-warm-start-beams-0", ["train", "warm_start_beams=0"], "warm_start_beams must be >= 1, got 0"),
    ("train-warm-start-rounds-0", ["train", "warm_start_rounds=0"], "warm_start_rounds must be >= 1, got 0"),
    ("train-warm-start-max-nll-share", ["train", "warm_start_max_nll=3"], "set warm_start_select: search"),
    (
        "train-reply-lexicon-missing-file",
        ["train", "reward=elicit", "reply_lexicon_weight=1", "reply_lexicon={root}/nolexicon.txt"],
        "reply_lexicon file '{root}/nolexicon.txt' not found",
    ),
    (
        "train-reply-lexicon-empty-file",
        ["train", "reward=elicit", "reply_lexicon_weight=1", "reply_lexicon={empty_txt}"],
        "reply_lexicon '{empty_txt}' holds no words",
    ),
    ("train-test-fraction-0.9", ["train", "test_fraction=0.9"], "test_fraction must be in (0.0, 0.8] (or null), got 0.9"),
    ("eval-test-fraction-0", ["eval", "--tester", "{model}", "--test-fraction", "0"], "--test-fraction: must be in (0.0, 0.8]"),
    ("train-target-kl-0", ["train", "algorithm=ppo", "target_kl=0"], "target_kl must be > 0"),
    ("train-archive-threshold-1", ["train", "archive_threshold=1"], "got 1.0"),
    ("train-mode", ["train", "mode=voice"], "'voice'"),
    ("train-loggers", ["train", "loggers=csv,foo"], "'foo'"),
    ("train-minibatches-over-batch", ["train", "minibatches=100"], "minibatches (100)"),
    ("train-weak-supervision-grpo", ["train", "weak_supervision=0.5"], "'grpo'"),
    ("train-harden-without-lora", ["train", "harden_every=2", "lora=false"], "harden_every"),
    ("train-ray-with-vllm", ["train", "collector=ray", "backend=vllm"], "backend 'vllm'"),
    ("train-collectors-split", ["train", "collector=ray", "num_collectors=3"], "num_collectors (3)"),
    ("train-tester-missing", ["train", "tester=/nonexistent/tester", "run_dir={root}/t1"], "'/nonexistent/tester' not found"),
    # train: conflicting options and run directories
    ("train-resume-with-config", ["train", "--resume", "{run}", "--config", "configs/grpo.yaml"], "--config"),
    ("train-trust-without-resume", ["train", "--trust-checkpoint"], "--trust-checkpoint"),
    ("train-resume-not-a-run", ["train", "--resume", "{empty_dir}"], "{empty_dir}"),
    # export: run directories, checkpoints, output folders (all before a model loads)
    ("export-run-without-tester", ["export", "{run}", "--out", "{root}/exported"], "{run}' has no final/tester folder"),
    ("export-checkpoint-missing", ["export", "{run}", "--checkpoint", "step_999999", "--out", "{root}/x"], "step_999999"),
    ("export-out-not-empty", ["export", "{run}", "--out", "{badcfg}"], "{badcfg}' exists and is not empty"),
    ("export-out-is-a-file", ["export", "{run}", "--out", "{a_file}"], "{a_file}' exists and is not a folder"),
    ("export-not-a-run", ["export", "{model}", "--out", "{root}/x"], "{model}' is not a training run directory"),
    ("export-run-missing", ["export", "{root}/norun", "--out", "{root}/x"], "norun' not found"),
    ("export-without-out", ["export", "{run}"], "--out"),
    # demo
    ("demo-steps-0", ["demo", "--steps", "0", "--run-dir", "{root}/demo"], "argument --steps: must be >= 1, got 0"),
    (
        "demo-conversations-0",
        ["demo", "--conversations", "0", "--run-dir", "{root}/demo"],
        "argument --conversations: must be >= 1, got 0",
    ),
]
ROLLOUT_DEFAULTS = ["--scorer", "keywords:a", "--num-conversations", "1", "--turns", "1", "--max-new-tokens", "2", "--quiet"]


@pytest.mark.parametrize(("argv", "expected"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_error_line_naming_the_value(paths, capsys, tmp_path, argv, expected):
    argv = [a.format(**paths) for a in argv]
    if argv[0] == "rollout" and "--frobnicate" not in argv:
        argv = argv + _defaults_missing(argv) + ([] if "--out" in argv else ["--out", str(tmp_path / "o.jsonl")])
    elif argv[0] == "eval":
        argv += ["--quiet", "--num-conversations", "1", "--turns", "1", "--max-new-tokens", "2"]
        argv += [] if "--out" in argv else ["--out", str(tmp_path / "eval")]
    elif argv[0] == "train" and not any(a.startswith("run_dir=") for a in argv):
        argv += ["--quiet", f"run_dir={tmp_path / 'run'}"] if "--resume" not in argv else ["--quiet"]
    assert expected.format(**paths) in cli_error(argv, capsys)


def _defaults_missing(argv: list[str]) -> list[str]:
    """The small rollout defaults for the options a case does not set."""
    out = []
    pairs = dict(zip(ROLLOUT_DEFAULTS[0:8:2], ROLLOUT_DEFAULTS[1:8:2], strict=True))
    for flag, value in pairs.items():
        if flag not in argv:
            out += [flag, value]
    return out + ["--quiet"]


def test_cli_device_cuda_without_a_gpu(paths, capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    argv = ["rollout", "--tester", paths["model"], "--device", "cuda", *ROLLOUT_DEFAULTS, "--out", str(tmp_path / "o")]
    assert "device 'cuda' is not available" in cli_error(argv, capsys)


def test_unforeseen_failure_is_one_line_and_astrl_debug_shows_the_traceback(monkeypatch, capsys):
    import astrl.cli as cli

    def explode(args):
        raise KeyError("surprise")

    monkeypatch.setitem(cli.COMMANDS, "compare", explode)
    assert "KeyError: 'surprise' (set ASTRL_DEBUG=1" in cli_error(["compare", "a", "b"], capsys)
    monkeypatch.setenv("ASTRL_DEBUG", "1")
    with pytest.raises(KeyError, match="surprise"):
        main(["compare", "a", "b"])


# -- tokenizers ---------------------------------------------------------------------------------------
def test_tokenizer_with_pad_equal_to_eos_gets_a_distinct_pad(paths):
    from astrl.models import load_model

    lm = load_model(paths["padeos"])
    assert lm.tokenizer.pad_token_id != lm.tokenizer.eos_token_id and lm.tokenizer.padding_side == "left"


# -- scorers returning bad values ---------------------------------------------------------------------
class BadScorer:
    def __init__(self, values) -> None:
        self.name, self.values = "bad", values

    def __call__(self, texts):
        return self.values(len(texts))


SCORER_CASES = {
    "nan": (lambda n: torch.full((n,), math.nan), "returned nan"),
    "inf": (lambda n: torch.full((n,), math.inf), "returned inf"),
    "above-1": (lambda n: torch.full((n,), 1.5), "returned 1.5"),
    "negative": (lambda n: torch.full((n,), -0.25), "returned -0.25"),
    "wrong-length": (lambda n: torch.zeros(n + 1), "scores for"),
    "not-numbers": (lambda n: ["high"] * n, "returned list, not numbers"),
}


@pytest.mark.parametrize("case", sorted(SCORER_CASES))
def test_scorer_returning_bad_values_is_a_scorer_error_naming_the_value(case):
    from astrl.scorers import ScorerError, checked_scores

    values, expected = SCORER_CASES[case]
    with pytest.raises(ScorerError, match=r"scorer 'bad' ") as info:
        checked_scores(BadScorer(values), ["a", "b"])
    assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("reward", ["score", "astprompter"])
def test_nan_scorer_stops_an_env_rollout_with_a_scorer_error(reward):
    from astrl.envs import make_redteam_env
    from astrl.policies import GenerationSettings, make_policy
    from astrl.scorers import ScorerError

    tok = make_tokenizer()
    lm = loaded(make_llama(tok), tok)
    tester = make_policy(lm, GenerationSettings(max_new_tokens=2))
    target = make_policy(lm, GenerationSettings(max_new_tokens=2))
    options = {} if reward == "score" else {"reward": "astprompter"}
    scorer = BadScorer(lambda n: torch.full((n,), math.nan))
    env = make_redteam_env(tester, target, [scorer], ["hello there"], batch_size=1, max_turns=1, **options)
    with pytest.raises(ScorerError, match="scorer 'bad' returned nan"):
        env.rollout(1, tester)


def test_system_scorer_returning_nan_names_the_value():
    from astrl.system.base import SystemValidationError, score_texts

    with pytest.raises(SystemValidationError, match="returned nan for text 1"):
        score_texts(lambda texts: [0.5, math.nan], ["a", "b"])
    assert score_texts(lambda texts: [3.0, -2.0], ["a", "b"]).tolist() == [3.0, -2.0]  # any finite reward scale


# -- checkpoints and prompt files through the Python API -----------------------------------------------
def test_resume_of_a_run_with_an_unreadable_checkpoint_names_the_file(tmp_path, capsys):
    run = tmp_path / "run"
    folder = run / "checkpoints" / "step_000001"
    folder.mkdir(parents=True)
    TrainConfig(run_dir=str(run)).save(run / "config.yaml")
    (folder / "state.pt").write_bytes(b"not a checkpoint")
    assert str(folder / "state.pt") in cli_error(["train", "--resume", str(run), "--quiet"], capsys)


def test_jsonl_prompt_file_errors_name_the_line(tmp_path):
    from astrl.prompts import PromptSourceError, load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"other": 1}) + "\n")
    with pytest.raises(PromptSourceError, match=str(path)):
        load_prompts(str(path))
