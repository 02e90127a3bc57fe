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

from astrl.lm_scoring import response_mask, shared_prefix_logprobs, token_logprobs
from astrl.rewards.astprompter import ASTPrompterReward, ASTPrompterWeights, ElicitReward, ElicitWeights, probe_logprobs
from astrl.rewards.kl import ClippedKLReward, clipped_kl_reward, kl_reward, make_kl_controller
from astrl.rewards.logprobs import StepTransform, TokenLogProbs
from astrl.rewards.novelty import EmbeddingNovelty, NgramNovelty, NoveltyReward, make_novelty
from astrl.rewards.reference import AdaptersDisabled, make_reference
from astrl.rewards.shaping import RewardShaping

__all__ = [
    "ASTPrompterReward",
    "ASTPrompterWeights",
    "AdaptersDisabled",
    "ClippedKLReward",
    "ElicitReward",
    "ElicitWeights",
    "EmbeddingNovelty",
    "NgramNovelty",
    "NoveltyReward",
    "RewardShaping",
    "StepTransform",
    "TokenLogProbs",
    "clipped_kl_reward",
    "kl_reward",
    "make_kl_controller",
    "make_novelty",
    "make_reference",
    "probe_logprobs",
    "response_mask",
    "shared_prefix_logprobs",
    "token_logprobs",
]
