"""Any :class:`~astrl.system.System` as a TorchRL environment and a TorchRL policy.

* :class:`SystemPolicy` (a ``TensorDictModuleBase``) reads the states at ``("text", "prompt")``
  and writes the tester's probes at ``("text", "response")`` through
  ``system._rollout_prompt_with_tester_and_validate``.
* :class:`SystemEnv` (an ``EnvBase``) holds one text state per batch element. ``reset`` takes the
  openers at ``"query"``; ``step`` reads the probe, asks the target (``rollout_prompt_with_target``
  on ``advance(state, probe, "")``, what the target reads), scores with ``system.reward`` and moves
  to ``advance(state, probe, response)``. Step outputs: ``probe``, ``target_response``,
  ``context`` (the state the probe followed), ``reward`` (``(*batch, 1)``), ``done`` after
  ``max_turns``.

Both are ordinary TorchRL components: ``env.rollout(max_steps, policy)``, TorchRL transforms and
collectors work on them, and :class:`astrl.system.ASTSampler` grows preference trees with them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.data import Bounded, Composite, NonTensor, Unbounded
from torchrl.envs import EnvBase

from astrl._compat import as_list
from astrl.keys import CONTEXT, DONE, PROBE, QUERY, REWARD, TARGET_RESPONSE, TERMINATED, TEXT, TEXT_PROMPT, TEXT_RESPONSE
from astrl.system.base import System


class SystemPolicy(TensorDictModuleBase):
    """The tester of a System as a TorchRL policy: ``("text", "prompt")`` -> ``("text", "response")``."""

    def __init__(self, system: System) -> None:
        super().__init__()
        if not isinstance(system, System):
            raise TypeError(f"SystemPolicy needs an astrl.System, got {type(system).__name__}")
        self.system = system
        self.in_keys = [TEXT_PROMPT]
        self.out_keys = [TEXT_RESPONSE]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        states = as_list(tensordict.get(TEXT_PROMPT))
        probes = self.system._rollout_prompt_with_tester_and_validate(states)
        tensordict.set(TEXT_RESPONSE, probes)
        return tensordict


class SystemEnv(EnvBase):
    """A System's conversation as a batched TorchRL environment (text states).

    Args:
        system: the System (its ``advance``, target rollout and ``reward`` drive the step).
        batch_size: number of conversations run side by side.
        max_turns: tester turns per conversation (``done`` after that many steps).
    """

    batch_locked = False

    def __init__(self, system: System, *, batch_size: int = 1, max_turns: int = 1) -> None:
        if not isinstance(system, System):
            raise TypeError(f"SystemEnv needs an astrl.System, got {type(system).__name__}")
        if batch_size < 1 or max_turns < 1:
            raise ValueError(f"batch_size and max_turns must be >= 1, got {batch_size} and {max_turns}")
        super().__init__(batch_size=torch.Size([batch_size]))
        self.system, self.max_turns = system, int(max_turns)
        shape = self.batch_size
        self.observation_spec = Composite(
            {
                TEXT: Composite(prompt=NonTensor(shape=shape, example_data="state"), shape=shape),
                PROBE: NonTensor(shape=shape, example_data="probe"),
                TARGET_RESPONSE: NonTensor(shape=shape, example_data="reply"),
                CONTEXT: NonTensor(shape=shape, example_data="state"),
                "turn": Bounded(0, max_turns, shape=(*shape, 1), dtype=torch.long),
            },
            shape=shape,
        )
        self.action_spec = Composite(
            {TEXT: Composite(response=NonTensor(shape=shape, example_data="probe"), shape=shape)}, shape=shape
        )
        self.reward_spec = Unbounded(shape=(*shape, 1))

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        if tensordict is None or QUERY not in tensordict.keys():
            raise KeyError("SystemEnv.reset needs the openers: env.reset(TensorDict(query=[...], batch_size=[B]))")
        openers = as_list(tensordict[QUERY])
        return self._observation(
            openers, [""] * len(openers), [""] * len(openers), [""] * len(openers), torch.zeros(len(openers), 1, dtype=torch.long)
        )

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        states = as_list(tensordict.get(TEXT_PROMPT))
        probes = as_list(tensordict.get(TEXT_RESPONSE))
        target_prompts = self.system._advance_and_validate(states, probes, [""] * len(states))
        replies = self.system._rollout_prompt_with_target_and_validate(target_prompts)
        rewards = self.system._reward_and_validate(states, probes, replies)
        following = self.system._advance_and_validate(states, probes, replies)
        turn = tensordict.get("turn", torch.zeros(len(states), 1, dtype=torch.long)) + 1
        out = self._observation(following, probes, replies, states, turn)
        out.set(REWARD, rewards.reshape(-1, 1))
        done = turn >= self.max_turns
        out.set(DONE, done)
        out.set(TERMINATED, done.clone())
        return out

    @staticmethod
    def _observation(states: Sequence[str], probes, replies, contexts, turn: torch.Tensor) -> TensorDict:
        n = len(states)
        return TensorDict(
            {
                TEXT_PROMPT: list(states),
                PROBE: list(probes),
                TARGET_RESPONSE: list(replies),
                CONTEXT: list(contexts),
                "turn": turn,
                DONE: torch.zeros(n, 1, dtype=torch.bool),
                TERMINATED: torch.zeros(n, 1, dtype=torch.bool),
            },
            batch_size=[n],
        )

    def _set_seed(self, seed: int | None) -> None:
        if seed is not None and hasattr(self.system, "seed"):
            self.system.seed = int(seed)
