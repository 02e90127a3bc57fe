"""TorchRL environments for red-teaming: :class:`RedTeamEnv`, its transforms, and the conversation
recipe (:class:`ConversationSpec` -> :func:`build_conversation`) every entry point builds them with."""

from astrl._lazy import lazy_exports

_EXPORTS = {
    "Conversation": "astrl.envs.recipe",
    "ConversationSpec": "astrl.envs.recipe",
    "DEFAULT_TESTER_SYSTEM_PROMPT": "astrl.envs.redteam",
    "RedTeamEnv": "astrl.envs.redteam",
    "ScoreReward": "astrl.envs.transforms",
    "TargetTurn": "astrl.envs.transforms",
    "build_conversation": "astrl.envs.recipe",
    "concatenate": "astrl.envs.transforms",
    "make_redteam_env": "astrl.envs.redteam",
    "preflight": "astrl.envs.recipe",
    "target_view": "astrl.envs.transforms",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
