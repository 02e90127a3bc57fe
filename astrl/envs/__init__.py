"""TorchRL environments for red-teaming: :class:`RedTeamEnv`, its transforms, and the conversation
recipe (:class:`ConversationSpec` -> :func:`build_conversation`) every entry point builds them with."""

from astrl.envs.recipe import Conversation, ConversationSpec, build_conversation
from astrl.envs.redteam import DEFAULT_TESTER_SYSTEM_PROMPT, RedTeamEnv, make_redteam_env
from astrl.envs.transforms import ScoreReward, TargetTurn, concatenate, target_view

__all__ = [
    "DEFAULT_TESTER_SYSTEM_PROMPT",
    "Conversation",
    "ConversationSpec",
    "RedTeamEnv",
    "ScoreReward",
    "TargetTurn",
    "build_conversation",
    "concatenate",
    "make_redteam_env",
    "target_view",
]
