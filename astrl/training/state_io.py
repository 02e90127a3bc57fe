"""Checkpoint state files (``state.pt``): written with ``torch.save``, read with ``weights_only=True``.

A checkpoint's state holds only tensors and plain data (dicts, lists, tuples, ints, floats, strings,
booleans, ``None``): model and optimizer tensors, RNG states as tensors and lists of ints, counters,
prompt-stream positions and novelty histories. ``torch.load(..., weights_only=True)`` reads such a file
without unpickling arbitrary objects, so a crafted ``state.pt`` from someone else's run directory
cannot run code when a run is resumed.

Files that need full unpickling (written by older astrl versions, which stored Python and NumPy RNG
states as pickled objects, or holding anything else) are refused with :class:`UnsafeCheckpointError`;
``trust=True`` (``astrl train --resume RUN_DIR --trust-checkpoint``) loads them anyway, for files whose
origin you trust. The next checkpoint the resumed run writes is in the safe format.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import zipfile
from pathlib import Path

import numpy as np
import torch

from astrl.errors import one_line
from astrl.rewards.reference import is_peft_model
from astrl.training.config import ConfigError

STATE_FILE = "state.pt"


MANIFEST_FILE = "manifest.json"


class UnsafeCheckpointError(ConfigError):
    """A checkpoint state file that ``torch.load(..., weights_only=True)`` refuses."""


class DamagedCheckpointError(ConfigError):
    """A checkpoint whose files are missing, truncated or changed since they were written."""


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` through a temporary file: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_manifest(folder: str | Path) -> None:
    """Record the size and SHA-256 of every file of a checkpoint folder (written last, before the folder is renamed)."""
    folder = Path(folder)
    files = {
        str(path.relative_to(folder)): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MANIFEST_FILE
    }
    (folder / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1), encoding="utf-8")


def checkpoint_problem(folder: str | Path) -> str | None:
    """Why a checkpoint folder cannot be trusted (a missing, truncated or changed file), or None.

    Folders written before manifests existed are checked only for a readable ``state.pt``."""
    folder = Path(folder)
    state = folder / STATE_FILE
    if not state.is_file():
        return f"{str(state)!r} is missing"
    manifest = folder / MANIFEST_FILE
    if not manifest.is_file():
        return None if zipfile.is_zipfile(state) else f"{str(state)!r} is not a torch checkpoint (truncated or damaged)"
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        return f"{str(manifest)!r} is unreadable ({type(err).__name__})"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{str(path)!r} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{str(path)!r} has {path.stat().st_size} bytes, {expected['size']} were written (truncated or damaged)"
        if _sha256(path) != expected["sha256"]:
            return f"{str(path)!r} changed since it was written (checksum mismatch)"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_state(state: dict, path: str | Path) -> None:
    """Write a checkpoint state (tensors and plain data only) to ``path``."""
    torch.save(state, path)


def load_state(path: str | Path, *, trust: bool = False) -> dict:
    """Read a checkpoint state with ``weights_only=True``; ``trust=True`` unpickles it fully (opt-in)."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise DamagedCheckpointError(f"{str(path)!r} is not a torch checkpoint (truncated or damaged)")
    if trust:
        return torch.load(path, weights_only=False)
    try:
        return torch.load(path, weights_only=True)
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as err:
        raise DamagedCheckpointError(f"{str(path)!r} cannot be read ({one_line(err)[:120]})") from None
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnsafeCheckpointError(
            f"refusing to load {str(path)!r}: it does not load with torch.load(weights_only=True) ({reason}). "
            "It was written by an older astrl, or it holds objects other than tensors and plain data; a crafted "
            "file of this kind can run code when unpickled. Only if you trust where the run directory came from, "
            "resume it with full unpickling: astrl train --resume RUN_DIR --trust-checkpoint "
            "(resume(run_dir, trust_checkpoint=True) in Python); its next checkpoint is written in the safe format."
        ) from None


def rng_state() -> dict:
    """The global torch, Python and NumPy RNG states as tensors and plain data."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned (or the pickled tuples older checkpoints hold)."""
    torch.set_rng_state(state["torch"])
    python = state["python"]
    if isinstance(python, dict):
        python = (python["version"], tuple(python["state"]), python["gauss"])
    random.setstate(python)
    numpy = state["numpy"]
    if isinstance(numpy, dict):
        keys = np.asarray(numpy["keys"].numpy(), dtype=np.uint32)
        numpy = (numpy["kind"], keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"])
    np.random.set_state(numpy)


def trainable_state(model: torch.nn.Module) -> dict:
    """What a checkpoint keeps of a model: its PEFT adapters, or the whole state dict."""
    if is_peft_model(model):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(model)
    return model.state_dict()


def load_trainable_state(model: torch.nn.Module, state: dict) -> None:
    """Put a :func:`trainable_state` back into ``model``."""
    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, state)
    else:
        model.load_state_dict(state)
