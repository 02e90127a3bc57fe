"""Training configuration: one flat dataclass made of sections, loaded from YAML plus ``key=value`` overrides.

Each section (:data:`SECTIONS`) declares its keys with their defaults, help and own range or choices
(:func:`~astrl.argtypes.setting`, checked for every key at once), and checks the keys that must fit
together (``_check_<section>``; a check may read another section's keys). :class:`TrainConfig` inherits
them all, so its keys stay flat: ``TrainConfig(**flat_kwargs)``, YAML files and overrides name a
key, never its section. The conversation keys are :mod:`astrl.envs.settings`'s, declared once for
every entry point."""

from __future__ import annotations

import dataclasses
import textwrap
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from astrl.argtypes import check_settings, range_text, setting
from astrl.backends import CollectionSettings
from astrl.envs.settings import ConversationSettings, SamplingSettings, SeedSettings, with_defaults
from astrl.errors import ConfigError
from astrl.losses.settings import ADVANTAGE_MODES
from astrl.names import ModelSettings
from astrl.rewards.settings import RewardSettings
from astrl.rewards.weights import NOVELTY_REDUCTIONS
from astrl.yaml_data import read_yaml_mapping, yaml_problem

ALGORITHMS = ("grpo", "ppo", "dpo", "ipo")
# algorithms that read one data path (on-policy conversations; tree-sampled pairs): a run's step-0 checkpoint,
# the warm-started tester, may go on under another algorithm of its family (astrl train --resume RUN algorithm=...)
ALGORITHM_FAMILIES = (("grpo", "ppo"), ("dpo", "ipo"))
RETURNS = ("turn", "to_go")
GROUP_SCALES = ("std", "none")
GUIDE_ADVANTAGES = ("signed", "positive")
GUIDE_REPLAY_RANKS = ("return", "lexicon")
KL_REFERENCES = ("base", "warm_start")
WARM_START_SELECTIONS = ("share", "lexicon", "search", "best_of")  # how the warm start finds and rates its probes
# the optimizer key's choices -> their torch.optim class (the trainer builds it by that name)
OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "rmsprop": "RMSprop", "adagrad": "Adagrad"}
# Keys that were renamed, old name -> new name: files and overrides that use the old name still load, with a warning.
RENAMED_KEYS = {"gamma": "likelihood_weight"}


def _raise_first(checks: list[tuple[bool, str]]) -> None:
    """Raise a :class:`ConfigError` with the message of the first check that fails."""
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


@dataclass
class RunSection(ModelSettings, SeedSettings):  # bases in reverse: the seeds first
    """The run: its seeds, dtype and device (:class:`~astrl.names.ModelSettings`, declared once for every
    command), the algorithm, the tester and the target, the tester's LoRA adapters."""

    algorithm: str = setting(
        "grpo", "grpo, ppo (value head and GAE), dpo or ipo (best-vs-worst sibling pairs from tree sampling).", choices=ALGORITHMS
    )
    tester: str = setting("smollm2-135m", "The model trained to write probes: an embedded name, a local folder or a hub id.")
    target: str = setting(
        "smollm2-135m", "The model attacked (same forms as tester); named like tester, the two share the base weights."
    )
    lora: bool = setting(True, "Train LoRA adapters (true) or every weight of the tester (false).")
    lora_rank: int = setting(8, "LoRA rank.", at_least=1)
    lora_alpha: int = setting(16, "LoRA alpha (scale alpha / rank).", at_least=1)
    lora_dropout: float = setting(0.0, "LoRA dropout (0 keeps behaviour and training log-probs equal).", at_least=0, below=1)
    lora_targets: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata={"help": "Module names that get LoRA adapters."},
    )


@dataclass
class ConversationSection(
    with_defaults(SamplingSettings, max_new_tokens=24),
    with_defaults(ConversationSettings, split="train", turns=2),
):  # bases in reverse: a dataclass takes its bases' fields last base first
    """The conversations: the shared conversation and sampling settings
    (:mod:`astrl.envs.settings`, with the training defaults) and the openers per step."""

    prompts_per_step: int = setting(4, "Openers per step (grpo, ppo); trees per step (dpo, ipo).", at_least=1)
    group_size: int = setting(4, "Conversations per opener (grpo compares turns within a group, so >= 2 there).", at_least=1)

    @property
    def batch_size(self) -> int:
        """Conversations per step (``prompts_per_step`` openers, each ``group_size`` times)."""
        return self.prompts_per_step * self.group_size


@dataclass
class ScorerSection:
    """The scorer that gives the reward and the judges logged beside it."""

    scorer: str = setting(
        "profanity",
        "Scorer of the target's replies that gives the reward: profanity, wordlist[:strict][,-w1,-w2], "
        "detoxify[:variant], hf:MODEL[@LABEL], judge:MODEL[@STYLE] or keywords:w1,w2.",
    )
    judges: list[str] = field(
        default_factory=list, metadata={"help": "Extra scorers of the replies, logged beside the reward (never rewarded)."}
    )


