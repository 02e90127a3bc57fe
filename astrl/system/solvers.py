"""Seed-style solvers (``DPO``, ``IPO``, ``PPO``) and their training config over astrl's losses and trainer.

A solver holds a System and its loss; :class:`astrl.Trainer` binds it to a sampler
(:class:`astrl.training.trainer.SystemSource`) and runs it with the same loop as every other astrl run::

    sampler = ASTSampler(system, PROMPTS, tree_width=2, tree_depth=3)
    solver = DPO(system, beta=0.1)
    Trainer(config=system_train_config(...), sampler=sampler, algorithm=solver).train()

DPO and IPO are :class:`astrl.losses.DPOLoss` / :class:`astrl.losses.IPOLoss` on the System's summed
log-probs. PPO treats each probe as one action: ``log pi(probe | state)`` is the sum of the tester's
per-token log-probs, the ratio is taken against the policy that sampled the tree (not the
baseline), and the advantage is ``reward - V(state)`` with the System's ``value`` function when it
has one, else ``reward - mean(sibling rewards)`` (the other probes from the same state), normalised
over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from torchrl.objectives import LossModule

from astrl._compat import as_list
from astrl.argtypes import require
from astrl.keys import ADVANTAGE, CONTEXT, GROUP, NODES, PROBE, REWARD, SAMPLE_LOG_PROB, VALUE_TARGET
from astrl.losses import DPOLoss, IPOLoss
from astrl.losses.ppo import clipped_surrogate
from astrl.system.base import System, SystemValidationError
from astrl.training.config import TrainConfig
from astrl.training.preference import PreferenceAlgorithm, TreeAlgorithm
from astrl.training.trainer import SystemSource  # noqa: F401  (re-exported)


def system_train_config(
    *,
    lr: float = 3e-3,
    batch_size: int | None = 16,
    optimizer: str = "adamw",
    gradient_accumulation_steps: int = 1,
    training_steps: int = 1024,
    num_episodes_per_experience: int = 8,
    **options,
) -> TrainConfig:
    """The :class:`~astrl.training.TrainConfig` of a System run, from the seed's training settings.

    ``lr`` -> ``lr``; ``batch_size`` (items per gradient step) -> ``minibatch_size``; ``optimizer``
    (adamw, adam, sgd, rmsprop, adagrad) -> ``optimizer``; ``gradient_accumulation_steps`` ->
    ``grad_accum``; ``training_steps`` -> ``total_steps`` (one sampler call and its updates per step);
    ``num_episodes_per_experience`` -> ``prompts_per_step`` (trees per sampler call). Any other
    :class:`TrainConfig` key (``run_dir``, ``seed``, ``epochs``, ``warmup_steps``, ``save_every``, ...)
    passes through. Unlike the seed, the LR warms up over ``warmup_steps`` (default 0 here) and then
    decays linearly to 0. ASTRA-RL calls it ``TrainingConfig``, an alias kept for ported code.
    """
    options.setdefault("warmup_steps", 0)
    options.setdefault("lora", False)
    return TrainConfig(
        lr=lr,
        minibatch_size=batch_size,
        optimizer=optimizer,
        grad_accum=gradient_accumulation_steps,
        total_steps=training_steps,
        prompts_per_step=num_episodes_per_experience,
        **options,
    )


# ASTRA-RL's name of system_train_config (a class there, a function here), so that ported code runs unchanged.
TrainingConfig = system_train_config


class _Solver:
    """What the seed's solvers share: a System, and binding to a sampler for the trainer."""

    def __init__(self, system: System) -> None:
        if not isinstance(system, System):
            raise TypeError(f"{type(self).__name__} needs an astrl.System, got {type(system).__name__}")
        self.system = system

    def _batching(self, sampler, config: TrainConfig) -> dict:
        """Check that ``sampler`` grows trees of this System, size it from the config, return the batching."""
        if getattr(sampler, "system", None) is not self.system:
            raise ValueError(f"the sampler samples a different System than the one {type(self).__name__} trains")
        if not sampler.num_trees_set and sampler.num_trees != config.prompts_per_step:
            sampler.set_num_trees(config.prompts_per_step)
        return {"epochs": config.epochs, "minibatches": config.minibatches, "minibatch_size": config.minibatch_size}


class DPO(_Solver):
    """Direct Preference Optimisation on a System's tree-sampled pairs (:class:`astrl.losses.DPOLoss`)."""

    loss_class = DPOLoss

    def __init__(self, system: System, beta: float | None = None) -> None:
        super().__init__(system)
        self.loss_module = self.loss_class(system, beta=beta)
        self.beta = self.loss_module.beta

    def bind(self, sampler, config: TrainConfig) -> PreferenceAlgorithm:
        """The trainer's algorithm: this solver's loss on ``sampler``'s pairs."""
        return PreferenceAlgorithm(sampler, self.loss_module, self.system.parameters, **self._batching(sampler, config))


class IPO(DPO):
    """Identity Preference Optimisation on a System's tree-sampled pairs (:class:`astrl.losses.IPOLoss`)."""

    loss_class = IPOLoss


