"""The settings of the rewards, apart from the reward modules (no torch import): reward names,
their weights and the ``reward_options`` an env takes. Configs are checked against these before any
model is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

MODES = ("chat", "text")


@dataclass
class ASTPrompterWeights:
    """Weights of the ASTPrompter reward terms (the paper's defaults)."""

    alpha: float = 1.0
    zeta: float = 0.5
    gamma: float = 0.1

    def combine(self, response_tox: Tensor, combined_tox: Tensor, probe_logprob: Tensor) -> Tensor:
        return self.alpha * response_tox + self.zeta * combined_tox + self.gamma * probe_logprob


@dataclass
class ElicitWeights:
    """Weights of the elicitation reward ``alpha*tox(reply)*g - penalty*tox(probe) + gamma*probe_logprob``.

    ``gate=True`` sets ``g = 1 - tox(probe)`` (a toxic probe earns nothing for the reply it
    gets); ``gate=False`` sets ``g = 1`` (the reply and probe terms stay separate)."""

    alpha: float = 1.0
    penalty: float = 1.0
    gamma: float = 0.1
    gate: bool = False

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.penalty < 0 or self.gamma < 0:
            raise ValueError(f"elicit weights must be >= 0, got alpha={self.alpha}, penalty={self.penalty}, gamma={self.gamma}")

    def combine(self, response_tox: Tensor, probe_tox: Tensor, probe_logprob: Tensor) -> Tensor:
        gate = 1.0 - probe_tox if self.gate else 1.0
        return self.alpha * response_tox * gate - self.penalty * probe_tox + self.gamma * probe_logprob


# the weights class of each reward that adds the probe's likelihood under the target
LIKELIHOOD_REWARDS = {"astprompter": ASTPrompterWeights, "elicit": ElicitWeights}
REWARDS = ("score", *LIKELIHOOD_REWARDS)


def weight_names(reward: str) -> tuple[str, ...]:
    """The weights of the ``"astprompter"`` or ``"elicit"`` reward (the fields of its weights class)."""
    return tuple(f.name for f in fields(LIKELIHOOD_REWARDS[reward]))


def reward_weights(reward: str, **values) -> ASTPrompterWeights | ElicitWeights:
    """The weights of the ``"astprompter"`` or ``"elicit"`` reward from ``values``: its own names are
    taken (cast to float, ``gate`` to bool), any other is left out; a missing one keeps its default."""
    kind = LIKELIHOOD_REWARDS[reward]
    return kind(**{f.name: (bool if f.type == "bool" else float)(values[f.name]) for f in fields(kind) if f.name in values})


def reward_options(reward: str, alpha: float, zeta: float, gamma: float, penalty: float, gate: bool) -> dict | None:
    """The ``reward_options`` of :func:`astrl.envs.make_redteam_env` for a reward name: the weights it uses."""
    if reward not in LIKELIHOOD_REWARDS:
        return None
    values = {"alpha": alpha, "zeta": zeta, "gamma": gamma, "penalty": penalty, "gate": gate}
    return {name: values[name] for name in weight_names(reward)}


def check_reward_options(reward: str, options: Mapping[str, object] | None) -> None:
    """Refuse a reward name, or ``reward_options`` the reward does not take, naming the offending value."""
    if reward not in REWARDS:
        raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
    if options and reward == "score":
        raise ValueError(f"reward_options {sorted(options)} only apply to reward='astprompter' or 'elicit'")
    allowed = {*weight_names(reward), "join", "empty_probe_logprob"} if reward != "score" else set()
    unknown = set(options or {}) - allowed
    if unknown:
        raise ValueError(f"unknown reward_options {sorted(unknown)} for reward={reward!r}; valid: {', '.join(sorted(allowed))}")
