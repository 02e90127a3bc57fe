"""One writer per run or eval folder: a second job is refused at once, naming the folder and its holder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from astrl.cli import main
from astrl.errors import FolderInUseError
from astrl.locks import LOCK_FILE, sole_writer

HOLDER = """
import sys
from astrl.locks import sole_writer
with sole_writer(sys.argv[1], "run folder"):
    print("held", flush=True)
    sys.stdin.readline()
"""


@pytest.fixture()
def held(tmp_path):
    """A folder held by another process until the test ends; yields (folder, that process's pid)."""
    folder = tmp_path / "busy"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield folder, proc.pid
    proc.communicate("\n", timeout=30)
    assert proc.returncode == 0


def test_a_folder_another_process_writes_is_refused_with_its_holder_named(held):
    folder, pid = held
    with pytest.raises(FolderInUseError, match=rf"--out '{folder}' is being written by another astrl job \(pid {pid}\)"):
        with sole_writer(folder, "--out"):
            pass
    assert (folder / LOCK_FILE).read_text() == f"pid {pid}"  # the refused job left the holder's lock as it was


def test_the_lock_goes_with_its_job_and_nested_holds_in_one_process_are_one(tmp_path):
    folder = tmp_path / "run"
    with sole_writer(folder, "run folder"):
        assert (folder / LOCK_FILE).is_file()
        with sole_writer(folder / ".." / "run", "run folder"):  # the same folder by another path: this process's hold
            assert (folder / LOCK_FILE).is_file()
        assert (folder / LOCK_FILE).is_file()  # the inner hold's end does not release the outer one
    assert list(folder.iterdir()) == []  # nothing left behind
    with sole_writer(folder, "run folder"):  # and it can be taken again
        pass


CRASHES_LEAVING_A_WORKER = """
import os, sys, time
from astrl.locks import sole_writer
with sole_writer(sys.argv[1], "run folder"):
    worker = os.fork()
    if worker == 0:  # a worker forked by the job (not exec'd), still running after the job dies
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1), os.dup2(quiet, 2)  # the test reads the job's output to its end, not the worker's
        time.sleep(60)
        os._exit(0)
    print(worker, flush=True)
    os._exit(1)  # the job crashes: no clean-up, its lock file stays
"""


def test_a_worker_forked_by_a_crashed_job_does_not_keep_its_folder(tmp_path):
    import os
    import signal

    folder = tmp_path / "run"
    args = [sys.executable, "-c", CRASHES_LEAVING_A_WORKER, str(folder)]
    job = subprocess.run(args, capture_output=True, text=True, timeout=60)
    worker = int(job.stdout.strip())
    try:
        assert job.returncode == 1, job.stderr
        assert (folder / LOCK_FILE).is_file()  # left behind by the crash, while the worker still runs
        os.kill(worker, 0)  # the worker is alive
        with sole_writer(folder, "run folder"):  # a resume takes the folder at once
            assert (folder / LOCK_FILE).read_text() == f"pid {os.getpid()}"
    finally:
        os.kill(worker, signal.SIGKILL)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("astrl: error: "), err
    return lines[0]


def test_train_eval_and_resume_into_a_folder_being_written_stop_before_loading_anything(held, tiny_model_dir, capsys):
    folder, pid = held
    before = sorted(p.name for p in folder.iterdir())
    train = ["train", "--quiet", f"tester={tiny_model_dir}", f"target={tiny_model_dir}", "scorer=keywords:damn",
             "total_steps=1", f"run_dir={folder}"]  # fmt: skip
    assert main(train) == 2
    assert f"run folder '{folder}' is being written by another astrl job (pid {pid})" in _one_error_line(capsys)
    assert main(["train", "--resume", str(folder), "--quiet"]) == 2
    assert f"(pid {pid})" in _one_error_line(capsys)
    evaluate = ["eval", "--tester", str(tiny_model_dir), "--target", str(tiny_model_dir), "--judge", "keywords:damn",
                "--num-conversations", "1", "--out", str(folder)]  # fmt: skip
    assert main(evaluate) == 2
    assert f"--out '{folder}' is being written by another astrl job (pid {pid})" in _one_error_line(capsys)
    assert sorted(p.name for p in folder.iterdir()) == before  # none of them wrote a file there


def test_a_resume_of_a_missing_folder_makes_no_folder(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["train", "--resume", str(missing), "--quiet"]) == 2
    assert str(missing) in _one_error_line(capsys)
    assert not Path(missing).exists()
