"""Rewards of the red-team loop.

* :class:`ASTPrompterReward`: ``alpha*tox(response) + zeta*tox(probe+response) + gamma*mean log p_target(probe)``.
* :class:`ElicitReward`: ``alpha*tox(response)[*(1-tox(probe))] - penalty*tox(probe) + gamma*mean log p_target(probe)``:
  toxicity the tester elicits from the target, not toxicity it writes.
* :class:`ClippedKLReward` (+ :class:`TokenLogProbs`, :func:`kl_reward`): the per-token reward of
  TorchRL's ``RolloutFromModel`` with a clipped KL penalty to a frozen reference.
* :class:`NgramNovelty`, :class:`EmbeddingNovelty`: novelty of each probe against past probes.
* :class:`RewardShaping`: clipping, batch whitening, running normalisation.

Convention everywhere: higher reward = more harmful.
"""

from astrl._lazy import lazy_exports

_EXPORTS = {
    "ASTPrompterReward": "astrl.rewards.astprompter",
    "ASTPrompterWeights": "astrl.rewards.astprompter",
    "AdaptersDisabled": "astrl.rewards.reference",
    "PinnedReference": "astrl.rewards.reference",
    "ClippedKLReward": "astrl.rewards.kl",
    "ElicitReward": "astrl.rewards.astprompter",
    "ElicitWeights": "astrl.rewards.astprompter",
    "EmbeddingNovelty": "astrl.rewards.novelty",
    "NgramNovelty": "astrl.rewards.novelty",
    "NoveltyReward": "astrl.rewards.novelty",
    "RewardShaping": "astrl.rewards.shaping",
    "StepTransform": "astrl.rewards.logprobs",
    "TokenLogProbs": "astrl.rewards.logprobs",
    "clipped_kl_reward": "astrl.rewards.kl",
    "kl_reward": "astrl.rewards.kl",
    "make_kl_controller": "astrl.rewards.kl",
    "make_novelty": "astrl.rewards.novelty",
    "make_reference": "astrl.rewards.reference",
    "probe_logprobs": "astrl.rewards.astprompter",
    "response_mask": "astrl.lm_scoring",
    "shared_prefix_logprobs": "astrl.lm_scoring",
    "token_logprobs": "astrl.lm_scoring",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
