"""DPO / IPO on tree-sampled preference pairs (the ASTPrompter recipe: IPO, beta=0.01, width 2, depth 3).

Per step the :class:`~astrl.sampling.TreeSampler` grows ``prompts_per_step`` trees of
``tree_width`` probes per state and ``tree_depth`` levels; each sibling group gives one pair
(best vs worst reward, skipped below ``min_reward_gap``). Reference log-probs are computed once
per batch, then ``epochs`` passes of the loss over ``minibatches``. With ``weak_supervision: p``,
a batch is forced with probability ``p`` (:class:`~astrl.sampling.WeakSupervision`).

:class:`TreeAlgorithm` is what every tree-sampled algorithm shares (sampling, minibatches,
metrics, samples, state); :class:`PreferenceAlgorithm` adds the DPO / IPO loss. The same classes run
astrl's configs and user Systems (:mod:`astrl.system`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from tensordict import TensorDictBase

from astrl._compat import as_list
from astrl.archive import conversation_turns
from astrl.envs.transforms import ScoreReward
from astrl.keys import (
    DEPTH,
    NODES,
    NUM_FORCED,
    NUM_PAIRS,
    NUM_SKIPPED,
    OPENERS,
    PAIRS,
    PARENT,
    PROBE,
    REPLY,
    REWARD,
    SCORES,
    TREE,
)
from astrl.losses import DPOLoss, IPOLoss, PreferenceLoss
from astrl.sampling import TreeSampler, WeakSupervision
from astrl.training.algorithm import Algorithm
from astrl.training.batches import shuffled_minibatches, turn_metrics
from astrl.training.config import TrainConfig
from astrl.training.setup import RunModels, training_conversation


class TreeAlgorithm(Algorithm):
    """An algorithm of the trainer fed by a tree sampler (no env, no collector); subclasses add
    ``collect`` and ``loss``.

    Args:
        sampler: a :class:`~astrl.sampling.TreeSampler` (or :class:`astrl.system.ASTSampler`).
        parameters: returns the trainable parameters.
        epochs, minibatches, minibatch_size: passes over each batch and how it is split.
    """

    name = "tree"

    def __init__(
        self,
        sampler: TreeSampler,
        parameters: Callable[[], Iterable[torch.nn.Parameter]],
        *,
        epochs: int = 1,
        minibatches: int = 1,
        minibatch_size: int | None = None,
    ) -> None:
        self.sampler = sampler
        self._parameters = parameters
        self.epochs, self.count, self.size = int(epochs), int(minibatches), minibatch_size

    def parameter_groups(self, lr: float) -> list[dict]:
        params = [p for p in self._parameters() if p.requires_grad]
        if not params:
            raise ValueError("no trainable parameters (requires_grad=False everywhere)")
        return [{"params": params, "lr": lr}]

    def minibatches(self, batch: TensorDictBase, generator: torch.Generator) -> Iterator[TensorDictBase]:
        return shuffled_minibatches(batch, generator, epochs=self.epochs, count=self.count, size=self.size)

    @staticmethod
    def metrics(result: TensorDictBase) -> dict:
        return turn_metrics(result[NODES])

    @staticmethod
    def samples(result: TensorDictBase) -> list[dict]:
        nodes = result[NODES]
        probes, replies = as_list(nodes[PROBE]), as_list(nodes[REPLY])
        rewards, depths = nodes[REWARD].reshape(-1).tolist(), nodes[DEPTH].reshape(-1).tolist()
        openers = as_list(result[OPENERS])
        trees = nodes[TREE].reshape(-1).tolist()
        return [
            {"opener": openers[t], "turn": d - 1, "probe": p, "response": r, "reward": w}
            for t, d, p, r, w in zip(trees, depths, probes, replies, rewards, strict=True)
        ]

    @property
    def reward_scorer(self) -> str | None:
        """Name of the scorer that gives the reward (None for a System, whose reward is its own)."""
        return next((t.reward_scorer for t in self.sampler.transforms if isinstance(t, ScoreReward)), None)

    @staticmethod
    def turn_records(result: TensorDictBase) -> list[dict]:
        """One record per tree node for the attack archive; its conversation is the path from the opener."""
        nodes = result[NODES]
        probes, replies = as_list(nodes[PROBE]), as_list(nodes[REPLY])
        parents, trees = nodes[PARENT].reshape(-1).tolist(), nodes[TREE].reshape(-1).tolist()
        rewards, openers = nodes[REWARD].reshape(-1).tolist(), as_list(result[OPENERS])
        scores = {name: nodes[SCORES, name].reshape(-1).tolist() for name in nodes[SCORES].keys()}
        records = []
        for i, (probe, reply) in enumerate(zip(probes, replies, strict=True)):
            path, node = [], parents[i]
            while node >= 0:
                path.append((probes[node], replies[node]))
                node = parents[node]
            records.append(
                {
                    "probe": probe,
                    "reply": reply,
                    "conversation": conversation_turns(openers[trees[i]], path[::-1]),
                    "scores": {name: values[i] for name, values in scores.items()},
                    "reward": rewards[i],
                    "turn": len(path),
                }
            )
        return records

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])


class PreferenceAlgorithm(TreeAlgorithm):
    """DPO / IPO: best-vs-worst sibling pairs from the tree sampler, reference log-probs once per batch."""

    def __init__(
        self, sampler: TreeSampler, loss_module: PreferenceLoss, parameters, *, weak: WeakSupervision | None = None, **batching
    ) -> None:
        super().__init__(sampler, parameters, **batching)
        self.loss_module = loss_module
        self.weak = weak
        self.name = "dpo" if isinstance(loss_module, DPOLoss) else "ipo" if isinstance(loss_module, IPOLoss) else "preference"

    @classmethod
    def from_config(cls, config: TrainConfig, models: RunModels, stream) -> PreferenceAlgorithm:
        """The DPO / IPO algorithm of a config run (its prompt stream lives in the sampler)."""
        conversation = training_conversation(config, models, stream, env=False)
        sampler = TreeSampler.from_conversation(conversation, tree_width=config.tree_width, min_reward_gap=config.min_reward_gap)
        loss_class = DPOLoss if config.algorithm == "dpo" else IPOLoss
        loss = loss_class(
            models.tester.model,
            models.reference,
            beta=config.beta,
            max_length=models.tester.context_window,
            share_prompt=config.share_prompt,
        )
        weak = None
        if config.weak_supervision > 0:
            weak = WeakSupervision.from_source(
                config.weak_supervision_prompts,
                models.tester.tokenizer,
                probability=config.weak_supervision,
                max_new_tokens=config.max_new_tokens,
                seed=config.seed,
                clean_under=next(iter(conversation.scorers.values())) if config.reward == "elicit" else None,  # the reward scorer
            )
        return cls(
            sampler,
            loss,
            models.tester.model.parameters,
            weak=weak,
            epochs=config.epochs,
            minibatches=config.minibatches,
            minibatch_size=config.minibatch_size,
        )

    def collect(self) -> tuple[TensorDictBase, TensorDictBase]:
        result = self.sampler.sample()
        pairs = result[PAIRS]
        if self.weak is not None:
            pairs, forced = self.weak(result)
            result[PAIRS], result[NUM_FORCED] = pairs, torch.tensor(forced)
        if pairs.batch_size[0] > 0:
            self.loss_module.reference_logprobs(pairs)
        return pairs, result

    def loss(self, minibatch: TensorDictBase) -> TensorDictBase:
        return self.loss_module(minibatch)

    @staticmethod
    def metrics(result: TensorDictBase) -> dict:
        row = TreeAlgorithm.metrics(result)
        row["pairs"] = int(result[NUM_PAIRS])
        row["pairs_skipped"] = int(result[NUM_SKIPPED])
        if NUM_FORCED in result.keys():
            row["pairs_forced"] = int(result[NUM_FORCED])
        return row

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.weak is not None:
            state["weak"] = self.weak.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.weak is not None:
            if "weak" not in state:
                raise KeyError("the checkpoint has no weak supervision state (it was saved with weak_supervision: 0)")
            self.weak.load_state_dict(state["weak"])
