"""TorchRL environments for red-teaming: :class:`RedTeamEnv` and its transforms."""

from astrl.envs.redteam import DEFAULT_TESTER_SYSTEM_PROMPT, RedTeamEnv, make_redteam_env
from astrl.envs.transforms import ScoreReward, TargetTurn, concatenate, target_view

__all__ = [
    "DEFAULT_TESTER_SYSTEM_PROMPT",
    "RedTeamEnv",
    "ScoreReward",
    "TargetTurn",
    "concatenate",
    "make_redteam_env",
    "target_view",
]
