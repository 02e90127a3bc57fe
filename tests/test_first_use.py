"""First use on a fresh machine: bad arguments cost no model load, and the embedded model's one-time
conversion is quiet, announced in one line and safe when several processes start at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import astrl.models
from astrl.cli import main


class ModelLoaded(BaseException):
    """Raised by the patched loader: a BaseException, so no ``except Exception`` turns it into an error line."""


@pytest.fixture()
def no_model_loads(tmp_path, monkeypatch) -> Path:
    """An empty ``ASTRL_CACHE`` and a model resolver that fails the test when anything asks for a model."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ASTRL_CACHE", str(cache))

    def refuse(name, *args, **kwargs):
        raise ModelLoaded(name)

    monkeypatch.setattr(astrl.models, "resolve", refuse)
    monkeypatch.setattr(astrl.models, "_embedded_folder", refuse)
    return cache


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


# (case id, argv with {tmp} for the test's folder, text the one error line must contain)
BAD_BEFORE_ANY_MODEL = [
    ("rollout-scorer", ["rollout", "--scorer", "bogus"], "'bogus'"),
    ("rollout-second-scorer", ["rollout", "--scorer", "profanity", "--scorer", "keywords:"], "'keywords:'"),
    ("rollout-detoxify-variant", ["rollout", "--scorer", "detoxify:huge"], "'detoxify:huge'"),
    ("rollout-judge-folder", ["rollout", "--scorer", "judge:/nonexistent/judge@guard"], "'/nonexistent/judge'"),
    ("rollout-prompts", ["rollout", "--prompts", "{tmp}/missing.txt"], "missing.txt"),
    ("rollout-rtp-category", ["rollout", "--prompts", "rtp:nosuchcategory"], "nosuchcategory"),
    ("rollout-target-after-embedded-tester", ["rollout", "--target", "/nonexistent/target"], "'/nonexistent/target' not found"),
    ("rollout-ray", ["rollout", "--collector", "ray", "--scorer", "bogus"], "'bogus'"),
    ("eval-judge", ["eval", "--tester", "smollm2-135m", "--judge", "bogus"], "'bogus'"),
    ("eval-judge-left-out-word", ["eval", "--tester", "smollm2-135m", "--judge", "wordlist:-gdo"], "'gdo' not in the word list"),
    ("eval-prompts", ["eval", "--tester", "smollm2-135m", "--prompts", "{tmp}/missing.txt"], "missing.txt"),
    ("eval-target", ["eval", "--tester", "smollm2-135m", "--target", "/nonexistent/target"], "'/nonexistent/target'"),
    ("replay-judge", ["replay", "{tmp}/probes.txt", "--judge", "bogus"], "'bogus'"),
    (
        "replay-second-target",
        ["replay", "{tmp}/probes.txt", "--target", "smollm2-135m", "--target", "/nonexistent/target"],
        "'/nonexistent/target'",
    ),
    ("train-scorer", ["train", "scorer=bogus", "run_dir={tmp}/run"], "'bogus'"),
    ("train-prompts", ["train", "prompts={tmp}/missing.txt", "run_dir={tmp}/run"], "missing.txt"),
    ("train-config-prompts", ["train", "--config", "configs/demo.yaml", "prompts=rtp:nope", "run_dir={tmp}/run"], "nope"),
    ("train-ipo-scorer", ["train", "--config", "configs/cpu/ipo.yaml", "scorer=bogus", "run_dir={tmp}/run"], "'bogus'"),
    ("demo-steps", ["demo", "--steps", "0", "--run-dir", "{tmp}/demo"], "argument --steps: must be >= 1, got 0"),
]


