"""Collection over Ray: TorchRL ``RayLLMCollector`` workers that each run a shard of the batch.

Each worker is a Ray actor holding a TorchRL ``LLMCollector`` over its own red-team env. The
env and the tester policy are built *inside* the worker by :func:`astrl.envs.build_conversation`
from a :class:`WorkerSpec`: the run's :class:`~astrl.envs.ConversationSpec` (model ids or
folders plus settings: plain, picklable data) and the worker's place, so the tester, the target
and the scorers all run in the worker. Worker ``i`` of ``n`` draws slice ``i`` of every batch of
openers of the run's seeded :class:`~astrl.prompts.PromptStream` (whole groups), so the workers
together collect the conversations a local collector would, in worker order.

After each update the trainer sends the tester's trainable weights (the LoRA adapters, or the
full model) with the collectors' ``update_policy_weights_``, TorchRL's weight-update path,
which also advances each worker's ``PolicyVersion``; every collected turn carries the
``policy_version`` it was generated with.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

from astrl.backends import init_ray, require_ray

if TYPE_CHECKING:
    from astrl.envs.recipe import ConversationSpec

_PARTS: dict[str, tuple] = {}  # per process: (env, policy) of each spec, built once


@dataclass
class WorkerSpec:
    """What a worker builds its env and tester policy from (models are loaded in the worker).

    ``conversation`` is the run's :class:`~astrl.envs.ConversationSpec`: its models are embedded
    names, local checkpoint folders (visible to every node) or hub ids, and its ``batch_size`` is
    the size of the *whole* batch of conversations (all workers); worker ``worker`` of
    ``num_workers`` runs ``batch_size / num_workers`` of them, from the run's opener stream at
    ``stream_state``. ``threads``: torch threads of the worker.
    """

    conversation: ConversationSpec
    threads: int | None = None
    stream_state: dict | None = None
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        batch, group = self.conversation.batch_size, self.conversation.group_size
        if batch % (self.num_workers * group):
            raise ValueError(
                f"{batch} conversations ({batch // group} openers x group {group}) "
                f"cannot be split into {self.num_workers} workers of whole groups"
            )

    @classmethod
    def for_collectors(cls, conversation: ConversationSpec, settings, stream_state: dict | None = None) -> WorkerSpec:
        """The spec of the Ray workers of ``settings`` (a config with ``num_collectors`` and
        ``collector_cpus``: a TrainConfig, a RolloutConfig): a torch thread per CPU of a worker."""
        threads = max(1, int(settings.collector_cpus))
        return cls(conversation, threads=threads, stream_state=stream_state, num_workers=settings.num_collectors)

    @property
    def worker_batch_size(self) -> int:
        return self.conversation.batch_size // self.num_workers

    def for_worker(self, index: int) -> WorkerSpec:
        return replace(self, worker=index)


def build_worker(spec: WorkerSpec) -> tuple:
    """Build (once per process) the env and tester policy of ``spec``'s worker: ``(env, policy)``."""
    key = repr(spec)
    if key in _PARTS:
        return _PARTS[key]
    from astrl.envs.recipe import build_conversation, opener_stream

    if spec.threads:
        torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.conversation.seed + 7919 * spec.worker)
    stream = opener_stream(spec.conversation)
    if spec.stream_state is not None:
        stream.load_state_dict(spec.stream_state)
    conversation = build_conversation(spec.conversation, stream=stream, shard=(spec.worker, spec.num_workers))
    _PARTS[key] = (conversation.env, conversation.tester)
    return _PARTS[key]


def worker_env(spec: WorkerSpec):
    """Env factory run inside a worker."""
    return build_worker(spec)[0]


def worker_policy(spec: WorkerSpec):
    """Policy factory run inside a worker."""
    return build_worker(spec)[1]


def trainable_weights(policy: torch.nn.Module) -> TensorDictBase:
    """The trainable parameters of a policy module as a TensorDict laid out like the module
    (the LoRA adapters under LoRA), detached and on CPU: what a worker's policy is updated with."""
    params = TensorDict.from_module(policy)
    names = {name for name, p in policy.named_parameters() if p.requires_grad}
    keys = [k for k in params.keys(include_nested=True, leaves_only=True) if ".".join(k) in names]
    if not keys:
        raise ValueError(f"{type(policy).__name__} has no trainable parameters to send to the workers")
    return params.select(*keys).data.detach().to("cpu").clone()


class RayCollectors:
    """``num_workers`` TorchRL ``RayLLMCollector`` actors that together collect one batch per call.

    Each call of :meth:`next` asks every worker for its shard (one completed trajectory per
    conversation, ``turns`` steps each) in parallel and returns them concatenated in worker
    order, flat: one entry per tester turn.

    Args:
        spec: the run's worker recipe (the worker index is set per actor).
        num_cpus / num_gpus: Ray resources of each worker.
        ray_address: an existing cluster (``"auto"`` or ``"ray://host:10001"``); None starts a
            local Ray instance unless one is already initialised.
        ray_options: keyword arguments of ``ray.init`` for a local start.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        ray_address: str | None = None,
        ray_options: dict | None = None,
    ) -> None:
        self._ray = require_ray()
        from torchrl.collectors.llm import RayLLMCollector

        self._started_ray = init_ray(ray_address, **(ray_options or {}))
        self.spec = spec
        self.collectors = []
        for index in range(spec.num_workers):
            worker = spec.for_worker(index)
            self.collectors.append(
                RayLLMCollector(
                    functools.partial(worker_env, worker),
                    policy_factory=functools.partial(worker_policy, worker),
                    dialog_turns_per_batch=worker.worker_batch_size * worker.conversation.turns,
                    yield_completed_trajectories=True,
                    track_policy_version=True,
                    remote_config={"num_cpus": num_cpus, "num_gpus": num_gpus},
                )
            )

    def next(self) -> TensorDictBase:
        """One batch of completed conversations from all workers, flat (one entry per tester turn)."""
        parts = self._ray.get([collector._next_remote() for collector in self.collectors])
        return lazy_stack([turn for part in parts for turn in part.reshape(-1).unbind(0)])

    def __iter__(self) -> Iterator[TensorDictBase]:
        while True:
            yield self.next()

    def update_policy_weights_(self, weights: TensorDictBase) -> None:
        """Send ``weights`` (see :func:`trainable_weights`) to every worker's policy; bumps their policy version."""
        ref = self._ray.put(weights)
        self._ray.get([c._collector.update_policy_weights_.remote(policy_or_weights=ref) for c in self.collectors])

    @property
    def policy_version(self) -> int:
        versions = self._ray.get([c._collector.get_policy_version.remote() for c in self.collectors])
        if len(set(versions)) != 1:
            raise RuntimeError(f"workers disagree on the policy version: {versions}")
        return versions[0]

    def worker_weights(self, index: int = 0) -> dict[str, torch.Tensor]:
        """The state dict of worker ``index``'s tester model (for checks)."""
        model = self._ray.get(self.collectors[index]._collector.get_policy_model.remote())
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def shutdown(self) -> None:
        """Stop the workers (and the local Ray instance, if this object started it)."""
        for collector in self.collectors:
            try:
                collector.shutdown()
            finally:
                self._ray.kill(collector._collector)
        self.collectors = []
        if self._started_ray:
            self._ray.shutdown()
            self._started_ray = False
