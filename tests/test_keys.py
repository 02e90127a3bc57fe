"""astrl.keys: the key values are a data format, TorchRL's keys agree with TorchRL, and the modules use them."""

import dataclasses

from torchrl.envs.llm import ChatEnv
from torchrl.objectives.llm import GRPOLoss

from astrl import keys
from astrl.losses import PPOLoss, PreferenceLoss
from astrl.rewards import ClippedKLReward, RewardShaping
from astrl.rewards.astprompter import ELICIT_TERMS, TERMS
from astrl.sampling import PAIR_KEYS
from astrl.system.solvers import SequencePPOLoss

# Collected batches, tree-sampler results and user code read these values: they never change.
VALUES = {
    "QUERY": "query",
    "HISTORY": "history",
    "HISTORY_PROMPT": ("history", "prompt"),
    "TEXT": "text",
    "TEXT_PROMPT": ("text", "prompt"),
    "TEXT_RESPONSE": ("text", "response"),
    "TOKENS": "tokens",
    "TOKENS_PROMPT": ("tokens", "prompt"),
    "TOKENS_RESPONSE": ("tokens", "response"),
    "TOKENS_FULL": ("tokens", "full"),
    "MASKS": "masks",
    "ATTENTION_MASK": ("masks", "all_attention_mask"),
    "LOG_PROBS_FULL": ("log_probs", "full"),
    "NEXT": "next",
    "REWARD": "reward",
    "DONE": "done",
    "TERMINATED": "terminated",
    "STEP_COUNT": "step_count",
    "POLICY_VERSION": "policy_version",
    "PROBE": "probe",
    "TARGET_RESPONSE": "target_response",
    "TARGET_RESPONSES": "target_responses",
    "REPLY_SCORES": "reply_scores",
    "TARGET_LEXICON": "target_lexicon",
    "TARGET_CONTEXT": "target_context",
    "TARGET_TOKENS": "target_tokens",
    "TARGET_MASK": "target_mask",
    "SCORES": "scores",
    "REWARD_TERMS": "reward_terms",
    "PROBE_LOGPROB": ("reward_terms", "probe_logprob"),
    "REWARD_UNSHAPED": "reward_unshaped",
    "ACTOR_LOG_PROBS": "actor_log_probs",
    "REF_LOG_PROBS": "ref_log_probs",
    "REF_LOG_PROBS_FULL": ("ref_log_probs", "full"),
    "RESPONSE_MASK": "response_mask",
    "REWARD_RAW": "reward_raw",
    "REWARD_KL": "reward_kl",
    "STATE_VALUE": "state_value",
    "ADVANTAGE": "advantage",
    "VALUE_TARGET": "value_target",
    "CONVERSATION": "conversation",
    "SAMPLE_LOG_PROB": "sample_log_prob",
    "PAIRS": "pairs",
    "GROUPS": "groups",
    "NODES": "nodes",
    "OPENERS": "openers",
    "NUM_PAIRS": "num_pairs",
    "NUM_SKIPPED": "num_skipped",
    "NUM_GROUPS": "num_groups",
    "NUM_FORCED": "num_forced",
    "TREE": "tree",
    "DEPTH": "depth",
    "PARENT": "parent",
    "GROUP": "group",
    "REPLY": "reply",
    "CONTEXT": "context",
    "PROMPT_TOKENS": "prompt_tokens",
    "RESPONSE_TOKENS": "response_tokens",
    "BEST": "best",
    "WORST": "worst",
    "CHOSEN_TOKENS": "chosen_tokens",
    "REJECTED_TOKENS": "rejected_tokens",
    "CHOSEN_MASK": "chosen_mask",
    "REJECTED_MASK": "rejected_mask",
    "CHOSEN_REWARD": "chosen_reward",
    "REJECTED_REWARD": "rejected_reward",
    "REWARD_GAP": "reward_gap",
    "CHOSEN_PROBE": "chosen_probe",
    "REJECTED_PROBE": "rejected_probe",
    "CHOSEN_NODE": "chosen_node",
    "REJECTED_NODE": "rejected_node",
    "FORCED": "forced",
    "REF_CHOSEN_LOGPROB": "ref_chosen_logprob",
    "REF_REJECTED_LOGPROB": "ref_rejected_logprob",
}


def test_every_key_keeps_its_value():
    defined = {name: value for name, value in vars(keys).items() if name.isupper()}
    assert defined == VALUES


def test_torchrl_keys_are_the_ones_torchrl_uses():
    assert (keys.QUERY, keys.TEXT_PROMPT, keys.TEXT_RESPONSE) == (ChatEnv.data_key, ChatEnv.text_key, ChatEnv.response_key)
    grpo = GRPOLoss._AcceptedKeys()
    assert (grpo.advantage, grpo.action, grpo.sample_log_prob) == (keys.ADVANTAGE, keys.TOKENS_FULL, keys.LOG_PROBS_FULL)


def test_loss_and_transform_defaults_come_from_the_vocabulary():
    ppo = dataclasses.asdict(PPOLoss._AcceptedKeys())
    assert ppo == {
        "prompt": keys.TOKENS_PROMPT,
        "response": keys.TOKENS_RESPONSE,
        "response_mask": keys.RESPONSE_MASK,
        "sample_log_prob": keys.ACTOR_LOG_PROBS,
        "ref_log_probs": keys.REF_LOG_PROBS,
        "reward": keys.REWARD,
        "advantage": keys.ADVANTAGE,
        "value_target": keys.VALUE_TARGET,
        "value": keys.STATE_VALUE,
    }
    preference = PreferenceLoss._AcceptedKeys()
    pair_inputs = (preference.prompt, preference.chosen, preference.rejected, preference.chosen_mask, preference.rejected_mask)
    assert set(pair_inputs) | {preference.chosen_text, preference.rejected_text} <= set(PAIR_KEYS)
    assert preference.context == keys.CONTEXT
    sequence = SequencePPOLoss._AcceptedKeys()
    assert (sequence.context, sequence.probe, sequence.sample_log_prob) == (keys.CONTEXT, keys.PROBE, keys.SAMPLE_LOG_PROB)
    kl = ClippedKLReward()
    assert (kl.log_prob_key, kl.ref_log_prob_key, kl.mask_key, kl.score_key) == (
        keys.ACTOR_LOG_PROBS,
        keys.REF_LOG_PROBS,
        keys.RESPONSE_MASK,
        keys.REWARD,
    )
    shaping = RewardShaping()
    assert (shaping.in_key, shaping.keep_raw_key) == (keys.REWARD, keys.REWARD_UNSHAPED)


def test_the_likelihood_term_is_the_one_eval_reads():
    term = keys.PROBE_LOGPROB[1]
    assert term in TERMS and term in ELICIT_TERMS
