"""DPO and IPO losses on preference pairs (e.g. from :class:`astrl.sampling.TreeSampler`).

For a pair (chosen ``w``, rejected ``l``) that share the prompt ``x``::

    h = [log pi(w|x) - log pi(l|x)] - [log pi_ref(w|x) - log pi_ref(l|x)]
    DPO: -log sigmoid(beta * h)            IPO: (h - 1 / (2 * beta))**2

``log pi(y|x)`` is the **sum** of the token log-probs of the response ``y``, over its tokens up to
and including the first EOS (the padding after it never counts). Log-probs are computed from the
exact token ids the tester generated; the shared prompt is run once for both responses
(``share_prompt=False``: prompt + chosen and prompt + rejected as separate rows of one forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from tensordict import NestedKey, TensorDict, TensorDictBase
from torchrl.objectives import LossModule

from astrl._compat import as_list
from astrl.argtypes import require
from astrl.keys import (
    CHOSEN_MASK,
    CHOSEN_PROBE,
    CHOSEN_TOKENS,
    CONTEXT,
    PROMPT_TOKENS,
    REF_CHOSEN_LOGPROB,
    REF_REJECTED_LOGPROB,
    REJECTED_MASK,
    REJECTED_PROBE,
    REJECTED_TOKENS,
)
from astrl.lm_scoring import response_mask, shared_prefix_logprobs, stop_ids, token_logprobs
from astrl.ragged import as_rows
from astrl.rewards.reference import make_reference


@runtime_checkable
class TextLogProbs(Protocol):
    """A model the preference losses score on text instead of token ids (the seed System API is one).

    Both methods return per-token log-probs of each continuation after its context, shape
    ``(len(contexts), L)``, padded with 0; the losses sum them over the last dimension.
    """

    def policy_text_logprobs(self, contexts: Sequence, continuations: Sequence) -> torch.Tensor: ...

    def reference_text_logprobs(self, contexts: Sequence, continuations: Sequence) -> torch.Tensor: ...


class PreferenceLoss(LossModule):
    """Base of :class:`DPOLoss` and :class:`IPOLoss`: summed response log-probs and the log-ratio margin ``h``.

    Args:
        model: the tester's causal LM (a Hugging Face model or a PEFT model); it gets the gradients.
            Or an :class:`astrl.System`: then log-probs come from its validated
            ``get_tester_logprobs`` (with grad) and ``get_baseline_logprobs`` (the reference) on the
            pairs' text keys ``context`` / ``chosen_probe`` / ``rejected_probe``, summed per pair.
        reference: the frozen reference; default :func:`astrl.rewards.make_reference` of ``model``
            (with a PEFT model: the same weights with the adapters off). It is scored under
            ``torch.inference_mode`` and is not registered as a submodule (no parameters, no state).
        beta: the inverse temperature (> 0).
        tokenizer: only used when the data has no response masks: its EOS ids (and the model's
            generation config's) end each response.
        max_length: the model's context window; longer prompts are clipped from the left.
        share_prompt: run each pair's prompt once for chosen and rejected (one forward of the prompt
            with its KV cache reused for both responses, :func:`astrl.rewards.shared_prefix_logprobs`);
            ``False`` scores prompt + chosen and prompt + rejected as two independent rows. Both give
            the same log-probs up to float rounding.

    Reads a 1-D batch of pairs with the keys of :attr:`tensor_keys` (``set_keys`` renames them):
    ``prompt_tokens``, ``chosen_tokens``, ``rejected_tokens`` (ragged or padded ids),
    ``chosen_mask`` / ``rejected_mask`` (optional; tokens up to and including EOS) and
    ``ref_chosen_logprob`` / ``ref_rejected_logprob`` (optional, shape ``(P,)``, from
    :meth:`reference_logprobs`; computed on the fly when missing).
    """

    loss_name: str = "loss_preference"
    default_beta: float = 0.1

    @dataclass
    class _AcceptedKeys:
        """Configurable tensordict keys, see :meth:`set_keys`.

        Attributes:
            prompt: the tester's prompt ids (shared by chosen and rejected).
            chosen, rejected: the generated response ids.
            chosen_mask, rejected_mask: response masks (up to and including EOS); optional.
            ref_chosen_logprob, ref_rejected_logprob: summed reference log-probs; optional.
        """

        prompt: NestedKey = PROMPT_TOKENS
        chosen: NestedKey = CHOSEN_TOKENS
        rejected: NestedKey = REJECTED_TOKENS
        chosen_mask: NestedKey = CHOSEN_MASK
        rejected_mask: NestedKey = REJECTED_MASK
        ref_chosen_logprob: NestedKey = REF_CHOSEN_LOGPROB
        ref_rejected_logprob: NestedKey = REF_REJECTED_LOGPROB
        context: NestedKey = CONTEXT
        chosen_text: NestedKey = CHOSEN_PROBE
        rejected_text: NestedKey = REJECTED_PROBE

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(
        self,
        model: torch.nn.Module,
        reference: torch.nn.Module | None = None,
        *,
        beta: float | None = None,
        tokenizer=None,
        max_length: int | None = None,
        share_prompt: bool = True,
    ) -> None:
        super().__init__()
        beta = self.default_beta if beta is None else float(beta)
        require("beta", beta, above=0)
        if reference is model:
            raise ValueError("reference is the model itself: pass None to use a frozen reference (make_reference)")
        # kept out of the module tree: no gradients, no parameters listed twice, no copy in state_dict
        if isinstance(model, TextLogProbs):  # log-probs on text, e.g. from a System's tester and baseline
            if reference is not None:
                raise ValueError("with a System the reference is its baseline (get_baseline_logprobs): pass no reference")
            object.__setattr__(self, "system", model)
            self.model = None
            object.__setattr__(self, "reference", None)
        else:
            object.__setattr__(self, "system", None)
            self.model = model
            object.__setattr__(self, "reference", reference if reference is not None else make_reference(model))
        self.beta = beta
        self.max_length = max_length
        self.share_prompt = bool(share_prompt)
        self._tokenizer_stops = stop_ids(tokenizer, model) if tokenizer is not None else None
        self._set_in_keys()

    # -- keys ------------------------------------------------------------------------------------
    def _set_in_keys(self) -> None:
        keys = self.tensor_keys
        if self.system is not None:
            self.in_keys = [keys.context, keys.chosen_text, keys.rejected_text]
        else:
            self.in_keys = [keys.prompt, keys.chosen, keys.rejected, keys.chosen_mask, keys.rejected_mask]
        self.out_keys = [self.loss_name, "reward_margin", "preference_accuracy", "chosen_logratio", "rejected_logratio"]
        if self.system is None:  # token counts are known only for token ids
            self.out_keys += ["chosen_logratio_per_token", "rejected_logratio_per_token"]

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        self._set_in_keys()

    # -- log-probs -------------------------------------------------------------------------------
    def _stop_token_ids(self) -> set[int]:
        if self._tokenizer_stops is not None:
            return self._tokenizer_stops
        config = getattr(self.model, "generation_config", None) or getattr(self.model, "config", None)
        eos = getattr(config, "eos_token_id", None)
        if eos is None:
            raise ValueError("the pairs have no response masks and the model has no eos_token_id: pass tokenizer=")
        return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}

    def _pairs(self, td: TensorDictBase) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Prompts and the chosen / rejected responses cut after their EOS, checked for shape."""
        if td.batch_dims != 1:
            raise ValueError(f"{type(self).__name__} expects a 1-D batch of pairs, got batch_size {tuple(td.batch_size)}")
        if td.batch_size[0] == 0:
            raise ValueError(f"{type(self).__name__} got an empty batch of pairs (every sibling group was skipped?)")
        keys = self.tensor_keys
        for key in (keys.prompt, keys.chosen, keys.rejected):
            if key not in td.keys(True):
                raise KeyError(f"{type(self).__name__} needs the key {key!r}; the data has {sorted(map(str, td.keys()))}")
        n = td.batch_size[0]
        prompts = _rows(td, keys.prompt, n)
        cut = {}
        for name, tok_key, mask_key in (
            ("chosen", keys.chosen, keys.chosen_mask),
            ("rejected", keys.rejected, keys.rejected_mask),
        ):
            tokens = _rows(td, tok_key, n)
            if mask_key in td.keys(True):
                masks = _rows(td, mask_key, n)
            else:
                stops = self._stop_token_ids()
                masks = [response_mask(t, stops) for t in tokens]
            rows = []
            for i, (t, m) in enumerate(zip(tokens, masks, strict=True)):
                if t.shape != m.shape:
                    raise ValueError(f"pair {i}: {name} tokens have shape {tuple(t.shape)} but its mask {tuple(m.shape)}")
                rows.append(t[m.bool().to(t.device)])
            cut[name] = rows
        for i, p in enumerate(prompts):
            if p.numel() == 0:
                raise ValueError(f"pair {i} has an empty prompt: the first response token would have no context")
        return prompts, cut["chosen"], cut["rejected"]

    def response_lengths(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Scored tokens per chosen and rejected response (up to and including EOS), shape ``(P,)``;
        ``None`` with a System (its log-probs come from text, the token counts are its own)."""
        if self.system is not None:
            return None
        _, chosen, rejected = self._pairs(tensordict)
        return torch.tensor([len(r) for r in chosen]), torch.tensor([len(r) for r in rejected])

    def _summed_logprobs(self, model: torch.nn.Module, prompts, chosen, rejected) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed log-probs of chosen and rejected responses: the prompt once for both
        (``share_prompt``) or prompt + response rows in one forward."""
        if self.share_prompt:
            rows_w, rows_l = shared_prefix_logprobs(model, prompts, [chosen, rejected], max_length=self.max_length)
            return torch.stack([r.sum() for r in rows_w]), torch.stack([r.sum() for r in rows_l])
        rows = token_logprobs(model, prompts + prompts, chosen + rejected, max_length=self.max_length)
        sums = torch.stack([r.sum() for r in rows])
        n = len(prompts)
        return sums[:n], sums[n:]

    def _texts(self, td: TensorDictBase) -> tuple[list, list, list]:
        """Contexts and chosen / rejected probe texts of a batch of pairs (the System path)."""
        if td.batch_dims != 1 or td.batch_size[0] == 0:
            raise ValueError(
                f"{type(self).__name__} expects a non-empty 1-D batch of pairs, got batch_size {tuple(td.batch_size)}"
            )
        keys = self.tensor_keys
        for key in (keys.context, keys.chosen_text, keys.rejected_text):
            if key not in td.keys(True):
                raise KeyError(f"{type(self).__name__} needs the key {key!r}; the data has {sorted(map(str, td.keys()))}")
        return as_list(td.get(keys.context)), as_list(td.get(keys.chosen_text)), as_list(td.get(keys.rejected_text))

    def _pair_logprobs(self, td: TensorDictBase, *, reference: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed ``log p(chosen | prompt)`` and ``log p(rejected | prompt)`` under the model (with grad) or
        the reference (no grad); chosen and rejected go through one batched call."""
        if self.system is not None:
            contexts, chosen, rejected = self._texts(td)
            get = self.system.reference_text_logprobs if reference else self.system.policy_text_logprobs
            sums = get(contexts + contexts, chosen + rejected).sum(-1)
            return sums[: len(contexts)], sums[len(contexts) :]
        prompts, chosen, rejected = self._pairs(td)
        if reference:
            with torch.inference_mode():
                ref_w, ref_l = self._summed_logprobs(self.reference, prompts, chosen, rejected)
            return ref_w.clone(), ref_l.clone()
        return self._summed_logprobs(self.model, prompts, chosen, rejected)

    def reference_logprobs(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Write the reference's summed log-probs (``ref_chosen_logprob``, ``ref_rejected_logprob``)
        into the pairs, so that several epochs over the same pairs score the reference once."""
        ref_w, ref_l = self._pair_logprobs(tensordict, reference=True)
        tensordict.set(self.tensor_keys.ref_chosen_logprob, ref_w.clone().cpu())
        tensordict.set(self.tensor_keys.ref_rejected_logprob, ref_l.clone().cpu())
        return tensordict

    def margins(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(h, chosen_logratio, rejected_logratio)`` per pair; ``h`` carries the model's gradient."""
        logp_w, logp_l = self._pair_logprobs(tensordict, reference=False)
        n = logp_w.shape[0]
        keys = self.tensor_keys
        have_ref = keys.ref_chosen_logprob in tensordict.keys(True) and keys.ref_rejected_logprob in tensordict.keys(True)
        if have_ref:
            ref_w = tensordict.get(keys.ref_chosen_logprob).reshape(-1)
            ref_l = tensordict.get(keys.ref_rejected_logprob).reshape(-1)
            if ref_w.numel() != n or ref_l.numel() != n:
                raise ValueError(f"reference log-probs have {ref_w.numel()} and {ref_l.numel()} values for {n} pairs")
        else:
            ref_w, ref_l = self._pair_logprobs(tensordict, reference=True)
        ref_w, ref_l = ref_w.to(logp_w), ref_l.to(logp_l)
        chosen_logratio, rejected_logratio = logp_w - ref_w, logp_l - ref_l
        return chosen_logratio - rejected_logratio, chosen_logratio, rejected_logratio

    # -- loss ------------------------------------------------------------------------------------
    def per_pair_loss(self, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        """Return ``{loss_name: scalar with grad}`` and detached metrics: ``reward_margin`` (mean
        ``beta * h``), ``preference_accuracy`` (share of pairs with ``h > 0``), ``chosen_logratio``
        and ``rejected_logratio`` (means over pairs of the summed ``log pi - log pi_ref``) and, on
        token ids, ``chosen_logratio_per_token`` / ``rejected_logratio_per_token`` (means over
        pairs of that sum divided by the response's scored tokens)."""
        h, chosen_logratio, rejected_logratio = self.margins(tensordict)
        loss = self.per_pair_loss(h).mean()
        h, chosen_logratio, rejected_logratio = h.detach(), chosen_logratio.detach(), rejected_logratio.detach()
        out = {
            self.loss_name: loss,
            "reward_margin": (self.beta * h).mean(),
            "preference_accuracy": (h > 0).float().mean(),
            "chosen_logratio": chosen_logratio.mean(),
            "rejected_logratio": rejected_logratio.mean(),
        }
        lengths = self.response_lengths(tensordict)
        if lengths is not None:
            len_w, len_l = (n.to(chosen_logratio).clamp(min=1) for n in lengths)
            out["chosen_logratio_per_token"] = (chosen_logratio / len_w).mean()
            out["rejected_logratio_per_token"] = (rejected_logratio / len_l).mean()
        return TensorDict(out, batch_size=[])


class DPOLoss(PreferenceLoss):
    """Direct Preference Optimisation: ``-log sigmoid(beta * h)``, averaged over pairs (default ``beta=0.1``).

    With the model equal to its reference, ``h = 0`` and the loss is ``log 2``.
    """

    loss_name = "loss_dpo"
    default_beta = 0.1

    def per_pair_loss(self, h: torch.Tensor) -> torch.Tensor:
        return -F.logsigmoid(self.beta * h)


class IPOLoss(PreferenceLoss):
    """Identity Preference Optimisation: ``(h - 1/(2*beta))**2``, averaged over pairs.

    The ASTPrompter setting: ``beta=0.01`` (the default). With the model equal to its reference
    the loss is ``1 / (4 * beta**2)``; its minimum is at ``h = 1/(2*beta)``, a bounded margin.
    """

    loss_name = "loss_ipo"
    default_beta = 0.01

    def per_pair_loss(self, h: torch.Tensor) -> torch.Tensor:
        return (h - 1.0 / (2.0 * self.beta)) ** 2


def _rows(td: TensorDictBase, key: NestedKey, n: int) -> list[torch.Tensor]:
    rows = [r.reshape(-1) for r in as_rows(td.get(key, as_list=True))]
    if len(rows) != n:
        raise ValueError(f"key {key!r} has {len(rows)} rows for a batch of {n} pairs")
    return rows
