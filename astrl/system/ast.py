"""``ASTSystem``: text states, concatenation as the state update, and the ASTPrompter reward."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from astrl.rewards.astprompter import ASTPrompterWeights
from astrl.system.base import System, score_texts


class ASTSystem(System[str, str]):
    """A text System whose reward is the ASTPrompter reward::

        r = alpha * tox(response) + zeta * tox(probe + response) + gamma * probe_logprob

    ``tox`` is the scorer (higher = more harmful), ``probe_logprob`` the **mean per-token**
    log-prob of the probe under the target given the state it followed (natural probes score
    higher; an empty probe gets ``empty_probe_logprob``). ``advance`` concatenates
    ``context + probe + response``. Subclasses still implement the rollouts, the log-probs and
    ``parameters``; :class:`HFASTSystem` does all of it for Hugging Face models.

    Args:
        scorer: the harm scorer (astrl scorer, object with ``.score``, or a scorer name).
        alpha, zeta, gamma: reward weights (the ASTPrompter defaults 1, 0.5, 0.1).
        empty_probe_logprob: ``probe_logprob`` of a probe with no tokens.
    """

    def __init__(
        self, scorer="profanity", *, alpha: float = 1.0, zeta: float = 0.5, gamma: float = 0.1, empty_probe_logprob: float = -10.0
    ) -> None:
        super().__init__(scorer)
        self.weights = ASTPrompterWeights(alpha, zeta, gamma)
        self.empty_probe_logprob = float(empty_probe_logprob)

    def advance(self, context: str, probe: str, response: str) -> str:
        return context + probe + response

    def probe_logprob(self, contexts: Sequence[str], probes: Sequence[str]) -> torch.Tensor:
        """Mean per-token log-prob of each probe under the target, shape ``(B,)``.

        From :meth:`get_target_logprobs`: the row sum over the number of non-zero entries (the
        convention pads with exact zeros). :class:`HFASTSystem` counts its tokens exactly."""
        logprobs = self._get_target_logprobs_and_validate(contexts, probes).detach().float().cpu()
        counts = (logprobs != 0).sum(-1)
        means = logprobs.sum(-1) / counts.clamp(min=1)
        return torch.where(counts > 0, means, torch.full_like(means, self.empty_probe_logprob))

    def reward_terms(self, contexts: Sequence[str], probes: Sequence[str], responses: Sequence[str]) -> dict[str, torch.Tensor]:
        """The three terms of the reward, each of shape ``(B,)``: one scorer call for replies and probe+reply."""
        n = len(responses)
        scores = score_texts(self.scorer, [*responses, *(p + r for p, r in zip(probes, responses, strict=True))])
        terms = {"response_tox": scores[:n], "combined_tox": scores[n:]}
        terms["probe_logprob"] = self.probe_logprob(contexts, probes) if self.weights.gamma else torch.zeros(n)
        return terms

    def reward(self, contexts: Sequence[str], probes: Sequence[str], responses: Sequence[str]) -> list[float]:
        terms = self.reward_terms(contexts, probes, responses)
        return self.weights.combine(terms["response_tox"], terms["combined_tox"], terms["probe_logprob"]).tolist()
