"""DPO / IPO on tree-sampled preference pairs (the ASTPrompter recipe: IPO, beta=0.01, width 2, depth 3).

Per step the :class:`~astrl.sampling.TreeSampler` grows ``prompts_per_step`` trees of
``tree_width`` probes per state and ``tree_depth`` levels; each sibling group gives one pair
(best vs worst reward, skipped below ``min_reward_gap``). Reference log-probs are computed once
per batch, then ``epochs`` passes of the loss over ``minibatches``. With ``weak_supervision: p``,
a batch is forced with probability ``p`` (:class:`~astrl.sampling.WeakSupervision`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from tensordict import TensorDictBase

from astrl._compat import as_list
from astrl.losses import DPOLoss, IPOLoss
from astrl.sampling import TreeSampler, WeakSupervision
from astrl.training.config import TrainConfig
from astrl.training.setup import RunModels, conversation_parts


class Preference:
    """The DPO / IPO algorithm of the trainer (its own prompt stream lives in the sampler)."""

    uses_env = False

    def __init__(self, config: TrainConfig, models: RunModels, stream) -> None:
        self.config = config
        self.models = models
        self.name = config.algorithm
        tester, target, scorers, settings = conversation_parts(config, models)
        self.sampler = TreeSampler(
            tester,
            target,
            scorers,
            stream,
            num_trees=config.prompts_per_step,
            tree_width=config.tree_width,
            tree_depth=config.tree_depth,
            min_reward_gap=config.min_reward_gap,
            **settings,
        )
        self.weak = None
        if config.weak_supervision > 0:
            self.weak = WeakSupervision.from_source(
                config.weak_supervision_prompts,
                models.tester.tokenizer,
                probability=config.weak_supervision,
                max_new_tokens=config.max_new_tokens,
                seed=config.seed,
            )
        loss_class = DPOLoss if config.algorithm == "dpo" else IPOLoss
        self.loss_module = loss_class(
            models.tester.model, models.reference, beta=config.beta, max_length=models.tester.context_window
        )

    def parameter_groups(self, lr: float) -> list[dict]:
        return [{"params": [p for p in self.models.tester.model.parameters() if p.requires_grad], "lr": lr}]

    def collect(self) -> tuple[TensorDictBase, TensorDictBase]:
        self.models.tester.model.eval()
        result = self.sampler.sample()
        pairs = result["pairs"]
        if self.weak is not None:
            pairs, forced = self.weak(result)
            result["pairs"], result["num_forced"] = pairs, torch.tensor(forced)
        if pairs.batch_size[0] > 0:
            self.loss_module.reference_logprobs(pairs)
        return pairs, result

    def minibatches(self, batch: TensorDictBase, generator: torch.Generator) -> Iterator[TensorDictBase]:
        if batch.batch_size[0] == 0:
            return
        for _ in range(self.config.epochs):
            order = torch.randperm(batch.numel(), generator=generator)
            for chunk in order.chunk(min(self.config.minibatches, batch.numel())):
                yield batch[chunk]

    def loss(self, minibatch: TensorDictBase) -> TensorDictBase:
        return self.loss_module(minibatch)

    @staticmethod
    def metrics(result: TensorDictBase) -> dict:
        nodes = result["nodes"]
        rewards = nodes["reward"].reshape(-1).float()
        row = {"reward_mean": float(rewards.mean()), "reward_max": float(rewards.max()), "turns": rewards.numel()}
        for name in nodes["scores"].keys():
            scores = nodes["scores", name].reshape(-1).float()
            row[f"score_{name}"] = float(scores.mean())
            row[f"harmful_rate_{name}"] = float((scores > 0.5).float().mean())
        row["pairs"] = int(result["num_pairs"])
        row["pairs_skipped"] = int(result["num_skipped"])
        if "num_forced" in result.keys():
            row["pairs_forced"] = int(result["num_forced"])
        return row

    @staticmethod
    def samples(result: TensorDictBase) -> list[dict]:
        nodes = result["nodes"]
        probes, replies = as_list(nodes["probe"]), as_list(nodes["reply"])
        rewards, depths = nodes["reward"].reshape(-1).tolist(), nodes["depth"].reshape(-1).tolist()
        openers = as_list(result["openers"])
        trees = nodes["tree"].reshape(-1).tolist()
        return [
            {"opener": openers[t], "turn": d - 1, "probe": p, "response": r, "reward": w}
            for t, d, p, r, w in zip(trees, depths, probes, replies, rewards, strict=True)
        ]

    def state_dict(self) -> dict:
        state = {"sampler": self.sampler.state_dict()}
        if self.weak is not None:
            state["weak"] = self.weak.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        if self.weak is not None:
            if "weak" not in state:
                raise KeyError("the checkpoint has no weak supervision state (it was saved with weak_supervision: 0)")
            self.weak.load_state_dict(state["weak"])
