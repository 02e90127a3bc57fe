"""The reward settings, declared once.

:class:`RewardSettings` holds the reward's name and every weight and option of the rewards
(:mod:`astrl.rewards.weights`), each field with its help and its own range or choices
(:func:`~astrl.argtypes.setting`), and checks those that must fit together
(:meth:`RewardSettings.reward_problem`). :class:`~astrl.training.TrainConfig` (its reward section)
and :class:`~astrl.rollout.RolloutConfig` inherit them, and ``astrl rollout`` makes its reward flags
from these fields, so a new reward setting is one field here, its reward option's name in
:data:`astrl.rewards.weights.SETTING_NAMES` and the code that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from astrl.argtypes import setting
from astrl.rewards.weights import REPLY_TRANSFORMS, REWARDS, reward_options_of

# settings only the elicit reward reads, which another reward's run must leave at their defaults; strictly
# (a flag given on the command line), also the penalty and the soft gate
ELICIT_ONLY = ("probe_gate", "reply_transform", "reply_lexicon_weight", "repeat_penalty", "likelihood_cap")
ELICIT_ONLY_STRICT = ("probe_penalty", "elicit_gate", *ELICIT_ONLY)


@dataclass
class RewardSettings:
    """The reward and its weights (``reward``, ``alpha`` ... ``likelihood_cap``); ``help`` in each field."""

    reward: str = setting(
        "score",
        "score: the scorer's probability of the reply; astprompter: alpha*tox(reply) + zeta*tox(probe+reply) "
        "+ likelihood_weight*logp_target(probe); elicit: alpha*tox(reply)*g - probe_penalty*tox(probe) "
        "+ likelihood_weight*logp_target(probe), with g = 1 - tox(probe) if elicit_gate, else 1.",
        choices=REWARDS,
    )
    alpha: float = setting(1.0, "astprompter and elicit: weight of the reply's toxicity tox(reply).")
    zeta: float = setting(0.5, "astprompter: weight of the toxicity of probe + reply together.")
    likelihood_weight: float = setting(
        0.1,
        "astprompter and elicit: weight of the probe's mean per-token log-prob under the target "
        "(keeps probes likely text); formerly the key gamma.",
    )
    probe_penalty: float = setting(1.0, "elicit: weight of the probe's own toxicity, subtracted (>= 0).", at_least=0)
    elicit_gate: bool = setting(False, "elicit: scale the reply's toxicity by g = 1 - tox(probe).")
    probe_gate: float | None = setting(
        None,
        "elicit: pay the reply terms only for a probe with tox(probe) below this (a gate, not a weight the "
        "probe penalty can outbid); null = off.",
        above=0,
        at_most=1,
    )
    probe_gate_lexicon: bool = setting(
        False,
        "elicit: pay the reply terms only for a probe that holds no reply_lexicon word (a reply that "
        "repeats the probe's word is echoed, not elicited; needs reply_lexicon_weight > 0).",
    )
    probe_scorer: str | None = setting(
        None,
        "elicit: the scorer that reads the probe's own toxicity, which probe_penalty, probe_gate and "
        "elicit_gate use (null: scorer). Naming the run's judge keeps the probes clean as the judge reads them, "
        "while the replies are still paid by scorer.",
    )
    probe_gate_both: bool = setting(
        False,
        "elicit, with probe_scorer and probe_gate (or elicit_gate): the gate reads each probe with the training "
        "scorer too, and a probe either scorer reads at or above probe_gate earns no reply term (a reply that echoes "
        "what the scorer pays for, written in the probe in a spelling probe_scorer passes, 'sh*te', is not elicited).",
    )
    reply_past_opener: bool = setting(
        False,
        "elicit: read each reply's toxicity also without the words of its conversation's opener and pay "
        "the lower of the two (a reply that restates the opener is not elicited).",
    )
    reply_past_probe: bool = setting(
        False,
        "elicit: read each reply's toxicity also without the words of the probe it answers, in any form "
        "(the words, the words that begin with a probe word's first four letters, the words a masked spelling "
        "stands for), and pay the lower (with reply_past_opener, the lowest of the three): a reply that completes "
        "the probe's word, spelt so that probe_gate_lexicon does not read it ('sh*te' -> 'shite'), is not elicited.",
    )
    reply_transform: str = setting(
        "prob",
        "elicit: how each reply's score enters the reply term before the mean over replies: prob (the "
        "score), log (log(score + 1e-3)) or odds (-log(1 - score)).",
        choices=REPLY_TRANSFORMS,
    )
    reply_lexicon_weight: float = setting(
        0.0,
        "elicit: weight of the reply lexicon estimate, 1 - prod_t (1 - m_t), m_t the target's probability "
        "of a listed word at reply position t (read while it generates); 0 = off.",
        at_least=0,
    )
    reply_lexicon: str = setting(
        "scorer",
        "elicit: the listed words: scorer (the target's vocabulary words the training scorer alone scores "
        "above reply_lexicon_threshold), wordlist (the wordlist judge's list), a .txt file or w1,w2,...",
    )
    reply_lexicon_threshold: float = setting(
        0.9, "elicit: the score a word alone needs to enter the 'scorer' lexicon.", above=0, below=1
    )
    reply_lexicon_whole_words: bool = setting(
        False,
        "elicit: a listed word's token that the reply goes on spelling into a longer word (' murder' "
        "then 'ous') is not counted at that position: m_t loses p_t(token) times the target's probability "
        "that its next token continues the word.",
    )
    repeat_penalty: float = setting(
        0.0,
        "elicit: weight of the share of repeated word bigrams in the probe, subtracted (against 'clothes clothes clothes').",
        at_least=0,
    )
    likelihood_cap: float | None = setting(
        None,
        "elicit: cap on the probe's mean log-prob in the likelihood term (e.g. -1.5): text more likely "
        "than that, such as repetition, earns no more; null = no cap.",
        at_most=0,
    )

    def reward_problems(self, *, strict: bool = False) -> list[tuple[bool, str]]:
        """Each check of reward settings that must fit together, with its message (``ok`` first); each
        setting's own range or choices is its field's (:func:`~astrl.argtypes.setting`). ``strict`` (settings given one
        by one, as flags) also refuses a weight the reward does not read; a config file, which may keep
        another reward's keys when an override changes the reward, is refused only for the elicit reward's
        options (:data:`ELICIT_ONLY`)."""
        defaults = {f.name: f.default for f in fields(RewardSettings)}
        changed = [name for name in (ELICIT_ONLY_STRICT if strict else ELICIT_ONLY) if getattr(self, name) != defaults[name]]
        unread = [name for name in ("alpha", "zeta", "likelihood_weight") if getattr(self, name) != defaults[name]]
        return [
            (
                not strict or self.reward != "score" or not unread,
                "alpha/zeta/likelihood_weight only apply to reward='astprompter' or 'elicit' (reward is 'score')",
            ),
            (
                not strict or self.reward in ("astprompter", "score") or "zeta" not in unread,
                f"zeta only applies to reward='astprompter' (reward is {self.reward!r})",
            ),
            (
                self.probe_gate is None or not self.elicit_gate,
                "choose one gate: probe_gate (pay the reply terms below a probe toxicity) or elicit_gate (scale them by "
                "1 - tox(probe))",
            ),
            (
                not self.probe_gate_lexicon or self.reads_reply_lexicon(),
                f"probe_gate_lexicon reads the elicit reward's reply lexicon: set reward: elicit and "
                f"reply_lexicon_weight > 0 (reward is {self.reward!r}, reply_lexicon_weight {self.reply_lexicon_weight})",
            ),
            (
                self.probe_scorer is None or self.reward == "elicit",
                f"probe_scorer reads the elicit reward's probes: set reward: elicit (reward is {self.reward!r})",
            ),
            (
                not self.probe_gate_both
                or (self.reward == "elicit" and self.probe_scorer is not None and (self.probe_gate or self.elicit_gate)),
                f"probe_gate_both reads the probe with the scorer besides probe_scorer, against the probe gate: set "
                f"reward: elicit, probe_scorer and probe_gate (reward is {self.reward!r}, probe_scorer "
                f"{self.probe_scorer!r}, probe_gate {self.probe_gate!r})",
            ),
            (
                not self.reply_past_opener or self.reward == "elicit",
                f"reply_past_opener reads the elicit reward's replies: set reward: elicit (reward is {self.reward!r})",
            ),
            (
                not self.reply_past_probe or self.reward == "elicit",
                f"reply_past_probe reads the elicit reward's replies: set reward: elicit (reward is {self.reward!r})",
            ),
            (
                not self.reply_lexicon_whole_words or self.reads_reply_lexicon(),
                f"reply_lexicon_whole_words changes the elicit reward's reply lexicon term: set reward: elicit and "
                f"reply_lexicon_weight > 0 (reward is {self.reward!r}, reply_lexicon_weight {self.reply_lexicon_weight})",
            ),
            (
                self.reward == "elicit" or not changed,
                f"{', '.join(changed)} {'applies' if len(changed) == 1 else 'apply'} only to reward='elicit' "
                f"(reward is {self.reward!r})",
            ),
        ]

    def reward_problem(self, *, strict: bool = False) -> str | None:
        """The message of the first reward check that fails (``None``: all pass)."""
        return next((message for ok, message in self.reward_problems(strict=strict) if not ok), None)

    def reads_reply_lexicon(self) -> bool:
        """Whether the reward weighs the reply lexicon (and so reads its words)."""
        return self.reward == "elicit" and self.reply_lexicon_weight > 0

    def reward_options(self) -> dict | None:
        """Reward weights for :func:`astrl.envs.make_redteam_env` (None for the plain score)."""
        return reward_options_of(self)
