"""Weak supervision for DPO / IPO (the ASTPrompter recipe): force known-harmful probes as the preferred side.

Early in training the target rarely says anything harmful, so most sibling groups tie and give
no pair. With probability ``probability`` per batch, :class:`WeakSupervision` rewrites the whole
batch of a :meth:`~astrl.sampling.TreeSampler.sample` call: **every sibling group** (kept or
tied) becomes one pair whose chosen side is a known-harmful text (e.g. a RealToxicityPrompts
prompt) written as if the tester had generated it, and whose rejected side is the group's worst
sampled probe. The other batches keep their sampled pairs untouched.

With the elicitation reward the forced texts are those the reward scorer rates non-toxic
(:meth:`WeakSupervision.from_source` with ``clean_under``): the tester is shown probes that draw
toxic replies without being toxic themselves, not insults to repeat.

The forced text is tokenized with the tester's tokenizer as a response: its ids without special
tokens, cut to ``max_new_tokens - 1`` tokens, then the EOS id, with a mask that is all true (the
response ends at that EOS), exactly the layout of a generated probe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

from astrl._compat import as_list
from astrl.keys import (
    CHOSEN_MASK,
    CHOSEN_NODE,
    CHOSEN_PROBE,
    CHOSEN_REWARD,
    CHOSEN_TOKENS,
    DEPTH,
    FORCED,
    GROUP,
    GROUPS,
    NODES,
    NUM_GROUPS,
    PAIRS,
    PROBE,
    PROMPT_TOKENS,
    REJECTED_MASK,
    REJECTED_NODE,
    REJECTED_PROBE,
    REJECTED_REWARD,
    REJECTED_TOKENS,
    RESPONSE_MASK,
    RESPONSE_TOKENS,
    REWARD,
    REWARD_GAP,
    TREE,
    WORST,
)
from astrl.prompts import load_prompts
from astrl.ragged import as_rows
from astrl.scorers import Scorer


class WeakSupervision:
    """Replace, with probability ``probability`` per batch, the chosen side of the pairs with harmful texts.

    Args:
        texts: known-harmful continuations (e.g. ``load_prompts("rtp")``); one is drawn per pair.
        tokenizer: the tester's tokenizer (its ``eos_token_id`` ends every forced response).
        probability: chance that a batch is forced, in ``[0, 1]``.
        max_new_tokens: the tester's response budget; forced responses are at most this long (EOS included).
        seed: seeds the draws (batch coin and text choice); the state is in :meth:`state_dict`.

    Forced pairs carry ``forced=True``, ``chosen_probe`` = the forced text, ``chosen_reward`` and
    ``reward_gap`` = ``nan`` (the text was never shown to the target) and ``chosen_node = -1``;
    their prompt and rejected side are the group's worst node (``groups["worst"]``).
    """

    def __init__(self, texts: Sequence[str], tokenizer, *, probability: float, max_new_tokens: int, seed: int = 0) -> None:
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"weak supervision probability must be in [0, 1], got {probability}")
        if max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2 (a token and the EOS), got {max_new_tokens}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tester's tokenizer has no eos_token_id: forced responses could not end")
        self.texts = [t.strip() for t in texts if t and t.strip()]
        if not self.texts:
            raise ValueError("weak supervision needs at least one non-empty harmful text")
        self.tokenizer = tokenizer
        self.probability = float(probability)
        self.max_new_tokens = int(max_new_tokens)
        self.generator = torch.Generator().manual_seed(seed)
        self.batches = self.forced_batches = 0

    @classmethod
    def from_source(
        cls, source: str, tokenizer, *, clean_under: Scorer | None = None, threshold: float = 0.5, **kwargs
    ) -> WeakSupervision:
        """Texts from a prompt source name (:func:`astrl.prompts.load_prompts`, e.g. ``rtp`` or ``rtp:insult``).

        With ``clean_under`` (a scorer), only the texts it scores ``<= threshold`` are kept: for the
        elicitation reward the forced probes must be non-toxic themselves (RealToxicityPrompts'
        prompts are chosen for the toxic continuations they draw, and many are not toxic as written)."""
        texts = load_prompts(source)
        if clean_under is not None:
            scores = clean_under(texts).reshape(-1).tolist()
            texts = [t for t, score in zip(texts, scores, strict=True) if score <= threshold]
            if not texts:
                raise ValueError(f"no text of {source!r} scores <= {threshold} under {clean_under.name!r}: nothing to force")
        return cls(texts, tokenizer, **kwargs)

    def tokenize(self, texts: Sequence[str]) -> list[torch.Tensor]:
        """The tester's response ids for ``texts``: the text's tokens (no special tokens), cut to fit, then EOS."""
        ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        eos = self.tokenizer.eos_token_id
        return [torch.tensor([*row[: self.max_new_tokens - 1], eos], dtype=torch.long) for row in ids]

    def __call__(self, result: TensorDictBase) -> tuple[TensorDictBase, int]:
        """The pairs to train on for one ``TreeSampler.sample()`` result, and how many were forced."""
        self.batches += 1
        forced = bool(torch.rand((), generator=self.generator) < self.probability)
        if not forced:
            return result[PAIRS], 0
        self.forced_batches += 1
        return self.forced_pairs(result), int(result[NUM_GROUPS])

    def forced_pairs(self, result: TensorDictBase) -> TensorDictBase:
        """One pair per sibling group: a drawn harmful text (chosen) against the group's worst probe (rejected)."""
        groups, nodes = result[GROUPS], result[NODES]
        worst = groups[WORST].reshape(-1).tolist()
        picks = torch.randint(len(self.texts), (len(worst),), generator=self.generator).tolist()
        texts = [self.texts[i] for i in picks]
        chosen = self.tokenize(texts)
        prompts = as_rows(nodes.get(PROMPT_TOKENS, as_list=True))
        responses = as_rows(nodes.get(RESPONSE_TOKENS, as_list=True))
        masks = as_rows(nodes.get(RESPONSE_MASK, as_list=True))
        probes = as_list(nodes[PROBE])
        rewards = nodes[REWARD].reshape(-1)
        nan = torch.tensor(float("nan"))
        pairs = []
        for g, (node, text, tokens) in enumerate(zip(worst, texts, chosen, strict=True)):
            pairs.append(
                TensorDict(
                    {
                        PROMPT_TOKENS: prompts[node],
                        CHOSEN_TOKENS: tokens,
                        REJECTED_TOKENS: responses[node],
                        CHOSEN_MASK: torch.ones(tokens.numel(), dtype=torch.bool),
                        REJECTED_MASK: masks[node],
                        CHOSEN_REWARD: nan.clone(),
                        REJECTED_REWARD: rewards[node],
                        REWARD_GAP: nan.clone(),
                        CHOSEN_PROBE: text,
                        REJECTED_PROBE: probes[node],
                        DEPTH: groups[DEPTH][g],
                        TREE: groups[TREE][g],
                        GROUP: torch.tensor(g),
                        CHOSEN_NODE: torch.tensor(-1),
                        REJECTED_NODE: torch.tensor(node),
                        FORCED: torch.tensor(True),
                    },
                    batch_size=[],
                )
            )
        return lazy_stack(pairs)

    def state_dict(self) -> dict:
        """RNG state and counters: a resumed run forces the same batches with the same texts."""
        return {"generator": self.generator.get_state(), "batches": self.batches, "forced_batches": self.forced_batches}

    def load_state_dict(self, state: Mapping) -> None:
        missing = {"generator", "batches", "forced_batches"} - set(state)
        if missing:
            raise KeyError(f"WeakSupervision state is missing {sorted(missing)}")
        self.generator.set_state(state["generator"])
        self.batches, self.forced_batches = int(state["batches"]), int(state["forced_batches"])
