"""Optional scale-out backends: checks that fail early, with the fix, when an extra is missing.

* ``backend: vllm`` generates with vLLM through TorchRL's ``vLLMWrapper``; it needs the
  ``vllm`` package (``pip install 'astrl[vllm]'``) and a CUDA GPU.
* ``collector: ray`` spreads collection over Ray actors with TorchRL's ``RayLLMCollector``;
  it needs the ``ray`` package (``pip install 'astrl[ray]'``).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from astrl.argtypes import check_settings, setting

BACKENDS = ("transformers", "vllm")
COLLECTORS = ("local", "ray")


class MissingExtraError(RuntimeError):
    """An optional dependency (or the hardware it needs) is not available."""


def _has(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def require_ray():
    """The ``ray`` module, or a :class:`MissingExtraError` that says how to install it."""
    if not _has("ray"):
        raise MissingExtraError("collector 'ray' needs the ray package: pip install 'astrl[ray]'")
    return importlib.import_module("ray")


def require_vllm(device: str | None = None):
    """The ``vllm`` module, after checking that it is installed and a CUDA GPU is present.

    Args:
        device: the device the engine should use; anything but a CUDA device is refused.
    """
    if not _has("vllm"):
        raise MissingExtraError("backend 'vllm' needs the vllm package (CUDA only): pip install 'astrl[vllm]'")
    import torch

    if not torch.cuda.is_available():
        raise MissingExtraError(
            "backend 'vllm' needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
            "use backend 'transformers' on CPU"
        )
    if device is not None and not str(device).startswith("cuda"):
        raise MissingExtraError(f"backend 'vllm' runs on CUDA devices only, got device {device!r}")
    return importlib.import_module("vllm")


def check_backend(backend: str, device: str | None = None) -> None:
    """Refuse an unknown backend name, or ``vllm`` where it cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    if backend == "vllm":
        require_vllm(device)


def init_ray(address: str | None = None, **options) -> bool:
    """Connect to the Ray cluster at ``address``, or start a local Ray instance.

    Does nothing when Ray is already initialised (for instance by the caller, with its own
    resources). Local starts run without the dashboard. Returns whether this call started Ray,
    so the caller knows whether to shut it down.
    """
    ray = require_ray()
    if ray.is_initialized():
        return False
    settings = {"include_dashboard": False, "runtime_env": {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}}
    if address:
        ray.init(address=address, runtime_env=settings["runtime_env"], **options)
    else:
        ray.init(**{**settings, **options})
    return True


@dataclass
class BackendSettings:
    """Which library generates each side's tokens, and the GPU share vLLM takes, declared once: the base of
    :class:`CollectionSettings` and of :class:`~astrl.envs.ConversationSpec`."""

    backend: str = setting("transformers", "Tester generation backend: transformers or vllm.", choices=BACKENDS)
    target_backend: str = setting("transformers", "Target generation backend: transformers or vllm.", choices=BACKENDS)
    vllm_memory: float = setting(0.5, "Share of GPU memory all vLLM engines take together.", above=0, at_most=1)


@dataclass
class CollectionSettings(BackendSettings):
    """Where the conversations are generated, declared once: the generation backends
    (:class:`BackendSettings`) and the collector. :class:`~astrl.training.TrainConfig` (its scale-out
    section) and :class:`~astrl.rollout.RolloutConfig` inherit these fields, and ``astrl rollout`` makes
    one flag per field."""

    collector: str = setting("local", "Collect in this process (local) or over Ray workers (ray).", choices=COLLECTORS)
    num_collectors: int = setting(1, "Ray workers; each runs whole groups.", at_least=1)
    collector_cpus: float = setting(1.0, "CPUs per Ray worker.", above=0)
    collector_gpus: float = setting(0.0, "GPUs per Ray worker.", at_least=0)
    ray_address: str | None = setting(None, "An existing Ray cluster (e.g. auto); null: start Ray here.")

    def check_collection(self) -> None:
        """Refuse a collection setting out of its range or choices (:func:`~astrl.argtypes.setting`), or
        collector settings that do not fit together (``ValueError``)."""
        check_settings(self, CollectionSettings)
        if self.collector == "local" and self.num_collectors != 1:
            raise ValueError(f"num_collectors={self.num_collectors} needs collector 'ray' (the local collector is one process)")
        if self.collector == "local" and self.ray_address:
            raise ValueError(f"ray_address {self.ray_address!r} needs collector 'ray'")
