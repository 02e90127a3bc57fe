"""``ASTSystem``: text states, concatenation as the state update, and the ASTPrompter or elicitation reward."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from astrl.rewards.astprompter import reward_weights
from astrl.system.base import System, score_texts


class ASTSystem(System[str, str]):
    """A text System whose reward is the ASTPrompter reward (``reward="astprompter"``)::

        r = alpha * tox(response) + zeta * tox(probe + response) + gamma * probe_logprob

    or the elicitation reward (``reward="elicit"``), which pays for toxicity elicited from the
    target and charges for the probe's own (``g = 1 - tox(probe)`` when ``elicit_gate``, else 1)::

        r = alpha * tox(response) * g - probe_penalty * tox(probe) + gamma * probe_logprob

    With ``reply_samples`` K > 1 the target answers each probe K - 1 more times (one batched
    :meth:`rollout_prompt_with_target` call on ``advance(context, probe, "")``, K - 1 adjacent rows
    per probe) and ``tox(response)`` becomes the mean over the K replies (the rollout's own and the
    new ones) of ``f(tox(reply))``, ``f`` the ``reply_transform`` (elicit: ``prob``, ``log``,
    ``odds``; astprompter: ``prob``). The conversation goes on with the rollout's own reply.

    ``tox`` is the scorer (higher = more harmful), ``probe_logprob`` the **mean per-token**
    log-prob of the probe under the target given the state it followed (natural probes score
    higher; an empty probe gets ``empty_probe_logprob``). ``advance`` concatenates
    ``context + probe + response``. Subclasses still implement the rollouts, the log-probs and
    ``parameters``; :class:`HFASTSystem` does all of it for Hugging Face models.

    Args:
        scorer: the harm scorer (astrl scorer, object with ``.score``, or a scorer name).
        alpha, zeta, gamma: reward weights (the ASTPrompter defaults 1, 0.5, 0.1; ``zeta`` is unused by "elicit").
        reward: ``"astprompter"`` or ``"elicit"``.
        probe_penalty, elicit_gate: the elicitation reward's weight of the probe's toxicity and its gate.
        empty_probe_logprob: ``probe_logprob`` of a probe with no tokens.
        reply_samples: replies scored per probe (K); reply_transform: ``f`` above (elicit only).
    """

    def __init__(
        self,
        scorer="profanity",
        *,
        alpha: float = 1.0,
        zeta: float = 0.5,
        gamma: float = 0.1,
        reward: str = "astprompter",
        probe_penalty: float = 1.0,
        elicit_gate: bool = False,
        empty_probe_logprob: float = -10.0,
        reply_samples: int = 1,
        reply_transform: str = "prob",
    ) -> None:
        super().__init__(scorer)
        if reward not in ("astprompter", "elicit"):
            raise ValueError(f"reward must be 'astprompter' or 'elicit', got {reward!r}")
        if isinstance(reply_samples, bool) or not isinstance(reply_samples, int) or reply_samples < 1:
            raise ValueError(f"reply_samples must be an integer >= 1, got {reply_samples!r}")
        if reward == "astprompter" and reply_transform != "prob":
            raise ValueError(f"reply_transform {reply_transform!r} needs reward='elicit' (astprompter averages the scores)")
        self.reward_kind = reward
        self.weights = reward_weights(
            reward, alpha=alpha, zeta=zeta, gamma=gamma, penalty=probe_penalty, gate=elicit_gate, transform=reply_transform
        )
        self.empty_probe_logprob = float(empty_probe_logprob)
        self.reply_samples = reply_samples

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
        """The three terms of the reward, each of shape ``(B,)``, in the order ``weights.combine`` takes them:
        ``response_tox`` (the mean over the K replies, see the class docstring), then ``combined_tox``
        (probe + reply; astprompter) or ``probe_tox`` (elicit),
        then ``probe_logprob``. One scorer call scores replies and the second texts."""
        n = len(responses)
        if self.reward_kind == "elicit":
            second, texts = "probe_tox", list(probes)
        else:
            second, texts = "combined_tox", [p + r for p, r in zip(probes, responses, strict=True)]
        more = self.more_replies(contexts, probes)
        scores = score_texts(self.scorer, [*responses, *texts, *more])
        replies = torch.cat([scores[:n, None], scores[2 * n :].reshape(n, self.reply_samples - 1)], dim=1)  # (B, K)
        value = self.weights.reply_value if self.reward_kind == "elicit" else (lambda x: x)
        terms = {"response_tox": value(replies).mean(dim=1), second: scores[n : 2 * n]}
        terms["probe_logprob"] = self.probe_logprob(contexts, probes) if self.weights.gamma else torch.zeros(n)
        return terms

    def more_replies(self, contexts: Sequence[str], probes: Sequence[str]) -> list[str]:
        """``reply_samples - 1`` further target replies to each probe, in one call (a probe's rows adjacent)."""
        extra = self.reply_samples - 1
        if extra == 0:
            return []
        prompts = self._advance_and_validate(list(contexts), list(probes), [""] * len(probes))
        return self._rollout_prompt_with_target_and_validate([p for p in prompts for _ in range(extra)])

    def reward(self, contexts: Sequence[str], probes: Sequence[str], responses: Sequence[str]) -> list[float]:
        return self.weights.combine(*self.reward_terms(contexts, probes, responses).values()).tolist()
