"""PPO with a value head: per-token clipped-KL rewards, GAE (or one-step) advantages, ``PPOLoss``.

Per step: conversations are collected as for GRPO; each tester turn becomes one episode whose
per-token reward is ``-kl_coef * clip(log pi - log pi_ref) + [last token] * clip(score)``
(:class:`astrl.rewards.ClippedKLReward`); the value head gives old values, undiscounted advantages
follow (:func:`astrl.losses.compute_advantages`), then ``epochs`` passes of clipped-surrogate updates
with value loss and entropy bonus. The value head has its own learning rate (``value_lr``).
"""

from __future__ import annotations

from tensordict import TensorDict, TensorDictBase, lazy_stack

from astrl.keys import CONVERSATION, NEXT, REF_LOG_PROBS, REWARD, TOKENS_PROMPT, TOKENS_RESPONSE
from astrl.losses import PPOLoss, ValueHead, compute_advantages
from astrl.rewards import ClippedKLReward, TokenLogProbs
from astrl.training.config import ConfigError, TrainConfig
from astrl.training.grpo import OnPolicy
from astrl.training.setup import RunModels

# Episodes are undiscounted (the advantages' gamma is 1): an episode is one tester turn, whose score
# arrives on its last token, so each token's return is the plain sum of the rewards from it to the end
# of the turn and the score counts in full for every token of the probe.
DISCOUNT = 1.0


class PPOAlgorithm(OnPolicy):
    """The trainer's PPO for ``algorithm: ppo`` (the System solver is :class:`astrl.PPO`)."""

    name = "ppo"

    def __init__(self, config: TrainConfig, models: RunModels, env, policy, stream=None) -> None:
        super().__init__(config, models, env, policy, stream)
        model = models.tester.model
        self.value_head = ValueHead.for_model(model).to(next(model.parameters()).device)
        window = models.tester.context_window
        self.loss_module = PPOLoss(
            model,
            self.value_head,
            clip_epsilon=config.clip_epsilon,
            value_coef=config.value_coef,
            entropy_coef=config.entropy_coef,
            max_length=window,
            kl_token_cap=config.kl_token_cap,
            share_prefix=self.share_prefix,
        )
        self.reference = TokenLogProbs(
            models.reference,
            self.tokenizer,
            out_key=REF_LOG_PROBS,
            frozen=True,
            max_length=window,
            nested=True,
            share_prefix=self.share_prefix,
        )
        self.kl_reward = ClippedKLReward(
            kl_coef=config.kl_coef, kl_clip=config.kl_clip, score_clip=config.score_clip, target_kl=config.target_kl
        )

    def parameter_groups(self, lr: float) -> list[dict]:
        return self.loss_module.parameter_groups(lr, self.config.value_lr)

    def collect(self) -> tuple[TensorDictBase, TensorDictBase]:
        data = self.next_rollout()
        batch = self.training_batch(data)
        self.kl_reward.update_kl_coef()
        return batch, data

    def training_batch(self, data: TensorDictBase) -> TensorDictBase:
        """Per-turn samples of a flat rollout with old values, log-probs, per-token rewards and advantages."""
        prompts = data.get(TOKENS_PROMPT, as_list=True)
        responses = data.get(TOKENS_RESPONSE, as_list=True)
        scores = data[NEXT, REWARD].reshape(-1, 1).float()
        conversations = self.conversation_index(data)  # a conversation's turns share a minibatch (minibatches())
        batch = lazy_stack(
            [
                TensorDict().set(TOKENS_PROMPT, p).set(TOKENS_RESPONSE, r).set(REWARD, s).set(CONVERSATION, c)
                for p, r, s, c in zip(prompts, responses, scores, conversations, strict=True)
            ]
        )
        self.reference(batch)  # ref_log_probs and response_mask
        self.loss_module.annotate(batch)  # old values and behaviour log-probs, one forward
        self.kl_reward(batch)  # per-token reward
        compute_advantages(batch, mode=self.config.advantage, gamma=DISCOUNT, lmbda=self.config.gae_lambda)
        return batch

    def loss(self, minibatch: TensorDictBase) -> TensorDictBase:
        return self.loss_module(minibatch.to(self.models.tester.model.device))

    def state_dict(self) -> dict:
        return {"value_head": self.value_head.state_dict(), "kl_reward": self.kl_reward.state_dict(), **super().state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "value_head" not in state:
            raise ConfigError("the checkpoint holds no value head: it was saved by another algorithm than ppo")
        self.value_head.load_state_dict(state["value_head"])
        self.kl_reward.load_state_dict(state["kl_reward"])

    def step_metrics(self) -> dict:
        return {"kl_coef": self.kl_reward.kl_coef}