@dataclass
class RewardSection(RewardSettings, ScorerSection):  # bases in reverse: scorer and judges first among the keys
    """The reward: the scorer, the judges logged beside it, the reward and its weights (the reward settings
    are :mod:`astrl.rewards.settings`'s, declared once for training and ``astrl rollout``)."""

    def _check_reward(self) -> None:
        problem = self.reward_problem()  # the reward settings' own checks (astrl.rewards.settings)
        if problem:
            raise ConfigError(problem)

    def _check_reply_lexicon(self) -> None:
        """A reply lexicon the run reads (a file, ``wordlist``, a word list) is read now, before any model
        loads; ``scorer`` needs the target's tokenizer and is built with it."""
        reads = self.reads_reply_lexicon() or self.warm_start_select == "search"
        if not reads or self.reply_lexicon == "scorer":
            return
        from astrl.errors import ScorerError
        from astrl.rewards.lexicon import lexicon_words

        try:
            lexicon_words(self.reply_lexicon)
        except ScorerError as err:
            raise ConfigError(str(err)) from None


@dataclass
class AlgorithmSection:
    """The algorithm's settings and its optimisation: GRPO / PPO / DPO / IPO, optimizer and schedule."""

    returns: str = setting(
        "turn", "grpo: a turn's return is its own reward (turn) or the sum with its later turns' (to_go).", choices=RETURNS
    )
    group_scale: str = setting(
        "std",
        "grpo: a return's advantage is its difference from its group's mean divided by the group's std "
        "(std) or not divided (none), so a group whose returns barely differ moves the tester barely.",
        choices=GROUP_SCALES,
    )
    guide_search: bool = setting(
        False,
        "grpo: every group gains one conversation whose first probe is the lexicon search's for its opener "
        "(the warm start's search settings: warm_start_beams, warm_start_top_k, warm_start_max_nll, "
        "warm_start_reply_tokens), sampled under a processor that allows only the searched tokens; its advantage "
        "is taken in its group and its ratio clipped like the others' (search-guided GRPO).",
    )
    guide_replay: bool = setting(
        False,
        "grpo: every group gains one conversation whose first probe is the best first probe the run has "
        "sampled so far, ranked by its first-turn returns over all its tests (shrunk toward the mean of every "
        "test) and re-tested on the group's opener; its advantage is taken in its group and its ratio clipped "
        "like the others' (replay-guided GRPO: needs no target logits).",
    )
    guide_replay_warm_start: bool = setting(
        False,
        "guide_replay with a warm start: the replay archive starts with the warm start's kept probes "
        "(warm_start.jsonl), and a probe not yet tested is replayed before any ranked one, so every probe the "
        "warm start kept is tried on a training opener in the first steps, not only those the tester samples.",
    )
    guide_replay_retest: int = setting(
        0,
        "guide_replay_warm_start: re-test each of the warm start's kept probes after this many training openers "
        "(the target's greedy reply of target_max_new_tokens tokens, read by the reward's reply lexicon, as "
        "warm_start_retest does) and start the archive with only the best guide_replay_retest_keep share of them, "
        "best first (replay_seeds.jsonl); the warm start's fine-tuning still reads every kept probe. 0: every kept "
        "probe, in the warm start's order.",
        at_least=0,
    )
    guide_replay_retest_keep: float = setting(
        0.5,
        "guide_replay_retest: the share of the warm start's kept probes the replay archive starts with, best re-tested first.",
        above=0,
        at_most=1,
    )
    guide_replay_bonus: float = setting(
        0.0,
        "guide_replay: the archive ranks a probe by its score plus this many standard deviations of all "
        "tests' returns, divided by sqrt(its tests + 1) (an upper confidence bound), so a probe seen once or twice "
        "is re-tested before one whose many tests pin it just above; 0: by its score alone.",
        at_least=0,
    )
    guide_replay_rank: str = setting(
        "return",
        "guide_replay: what a test of an archived probe counts as: its first turn's return (return) or the reward's "
        "gated reply lexicon term g * lex(reply), averaged over the turn's reply samples and unweighted (lexicon: no "
        "sampled score, likelihood or penalty; needs reward elicit with reply_lexicon_weight > 0). The archive's "
        "score and choice are the same either way; the advantages still read the returns.",
        choices=GUIDE_REPLAY_RANKS,
    )
    guide_replay_members: int = setting(
        1,
        "guide_replay: the replayed conversations every group gains, each with a distinct archived probe (the "
        "best-ranked go to every group's first member, the next to its second, and so on), so that the replayed "
        "probes are not outnumbered by the group_size samples of the tester's own opening.",
        at_least=1,
    )
    guide_advantage: str = setting(
        "signed",
        "grpo with guide_search or guide_replay: the guided members' advantages as their group gives them "
        "(signed) or only where they beat it (positive: a negative one is set to 0, self-imitation), so a forced "
        "probe pulls the tester toward it but never pushes its tokens down (every turn of a guided conversation); the "
        "group's mean and std still count it.",
        choices=GUIDE_ADVANTAGES,
    )
    total_steps: int = setting(100, "Training steps (one collection and its updates each).", at_least=1)
    branches: int = setting(
        1,
        "RL branches of the run's step 0 (its warm start) tried before it goes on: branch b trains "
        "branch_steps steps from step 0 with seed + 100 b (b = 0: the run's own draws) in branches/seed_N/, and "
        "the run continues the branch whose mean training reward over the second half of those steps is highest "
        "(branches.json); 1: no branches.",
        at_least=1,
    )
    branch_steps: int = setting(16, "Steps each branch trains before one is chosen (with branches > 1).", at_least=2)
    lr: float = setting(1e-4, "Peak learning rate of the tester (warm-up, then linear decay to 0).", above=0)
    weight_decay: float = setting(0.0, "Weight decay of the optimizer.", at_least=0)
    warmup_steps: int = setting(5, "Steps of linear learning-rate warm-up.", at_least=0)
    max_grad_norm: float = setting(1.0, "Gradients are clipped to this total norm (grad_norm logs it before clipping).", above=0)
    epochs: int = setting(1, "Passes over each step's batch.", at_least=1)
    minibatches: int = setting(1, "Minibatches per pass (ignored when minibatch_size is set).", at_least=1)
    minibatch_size: int | None = setting(
        None, "Items per minibatch instead of a count (the schedule then advances once per step); null: off.", at_least=1
    )
    optimizer: str = setting("adamw", "adamw, adam, sgd, rmsprop or adagrad.", choices=tuple(OPTIMIZERS))
    grad_accum: int = setting(1, "Minibatches whose gradients add up before one optimizer step.", at_least=1)
    clip_epsilon: float = setting(0.2, "grpo, ppo: the importance ratio is clipped to [1 - eps, 1 + eps].", above=0, at_most=1)
    entropy_coef: float = setting(0.0, "grpo, ppo: weight of the entropy bonus (0: off).", at_least=0)
    kl_coef: float = setting(
        0.0,
        "grpo: weight of the per-token KL to the reference in the loss; ppo: of the clipped-KL reward "
        "(the start value when target_kl is set).",
        at_least=0,
    )
    kl_reference: str = setting(
        "base",
        "The reference of the KL term (grpo, ppo) and of the preference losses (dpo, ipo): the tester before "
        "training (base) or the tester as its warm start left it (warm_start; one more copy of the model in memory), "
        "so that the KL keeps the RL near the warm start's probes instead of pulling it back to the untrained tester.",
        choices=KL_REFERENCES,
    )
    kl_token_cap: float | None = setting(
        10.0,
        "grpo (and ppo's logged kl_to_ref): cap on one response token's k3 KL term exp(d) - d - 1, "
        "d = log pi_ref - log pi, which grows like exp(d): a token the policy samples although it finds it far "
        "less likely than the reference does can outweigh the batch; above the cap a token counts the cap and "
        "passes no gradient; null = no cap.",
        above=0,
    )
    beta: float = setting(0.01, "dpo, ipo: the preference loss's beta (> 0).", above=0)
    tree_width: int = setting(2, "dpo, ipo: probes written from each state (>= 2).", at_least=2)
    tree_depth: int = setting(3, "dpo, ipo: levels of each tree (tester turns per branch).", at_least=1)
    min_reward_gap: float = setting(
        0.0, "dpo, ipo: a sibling group makes a pair only when best - worst reward >= this.", at_least=0
    )
    share_prompt: bool = setting(True, "dpo, ipo: each pair's prompt runs once for chosen and rejected (false: two full rows).")
    weak_supervision: float = setting(
        0.0, "dpo, ipo: chance per batch that harmful texts are forced as the chosen probes (0: off).", at_least=0, at_most=1
    )
    weak_supervision_prompts: str = setting("rtp", "Prompt source of the forced texts (as prompts; astrl.prompts.load_prompts).")
    value_lr: float = setting(1e-4, "ppo: learning rate of the value head.", above=0)
    value_coef: float = setting(0.15, "ppo: weight of the value loss.", at_least=0)
    advantage: str = setting(
        "gae", "ppo: gae (with gae_lambda) or one_step (r_t + V_{t+1} - V_t) advantages.", choices=ADVANTAGE_MODES
    )
    gae_lambda: float = setting(0.95, "ppo: lambda of GAE (episodes are undiscounted).", at_least=0, at_most=1)
    kl_clip: float = setting(10.0, "ppo: the per-token log-ratio to the reference is clipped to +-this.", above=0)
    score_clip: float = setting(10.0, "ppo: the turn's score is clipped to +-this.", above=0)
    target_kl: float | None = setting(
        None, "ppo: an adaptive controller moves kl_coef (> 0) toward this KL per turn (null: constant).", above=0
    )

    def _check_algorithm(self) -> None:
        _raise_first(
            [
                (self.group_size >= 2 or self.algorithm != "grpo", f"grpo needs group_size >= 2, got {self.group_size}"),
                (
                    self.target_kl is None or self.kl_coef > 0,
                    f"target_kl ({self.target_kl}) needs kl_coef > 0, got kl_coef {self.kl_coef}: the adaptive controller "
                    "multiplies kl_coef, its start value, so from 0 it never moves; start it small (e.g. kl_coef=0.01) or "
                    "set target_kl=null for a constant coefficient",
                ),
                *self._guide_checks(),
                *self._reference_checks(),
                *self._branch_checks(),
                (
                    self.weak_supervision == 0 or self.algorithm in ("dpo", "ipo"),
                    f"weak_supervision needs algorithm dpo or ipo, got {self.algorithm!r}",
                ),
            ]
        )
        self._check_optimisation()

    def _guide_checks(self) -> list[tuple[bool, str]]:
        """``guide_search`` and ``guide_replay`` need GRPO collected here on Transformers and no novelty terms;
        ``guide_search`` also the reply lexicon; ``guide_advantage: positive`` one of the two;
        ``guide_replay_warm_start`` ``guide_replay`` and a warm start; ``guide_replay_retest`` ``guide_replay_warm_start``;
        ``guide_replay_bonus``, ``guide_replay_rank`` and ``guide_replay_members`` ``guide_replay``."""
        checks = []
        for key in ("guide_search", "guide_replay"):
            if not getattr(self, key):
                continue
            checks += [
                (self.algorithm == "grpo", f"{key} adds members to GRPO groups: set algorithm: grpo, got {self.algorithm!r}"),
                (
                    self.collector == "local" and self.backend == "transformers" and self.target_backend == "transformers",
                    f"{key} forces probes on Transformers models in this process: set collector: local, backend and "
                    f"target_backend: transformers (got {self.collector!r}, {self.backend!r}, {self.target_backend!r})",
                ),
                (
                    not (self.novelty_ngram or self.novelty_embedding),
                    f"{key} runs its conversations in an env of their own, without the novelty terms' history: "
                    "set novelty_ngram and novelty_embedding to 0",
                ),
            ]
        checks.append(
            (
                self.guide_advantage == "signed" or self.guide_search or self.guide_replay,
                f"guide_advantage: {self.guide_advantage} applies to guided members: set guide_search or guide_replay: true",
            )
        )
        checks.append(
            (
                not self.guide_replay_warm_start or (self.guide_replay and self.warm_start_probes > 0),
                "guide_replay_warm_start starts the replay archive with the warm start's probes: set guide_replay: true "
                f"and warm_start_probes > 0 (got guide_replay {self.guide_replay}, warm_start_probes {self.warm_start_probes})",
            )
        )
        checks += [
            (
                self.guide_replay_retest == 0 or self.guide_replay_warm_start,
                f"guide_replay_retest {self.guide_replay_retest} ranks the warm start's probes the replay archive starts "
                "with: set guide_replay_warm_start: true, or drop it",
            ),
            (
                self.guide_replay_retest_keep == 0.5 or self.guide_replay_retest > 0,
                f"guide_replay_retest_keep {self.guide_replay_retest_keep} is the share of re-tested probes the archive "
                f"starts with: set guide_replay_retest > 0 (got {self.guide_replay_retest}), or drop it",
            ),
        ]
        checks.append(
            (
                self.guide_replay or self.guide_replay_bonus == 0,
                f"guide_replay_bonus ranks the replay archive: it needs guide_replay: true "
                f"(got guide_replay_bonus {self.guide_replay_bonus}, guide_replay {self.guide_replay})",
            )
        )
        checks.append(
            (
                self.guide_replay or self.guide_replay_rank == "return",
                f"guide_replay_rank {self.guide_replay_rank!r} ranks the replay archive: it needs guide_replay: true",
            )
        )
        checks.append(
            (
                self.guide_replay or self.guide_replay_members == 1,
                f"guide_replay_members {self.guide_replay_members} is the replayed conversations per group: "
                "it needs guide_replay: true",
            )
        )
        if self.guide_replay_rank == "lexicon":
            checks.append(
                (
                    self.reads_reply_lexicon(),
                    f"guide_replay_rank: lexicon ranks by the elicit reward's reply lexicon term: set reward: elicit and "
                    f"reply_lexicon_weight > 0 (reward is {self.reward!r}, reply_lexicon_weight {self.reply_lexicon_weight})",
                )
            )
        if self.guide_search:
            checks.append(
                (
                    self.reads_reply_lexicon(),
                    f"guide_search searches for the elicit reward's reply lexicon: set reward: elicit and reply_lexicon_weight "
                    f"> 0 (reward is {self.reward!r}, reply_lexicon_weight {self.reply_lexicon_weight})",
                )
            )
        return checks

    def _branch_checks(self) -> list[tuple[bool, str]]:
        """``branches`` trains each branch in this process, on the run's models, before ``total_steps``."""
        if self.branches == 1:
            return []
        return [
            (
                self.branch_steps < self.total_steps,
                f"branch_steps must be below total_steps ({self.total_steps}): the run goes on after the branches, "
                f"got {self.branch_steps}",
            ),
            (
                self.collector == "local" and self.harden_every == 0,
                f"branches train one after another on the models of this process: set collector: local and "
                f"harden_every: 0 (got {self.collector!r}, {self.harden_every})",
            ),
        ]

    def _reference_checks(self) -> list[tuple[bool, str]]:
        """``kl_reference: warm_start`` needs a warm start and a term that reads the reference."""
        return [
            (
                self.kl_reference == "base" or self.warm_start_probes > 0,
                f"kl_reference: warm_start pins the tester its warm start leaves: set warm_start_probes > 0 "
                f"(got {self.warm_start_probes})",
            ),
            (
                self.kl_reference == "base" or self.kl_coef > 0 or self.algorithm in ("dpo", "ipo"),
                f"kl_reference: warm_start changes the KL term, which kl_coef {self.kl_coef} switches off: "
                f"set kl_coef > 0 (e.g. 0.02)",
            ),
        ]

    def _check_optimisation(self) -> None:
        _raise_first(
            [
                (
                    self.minibatches <= self.batch_size,
                    f"minibatches ({self.minibatches}) exceeds the turns per step ({self.batch_size})",
                ),
            ]
        )