class SequencePPOLoss(LossModule):
    """Clipped PPO with one action per probe, on a System's log-probs.

    ``log_ratio = sum_t log pi(probe_t) - sample_log_prob``; ``loss_objective`` is
    :func:`astrl.losses.ppo.clipped_surrogate` over the batch; with a value function
    ``loss_critic = value_coef * mean((V(state) - value_target)**2)``.

    Reads ``context``, ``probe``, ``sample_log_prob``, ``advantage`` and (with a value function)
    ``value_target``; ``set_keys`` renames them.
    """

    @dataclass
    class _AcceptedKeys:
        context: NestedKey = CONTEXT
        probe: NestedKey = PROBE
        sample_log_prob: NestedKey = SAMPLE_LOG_PROB
        advantage: NestedKey = ADVANTAGE
        value_target: NestedKey = VALUE_TARGET

    default_keys = _AcceptedKeys

    def __init__(self, system: System, *, clip_epsilon: float = 0.1, value_coef: float = 1.0) -> None:
        super().__init__()
        require("clip_epsilon", clip_epsilon, above=0)
        require("value_coef", value_coef, at_least=0)
        object.__setattr__(self, "system", system)
        self.clip_epsilon, self.value_coef = float(clip_epsilon), float(value_coef)
        self.has_value = callable(getattr(system, "value", None))

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        pass

    def state_values(self, contexts: list[str], probes: list[str]) -> torch.Tensor:
        """``V(state)`` per sample from ``system.value``: ``(B,)``, ``(B, 1)`` or per-token ``(B, T)`` (first token's)."""
        values = self.system.value(contexts, probes)
        if not isinstance(values, torch.Tensor) or values.shape[0] != len(contexts) or values.dim() > 2:
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise SystemValidationError(
                f"value must return a tensor of shape (B,), (B, 1) or (B, T) for B={len(contexts)}, got {shape}"
            )
        return values.reshape(len(contexts), -1)[:, 0].float()

    def sequence_logprobs(self, contexts: list[str], probes: list[str], *, grad: bool) -> torch.Tensor:
        if grad:
            return self.system._get_tester_logprobs_and_validate(contexts, probes).sum(-1)
        with torch.no_grad():
            name = "get_tester_logprobs"
            return self.system._checked_logprobs(name, self.system.get_tester_logprobs, contexts, probes, grad=None).sum(-1)

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        keys = self.tensor_keys
        contexts, probes = as_list(tensordict.get(keys.context)), as_list(tensordict.get(keys.probe))
        log_probs = self.sequence_logprobs(contexts, probes, grad=True)
        device = log_probs.device
        old = tensordict.get(keys.sample_log_prob).reshape(-1).to(device)
        advantage = tensordict.get(keys.advantage).reshape(-1).to(device)
        mask = torch.ones_like(advantage, dtype=torch.bool)
        log_ratio = log_probs - old
        loss_objective, ratio = clipped_surrogate(log_ratio, advantage, mask, self.clip_epsilon)
        result = {"loss_objective": loss_objective}
        if self.has_value:
            values = self.state_values(contexts, probes).to(device)
            target = tensordict.get(keys.value_target).reshape(-1).to(device)
            result["loss_critic"] = self.value_coef * ((values - target) ** 2).mean()
        with torch.no_grad():
            result["clip_fraction"] = ((ratio - 1).abs() > self.clip_epsilon).float().mean()
            result["approx_kl"] = ((ratio - 1) - log_ratio).mean()
        return TensorDict(result, batch_size=[])


class SystemPPO(TreeAlgorithm):
    """The trainer's PPO over a System: every node of the sampled trees is a sample."""

    name = "ppo"

    def __init__(self, sampler, loss_module: SequencePPOLoss, parameters, **batching) -> None:
        super().__init__(sampler, parameters, **batching)
        self.loss_module = loss_module

    def collect(self) -> tuple[TensorDictBase, TensorDictBase]:
        result = self.sampler.sample()
        nodes = result[NODES]
        contexts, probes = as_list(nodes[CONTEXT]), as_list(nodes[PROBE])
        rewards = nodes[REWARD].reshape(-1).float()
        n = rewards.numel()
        batch = TensorDict({CONTEXT: contexts, PROBE: probes, REWARD: rewards}, batch_size=[n])
        batch[SAMPLE_LOG_PROB] = self.loss_module.sequence_logprobs(contexts, probes, grad=False).detach().float().cpu()
        if self.loss_module.has_value:
            with torch.no_grad():
                baseline = self.loss_module.state_values(contexts, probes).detach().float().cpu()
            batch[VALUE_TARGET] = rewards
        else:  # the siblings (probes from the same state) share a group id
            groups = nodes[GROUP].reshape(-1)
            sums = torch.zeros(int(groups.max()) + 1).index_add_(0, groups, rewards)
            counts = torch.zeros_like(sums).index_add_(0, groups, torch.ones_like(rewards))
            baseline = (sums / counts)[groups]
        advantage = rewards - baseline
        if n > 1:
            advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
        batch[ADVANTAGE] = advantage
        return batch, result

    def loss(self, minibatch: TensorDictBase) -> TensorDictBase:
        return self.loss_module(minibatch)


class PPO(_Solver):
    """PPO on a System's tree-sampled probes (one action per probe; see the module docstring).

    Args:
        system: the System; if it defines ``value(contexts, continuations)`` it is the critic
            (its parameters must be in ``system.parameters()``).
        clip_range: the ratio clip ``eps``; vf_loss_coef: weight of the value loss.
    """

    def __init__(self, system: System, clip_range: float = 0.1, vf_loss_coef: float = 1.0) -> None:
        super().__init__(system)
        self.loss_module = SequencePPOLoss(system, clip_epsilon=clip_range, value_coef=vf_loss_coef)

    def bind(self, sampler, config: TrainConfig) -> SystemPPO:
        """The trainer's algorithm: this solver's loss on every node ``sampler`` grows."""
        return SystemPPO(sampler, self.loss_module, self.system.parameters, **self._batching(sampler, config))
