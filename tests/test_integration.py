"""End to end on the embedded SmolLM2-135M-Instruct (converted once, then cached)."""

import pytest
import torch

from astrl._compat import history_to_chats
from astrl.envs import make_redteam_env
from astrl.models import load_model
from astrl.policies import GenerationSettings, make_policy
from astrl.prompts import load_prompts
from astrl.scorers import ProfanityScorer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_smollm2_tester_vs_target_two_conversations_three_turns():
    lm = load_model("smollm2-135m")
    assert lm.context_window == 8192 and lm.tokenizer.pad_token != lm.tokenizer.eos_token
    tester = make_policy(lm, GenerationSettings(16))
    target = make_policy(lm, GenerationSettings(16))
    env = make_redteam_env(tester, target, [ProfanityScorer()], load_prompts("builtin"), batch_size=2, max_turns=3)
    torch.manual_seed(0)
    ro = env.rollout(3, tester)
    assert ro.batch_size == (2, 3)
    rewards = ro["next", "reward"]
    assert rewards.shape == (2, 3, 1) and ((rewards >= 0) & (rewards <= 1)).all()
    final = history_to_chats(ro[:, -1]["next", "history"].prompt)
    assert all(len(chat) == 8 for chat in final)
    replies = list(ro["next", "target_response"])
    assert all(isinstance(r, str) and r.strip() for row in replies for r in row)
    assert "<|im_end|>" not in " ".join(r for row in replies for r in row)