@dataclass
class WarmStartSection:
    """The warm start before RL (0 probes = off)."""

    warm_start_probes: int = setting(
        0,
        "Warm start: probes the untrained tester writes on the train split before RL; those that "
        "elicit (see warm_start_min_toxic) are kept and the tester is fine-tuned on them; 0 = off.",
        at_least=0,
    )
    warm_start_min_toxic: float = setting(
        0.25,
        "Warm start: a probe is kept when its estimated share of toxic replies (warm_start_select) is "
        "at least this, while the training scorer does not call the probe alone toxic.",
        at_least=0,
        at_most=1,
    )
    warm_start_select: str = setting(
        "share",
        "Warm start: how a probe's share of toxic replies is estimated: share (of its reply_samples "
        "replies the training scorer calls toxic; at least one must be), lexicon (the mean of its replies' "
        "reply lexicon estimates; needs reward elicit with reply_lexicon_weight > 0), search (no sampling; a "
        "beam search over the tester's likely tokens finds, for each of warm_start_probes openers, the probe "
        "after which the target's next token (chat mode: its greedy reply of warm_start_reply_tokens tokens) "
        "most likely holds a reply_lexicon word; that probability is the estimate) or best_of (the tester "
        "samples warm_start_samples probes per opener; the one whose sampled reply of warm_start_reply_tokens "
        "tokens has the highest such probability is the opener's candidate; needs reward elicit with "
        "reply_lexicon_weight > 0).",
        choices=WARM_START_SELECTIONS,
    )
    warm_start_samples: int = setting(
        16, "Warm start with select best_of: probes the tester samples per opener, of which the best is kept.", at_least=1
    )
    warm_start_reply_tokens: int | None = setting(
        None,
        "Warm start with select best_of or search: the target reply each estimate reads, in tokens: the "
        "reply lexicon estimate 1 - prod_t (1 - m_t) over a reply this long (best_of: sampled; search: greedy, "
        "for every candidate token, so its cost grows with it; 1: the next-token probability of a lexicon "
        "word). null = 1 in text mode, target_max_new_tokens in chat mode (an assistant reply opens with 'I' "
        "or 'Sure', so its first token says nothing).",
        at_least=1,
    )
    warm_start_beams: int = setting(8, "Warm start with select search: partial probes kept per opener.", at_least=1)
    warm_start_top_k: int = setting(
        8, "Warm start with select search: the tester's likeliest next tokens tried per partial probe.", at_least=1
    )
    warm_start_max_nll: float | None = setting(
        None,
        "Warm start with select search or best_of: the naturalness bound, the largest mean per-token "
        "NLL under the target a probe may have (search: checked at every step; best_of: a sample above it is "
        "not chosen; a probe above it is never kept); null = no bound. search needs the tester and the "
        "target to share a tokenizer.",
        above=0,
    )
    warm_start_rounds: int = setting(
        1,
        "Warm start: rounds of find-keep-fine-tune. Each round draws warm_start_probes new candidates "
        "(training openers in an order of its own) with the tester as the rounds before left it, keeps by the "
        "same rule and fine-tunes on what it kept: expert iteration, each round's tester proposing set-ups "
        "the untrained one rarely writes.",
        at_least=1,
    )
    warm_start_scorer: str | None = setting(
        None,
        "Warm start: the scorer whose judgement chooses the warm start's probes (its lexicon when "
        "reply_lexicon is scorer, its scores of probes and sampled replies); null = scorer. The RL steps "
        "still train on scorer, so a run can start from probes one scorer found and learn on another's reward.",
    )
    warm_start_retest: int = setting(
        0,
        "Warm start: re-test every kept probe after this many more training openers (the target's "
        "greedy reply of target_max_new_tokens tokens, read by the reward's reply lexicon: scorer's, not "
        "warm_start_scorer's) and fine-tune only on the warm_start_retest_keep share with the highest mean "
        "estimate, the probes that carry past the opener they were found on; 0 = off.",
        at_least=0,
    )
    warm_start_retest_keep: float = setting(
        0.5,
        "Warm start with warm_start_retest: the share of kept probes, best re-tested first, fine-tuned on.",
        above=0,
        at_most=1,
    )
    warm_start_turns: int = setting(
        1,
        "Warm start with select search, chat mode: turns searched per opener. Turn t's probe is searched "
        "after the conversation so far (the searched probes before it, each followed by the target's greedy "
        "reply of target_max_new_tokens tokens), so each of warm_start_probes openers gives this many "
        "candidates and the tester is also fine-tuned on what to say after a reply; at most turns.",
        at_least=1,
    )
    warm_start_epochs: int = setting(3, "Warm start: passes over the kept probes.", at_least=1)
    warm_start_lr: float = setting(1e-3, "Warm start: learning rate of the fine-tuning (AdamW).", above=0)

    def _check_warm_start(self) -> None:
        _raise_first(
            [
                (
                    self.warm_start_select not in ("lexicon", "best_of") or self.reads_reply_lexicon(),
                    f"warm_start_select {self.warm_start_select!r} reads the elicit reward's reply lexicon: set reward: "
                    f"elicit and reply_lexicon_weight > 0 (reward is {self.reward!r}, reply_lexicon_weight "
                    f"{self.reply_lexicon_weight})",
                ),
                (
                    self.warm_start_reply_tokens is None or self.warm_start_select in ("search", "best_of") or self.guide_search,
                    f"warm_start_reply_tokens sets the reply that search and best_of read: set warm_start_select: search "
                    f"or best_of (warm_start_select is {self.warm_start_select!r}), or guide_search: true",
                ),
                (
                    self.warm_start_max_nll is None or self.warm_start_select in ("search", "best_of") or self.guide_search,
                    f"warm_start_max_nll bounds searched or best-of probes: set warm_start_select: search or best_of "
                    f"(warm_start_select is {self.warm_start_select!r}), or guide_search: true",
                ),
                (
                    self.warm_start_retest_keep == 0.5 or self.warm_start_retest > 0,
                    f"warm_start_retest_keep {self.warm_start_retest_keep} is the share of re-tested probes kept: set "
                    f"warm_start_retest > 0 (got {self.warm_start_retest}), or drop it",
                ),
                (
                    self.warm_start_retest == 0 or self.warm_start_probes > 0,
                    f"warm_start_retest {self.warm_start_retest} re-tests the warm start's probes: set "
                    f"warm_start_probes > 0 (got {self.warm_start_probes}), or drop it",
                ),
                (
                    self.warm_start_turns == 1 or self.warm_start_probes > 0,
                    f"warm_start_turns {self.warm_start_turns} searches the warm start's later turns: set "
                    f"warm_start_probes > 0 (got {self.warm_start_probes}), or drop it",
                ),
                (
                    self.warm_start_turns == 1
                    or (self.mode == "chat" and self.warm_start_select == "search" and self.warm_start_turns <= self.turns),
                    f"warm_start_turns {self.warm_start_turns} searches later turns of chat conversations: set mode: chat "
                    f"(got {self.mode!r}), warm_start_select: search (got {self.warm_start_select!r}) and turns >= "
                    f"{self.warm_start_turns} (got {self.turns})",
                ),
                (
                    self.warm_start_turns == 1 or self.warm_start_retest == 0,
                    f"warm_start_turns {self.warm_start_turns} is not read by warm_start_retest {self.warm_start_retest}, "
                    f"which re-tests first probes on other openers: drop one",
                ),
                (
                    self.warm_start_scorer is None or self.warm_start_probes > 0,
                    f"warm_start_scorer {self.warm_start_scorer!r} chooses the warm start's probes: set "
                    f"warm_start_probes > 0 (got {self.warm_start_probes}), or drop it",
                ),
            ]
        )


