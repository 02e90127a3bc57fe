"""``ASTSampler``: astrl's tree sampler driven by a :class:`~astrl.system.System`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from tensordict import TensorDict

from astrl._compat import as_list
from astrl.keys import CONTEXT, PROBE, QUERY, REPLY, REWARD, REWARD_TERMS, SCORES, TARGET_RESPONSE, TEXT_PROMPT
from astrl.prompts import PromptStream
from astrl.sampling.tree import TreeSampler, check_tree_shape
from astrl.system.adapter import SystemEnv, SystemPolicy
from astrl.system.base import System


class ASTSampler(TreeSampler):
    """Grow trees of probes with a System and turn sibling groups into preference pairs.

    The same :class:`~astrl.sampling.TreeSampler` as astrl's DPO / IPO training (same batching per
    level, pairing rule, seeding and state), with the System's tester as the policy
    (:class:`SystemPolicy`) and its target, ``advance`` and ``reward`` as the environment
    (:class:`SystemEnv`). Nodes and pairs carry text: ``context`` (the state a probe followed),
    ``chosen_probe`` / ``rejected_probe``, rewards, depth and indices (no token ids: the System
    tokenizes for itself).

    Args:
        system: the System.
        prompts: opening states (a list of strings) or a :class:`~astrl.prompts.PromptStream`.
        tree_width: probes per state (>= 2); tree_depth: levels (>= 1).
        num_trees: trees per :meth:`sample`; ``None`` lets the :class:`~astrl.Trainer` set it from
            its config (``num_episodes_per_experience`` / ``prompts_per_step``), 1 otherwise.
        min_reward_gap: a sibling group pairs only when best - worst >= this (ties never pair).
        seed: seeds the opener order and each call's sampling (forked RNG); ``None``: global RNG.
    """

    def __init__(
        self,
        system: System,
        prompts: Sequence[str] | PromptStream,
        tree_width: int = 2,
        tree_depth: int = 3,
        *,
        num_trees: int | None = None,
        min_reward_gap: float = 0.0,
        seed: int | None = 0,
    ) -> None:
        if not isinstance(system, System):
            raise TypeError(f"ASTSampler needs an astrl.System, got {type(system).__name__}")
        check_tree_shape(tree_width, tree_depth, min_reward_gap)
        if isinstance(prompts, (str, bytes)):
            raise TypeError("prompts must be a list of opening states, got a single string")
        self.system = system
        self.tester = SystemPolicy(system)
        self.transforms = []  # the System's step replaces the env transforms (no scorer, no novelty terms)
        self.mode = "text"
        self.tree_width, self.tree_depth = int(tree_width), int(tree_depth)
        self.min_reward_gap = float(min_reward_gap)
        self.seed, self.calls = seed, 0
        self.num_trees_set = num_trees is not None
        self._prompts = prompts
        self.set_num_trees(num_trees or (prompts.batch_size if isinstance(prompts, PromptStream) else 1))

    def set_num_trees(self, num_trees: int) -> None:
        """Trees per call (rebuilds the opener stream; only before the first :meth:`sample`)."""
        if num_trees < 1:
            raise ValueError(f"num_trees must be >= 1, got {num_trees}")
        if self.calls:
            raise RuntimeError("num_trees cannot change after sampling started")
        prompts = self._prompts
        if isinstance(prompts, PromptStream):
            if prompts.batch_size != num_trees:
                raise ValueError(f"PromptStream batch_size {prompts.batch_size} differs from num_trees {num_trees}")
            self.prompt_stream = prompts
        else:
            texts = list(prompts)
            if not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompts must be a non-empty list of strings")
            self.prompt_stream = PromptStream(texts, num_trees, seed=self.seed or 0)
        self.num_trees = int(num_trees)
        self.env = SystemEnv(self.system, batch_size=num_trees, max_turns=self.tree_depth)

    # -- the System in place of the LLM policies -------------------------------------------------
    @contextlib.contextmanager
    def _frozen(self) -> Iterator[None]:
        yield  # a System manages its own modules' modes

    def _device(self) -> torch.device:
        device = getattr(self.system, "device", None)
        return torch.device(device) if device is not None else torch.device("cpu")

    def _roots(self, openers: list[str]) -> list[str]:
        return as_list(self.env.reset(TensorDict({QUERY: openers}, batch_size=[len(openers)]))[TEXT_PROMPT])

    def _expand(self, states: list[str]) -> tuple[dict, list[str]]:
        children = [s for s in states for _ in range(self.tree_width)]
        n = len(children)
        out = self.tester(TensorDict({TEXT_PROMPT: children}, batch_size=[n]))
        nxt = self.env._step(out)  # level-wide: one target call, one reward call
        level = {
            CONTEXT: children,
            PROBE: as_list(nxt[PROBE]),
            REPLY: as_list(nxt[TARGET_RESPONSE]),
            REWARD: nxt[REWARD].reshape(-1).float().cpu(),
            SCORES: TensorDict(batch_size=[n]),
            REWARD_TERMS: None,
        }
        return level, as_list(nxt[TEXT_PROMPT])

    def state_dict(self) -> dict:
        """The tree sampler's state plus the System's generation call count (when it keeps one)."""
        state = super().state_dict()
        if isinstance(getattr(self.system, "calls", None), int):
            state["system_calls"] = self.system.calls
        return state

    def load_state_dict(self, state) -> None:
        super().load_state_dict(state)
        if "system_calls" in state:
            self.system.calls = int(state["system_calls"])
