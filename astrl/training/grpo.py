"""Multi-turn GRPO: ``LLMCollector`` -> group-relative advantages per turn -> ``ResponseGRPOLoss``.

Each tester turn is one training sample. A step runs ``prompts_per_step`` openers, each in
``group_size`` conversations of ``turns`` tester turns. The return of a turn is its own reward
(``returns: turn``) or the sum of its and the later turns' rewards (``returns: to_go``), and
:func:`turn_group_advantages` normalises it among the turns at the same position of the
conversations that share its opener, so that an advantage never carries the turn index.

Behaviour and reference log-probs are recomputed on the exact token ids (the generate-time
log-probs set the first token to 0.0). The behaviour log-probs of the first minibatch are its
loss forward's own (detached: no update has happened since the collection, so the importance
ratio is exactly 1 there); the other rows' are read before the first update, in ``minibatches``.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from torchrl.collectors.llm import LLMCollector
from torchrl.modules.llm import TransformersWrapper
from torchrl.objectives.llm import GRPOLoss

from astrl._compat import as_list
from astrl.archive import conversation_turns
from astrl.envs.transforms import ScoreReward
from astrl.keys import (
    ADVANTAGE,
    ATTENTION_MASK,
    CONVERSATION,
    DONE,
    LOG_PROBS_FULL,
    MASKS,
    NEXT,
    POLICY_VERSION,
    PROBE,
    QUERY,
    REF_LOG_PROBS_FULL,
    REWARD,
    REWARD_TERMS,
    SCORES,
    STEP_COUNT,
    TARGET_RESPONSE,
    TOKENS,
    TOKENS_FULL,
    TOKENS_PROMPT,
    TOKENS_RESPONSE,
)
from astrl.lm_scoring import nested_token_logprobs, stop_ids, until_stop
from astrl.losses.kl import KL_TOKEN_CAP, checked_cap, k3
from astrl.losses.ppo import masked_mean
from astrl.prefill import weights_fingerprint
from astrl.ragged import nested, pad_rows
from astrl.rewards.novelty import load_novelty_states, novelty_transforms
from astrl.training.algorithm import Algorithm
from astrl.training.batches import shuffled_minibatches, turn_metrics
from astrl.training.config import GROUP_SCALES, TrainConfig
from astrl.training.setup import RunModels


def returns_to_go(rewards: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """``G_t = r_t + G_{t+1}`` within each trajectory of a flat, trajectory-contiguous batch."""
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[0])
    for i in range(rewards.shape[0] - 1, -1, -1):
        running = rewards[i] + torch.where(done[i], torch.zeros_like(running), running)
        out[i] = running
    return out


def turn_group_advantages(
    returns: torch.Tensor, openers: list[str], turns: torch.Tensor, group_size: int, eps: float = 1e-6, scale: str = "std"
) -> torch.Tensor:
    """Group-relative advantages of a flat batch of tester turns, normalised per (opener, turn) cell.

    A cell holds the turns at one position (``turns[i]``, the turn index) of the conversations
    that share an opener (``openers[i]``) in this batch. Within each cell of ``n`` returns::

        A_i = (R_i - mean) / (std + eps),   mean = sum(R) / n,   std = sqrt(sum((R - mean)^2) / n)

    (``std`` is the population standard deviation, divided by ``n``, not ``n - 1``). With
    ``scale="none"`` the division is dropped, ``A_i = R_i - mean`` (Dr. GRPO, Liu et al. 2025): the
    std division gives a cell whose returns differ by noise the same weight as one whose returns
    differ by a success. A cell whose returns are all equal (zero std, a cell of one among them) gets
    ``A = 0``. The advantages of a cell therefore sum to zero, and adding the same value to every
    return at one turn position (e.g. a reward that grows with the turn index) changes no advantage.

    Every cell must hold whole groups: ``group_size`` turns, or a multiple of it when an opener is
    drawn twice in one batch (at an epoch boundary of the prompt stream; its conversations then
    form one larger group). Otherwise a ``ValueError`` names the cells and their sizes.
    """
    if scale not in GROUP_SCALES:
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    keys = list(zip(openers, turns.reshape(-1).tolist(), strict=True))
    index = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    cell = torch.tensor([index[key] for key in keys], device=returns.device)
    size = torch.bincount(cell, minlength=len(index))
    incomplete = {key: int(size[i]) for key, i in index.items() if size[i] % group_size}
    if incomplete:
        shown = ", ".join(f"(opener {o[:40]!r}, turn {t}): {n}" for (o, t), n in list(incomplete.items())[:5])
        raise ValueError(
            f"GRPO expected complete groups: each (opener, turn) cell needs a multiple of group_size={group_size} "
            f"turns; {len(incomplete)} of {len(index)} cells do not ({shown})"
        )
    values = returns.reshape(-1).double()  # float64 statistics: cell sums of large returns stay exact
    n = size.to(values.dtype)
    mean = torch.zeros_like(n).index_add_(0, cell, values) / n
    deviation = values - mean[cell]
    std = (torch.zeros_like(n).index_add_(0, cell, deviation**2) / n).sqrt()
    high = torch.zeros_like(n).scatter_reduce(0, cell, values, "amax", include_self=False)
    low = torch.zeros_like(n).scatter_reduce(0, cell, values, "amin", include_self=False)
    scaled = deviation / (std[cell] + eps) if scale == "std" else deviation
    advantages = torch.where((high > low)[cell], scaled, torch.zeros_like(values))
    return advantages.to(returns.dtype)


def full_rows(prompts: list[torch.Tensor], response_logprobs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-sample log-probs over prompt + response (0.0 on the prompt, which no loss reads)."""
    return [torch.cat([torch.zeros(len(p)), lp.float().cpu()]) for p, lp in zip(prompts, response_logprobs, strict=True)]


class BehaviourDue:
    """A collected batch whose behaviour log-probs are still to be read, with the tester's weights
    fingerprint at collection: they are read before the first update (GRPO's minibatches and loss)."""

    def __init__(self, batch: TensorDictBase, fingerprint: tuple) -> None:
        self.batch, self.fingerprint = batch, fingerprint
        self.pending = {id(td) for td in batch.tensordicts}


class ResponseGRPOLoss(GRPOLoss):
    """TorchRL's ``GRPOLoss`` surrogate, with its KL term and diagnostics taken per response token.

    Let ``M`` be the response tokens of the minibatch (each response up to its first EOS; no
    prompt, no padding), ``x_t = log pi(a_t) - log pi_old(a_t)`` the log importance ratio and
    ``d_t = log pi_ref(a_t) - log pi(a_t)``. The outputs are::

        loss_objective = GRPOLoss's clipped surrogate, token mean over M
        loss_kl_to_ref = kl_coef * kl_to_ref                       (only when kl_coef > 0; data without
                                                                    reference log-probs is then a ValueError)
        kl_to_ref      = mean over M of min(exp(d_t) - d_t - 1, cap)  (k3 estimate of KL(pi || pi_ref), >= 0)
        kl_approx      = mean over M of exp(x_t) - x_t - 1         (k3 estimate of KL(pi_old || pi), >= 0)
        clip_fraction  = share of M whose ratio exp(x_t) lies outside [1 - eps_low, 1 + eps_high]
        entropy        = mean over M of the full-vocabulary entropy; loss_entropy = -entropy_coef * entropy
        ESS            = GRPOLoss's effective sample size of the ratios over M, divided by |M|

    The KL is a token mean over the minibatch, like the surrogate, so ``kl_coef`` weighs the two
    per token; ``kl_token_cap`` (default 10, None: no cap) bounds one token's term, which otherwise
    grows like ``exp(d_t)`` (see :func:`astrl.losses.kl.k3`). ``kl_to_ref`` is logged whenever the data
    holds reference log-probs. GRPOLoss's own KL path is not used: it pads the reference log-probs its
    own way and averages the KL, ``kl_approx`` and ``clip_fraction`` over every position, prompt
    included, so longer prompts dilute them.

    The current log-probs are computed for response tokens only: one right-padded forward whose LM
    head runs on the response positions (:func:`astrl.rewards.token_logprobs`), laid out as
    GRPOLoss expects (left-padded over prompt + response, masked to the response). The entropy bonus
    reads the full distribution at those positions from the same forward, so it never holds the
    vocabulary's logits at prompt positions. With ``share_prefix``, rows whose prompts begin the same way (a
    group's system prompt and opener) read that prompt once in the forward (and the backward), see
    :func:`astrl.lm_scoring.score_tokens`.
    """

    def __init__(
        self,
        actor_network,
        *,
        model: torch.nn.Module,
        pad_token_id: int,
        max_length: int | None,
        kl_coef: float = 0.0,
        kl_token_cap: float | None = KL_TOKEN_CAP,
        share_prefix: bool = False,
        **kwargs,
    ) -> None:
        unused = [k for k in ("kl_to_ref_coeff", "kl_to_inference_coeff", "kl_mask_threshold") if kwargs.get(k) is not None]
        if unused:
            raise ValueError(f"ResponseGRPOLoss computes its KL itself (kl_coef); {unused} are not supported")
        if kwargs.get("aggregation", "token_mean") != "token_mean":
            raise ValueError("ResponseGRPOLoss aggregates over response tokens (token_mean) only")
        super().__init__(actor_network, **kwargs)
        object.__setattr__(self, "_scored_model", model)  # already registered through actor_network
        self.pad_token_id, self.max_length = pad_token_id, max_length
        self.share_prefix = share_prefix
        self.kl_coef, self.kl_token_cap = kl_coef, checked_cap(kl_token_cap)
        # set by the caller for a minibatch seen before any update since its collection: its behaviour
        # log-probs are the current ones (ratio exactly 1), taken from this forward into last_behaviour
        self.behaviour_from_current = False
        self.last_behaviour: torch.Tensor | None = None

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        tensordict = tensordict.copy()
        reference = tensordict.get(
            self.tensor_keys.ref_log_probs, None, as_padded_tensor=True, padding_side="left", padding_value=0.0
        )
        if reference is None and self.kl_coef > 0:  # GRPOLoss raises here too: never drop the KL term silently
            raise ValueError(
                f"kl_coef is {self.kl_coef} but the data holds no reference log-probs under "
                f"{self.tensor_keys.ref_log_probs!r}: add them or set kl_coef to 0"
            )
        advantage = tensordict.get(self.tensor_keys.advantage, as_padded_tensor=True)  # (B, 1, 1): one per sample
        log_weight, dist, _, mask = self._log_weight(tensordict, adv_shape=advantage.shape[:-1])
        current = tensordict.get("_cur_log_prob")  # (B, T), left-padded, 0.0 off the response
        objective, _ = self._compute_policy_objective(log_weight, advantage)
        out = TensorDict(loss_objective=masked_mean(objective.squeeze(-1), mask))
        log_ratio = log_weight.squeeze(-1).detach()
        low, high = self._clip_bounds
        out["clip_fraction"] = masked_mean(((log_ratio < low) | (log_ratio > high)).float(), mask)
        out["kl_approx"] = masked_mean(k3(log_ratio), mask)
        ratios = log_ratio[mask]
        out["ESS"] = (2 * ratios.logsumexp(0) - (2 * ratios).logsumexp(0)).exp() / mask.sum()
        if reference is not None:
            reference = reference.reshape(current.shape).to(current)
            kl = masked_mean(k3(reference - current, self.kl_token_cap), mask)
            out["kl_to_ref"] = kl.detach()
            if self.kl_coef > 0:
                out["loss_kl_to_ref"] = self.kl_coef * kl
        if self.entropy_bonus:
            entropy = masked_mean(dist.entropy, mask)
            out["entropy"] = entropy.detach()
            out["loss_entropy"] = -self.entropy_coeff * entropy
        return self.output_type.from_tensordict(out)

    def _get_cur_log_prob(self, tensordict: TensorDictBase):
        prompts = tensordict.get(TOKENS_PROMPT, as_list=True)
        responses = tensordict.get(TOKENS_RESPONSE, as_list=True)
        # a conversation's earlier turns begin its later ones: one forward (and backward) for them all
        rows = nested_token_logprobs(
            self._scored_model,
            prompts,
            responses,
            pad_token_id=self.pad_token_id,
            max_length=self.max_length,
            share_prefix=self.share_prefix,
            entropy=self.entropy_bonus,
        )
        rows, entropies = rows if self.entropy_bonus else (rows, None)
        if self.behaviour_from_current:  # no update since collection: the behaviour policy is this one
            self.last_behaviour = nested(full_rows(prompts, [r.detach() for r in rows]))
            tensordict.set(self.tensor_keys.sample_log_prob, self.last_behaviour.to(rows[0].device))
        width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
        log_prob = pad_rows(rows, side="left", width=width)  # left padding: each response ends the row
        mask = pad_rows([torch.ones(len(r), dtype=torch.bool) for r in rows], side="left", width=width, device=log_prob.device)
        # the entropy bonus reads each response position's full-vocabulary entropy from the same forward
        entropy = pad_rows(entropies, side="left", width=width) if entropies is not None else None
        return log_prob, SimpleNamespace(mask=mask, entropy=entropy), False


class OnPolicy(Algorithm):
    """What GRPO and PPO share: an ``LLMCollector`` over the red-team env, minibatches, metrics,
    samples and weight pushes (the :class:`~astrl.training.algorithm.Algorithm` hooks); GRPO and PPO
    add ``collect`` and ``loss``.
    """

    def __init__(self, config: TrainConfig, models: RunModels, env, policy, stream=None) -> None:
        self.config = config
        self.models = models
        self.env = env
        self.policy = policy
        self.novelty = novelty_transforms(env) if env is not None else []  # Ray workers keep their own
        self.tokenizer = models.tester.tokenizer
        self.stops = stop_ids(self.tokenizer, models.tester.model)
        # chat mode: a group's rows begin with one system prompt and opener, read once per forward. Text mode
        # keeps the row-by-row forward (equal up to float rounding), whose numbers its published results have.
        self.share_prefix = config.mode == "chat"
        self.stream = stream
        self.vllm_engine = None  # backend 'vllm': the engine the tester's weights are pushed to
        self._version_offset = 0
        if config.collector == "ray":
            from astrl.distributed import RayCollectors
            from astrl.training.setup import worker_spec

            state = stream.state_dict() if stream is not None else None
            self.collector = RayCollectors(
                worker_spec(config, state),
                num_cpus=config.collector_cpus,
                num_gpus=config.collector_gpus,
                ray_address=config.ray_address,
            )
        else:
            self.collector = LLMCollector(
                env,
                policy=policy,
                dialog_turns_per_batch=config.batch_size * config.turns,
                yield_completed_trajectories=True,
                track_policy_version=True,
            )
            if config.backend == "vllm":
                self.vllm_engine = policy.engine
        self._batches = iter(self.collector)

    def next_rollout(self) -> TensorDictBase:
        """One batch of completed conversations, flat: one entry per tester turn."""
        if self.config.collector == "ray" and self.stream is not None:
            self.stream.next_batch()  # the workers draw their shards of this batch: keep the run's stream in step
        return next(self._batches).reshape(-1)

    def push_weights(self) -> None:
        """After an update: bring the acting policy up to date and advance the policy version.

        Local Transformers collection shares the tester's weights (only the version moves); Ray
        workers get the trainable weights through ``update_policy_weights_``; the in-process vLLM
        engine gets the merged weights (:func:`astrl.training.vllm_sync.push_to_vllm`).
        """
        if self.config.collector == "ray":
            from astrl.distributed import trainable_weights

            self.collector.update_policy_weights_(trainable_weights(self.policy))
        elif self.vllm_engine is not None:
            from astrl.training.vllm_sync import push_to_vllm

            push_to_vllm(self.vllm_engine, self.models.tester.model)
            self.collector.increment_version()
        else:
            self.collector.increment_version()

    def sync_weights(self) -> None:
        """Bring the acting policy to the trainer's current weights without counting an update: called
        once before the first collection of a resumed (or rebuilt) run, so that Ray workers and a vLLM
        engine, which load the untrained weights, act with the restored ones (local Transformers
        collection shares the weights already)."""
        if self.config.collector == "ray":
            from astrl.distributed import trainable_weights

            self.collector.update_policy_weights_(trainable_weights(self.policy))
            self._version_offset += 1  # the workers count this push as a version: it is not an update
        elif self.vllm_engine is not None:
            from astrl.training.vllm_sync import push_to_vllm

            push_to_vllm(self.vllm_engine, self.models.tester.model)

    def data_policy_version(self, data: TensorDictBase) -> int | None:
        """The oldest policy version (updates since this collector started) that generated a turn of
        ``data`` (None if untracked)."""
        key = (NEXT, POLICY_VERSION)
        return int(data.get(key).min()) - self._version_offset if key in data.keys(True) else None

    def shutdown(self) -> None:
        if hasattr(self.collector, "shutdown"):
            self.collector.shutdown()

    def parameter_groups(self, lr: float) -> list[dict]:
        return [{"params": [p for p in self.models.tester.model.parameters() if p.requires_grad], "lr": lr}]

    def minibatches(self, batch: TensorDictBase, generator: torch.Generator) -> Iterator[TensorDictBase]:
        """Shuffled minibatches; a batch that holds each turn's conversation index keeps a conversation's
        turns in one minibatch, so that its loss forward reads the earlier turns inside the later ones."""
        config = self.config
        conversations = batch.get(CONVERSATION) if CONVERSATION in batch.keys() else None
        options = dict(epochs=config.epochs, count=config.minibatches, size=config.minibatch_size, groups=conversations)
        return shuffled_minibatches(batch, generator, **options)

    @staticmethod
    def conversation_index(*parts: TensorDictBase) -> torch.Tensor:
        """Each turn's conversation, counted over flat, trajectory-contiguous rollouts ``parts`` in order."""
        done = torch.cat([part[NEXT, DONE].reshape(-1).long() for part in parts])
        return done.cumsum(0) - done

    @staticmethod
    def metrics(data: TensorDictBase) -> dict:
        """:func:`~astrl.training.batches.turn_metrics` of a flat rollout's turns."""
        return turn_metrics(data[NEXT])

    @staticmethod
    def samples(data: TensorDictBase) -> list[dict]:
        """Per-turn records of a flat rollout, for the sample table and logs."""
        probes, replies = as_list(data[NEXT, PROBE]), as_list(data[NEXT, TARGET_RESPONSE])
        openers, rewards = as_list(data[QUERY]), data[NEXT, REWARD].reshape(-1).tolist()
        turns = data[STEP_COUNT].reshape(-1).tolist()
        return [
            {"opener": o, "turn": t, "probe": p, "response": r, "reward": w}
            for o, t, p, r, w in zip(openers, turns, probes, replies, rewards, strict=True)
        ]

    @property
    def reward_scorer(self) -> str | None:
        """Name of the scorer that gives the reward (None with Ray workers)."""
        if self.env is None:  # Ray workers score in their own envs
            return None
        return next(t.reward_scorer for t in self.env.transform if isinstance(t, ScoreReward))

    @staticmethod
    def turn_records(data: TensorDictBase) -> list[dict]:
        """One record per tester turn of a flat, trajectory-contiguous rollout, for the attack archive:
        ``probe``, ``reply``, ``conversation`` (what was said before the probe), ``scores``, ``reward``, ``turn``."""
        probes, replies = as_list(data[NEXT, PROBE]), as_list(data[NEXT, TARGET_RESPONSE])
        openers, rewards = as_list(data[QUERY]), data[NEXT, REWARD].reshape(-1).tolist()
        done = data[NEXT, DONE].reshape(-1).tolist()
        scores = {name: data[NEXT, SCORES, name].reshape(-1).tolist() for name in data[NEXT, SCORES].keys()}
        records, earlier = [], []
        for i, (probe, reply) in enumerate(zip(probes, replies, strict=True)):
            records.append(
                {
                    "probe": probe,
                    "reply": reply,
                    "conversation": conversation_turns(openers[i], earlier),
                    "scores": {name: values[i] for name, values in scores.items()},
                    "reward": rewards[i],
                    "turn": len(earlier),
                }
            )
            earlier = [] if done[i] else [*earlier, (probe, reply)]
        return records

    def state_dict(self) -> dict:
        """The histories of the env's novelty terms (empty without them)."""
        return {"novelty": [t.state_dict() for t in self.novelty]}

    def load_state_dict(self, state: dict) -> None:
        load_novelty_states(self.novelty, state.get("novelty", []))


class GRPOAlgorithm(OnPolicy):
    """Multi-turn GRPO: advantages per (opener, turn) cell, TorchRL's ``GRPOLoss`` surrogate."""

    name = "grpo"

    def __init__(self, config: TrainConfig, models: RunModels, env, policy, stream=None) -> None:
        super().__init__(config, models, env, policy, stream)
        self._behaviour_due: BehaviourDue | None = None

        def scorer(model):  # parameters for the loss module; entropy bonus path
            return TransformersWrapper(
                model, tokenizer=self.tokenizer, input_mode="tokens", generate=False, return_log_probs=True, pad_output=False
            )

        self.actor = scorer(models.tester.model)
        self.loss_module = ResponseGRPOLoss(
            self.actor,
            model=models.tester.model,
            pad_token_id=self.tokenizer.pad_token_id,
            max_length=models.tester.context_window,
            clip_epsilon=config.clip_epsilon,
            entropy_bonus=config.entropy_coef > 0,
            entropy_coeff=config.entropy_coef,
            kl_coef=config.kl_coef,
            kl_token_cap=config.kl_token_cap,
            masking_strategy="sft",
            share_prefix=self.share_prefix,
        )
        self.loss_module.set_keys(ref_log_probs=REF_LOG_PROBS_FULL)
        self.guides = []  # each adds members to every group (astrl.training.guidance)
        if config.guide_search:
            from astrl.training.guidance import SearchGuide

            self.guides.append(SearchGuide(config, models))
        if config.guide_replay:
            from astrl.training.guidance import ReplayGuide

            self.guides.append(ReplayGuide(config, models, self.replay_values, self.stops))

    def seed_replay(self, probes: list[str]) -> None:
        """Start the replay guide's archive with ``probes``, untested (``guide_replay_warm_start``;
        :meth:`~astrl.training.guidance.ReplayGuide.seed`)."""
        from astrl.training.guidance import ReplayGuide

        for guide in self.guides:
            if isinstance(guide, ReplayGuide):
                guide.seed(probes)

    def step_metrics(self) -> dict:
        """With ``guide_search``: the guided members' mean search estimate and reward (``guide_mass``,
        ``guide_reward``); with ``guide_replay``: the replayed members' reward, score (in what
        ``guide_replay_rank`` counts) and tests before their re-test, the number of probes kept and of those
        not yet tested (``replay_reward``, ``replay_score``, ``replay_tests``, ``replay_probes``,
        ``replay_untested``)."""
        return {k: v for guide in self.guides for k, v in guide.last.items()}

    def state_dict(self) -> dict:
        """The novelty histories and the guides' kept state (the replay guide's probes)."""
        return {**super().state_dict(), "guides": [guide.state_dict() for guide in self.guides]}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for guide, kept in zip(self.guides, state.get("guides", []), strict=False):
            guide.load_state_dict(kept)

    # -- collection ------------------------------------------------------------------
    def collect(self) -> tuple[TensorDictBase, TensorDictBase]:
        """One batch of completed conversations -> (training turns, raw flat rollout); with
        ``guide_search`` or ``guide_replay`` the training turns also hold each group's guided conversations
        (:mod:`astrl.training.guidance`), the raw rollout only the sampled ones."""
        data = self.next_rollout()
        guided = [guide.rollout(data) for guide in self.guides]
        return self.training_batch(data, self.advantages(data, *guided), *guided), data

    def returns(self, rollout: TensorDictBase) -> torch.Tensor:
        """Each turn's return of a flat, trajectory-contiguous rollout: its reward (``returns: turn``) or the
        sum with its conversation's later rewards (``to_go``)."""
        rewards = rollout[NEXT, REWARD].reshape(-1).float()
        if self.config.returns == "to_go":
            return returns_to_go(rewards, rollout[NEXT, DONE].reshape(-1))
        return rewards

    def replay_values(self, rollout: TensorDictBase) -> torch.Tensor:
        """What each turn of a flat rollout counts as when the replay archive tests its probe
        (``guide_replay_rank``): its return (:meth:`returns`), or the elicit reward's gated reply lexicon term
        ``g * lex(reply)`` (:meth:`~astrl.rewards.weights.ElicitWeights.gated_lexicon`)."""
        if self.config.guide_replay_rank == "return":
            return self.returns(rollout)
        from astrl.rewards.weights import reward_weights

        terms = rollout[NEXT, REWARD_TERMS]
        weights = reward_weights("elicit", **self.config.reward_options())
        return weights.gated_lexicon(**{name: terms[name].reshape(-1).float() for name in terms.keys()})

    def advantages(self, data: TensorDictBase, *guided: TensorDictBase) -> torch.Tensor:
        """:func:`turn_group_advantages` of a flat, trajectory-contiguous rollout's returns; each rollout of
        ``guided`` (the same number of conversations for every group) adds its members to every group, its
        advantages following ``data``'s (with ``guide_advantage: positive`` none below 0)."""
        parts = (data, *guided)
        rewards = [self.returns(part) for part in parts]
        openers = [opener for part in parts for opener in as_list(part[QUERY])]
        turns = torch.cat([part[STEP_COUNT].reshape(-1) for part in parts])
        conversations = [int((part[STEP_COUNT].reshape(-1) == 0).sum()) for part in parts]
        groups = conversations[0] // self.config.group_size
        members = self.config.group_size + sum(conversations[1:]) // groups
        advantages = turn_group_advantages(torch.cat(rewards), openers, turns, members, scale=self.config.group_scale)
        if self.config.guide_advantage == "positive":  # guided members only pull (self-imitation)
            sampled = rewards[0].numel()
            advantages[sampled:] = advantages[sampled:].clamp_min(0)
        return advantages

    def training_batch(self, data: TensorDictBase, advantages: torch.Tensor, *guided: TensorDictBase) -> TensorDictBase:
        """Exact tokens (prompt + response up to EOS), reference log-probs, advantage, conversation index
        of every turn of ``data`` and then of ``guided`` (:meth:`advantages`' order); the behaviour
        log-probs are read later, before the first update (see :meth:`minibatches`)."""
        parts = (data, *guided)
        prompts = [p for part in parts for p in part.get(TOKENS_PROMPT, as_list=True)]
        responses = [r for part in parts for r in part.get(TOKENS_RESPONSE, as_list=True)]
        conversations = self.conversation_index(*parts)
        items = []
        for prompt, response, advantage, conversation in zip(prompts, responses, advantages, conversations, strict=True):
            response = until_stop(response, self.stops)
            full = torch.cat([prompt, response])
            item = TensorDict()
            item.set(TOKENS_PROMPT, prompt).set(TOKENS_RESPONSE, response).set(TOKENS_FULL, full)
            item.set(ATTENTION_MASK, torch.ones(full.numel(), dtype=torch.bool)).set(ADVANTAGE, advantage.reshape(1, 1))
            item.set(CONVERSATION, conversation)
            items.append(item)
        batch = lazy_stack(items)
        prompts = batch.get(TOKENS_PROMPT, as_list=True)
        responses = batch.get(TOKENS_RESPONSE, as_list=True)
        window, pad = self.models.tester.context_window, self.tokenizer.pad_token_id
        if self.loss_module.entropy_bonus:  # behaviour log-probs, computed as the loss computes them
            with torch.no_grad():
                old = self.actor(batch.select(TOKENS, MASKS).copy()).get(LOG_PROBS_FULL, as_list=True)
            batch.set(LOG_PROBS_FULL, nested([o.clone() for o in old]))
            self._behaviour_due = None
        else:  # read later, before the first update: see minibatches() and loss()
            batch.set(LOG_PROBS_FULL, nested(full_rows(prompts, [torch.full((len(r),), float("nan")) for r in responses])))
            self._behaviour_due = BehaviourDue(batch, weights_fingerprint(self.models.tester.model))
        with torch.inference_mode():
            ref = nested_token_logprobs(
                self.models.reference, prompts, responses, pad_token_id=pad, max_length=window, share_prefix=self.share_prefix
            )
        batch.set(REF_LOG_PROBS_FULL, nested(full_rows(prompts, [r.clone() for r in ref])))
        return batch

    def minibatches(self, batch: TensorDictBase, generator: torch.Generator) -> Iterator[TensorDictBase]:
        """Shuffled minibatches of whole conversations (:func:`~astrl.training.batches.shuffled_minibatches` over conversations);
        the behaviour log-probs of every row outside the first minibatch are computed here (before any
        update), those of the first come from its own loss forward."""
        parts = list(super().minibatches(batch, generator))
        due = self._behaviour_due
        if due is not None and due.batch is batch and parts:
            first = {id(td) for td in parts[0].tensordicts}
            rest = [i for i, td in enumerate(batch.tensordicts) if id(td) not in first]
            if rest:
                self._read_behaviour(batch[torch.tensor(rest)], due)
        return iter(parts)

    def _read_behaviour(self, rows: TensorDictBase, due: BehaviourDue) -> None:
        """Behaviour log-probs of ``rows`` (no update may have happened since their collection)."""
        if weights_fingerprint(self.models.tester.model) != due.fingerprint:
            raise RuntimeError("the tester changed before the behaviour log-probs of its batch were read")
        prompts, responses = rows.get(TOKENS_PROMPT, as_list=True), rows.get(TOKENS_RESPONSE, as_list=True)
        window, pad = self.models.tester.context_window, self.tokenizer.pad_token_id
        with torch.no_grad():
            # a conversation's earlier turns begin its later ones: read them from the later rows' forward
            logprobs = nested_token_logprobs(
                self.models.tester.model,
                prompts,
                responses,
                pad_token_id=pad,
                max_length=window,
                share_prefix=self.share_prefix,
            )
        rows.set(LOG_PROBS_FULL, nested(full_rows(prompts, logprobs)))  # into the batch's rows
        due.pending -= {id(td) for td in rows.tensordicts}

    def loss(self, minibatch: TensorDictBase) -> TensorDictBase:
        due = self._behaviour_due
        rows = getattr(minibatch, "tensordicts", ())
        if due is None or not any(id(td) in due.pending for td in rows):
            return self.loss_module(minibatch.to(self.models.tester.model.device)).to_tensordict()
        if weights_fingerprint(self.models.tester.model) != due.fingerprint:
            raise RuntimeError("the tester changed before the behaviour log-probs of its batch were read")
        self.loss_module.behaviour_from_current = True
        try:
            out = self.loss_module(minibatch.to(self.models.tester.model.device)).to_tensordict()
        finally:
            self.loss_module.behaviour_from_current = False
        minibatch.set(LOG_PROBS_FULL, self.loss_module.last_behaviour)  # into the batch's rows, for later epochs
        due.pending -= {id(td) for td in rows}
        return out