@dataclass
class NoveltySection:
    """The novelty bonuses (0 = off)."""

    novelty_ngram: float = setting(
        0.0,
        "Coefficient of the n-gram novelty bonus: reward += coef * (1 - mean BLEU of the probe against past probes); 0 = off.",
        at_least=0,
    )
    novelty_embedding: float = setting(
        0.0,
        "Coefficient of the embedding novelty bonus: reward += coef * (1 - cosine of the probe to past probes); 0 = off.",
        at_least=0,
    )
    novelty_history: int = setting(1000, "Past probes the novelty bonuses compare against (a FIFO; >= 1).", at_least=1)
    novelty_ngram_n: int = setting(5, "Highest BLEU order of the n-gram novelty (orders 2..n).", at_least=2)
    novelty_embedding_reduce: str = setting(
        "max", "How the embedding novelty reduces cosines over the history: max or mean.", choices=NOVELTY_REDUCTIONS
    )

    def novelty_options(self) -> dict | None:
        """The ``novelty`` option of :func:`astrl.envs.make_redteam_env` (None when both coefficients are 0)."""
        if not (self.novelty_ngram or self.novelty_embedding):
            return None
        return {
            "ngram": self.novelty_ngram,
            "embedding": self.novelty_embedding,
            "history": self.novelty_history,
            "ngram_n": self.novelty_ngram_n,
            "embedding_reduce": self.novelty_embedding_reduce,
            "device": self.device,
        }


