"""Find and load the tester to evaluate: a model id, a model folder, or a training run directory.

A training run directory looks like::

    RUN_DIR/config.yaml                         resolved training config (tester, target, scorer, ...)
    RUN_DIR/metrics.csv                         training curves (step, reward_mean, loss, ...)
    RUN_DIR/checkpoints/step_000N/tester/       checkpoints
    RUN_DIR/final/tester/                       the final tester

Each ``tester/`` folder is either a full Hugging Face model folder or a PEFT adapter folder
(``adapter_config.json`` naming the base model as :func:`astrl.models.load_model` understands it,
tokenizer files alongside). Adapters are merged into the base weights for evaluation.

A folder written by ``astrl export`` is a plain model folder whose ``astrl_tester.json`` carries the
run's settings that ``astrl eval`` takes as defaults (target, judges, prompts, mode, seeds, system
prompts), so that evaluating the folder and evaluating the run give the same numbers.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from astrl.errors import ConfigError
from astrl.models import (
    LoadedModel,
    ModelLoadError,
    context_window,
    load_model,
    moved_embedded_base,
    prepare_tokenizer,
    unsafe_weights_message,
)
from astrl.names import is_run_dir
from astrl.yaml_data import read_yaml_mapping

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# What ``astrl export`` writes beside the weights: the tester's generation settings and the run's eval defaults.
EXPORT_SETTINGS = "astrl_tester.json"


@dataclass
class TesterSource:
    """Where the tester comes from.

    ``model`` is what gets loaded (a model id or folder); ``run_dir`` and ``run_config`` are set when
    the tester was given as a training run directory, and ``checkpoint`` names the folder used.
    """

    spec: str
    model: str
    run_dir: Path | None = None
    run_config: dict = field(default_factory=dict)
    checkpoint: str | None = None


def read_run_config(run_dir: Path) -> dict:
    """The run's resolved ``config.yaml`` as a dict."""
    try:
        return read_yaml_mapping(run_dir / "config.yaml")
    except ConfigError as err:
        raise ModelLoadError(str(err)) from None


def checkpoint_names(run_dir: Path) -> list[str]:
    """Checkpoint folder names under ``RUN_DIR/checkpoints`` that hold a tester, sorted."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / "tester").is_dir() and p.name.removeprefix("step_").isdigit())


def _tester_folder(path: Path) -> Path:
    """A checkpoint folder (holding ``tester/``) or the tester folder itself."""
    return path / "tester" if (path / "tester").is_dir() else path


def resolve_tester(spec: str, checkpoint: str | None = None) -> TesterSource:
    """Work out which model to load for ``--tester spec [--checkpoint checkpoint]``."""
    path = Path(spec).expanduser()
    if not is_run_dir(path):
        if checkpoint is not None:
            raise ValueError(f"--checkpoint {checkpoint!r} needs a training run directory as tester, got {spec!r}")
        return TesterSource(spec=spec, model=spec, run_config=exported_defaults(path))
    config = read_run_config(path)
    available = checkpoint_names(path)
    if checkpoint is None:
        folder, name = path / "final" / "tester", "final"
        if not folder.is_dir():
            raise ModelLoadError(
                f"run directory {spec!r} has no final/tester folder; pass --checkpoint with one of {available or '(none found)'}"
            )
    else:
        by_name = path / "checkpoints" / checkpoint
        candidate = by_name if by_name.is_dir() else Path(checkpoint).expanduser()
        if not candidate.is_dir():
            raise ModelLoadError(
                f"checkpoint {checkpoint!r} is neither in {path / 'checkpoints'} nor a folder; available: {available or '(none)'}"
            )
        folder, name = _tester_folder(candidate), checkpoint
    return TesterSource(spec=spec, model=str(folder), run_dir=path, run_config=config, checkpoint=name)


def exported_defaults(folder: Path) -> dict:
    """The run settings an ``astrl export`` folder carries (``EXPORT_SETTINGS``'s ``eval_defaults``:
    target, judges, prompts, mode, seeds, test fraction, system prompts, turns and lengths, training scorer);
    ``{}`` for any other folder."""
    path = folder / EXPORT_SETTINGS
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{str(path)!r} is not valid JSON ({type(err).__name__})") from None
    defaults = settings.get("eval_defaults") if isinstance(settings, dict) else None
    if not isinstance(defaults, dict):
        raise ModelLoadError(f"{str(path)!r} holds no 'eval_defaults' mapping")
    return defaults


def is_adapter_folder(path: str | Path) -> bool:
    return (Path(path).expanduser() / "adapter_config.json").is_file()


def load_adapter_model(folder: str | Path, *, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load a PEFT adapter folder onto its base model and merge it into the weights."""
    folder = Path(folder).expanduser()
    try:
        config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{folder / 'adapter_config.json'} is not valid JSON: {err.msg}") from None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(base, str) or not base:
        raise ModelLoadError(f"{folder / 'adapter_config.json'} names no base_model_name_or_path")
    try:
        from peft import PeftModel
    except ImportError:
        raise ModelLoadError(f"{folder} is a PEFT adapter: loading it needs the peft package (pip install peft)") from None
    base = moved_embedded_base(base)  # written on another machine: its converted folder is not here
    loaded = load_model(base, dtype=dtype, device=device)
    tokenizer = loaded.tokenizer
    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        prepare_tokenizer(tokenizer, loaded.model)
    rows = loaded.model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        loaded.model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    try:
        model = PeftModel.from_pretrained(loaded.model, str(folder), is_trainable=False).merge_and_unload()
    except pickle.UnpicklingError:
        raise ModelLoadError(unsafe_weights_message(str(folder))) from None
    except (OSError, ValueError, RuntimeError) as err:
        raise ModelLoadError(f"could not apply the adapter in {folder} to {base!r}: {err}") from None
    model.eval()
    return LoadedModel(str(folder), model, tokenizer, context_window(model, tokenizer))


def load_tester(source: TesterSource, *, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load the model named by a :class:`TesterSource` (adapters merged)."""
    if is_adapter_folder(source.model):
        return load_adapter_model(source.model, dtype=dtype, device=device)
    return load_model(source.model, dtype=dtype, device=device)
