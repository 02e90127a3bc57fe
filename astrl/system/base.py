"""The ``System`` interface: models + tokenization + rollout + log-probs + rewards behind batched methods.

A System is the seed-style entry point for users who bring their own stack. Every method is
batched (lists in, index-aligned lists or tensors out):

=====================================  =================================================================
``rollout_prompt_with_tester(x)``      one probe per state (the continuation only, not the state)
``rollout_prompt_with_target(x)``      one reply per prompt (the continuation only)
``get_tester_logprobs(ctx, cont)``     per-token ``log p(cont | ctx)`` under the tester, **with grad**
``get_target_logprobs(ctx, cont)``     the same under the target, no grad
``get_baseline_logprobs(ctx, cont)``   the same under the frozen baseline (reference), no grad
``parameters()``                       the trainable parameters (usually the tester's)
``advance(state, probe, response)``    the next state
``reward(states, probes, responses)``  one float per sample, higher = more harmful (better attack)
=====================================  =================================================================

**Log-prob convention.** ``get_*_logprobs`` return a float tensor of shape ``(B, T)``: row ``i``
holds the log-probs of the tokens of continuation ``i`` only (never the context's), left-aligned,
and ``0.0`` after the continuation's last token, ``T`` being the longest continuation in tokens.
Summing over the last dimension gives ``log p(continuation | context)``; that sum is what the
preference losses and PPO use. A ``(B,)`` tensor (already summed) is rejected with a message
saying so, as are probabilities, a wrong batch length, a wrong device and missing (or
unexpected) gradients: the ``_*_and_validate`` helpers check each call, and the solvers only call
those.

Older code names the tester "auditor": ``rollout_prompt_with_auditor`` and
``get_auditor_logprobs`` work as aliases in both directions (a subclass may define either name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import torch

StateT = TypeVar("StateT")
ActionT = TypeVar("ActionT")

_ALIASES = {
    "rollout_prompt_with_tester": "rollout_prompt_with_auditor",
    "get_tester_logprobs": "get_auditor_logprobs",
}


class SystemValidationError(ValueError):
    """A System method returned something that breaks the interface; the message says what and where."""


def score_texts(scorer, texts: Sequence[str]) -> torch.Tensor:
    """Scores of a batch of texts as a float tensor: ``scorer`` is an astrl scorer (a callable),
    an object with ``.score(texts)`` (the seed convention), or a scorer name for
    :func:`astrl.scorers.make_scorers`."""
    texts = list(texts)
    if isinstance(scorer, str):
        raise TypeError("resolve scorer names with System(scorer=...) first")
    from astrl.scorers import ScorerError, checked_scores

    call = scorer.score if hasattr(scorer, "score") else scorer
    name = getattr(scorer, "name", type(scorer).__name__)
    try:  # a System's scores may be any finite numbers (its own reward scale)
        return checked_scores(call, texts, probabilities=False, name=name)
    except ScorerError as err:
        raise SystemValidationError(str(err)) from None


def resolve_scorer(scorer):
    """A scorer object from a name (``"profanity"``, ``"keywords:a,b"``, ...) or the object itself."""
    if isinstance(scorer, str):
        from astrl.scorers import make_scorers

        return next(iter(make_scorers([scorer]).values()))
    if scorer is not None and not (callable(scorer) or hasattr(scorer, "score")):
        raise TypeError(f"scorer must be callable, have .score(texts) or be a scorer name, got {type(scorer).__name__}")
    return scorer


class System(Generic[StateT, ActionT]):
    """Base class of user systems (see the module docstring for the interface and conventions).

    Args:
        scorer: the harm scorer used by :meth:`reward` implementations (an astrl scorer, an
            object with ``.score(texts)``, or a scorer name); optional for systems that score
            otherwise.

    Subclasses implement the eight methods; the solvers call the ``_*_and_validate`` helpers, which
    raise :class:`SystemValidationError` naming the method and the mistake. Set ``self.device`` to have
    log-probs checked against it; otherwise the first log-prob tensor seen fixes the device.
    """

    def __init__(self, scorer=None) -> None:
        self.scorer = resolve_scorer(scorer)
        self._seen_device: torch.device | None = None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for new, old in _ALIASES.items():  # a subclass that defines only the older name still works
            if old in cls.__dict__ and new not in cls.__dict__:
                setattr(cls, new, cls.__dict__[old])

    # -- the interface (override) ----------------------------------------------------------------
    def rollout_prompt_with_tester(self, prompts: Sequence[StateT]) -> Sequence[ActionT]:
        raise NotImplementedError(f"{type(self).__name__} must implement rollout_prompt_with_tester(prompts)")

    def rollout_prompt_with_target(self, prompts: Sequence[StateT]) -> Sequence[StateT]:
        raise NotImplementedError(f"{type(self).__name__} must implement rollout_prompt_with_target(prompts)")

    def get_tester_logprobs(self, contexts: Sequence[StateT], continuations: Sequence[ActionT]) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement get_tester_logprobs(contexts, continuations)")

    def get_target_logprobs(self, contexts: Sequence[StateT], continuations: Sequence[ActionT]) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement get_target_logprobs(contexts, continuations)")

    def get_baseline_logprobs(self, contexts: Sequence[StateT], continuations: Sequence[ActionT]) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement get_baseline_logprobs(contexts, continuations)")

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        raise NotImplementedError(f"{type(self).__name__} must implement parameters()")

    def advance(self, context: StateT, probe: ActionT, response: StateT) -> StateT:
        raise NotImplementedError(f"{type(self).__name__} must implement advance(context, probe, response)")

    def reward(self, contexts: Sequence[StateT], probes: Sequence[ActionT], responses: Sequence[StateT]) -> Sequence[float]:
        raise NotImplementedError(f"{type(self).__name__} must implement reward(contexts, probes, responses)")

    # older names
    def rollout_prompt_with_auditor(self, prompts: Sequence[StateT]) -> Sequence[ActionT]:
        return self.rollout_prompt_with_tester(prompts)

    def get_auditor_logprobs(self, contexts: Sequence[StateT], continuations: Sequence[ActionT]) -> torch.Tensor:
        return self.get_tester_logprobs(contexts, continuations)

    # -- validated calls (what the sampler and the solvers use) ----------------------------------
    def policy_text_logprobs(self, contexts: Sequence[StateT], continuations: Sequence[ActionT]) -> torch.Tensor:
        """The tester's checked log-probs (:class:`astrl.losses.preference.TextLogProbs`)."""
        return self._get_tester_logprobs_and_validate(contexts, continuations)

    def reference_text_logprobs(self, contexts: Sequence[StateT], continuations: Sequence[ActionT]) -> torch.Tensor:
        """The baseline's checked log-probs (:class:`astrl.losses.preference.TextLogProbs`)."""
        return self._get_baseline_logprobs_and_validate(contexts, continuations)

    def _rollout_prompt_with_tester_and_validate(self, prompts: Sequence[StateT]) -> list[ActionT]:
        return self._checked_rollout("rollout_prompt_with_tester", self.rollout_prompt_with_tester, prompts)

    def _rollout_prompt_with_target_and_validate(self, prompts: Sequence[StateT]) -> list[StateT]:
        return self._checked_rollout("rollout_prompt_with_target", self.rollout_prompt_with_target, prompts)

    def _get_tester_logprobs_and_validate(self, contexts: Sequence[StateT], continuations: Sequence[ActionT]) -> torch.Tensor:
        return self._checked_logprobs("get_tester_logprobs", self.get_tester_logprobs, contexts, continuations, grad=True)

    def _get_target_logprobs_and_validate(self, contexts: Sequence[StateT], continuations: Sequence[ActionT]) -> torch.Tensor:
        return self._checked_logprobs("get_target_logprobs", self.get_target_logprobs, contexts, continuations, grad=False)

    def _get_baseline_logprobs_and_validate(self, contexts: Sequence[StateT], continuations: Sequence[ActionT]) -> torch.Tensor:
        return self._checked_logprobs("get_baseline_logprobs", self.get_baseline_logprobs, contexts, continuations, grad=False)

    # older names of the validated calls
    _rollout_prompt_with_auditor_and_validate = _rollout_prompt_with_tester_and_validate
    _get_auditor_logprobs_and_validate = _get_tester_logprobs_and_validate

    def _advance_and_validate(self, contexts: Sequence[StateT], probes: Sequence[ActionT], responses: Sequence[StateT]) -> list:
        _same_length("advance", contexts=contexts, probes=probes, responses=responses)
        states = [self.advance(c, p, r) for c, p, r in zip(contexts, probes, responses, strict=True)]
        kinds = {type(c) for c in contexts}
        for i, state in enumerate(states):
            if state is None or (kinds and type(state) not in kinds):
                raise SystemValidationError(
                    f"advance returned {type(state).__name__} for sample {i}; it must return the next state "
                    f"({'/'.join(sorted(k.__name__ for k in kinds))}, like the context it got)"
                )
        return states

    def _reward_and_validate(
        self, contexts: Sequence[StateT], probes: Sequence[ActionT], responses: Sequence[StateT]
    ) -> torch.Tensor:
        _same_length("reward", contexts=contexts, probes=probes, responses=responses)
        values = self.reward(contexts, probes, responses)
        if isinstance(values, (int, float)):
            raise SystemValidationError(
                f"reward returned one number ({values}) for a batch of {len(contexts)}; return one float per sample"
            )
        try:
            out = torch.as_tensor(values if isinstance(values, torch.Tensor) else list(values), dtype=torch.float32)
        except (TypeError, ValueError) as err:
            raise SystemValidationError(f"reward must return a sequence of floats, got {type(values).__name__}: {err}") from err
        out = out.detach().reshape(-1).cpu()
        if out.numel() != len(contexts):
            raise SystemValidationError(f"reward returned {out.numel()} values for a batch of {len(contexts)}")
        bad = (~torch.isfinite(out)).nonzero().flatten().tolist()
        if bad:
            raise SystemValidationError(f"reward returned non-finite values at samples {bad[:5]}: {out[bad[:5]].tolist()}")
        return out

    # -- checks ----------------------------------------------------------------------------------
    def _checked_rollout(self, name: str, method: Callable, prompts: Sequence) -> list:
        if isinstance(prompts, (str, bytes)):
            raise SystemValidationError(f"{name} takes a batch (a list of states), got a single {type(prompts).__name__}")
        prompts = list(prompts)
        out = method(prompts)
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
            raise SystemValidationError(f"{name} must return a list with one continuation per prompt, got {type(out).__name__}")
        out = list(out)
        if len(out) != len(prompts):
            raise SystemValidationError(f"{name} returned {len(out)} continuations for {len(prompts)} prompts")
        kinds = {type(p) for p in prompts}
        if str in kinds:
            wrong = [i for i, o in enumerate(out) if not isinstance(o, str)]
            if wrong:
                raise SystemValidationError(
                    f"{name} returned {type(out[wrong[0]]).__name__} at index {wrong[0]}; text systems return strings"
                )
        return out

    def _checked_logprobs(
        self, name: str, method: Callable, contexts: Sequence, continuations: Sequence, *, grad: bool | None
    ) -> torch.Tensor:
        """Call ``method`` and check its output; ``grad`` True/False requires/forbids a graph, None skips that check."""
        _same_length(name, contexts=contexts, continuations=continuations)
        contexts, continuations = list(contexts), list(continuations)
        out = method(contexts, continuations)
        batch = len(contexts)
        if not isinstance(out, torch.Tensor):
            raise SystemValidationError(f"{name} must return a torch.Tensor of shape (batch, tokens), got {type(out).__name__}")
        if out.dim() == 1 and out.shape[0] == batch:
            raise SystemValidationError(
                f"{name} returned shape {tuple(out.shape)}: one value per sample looks already summed; "
                "return per-token log-probs of shape (batch, max_continuation_tokens), 0.0 after each continuation"
            )
        if out.dim() != 2:
            raise SystemValidationError(f"{name} must return shape (batch, max_continuation_tokens), got {tuple(out.shape)}")
        if out.shape[0] != batch:
            raise SystemValidationError(f"{name} returned {out.shape[0]} rows for a batch of {batch} (shape {tuple(out.shape)})")
        if not out.is_floating_point():
            raise SystemValidationError(f"{name} returned dtype {out.dtype}; log-probs are floating point")
        if grad is True and not out.requires_grad:
            raise SystemValidationError(
                f"{name} returned a tensor without gradient: the tester's log-probs must be computed with grad enabled "
                "(no torch.no_grad / inference_mode, no .detach()) and the tester's parameters must require grad"
            )
        if grad is False and out.requires_grad:
            raise SystemValidationError(
                f"{name} returned a tensor that requires grad: compute it under torch.no_grad() (frozen model)"
            )
        expected = self._expected_device(out.device)
        if out.device != expected:
            raise SystemValidationError(
                f"{name} returned a tensor on {out.device}, but the system's log-probs live on {expected}"
            )
        values = out.detach()
        if not torch.isfinite(values).all():
            raise SystemValidationError(
                f"{name} returned non-finite values (nan/inf) for {int((~torch.isfinite(values)).any(1).sum())} samples"
            )
        if (values > 1e-4).any():
            raise SystemValidationError(
                f"{name} returned positive values (max {float(values.max()):.3g}): log-probs are <= 0; "
                "did you return probabilities or logits instead of log_softmax-ed values?"
            )
        return out

    def _expected_device(self, seen: torch.device) -> torch.device:
        device = getattr(self, "device", None)
        if device is not None:
            device = torch.device(device)
            if device.type == seen.type and device.index is None:
                return seen  # "cuda" matches "cuda:0"
            return device
        if self._seen_device is None:
            self._seen_device = seen
        return self._seen_device


def _same_length(name: str, **batches: Sequence) -> None:
    for key, value in batches.items():
        if isinstance(value, (str, bytes)):
            raise SystemValidationError(f"{name}: {key} must be a batch (a list), got a single {type(value).__name__}")
    lengths = {key: len(value) for key, value in batches.items()}
    if len(set(lengths.values())) > 1:
        raise SystemValidationError(f"{name}: batch lengths differ: {', '.join(f'{k}={n}' for k, n in lengths.items())}")
    if not any(lengths.values()):
        raise SystemValidationError(f"{name}: got an empty batch")


def summed(logprobs: torch.Tensor) -> torch.Tensor:
    """``log p(continuation | context)`` from per-token ``(B, T)`` log-probs (0.0 after each continuation)."""
    return logprobs.sum(-1)


__all__ = ["System", "SystemValidationError", "summed", "score_texts", "resolve_scorer"]