@dataclass
class HardeningSection:
    """Target hardening (harden_every 0 = off)."""

    harden_every: int = setting(
        0,
        "Every this many steps the target's own LoRA adapter learns to refuse the archived attacks (0: off; needs lora).",
        at_least=0,
    )
    harden_steps: int = setting(10, "Hardening: optimizer steps per round.", at_least=1)
    harden_lr: float = setting(1e-3, "Hardening: learning rate of the target's adapter.", above=0)
    harden_batch_size: int = setting(16, "Hardening: archived attacks per step.", at_least=1)
    harden_threshold: float = setting(
        0.5, "Hardening: an attack is archived when the reply's reward score is above this.", at_least=0, below=1
    )
    harden_max_attacks: int = setting(256, "Hardening: size of the attack archive (the oldest leave first).", at_least=1)
    refusal: str = setting(
        "I'm sorry, but I can't help with that.", "Hardening: the answer the target learns to give the archived attacks."
    )

    def _check_hardening(self) -> None:
        _raise_first(
            [
                (
                    self.harden_every == 0 or self.lora,
                    "harden_every needs lora: true (the target is hardened through its own LoRA adapter)",
                ),
                (bool(self.refusal.strip()), f"refusal must not be empty, got {self.refusal!r}"),
            ]
        )


@dataclass
class ScaleSection(CollectionSettings):
    """Scale-out: generation backends, vLLM's memory and collection (:class:`astrl.backends.CollectionSettings`,
    declared once for training and ``astrl rollout``), prefill sharing and the KV cache (docs/scaling.md)."""

    share_prefill: bool = setting(
        False, "Identical prompt rows of a generate call (tree siblings, GRPO groups) prefill once (transformers backend)."
    )
    turn_cache: bool = setting(
        True,
        "Keep each model's KV cache between generate calls, so that later turns and tree levels prefill only "
        "the tokens not read yet (transformers backend; exact up to float rounding).",
    )

    def _check_scale(self) -> None:
        try:
            self.check_collection()  # the collection settings' own checks (astrl.backends)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        scaled = self.collector == "ray" or "vllm" in (self.backend, self.target_backend)
        _raise_first(
            [
                (
                    not scaled or self.algorithm in ("grpo", "ppo"),
                    f"collector 'ray' and backend 'vllm' apply to grpo and ppo (the tree sampler of {self.algorithm} "
                    "generates with Transformers)",
                ),
                (
                    self.prompts_per_step % self.num_collectors == 0,
                    f"prompts_per_step ({self.prompts_per_step}) must be a multiple of num_collectors "
                    f"({self.num_collectors}): each worker runs whole groups",
                ),
                (
                    not (self.collector == "ray" and self.backend == "vllm"),
                    "backend 'vllm' runs with collector 'local' (one engine next to the trainer); with collector 'ray' "
                    "use backend 'transformers' in the workers",
                ),
                (
                    self.target_backend == "transformers" or self.reward == "score",
                    f"reward {self.reward!r} scores probes with the target's Transformers model: use target_backend "
                    "'transformers'",
                ),
            ]
        )


@dataclass
class LoggingSection:
    """The run directory, logging, checkpoints and the attack archive."""

    run_dir: str = setting("runs/train", "Run directory: config, metrics, samples, checkpoints.")
    save_every: int = setting(25, "Steps between checkpoints (one is also written at the end).", at_least=1)
    keep_checkpoints: int = setting(2, "Newest checkpoints kept; older ones are removed.", at_least=1)
    log_every: int = setting(1, "Steps between logger writes (metrics.csv gets every step).", at_least=1)
    sample_every: int = setting(10, "Steps between sample turns in samples.jsonl (and step 1).", at_least=1)
    loggers: list[str] = field(default_factory=lambda: ["csv"], metadata={"help": "TorchRL loggers: csv, tensorboard, wandb."})
    archive_threshold: float = setting(
        0.5, "A turn enters attacks.jsonl when its reward scorer's score is above this (in [0, 1)).", at_least=0, below=1
    )

    def _check_logging(self) -> None:
        _raise_first(
            [
                (
                    set(self.loggers) <= {"csv", "tensorboard", "wandb"},
                    f"loggers must be among csv, tensorboard, wandb, got {self.loggers}",
                ),
            ]
        )


# The sections of TrainConfig, in the order of its keys (astrl train --keys lists them so).
SECTIONS: dict[str, type] = {
    "run": RunSection,
    "conversation": ConversationSection,
    "reward": RewardSection,
    "algorithm": AlgorithmSection,
    "warm start": WarmStartSection,
    "novelty": NoveltySection,
    "hardening": HardeningSection,
    "scale-out": ScaleSection,
    "logging": LoggingSection,
}


@dataclass
class TrainConfig(
    LoggingSection,
    ScaleSection,
    HardeningSection,
    NoveltySection,
    WarmStartSection,
    AlgorithmSection,
    RewardSection,
    ConversationSection,
    RunSection,
):  # the sections last to first: a dataclass takes its bases' fields last base first
    """Every setting of a training run (``configs/*.yaml`` hold subsets of these keys).

    A flat dataclass made of the sections in :data:`SECTIONS`. Each field's ``metadata["help"]``
    says what it does; ``astrl train --keys`` prints them all, by section, with their defaults.
    """

    def __post_init__(self) -> None:
        try:
            check_settings(self)  # every key's own range or choices, declared with its field
        except ValueError as err:
            raise ConfigError(str(err)) from None
        for check in (
            self._check_reward,
            self._check_algorithm,
            self._check_warm_start,
            self._check_hardening,
            self._check_scale,
            self._check_logging,
        ):
            check()

    def check_names(self) -> None:
        """The checks of the run that need no model (:func:`astrl.names.check_names`): tester,
        target, scorer and judge names, and the prompt source with its split."""
        from astrl.names import check_names

        roles = {"tester": self.tester, "target": self.target}
        scorers = [self.scorer, *self.judges, *[s for s in (self.warm_start_scorer, self.probe_scorer) if s]]
        check_names(
            roles, scorers, self.prompts, split=self.split, split_seed=self.prompt_split_seed,
            test_fraction=self.test_fraction,
        )  # fmt: skip
        self._check_reply_lexicon()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False), encoding="utf-8")


def valid_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def _parse_value(key: str, text: str):
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {key}={text!r} is not a plain YAML value: {yaml_problem(err)}") from None
    if fields[key].type in ("list[str]",) and isinstance(value, str):
        value = [v for v in value.split(",") if v]
    return value


def renamed_keys(values: dict, where: str, on_warning: Callable[[str], None] | None = None) -> dict:
    """``values`` with the old names of renamed keys (:data:`RENAMED_KEYS`) replaced by the new ones.

    Each old name is reported to ``on_warning`` (default: a :class:`DeprecationWarning`); an old
    name beside its new one is a :class:`ConfigError`, since either could be the one meant.
    ``where`` names the source in the messages (``"config file 'x.yaml'"``, ``"the overrides"``).
    """
    for old, new in RENAMED_KEYS.items():
        if old in values and new in values:
            raise ConfigError(
                f"both {old!r} and {new!r} are set in {where}; {old!r} is the old name of {new!r}: keep only {new!r}"
            )
    for old in (key for key in values if key in RENAMED_KEYS):
        message = f"config key {old!r} in {where} is deprecated: it is now {RENAMED_KEYS[old]!r} (same meaning); rename it"
        if on_warning is None:
            warnings.warn(message, DeprecationWarning, stacklevel=2)
        else:
            on_warning(message)
    return {RENAMED_KEYS.get(key, key): value for key, value in values.items()}


def renamed_overrides(overrides: Sequence[str], on_warning: Callable[[str], None] | None = None) -> list[str]:
    """``key=value`` overrides with the old names of renamed keys replaced (see :func:`renamed_keys`)."""
    renamed_keys(dict.fromkeys(item.partition("=")[0] for item in overrides if "=" in item), "the overrides", on_warning)
    items = [item.partition("=") for item in overrides]
    return [f"{RENAMED_KEYS.get(key, key)}={text}" if sep else key for key, sep, text in items]


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    on_warning: Callable[[str], None] | None = None,
) -> TrainConfig:
    """Read a YAML config (or the defaults) and apply ``key=value`` overrides.

    Unknown keys, in the file or the overrides, are rejected with the list of valid ones. Old
    names of renamed keys are read as the new ones and reported to ``on_warning`` (default: a
    :class:`DeprecationWarning`).
    """
    values: dict = {}
    notes: list[str] = []
    if path is not None:
        values.update(renamed_keys(read_yaml_mapping(path), f"config file {str(path)!r}", notes.append))
    overrides = renamed_overrides(overrides, notes.append)
    for note in notes:
        if on_warning is None:
            warnings.warn(note, DeprecationWarning, stacklevel=2)
        else:
            on_warning(note)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key, text = item.split("=", 1)
        if key not in valid_keys():
            values[key] = None  # reported below with the list of valid keys
        else:
            values[key] = _parse_value(key, text)
    unknown = sorted(set(values) - set(valid_keys()))
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown}; valid keys: {', '.join(valid_keys())}")
    _check_types(values)
    try:
        return TrainConfig(**values)
    except TypeError as err:
        raise ConfigError(str(err)) from err


def _check_types(values: dict) -> None:
    defaults = TrainConfig.__dataclass_fields__
    for key, value in values.items():
        kind = defaults[key].type
        if kind in ("float", "float | None") and isinstance(value, str):
            try:  # YAML 1.1 reads 1e-4 (no dot) as a string
                value = values[key] = float(value)
            except ValueError:
                pass
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
            "str | None": value is None or isinstance(value, str),
            "float | None": value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)),
            "int | None": value is None or (isinstance(value, int) and not isinstance(value, bool)),
            "list[str]": isinstance(value, list) and all(isinstance(v, str) for v in value),
        }.get(kind, True)
        if not ok:
            raise ConfigError(f"config key {key!r} must be {kind}, got {value!r}")
        if kind == "float":
            values[key] = float(value)


def yaml_value(value) -> str:
    """``value`` written as in a YAML config, on one line (``null``, ``true``, ``0.0001``, ``[csv]``)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1_000_000).strip()
    return text.removesuffix("...").strip()


def describe_keys() -> str:
    """Every :class:`TrainConfig` key with its type, default and help, by section (:data:`SECTIONS`):
    the text of ``astrl train --keys``."""
    lines = ["config keys (YAML file or key=value on the command line; lists also as a,b):"]
    for title, section in SECTIONS.items():
        lines.append(f"{title}:")
        for spec in dataclasses.fields(section):
            default = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
            bounds = range_text(spec.metadata) or (
                "one of " + ", ".join(spec.metadata["choices"]) if "choices" in spec.metadata else ""
            )
            lines.append(f"  {spec.name} = {yaml_value(default)}  ({spec.type}{', ' if bounds else ''}{bounds})")
            lines.append(textwrap.fill(spec.metadata["help"], width=100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    renamed = ", ".join(f"{old} -> {new}" for old, new in RENAMED_KEYS.items())
    lines.append(f"renamed keys, still read with a warning: {renamed}")
    return "\n".join(lines)
