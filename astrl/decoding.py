"""How tokens are sampled, declared once: :class:`DecodingSettings` (temperature, top-p, top-k), read by the
configs (``SamplingSettings``, ``ReplayConfig``), the ``--temperature``, ``--top-p`` and ``--top-k`` flags
and the policies' :class:`~astrl.policies.GenerationSettings`. No torch import."""

from __future__ import annotations

from dataclasses import dataclass

from astrl.argtypes import check_settings, setting


@dataclass
class DecodingSettings:
    """How tokens are sampled, the same on every command: temperature, top-p and top-k (the ``--temperature``,
    ``--top-p`` and ``--top-k`` flags of rollout, eval and replay; a length means a turn, a reply or the
    run's on different commands, so the lengths are :class:`~astrl.envs.settings.SamplingSettings`'s)."""

    temperature: float = setting(1.0, "Sampling temperature (tester and target alike).", above=0)
    top_p: float = setting(1.0, "Nucleus sampling threshold, tester and target alike (1: off).", above=0, at_most=1)
    top_k: int = setting(
        0,
        "Top-k filtering, tester and target alike (0: the backend's default: Transformers keeps the 50 most likely "
        "tokens unless the model's generation config says otherwise, vLLM none; a value at least the "
        "vocabulary size turns it off on both).",
        at_least=0,
    )

    def __post_init__(self) -> None:
        check_settings(self)
