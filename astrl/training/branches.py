"""RL branches of one warm start: try a few, go on with the best (``branches``, ``branch_steps``).

A chat run settles on its probe's opening within its first few RL steps and keeps it, and which
opening it settles on decides how far it gets. So before the run goes on, ``branches`` branches of
its step-0 checkpoint each train ``branch_steps`` steps, branch ``b`` with seed ``seed + 100 b``
(every draw after step 0 from that seed, the openers in the run's order; branch 0 keeps the run's own
draws), on the run's learning-rate schedule over ``total_steps``. The run then continues the branch
whose training reward is highest over the second half of its steps:

    score_b = mean(reward_mean_t for t in (branch_steps // 2, branch_steps])

Each branch is a run directory of its own, ``RUN_DIR/branches/seed_N/`` (its metrics, samples and
checkpoints), trained on the run's models in this process; ``RUN_DIR/branches.json`` records the
scores and the choice. The chosen branch's logs and step-``branch_steps`` checkpoint become the run's,
and so is its seed (``config.yaml`` then names it, with the run's ``split_seed``, so the openers' split
stays the run's): the run from then on is that branch continued exactly. A run stopped among its branches resumes
them from their own checkpoints; the choice reads only the training reward, never a judge.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from astrl.archive import ARCHIVE_FILE
from astrl.training.state_io import atomic_write_text

BRANCHES_DIR = "branches"
BRANCHES_FILE = "branches.json"
SEED_STRIDE = 100  # branch b's seed: the run's seed + 100 b


def branch_seed(seed: int, index: int) -> int:
    """The seed of branch ``index`` (0: the run's own)."""
    return seed + SEED_STRIDE * index


def branch_score(rows: list[dict], steps: int) -> float:
    """The mean ``reward_mean`` of a branch's steps after ``steps // 2`` up to ``steps`` (NaN rows
    skipped); -inf when none is left, so such a branch is never chosen over one that has a score."""
    late = [r.get("reward_mean") for r in rows if steps // 2 < int(r["step"]) <= steps]
    values = [float(v) for v in late if v not in (None, "") and not math.isnan(float(v))]
    return sum(values) / len(values) if values else -math.inf


def choose(scores: list[float]) -> int:
    """The index of the highest score; the lowest index among equal ones."""
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def train_branches(trainer, step0: Path, open_branch: Callable[[int, Path, bool], Any]) -> dict:
    """Train ``trainer``'s branches of its step-0 checkpoint ``step0`` (each up to ``branch_steps``,
    resuming those already begun), record them in ``branches.json`` and return the chosen one's record
    (``seed``, ``folder``, ``score``). ``open_branch(seed, folder, own_draws)`` gives the trainer of a
    branch at its newest checkpoint (at ``step0`` when it has none; ``own_draws``: reseeded)."""
    from astrl.prefill import clear_turn_caches

    config = trainer.config
    record = trainer.run_dir / BRANCHES_FILE
    if not trainer.resumed:  # a new run in this folder: no branch of an earlier one goes on
        shutil.rmtree(trainer.run_dir / BRANCHES_DIR, ignore_errors=True)
        record.unlink(missing_ok=True)
    # the seeds come from the run's seed as the branches began (a resume after the choice names the branch's)
    base = json.loads(record.read_text(encoding="utf-8"))["seed"] if record.is_file() else config.seed
    begun = {"seed": base, "branch_steps": config.branch_steps, "chosen": None, "branches": []}
    atomic_write_text(record, json.dumps(begun, indent=2) + "\n")
    records = []
    for index in range(config.branches):
        seed = branch_seed(base, index)
        branch = open_branch(seed, trainer.run_dir / BRANCHES_DIR / f"seed_{seed}", seed != base)
        if trainer.progress:
            print(f"branch {index + 1} of {config.branches} (seed {branch.config.seed}): steps 1-{config.branch_steps}")
        if branch.step < config.branch_steps:
            branch.train(until=config.branch_steps)
        clear_turn_caches(trainer.models.tester.model, trainer.models.target.model)
        score = branch_score(_rows(branch.run_dir / "metrics.csv"), config.branch_steps)
        records.append({"seed": branch.config.seed, "folder": str(branch.run_dir), "score": score})
    chosen = choose([r["score"] for r in records])
    summary = {"seed": base, "branch_steps": config.branch_steps, "chosen": chosen, "branches": records}
    atomic_write_text(record, json.dumps(summary, indent=2) + "\n")
    if trainer.progress:
        print(f"branches: going on with seed {records[chosen]['seed']} (score {records[chosen]['score']:.4f})")
    return records[chosen]


def adopt(checkpoint: Path, run_dir: Path, config) -> Path:
    """Make the branch whose checkpoint is ``checkpoint`` the run's: its logs (metrics, samples,
    attacks), then ``config`` (the run's, with the branch's seed) as ``config.yaml``, then the checkpoint
    itself, whose presence marks the adoption done; returns the run's copy of it."""
    branch_dir = checkpoint.parent.parent
    for name in ("metrics.csv", "samples.jsonl", ARCHIVE_FILE):
        if (branch_dir / name).is_file():
            shutil.copyfile(branch_dir / name, run_dir / name)
    config.save(run_dir / "config.yaml")
    folder = run_dir / checkpoint.parent.name / checkpoint.name
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoint, tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder
