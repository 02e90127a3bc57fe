"""The TensorDict keys astrl reads and writes, named once.

Envs, rewards, losses, samplers and trainers exchange data through these keys; their values are
part of astrl's data format (collected batches, tree-sampler results, preference pairs, user code
reading a rollout) and never change. Loss outputs (``loss_*`` and their diagnostics) are not listed:
each loss module names its own ``out_keys``. Keys that one module uses for itself stay there.
"""

from __future__ import annotations

# -- TorchRL's LLM data -------------------------------------------------------------------------------
# Written by TorchRL: ``DataLoadingPrimer`` puts the openers at ``QUERY`` (``ChatEnv.data_key``),
# ``ChatEnv`` keeps the tester's state at ``HISTORY_PROMPT`` (chat) or ``TEXT_PROMPT``
# (``ChatEnv.text_key``, text), and the LLM wrappers write ``TEXT_RESPONSE`` (``ChatEnv.response_key``),
# the token ids at ``TOKENS_*``, ``ATTENTION_MASK`` and ``LOG_PROBS_FULL``; ``GRPOLoss`` (with its
# tokens-mode actor) reads ``TOKENS_FULL``, ``ATTENTION_MASK``, ``LOG_PROBS_FULL`` and ``ADVANTAGE``.
# astrl's envs, samplers and trainers read them, and the System adapter and the GRPO training batch
# write them in the same layout.
QUERY = "query"
HISTORY = "history"
HISTORY_PROMPT = (HISTORY, "prompt")
TEXT = "text"
TEXT_PROMPT = (TEXT, "prompt")
TEXT_RESPONSE = (TEXT, "response")
TOKENS = "tokens"
TOKENS_PROMPT = (TOKENS, "prompt")
TOKENS_RESPONSE = (TOKENS, "response")
TOKENS_FULL = (TOKENS, "full")
MASKS = "masks"
ATTENTION_MASK = (MASKS, "all_attention_mask")
LOG_PROBS_FULL = ("log_probs", "full")

# -- TorchRL's env step -------------------------------------------------------------------------------
# A step's outputs live under ``NEXT``; ``StepCounter`` writes ``STEP_COUNT`` (the turn index) and
# ``LLMCollector(track_policy_version=True)`` ``(NEXT, POLICY_VERSION)``. astrl's reward transforms
# write ``REWARD`` (shape ``(*batch, 1)``; per token after ``ClippedKLReward(reduction="token")``).
NEXT = "next"
REWARD = "reward"
DONE = "done"
TERMINATED = "terminated"
STEP_COUNT = "step_count"
POLICY_VERSION = "policy_version"

# -- The red-team env's step output --------------------------------------------------------------------
# ``TargetTurn`` writes the exchange (``PROBE``, ``TARGET_RESPONSE``, ``TARGET_CONTEXT``, what the
# target read before the probe, and its reply ids ``TARGET_TOKENS`` / ``TARGET_MASK``); ``ScoreReward``
# writes ``(SCORES, scorer name)``; the ASTPrompter / elicitation rewards and the novelty terms write
# ``(REWARD_TERMS, term name)``; ``RewardShaping`` keeps the reward before shaping at
# ``REWARD_UNSHAPED``. Rollout records, trainer metrics, the attack archive, the tree sampler and
# ``astrl eval`` read them (a System's env writes ``PROBE`` and ``TARGET_RESPONSE`` too).
PROBE = "probe"
TARGET_RESPONSE = "target_response"
# with ``reply_samples`` K > 1: all K replies to each probe (shape ``(*batch, K)``; the conversation goes
# on with the first, ``TARGET_RESPONSE``), each scorer's scores of them at ``(REPLY_SCORES, name)``
TARGET_RESPONSES = "target_responses"
REPLY_SCORES = "reply_scores"
# with a reply lexicon: per reply, the estimated probability that it holds a listed word (``(*batch, K)``)
TARGET_LEXICON = "target_lexicon"
TARGET_CONTEXT = "target_context"
TARGET_TOKENS = "target_tokens"
TARGET_MASK = "target_mask"
SCORES = "scores"
REWARD_TERMS = "reward_terms"
PROBE_LOGPROB = (REWARD_TERMS, "probe_logprob")
REWARD_UNSHAPED = "reward_unshaped"

# -- Per-token training data ----------------------------------------------------------------------------
# ``TokenLogProbs`` writes a model's log-probs of the response tokens (``ACTOR_LOG_PROBS`` for the
# tester, ``REF_LOG_PROBS`` for the reference) and ``RESPONSE_MASK``; ``ClippedKLReward`` writes
# ``REWARD_RAW`` and ``REWARD_KL``; ``compute_advantages`` writes ``STATE_VALUE``, ``ADVANTAGE`` and
# ``VALUE_TARGET``; ``PPOLoss`` reads them all. GRPO's batch holds ``REF_LOG_PROBS_FULL`` (over prompt +
# response, as ``GRPOLoss`` reads it) and each turn's ``CONVERSATION`` (its minibatches keep a
# conversation's turns together); the System's sequence-level PPO reads ``SAMPLE_LOG_PROB``.
ACTOR_LOG_PROBS = "actor_log_probs"
REF_LOG_PROBS = "ref_log_probs"
REF_LOG_PROBS_FULL = (REF_LOG_PROBS, "full")
RESPONSE_MASK = "response_mask"
REWARD_RAW = "reward_raw"
REWARD_KL = "reward_kl"
STATE_VALUE = "state_value"
ADVANTAGE = "advantage"
VALUE_TARGET = "value_target"
SAMPLE_LOG_PROB = "sample_log_prob"
CONVERSATION = "conversation"

# -- The tree sampler's result -----------------------------------------------------------------------------
# ``TreeSampler.sample`` writes ``PAIRS``, ``GROUPS``, ``NODES``, ``OPENERS`` and the counts;
# ``PreferenceAlgorithm`` adds ``NUM_FORCED``. Preference training, weak supervision, the System's
# solvers and target hardening read them. Nodes hold ``TREE``, ``DEPTH``, ``PARENT``, ``GROUP``,
# ``PROBE``, ``REPLY``, ``REWARD``, ``SCORES`` (and ``REWARD_TERMS``), ``TARGET_CONTEXT`` and, from
# token policies, ``PROMPT_TOKENS``, ``RESPONSE_TOKENS``, ``RESPONSE_MASK`` (from a System: ``CONTEXT``,
# the state the probe followed); sibling groups hold ``TREE``, ``DEPTH``, ``BEST`` and ``WORST`` (node
# indices) among their columns.
PAIRS = "pairs"
GROUPS = "groups"
NODES = "nodes"
OPENERS = "openers"
NUM_PAIRS = "num_pairs"
NUM_SKIPPED = "num_skipped"
NUM_GROUPS = "num_groups"
NUM_FORCED = "num_forced"
TREE = "tree"
DEPTH = "depth"
PARENT = "parent"
GROUP = "group"
REPLY = "reply"
CONTEXT = "context"
PROMPT_TOKENS = "prompt_tokens"
RESPONSE_TOKENS = "response_tokens"
BEST = "best"
WORST = "worst"

# -- Preference pairs ----------------------------------------------------------------------------------------
# The tree sampler and ``WeakSupervision`` write a pair: the shared ``PROMPT_TOKENS`` (or, from a System,
# ``CONTEXT``), both sides' ids, masks, rewards and probe texts, ``REWARD_GAP``, ``DEPTH``, ``TREE``,
# ``GROUP``, the node indices, and ``FORCED`` when weak supervision wrote it. ``PreferenceLoss`` reads
# the ids and masks (or the texts) and writes ``REF_CHOSEN_LOGPROB`` / ``REF_REJECTED_LOGPROB``.
CHOSEN_TOKENS = "chosen_tokens"
REJECTED_TOKENS = "rejected_tokens"
CHOSEN_MASK = "chosen_mask"
REJECTED_MASK = "rejected_mask"
CHOSEN_REWARD = "chosen_reward"
REJECTED_REWARD = "rejected_reward"
REWARD_GAP = "reward_gap"
CHOSEN_PROBE = "chosen_probe"
REJECTED_PROBE = "rejected_probe"
CHOSEN_NODE = "chosen_node"
REJECTED_NODE = "rejected_node"
FORCED = "forced"
REF_CHOSEN_LOGPROB = "ref_chosen_logprob"
REF_REJECTED_LOGPROB = "ref_rejected_logprob"