@pytest.mark.parametrize(("argv", "expected"), [c[1:] for c in BAD_BEFORE_ANY_MODEL], ids=[c[0] for c in BAD_BEFORE_ANY_MODEL])
def test_a_bad_argument_fails_before_any_model_is_loaded_or_converted(no_model_loads, tmp_path, capsys, argv, expected):
    (tmp_path / "probes.txt").write_text("tell me about your day\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    if argv[0] in ("rollout", "eval", "replay"):
        argv += ["--quiet", "--out", str(tmp_path / "out")]
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("astrl: error: ") and expected in lines[0], err
    assert _files(no_model_loads) == []  # nothing converted, nothing cached


def test_resuming_from_a_damaged_checkpoint_fails_before_any_model_is_loaded(no_model_loads, tmp_path, capsys):
    from astrl.training import TrainConfig

    run = tmp_path / "run"
    folder = run / "checkpoints" / "step_000001"
    folder.mkdir(parents=True)
    TrainConfig(run_dir=str(run)).save(run / "config.yaml")  # the embedded tester, not converted yet
    (folder / "state.pt").write_bytes(b"not a checkpoint")
    assert main(["train", "--resume", str(run), "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(folder / "state.pt") in lines[0]
    assert _files(no_model_loads) == []


def test_a_bad_scorer_with_an_empty_cache_is_one_line_and_converts_nothing(tmp_path):
    """The CLI as a user runs it, in a process of its own, on a cache folder that is empty."""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "ASTRL_CACHE": str(cache)}
    done = subprocess.run(
        [sys.executable, "-m", "astrl", "rollout", "--scorer", "bogus", "--out", str(tmp_path / "o.jsonl")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert lines == [lines[0]] and lines[0].startswith("astrl: error: unknown scorer 'bogus'"), done.stderr
    assert _files(cache) == []
    assert not (tmp_path / "o.jsonl").exists()


# A stand-in for the 20-30 s conversion: slow enough for two processes to overlap, and it counts its calls.
_CONVERT_ONCE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import astrl.models as models

    log = Path(sys.argv[1])

    def fake_convert(folder, gguf_file, out):
        with log.open("a") as handle:
            handle.write("convert\\n")
        out.mkdir(parents=True)
        time.sleep(1.5)
        (out / "weights.bin").write_bytes(b"x" * 1000)
        (out / "config.json").write_text('{"done": true}')

    models.EMBEDDED_MODELS["fake-lm"] = ("json", "unused.gguf")  # any importable package will do
    models._convert_gguf = fake_convert
    print(models._embedded_folder("fake-lm"))
    """
)


def test_two_processes_converting_at_once_convert_once_and_share_one_whole_folder(tmp_path):
    cache, log = tmp_path / "cache", tmp_path / "calls.log"
    env = {**os.environ, "ASTRL_CACHE": str(cache)}
    command = [sys.executable, "-c", _CONVERT_ONCE, str(log)]
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    folders = {out.strip() for out, _ in outputs}
    assert folders == {str(cache / "fake-lm")}
    assert log.read_text().splitlines() == ["convert"]  # the second process waited and reused the first one's folder
    assert json.loads((cache / "fake-lm" / "config.json").read_text()) == {"done": True}
    assert (cache / "fake-lm" / "weights.bin").stat().st_size == 1000
    assert [p for p in _files(cache) if ".tmp" in p] == []  # no half-written folder left behind
    announcements = [err for _, err in outputs if "converting the embedded fake-lm once" in err]
    assert len(announcements) == 1 and len(announcements[0].strip().splitlines()) == 1, outputs


def test_a_failed_conversion_leaves_no_folder_and_the_next_use_converts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ASTRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(astrl.models.EMBEDDED_MODELS, "fake-lm", ("json", "unused.gguf"))

    def disk_full(folder, gguf_file, out):
        out.mkdir(parents=True)
        (out / "half").write_text("x")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(astrl.models, "_convert_gguf", disk_full)
    with pytest.raises(astrl.models.ModelLoadError, match="No space left on device"):
        astrl.models._embedded_folder("fake-lm")
    assert [p for p in _files(tmp_path / "cache") if not p.startswith(".fake-lm.lock")] == []

    def works(folder, gguf_file, out):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(astrl.models, "_convert_gguf", works)
    assert astrl.models._embedded_folder("fake-lm") == tmp_path / "cache" / "fake-lm"
    assert "converting the embedded fake-lm once" in capsys.readouterr().err


@pytest.mark.slow  # the real 20-30 s conversion
@pytest.mark.integration
def test_first_use_of_the_embedded_model_says_one_line_and_draws_no_progress_bar_off_a_terminal(tmp_path):
    """The real conversion, in a process whose stderr is a pipe (as in CI logs and error reports)."""
    cache = tmp_path / "cache"
    script = "from astrl.models import load_model; lm = load_model('smollm2-135m'); print(lm.context_window)"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ, "ASTRL_CACHE": str(cache)}
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "8192"
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and lines[0] == f"astrl: converting the embedded smollm2-135m once (~30 s); cached under {cache / 'smollm2-135m'}"
    )
    assert (cache / "smollm2-135m" / "config.json").is_file()


def test_model_names_are_checked_without_loading(tmp_path, monkeypatch):
    from astrl.errors import ModelLoadError
    from astrl.names import check_model_name

    monkeypatch.setenv("ASTRL_CACHE", str(tmp_path / "cache"))
    check_model_name("smollm2-135m")  # the package is installed: fine, nothing converted
    check_model_name("org/some-model")  # a hub id: only a download can tell
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    check_model_name(str(tmp_path / "adapter"))  # a PEFT adapter folder (a run's tester)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    cases = [
        (str(tmp_path / "empty"), "has no config.json"),
        (str(tmp_path / "file"), "is a file"),
        (str(tmp_path / "missing"), "not found"),
        ("./relative/missing", "not found"),
        ("", "is not a model name"),
    ]
    for name, message in cases:
        with pytest.raises(ModelLoadError, match=message):
            check_model_name(name, "target")
    monkeypatch.setitem(astrl.models.EMBEDDED_MODELS, "absent-lm", ("no_such_package_here", "x.gguf"))
    with pytest.raises(ModelLoadError, match="needs the package no-such-package-here"):
        check_model_name("absent-lm")
    assert _files(tmp_path / "cache") == []
