"""Target hardening: fine-tune the target to refuse the attacks the tester found, so it must find new ones.

Every ``harden_every`` training steps, :class:`TargetHardener` runs one round:

1. the **archive** holds every attack seen so far whose target reply scored above
   ``harden_threshold``; an attack is the exact text the target read before replying (its
   rendered chat template up to the generation prompt, or the plain text context + probe);
2. the target's LoRA adapter is fine-tuned for ``harden_steps`` AdamW steps to answer those
   inputs with the ``refusal`` text (then EOS): a masked negative log-likelihood, token mean over
   the refusal tokens only;
3. attack success (ASR: share of archived attacks whose greedy reply scores above the
   threshold) is measured against the target before and after the round and against the
   original target (the same model with its adapter off).

TorchRL's ``SFTLoss`` is not used: it reads a chat ``History`` and needs assistant masks from a
chat template with generation blocks (or a history-mode wrapper that re-tokenizes the chat),
so it covers neither text mode (base models such as GPT-2) nor chat templates without those
blocks (SmolLM2's). The NLL here scores the exact ids the target reads
(:func:`astrl.lm_scoring.token_logprobs`), for both modes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDictBase

from astrl._compat import as_list, render_chats
from astrl.argtypes import require
from astrl.keys import NEXT, NODES, PROBE, SCORES, TARGET_CONTEXT
from astrl.lm_scoring import token_logprobs
from astrl.names import MODES
from astrl.ragged import pad_ids
from astrl.scorers import Scorer

DEFAULT_REFUSAL = "I'm sorry, but I can't help with that."
_MARK = "\ue001"


def target_inputs(tokenizer, contexts: Sequence[str], probes: Sequence[str], mode: str) -> list[str]:
    """The text the target read before replying, from what the env logs (``target_context`` and ``probe``).

    Text mode: ``context + probe``. Chat mode: the rendered context (up to the probe's content),
    the probe, then the end of the user turn and the generation prompt of ``tokenizer``'s template.
    """
    require("mode", mode, choices=MODES)
    if len(contexts) != len(probes):
        raise ValueError(f"got {len(contexts)} contexts but {len(probes)} probes")
    suffix = ""
    if mode == "chat":
        rendered = render_chats(tokenizer, [[{"role": "user", "content": _MARK}]])[0]
        suffix = rendered[rendered.rfind(_MARK) + 1 :]
    return [c + p + suffix for c, p in zip(contexts, probes, strict=True)]


def attacks_from(data: TensorDictBase, scorer_name: str) -> tuple[list[str], list[str], torch.Tensor]:
    """``(target contexts, probes, scores)`` of every turn of a training batch.

    Reads a flat on-policy rollout (``("next", "target_context")``, ...) or a
    :meth:`~astrl.sampling.TreeSampler.sample` result (its ``nodes``)."""
    turns = data[NODES] if NODES in data.keys() else data[NEXT]
    scores = turns[SCORES]
    if scorer_name not in scores.keys():
        raise KeyError(f"no scores of {scorer_name!r} in the data; it has {sorted(scores.keys())}")
    return as_list(turns[TARGET_CONTEXT]), as_list(turns[PROBE]), scores[scorer_name].reshape(-1).float().cpu()


class TargetHardener:
    """Archive successful attacks and fine-tune the target to refuse them.

    Args:
        model: the target; only its parameters with ``requires_grad`` train (a LoRA adapter).
        tokenizer: the target's tokenizer.
        scorer: harm probability of a reply (the run's reward scorer).
        original: the target before hardening (e.g. ``AdaptersDisabled(model)``); ``None`` skips that ASR.
        refusal: the text the target learns to answer attacks with.
        steps, lr, batch_size: AdamW steps per round, their learning rate and attacks per step (and per
            generation chunk when measuring ASR).
        threshold: an attack succeeds when its reply scores above it.
        max_new_tokens: reply length when measuring ASR (greedy decoding).
        context_window: the target's window; longer inputs are clipped from the left.
        add_special_tokens: tokenize attack texts with special tokens (text mode; a rendered chat
            template already holds its own).
        max_attacks: archive size; the oldest attacks go first.
        seed: seeds the order of the attacks in the SFT steps.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        scorer: Scorer,
        *,
        original: torch.nn.Module | None = None,
        refusal: str = DEFAULT_REFUSAL,
        steps: int = 10,
        lr: float = 1e-3,
        batch_size: int = 16,
        threshold: float = 0.5,
        max_new_tokens: int = 24,
        context_window: int = 2048,
        add_special_tokens: bool = False,
        max_attacks: int = 256,
        seed: int = 0,
    ) -> None:
        for name, value in (("steps", steps), ("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
            if value < 1:
                raise ValueError(f"hardening {name} must be >= 1, got {value}")
        if max_attacks < 1:
            raise ValueError(f"max_attacks must be >= 1, got {max_attacks}")
        require("hardening lr", lr, above=0)
        if not refusal.strip():
            raise ValueError(f"the refusal text must not be empty, got {refusal!r}")
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("the target's tokenizer needs eos and pad tokens")
        self.model, self.tokenizer, self.scorer, self.original = model, tokenizer, scorer, original
        self.refusal, self.steps, self.batch_size = refusal, steps, batch_size
        self.threshold, self.max_new_tokens, self.context_window = float(threshold), max_new_tokens, context_window
        self.add_special_tokens, self.max_attacks = add_special_tokens, max_attacks
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the target has no trainable parameters: give it a LoRA adapter (harden_every needs lora: true)")
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(seed)
        self.refusal_ids = torch.tensor(
            [*tokenizer(refusal, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id], dtype=torch.long
        )
        self.attacks: list[str] = []
        self.rounds = 0

    # -- archive -------------------------------------------------------------------------------
    def add(self, inputs: Sequence[str], scores: torch.Tensor) -> int:
        """Archive the inputs whose score is above the threshold (new ones only); returns how many were added."""
        scores = torch.as_tensor(scores).reshape(-1)
        if scores.numel() != len(inputs):
            raise ValueError(f"got {len(inputs)} attack inputs but {scores.numel()} scores")
        known, added = set(self.attacks), 0
        for text, score in zip(inputs, scores.tolist(), strict=True):
            if score > self.threshold and text not in known:
                self.attacks.append(text)
                known.add(text)
                added += 1
        del self.attacks[: max(0, len(self.attacks) - self.max_attacks)]
        return added

    # -- model calls ---------------------------------------------------------------------------
    def encode(self, texts: Sequence[str]) -> list[torch.Tensor]:
        """Token ids of attack inputs, clipped from the left to leave room for the reply."""
        budget = self.context_window - max(self.max_new_tokens, self.refusal_ids.numel())
        if budget < 1:
            raise ValueError(f"the reply length leaves no room for the attack in a window of {self.context_window} tokens")
        ids = self.tokenizer(list(texts), add_special_tokens=self.add_special_tokens)["input_ids"]
        return [torch.tensor(row[-budget:], dtype=torch.long) for row in ids]

    def sft_loss(self, texts: Sequence[str]) -> torch.Tensor:
        """Mean negative log-likelihood of the refusal (and its EOS) after each input, one batched forward."""
        prompts = self.encode(texts)
        rows = token_logprobs(self.model, prompts, [self.refusal_ids] * len(prompts), pad_token_id=self.tokenizer.pad_token_id)
        return -torch.cat(rows).mean()

    @torch.no_grad()
    def replies(self, model: torch.nn.Module, texts: Sequence[str]) -> list[str]:
        """Greedy replies of ``model`` to the inputs, ``batch_size`` inputs per ``generate`` call (left-padded)."""
        out: list[str] = []
        device = next(model.parameters()).device
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        for start in range(0, len(texts), self.batch_size):
            prompts = self.encode(texts[start : start + self.batch_size])
            ids, mask = pad_ids(prompts, pad, side="left", device=device)
            generated = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=eos,
            )[:, ids.shape[1] :].cpu()
            cut = [row[: int((row == eos).nonzero()[0])] if (row == eos).any() else row for row in generated]
            out += self.tokenizer.batch_decode([row[row != pad] for row in cut], skip_special_tokens=True)
        return out

    def success_rate(self, model: torch.nn.Module, texts: Sequence[str] | None = None) -> float:
        """Share of the inputs (default: the archive) whose greedy reply scores above the threshold."""
        texts = list(self.attacks if texts is None else texts)
        if not texts:
            return float("nan")
        from astrl.scorers import checked_scores

        return float((checked_scores(self.scorer, self.replies(model, texts)) > self.threshold).float().mean())

    # -- one round -------------------------------------------------------------------------------
    def harden(self, texts: Sequence[str] | None = None) -> list[float]:
        """``steps`` AdamW steps of the refusal loss on the inputs (default: the archive); returns the losses."""
        texts = list(self.attacks if texts is None else texts)
        if not texts:
            return []
        was_training = self.model.training
        self.model.eval()  # no dropout: the adapter learns what the target does at generation time
        losses, order = [], []
        try:
            for _ in range(self.steps):
                if len(order) < min(self.batch_size, len(texts)):
                    order += torch.randperm(len(texts), generator=self.generator).tolist()
                chunk, order = order[: self.batch_size], order[self.batch_size :]
                loss = self.sft_loss([texts[i] for i in chunk])
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                losses.append(float(loss.detach()))
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.train(was_training)
        return losses

    def round(self) -> dict[str, float]:
        """Harden on the archive and report ``harden_attacks``, ``harden_sft_loss`` (first and last step),
        ``asr_before`` / ``asr_current`` (the target before and after the round) and ``asr_original``."""
        self.rounds += 1
        row: dict[str, float] = {"harden_round": self.rounds, "harden_attacks": len(self.attacks)}
        if not self.attacks:
            return row
        row["asr_before"] = self.success_rate(self.model)
        losses = self.harden()
        row.update(harden_sft_loss_first=losses[0], harden_sft_loss=losses[-1], asr_current=self.success_rate(self.model))
        if self.original is not None:
            row["asr_original"] = self.success_rate(self.original)
        return row

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Trainable target weights, optimizer, archive, RNG state and round count."""
        from astrl.training.state_io import trainable_state

        return {
            "model": trainable_state(self.model),
            "optimizer": self.optimizer.state_dict(),
            "attacks": list(self.attacks),
            "generator": self.generator.get_state(),
            "rounds": self.rounds,
        }

    def load_state_dict(self, state: Mapping) -> None:
        from astrl.training.state_io import load_trainable_state

        missing = {"model", "optimizer", "attacks", "generator", "rounds"} - set(state)
        if missing:
            raise KeyError(f"TargetHardener state is missing {sorted(missing)}")
        load_trainable_state(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.attacks = list(state["attacks"])
        self.generator.set_state(state["generator"])
        self.rounds = int(state["rounds"])


class Hardening:
    """The trainer's hardening loop: archive the attacks of every batch, harden every ``harden_every`` steps."""

    def __init__(self, config, models) -> None:
        from astrl.scorers import make_scorers

        if models.original_target is None:
            raise ValueError("hardening needs a target with its own adapter (build the models with harden_every > 0)")
        self.config, self.every, self.mode = config, config.harden_every, config.mode
        self.scorer_name, scorer = next(iter(make_scorers([config.scorer], device=config.device).items()))
        target = models.target
        self.hardener = TargetHardener(
            target.model,
            target.tokenizer,
            scorer,
            original=models.original_target,
            refusal=config.refusal,
            steps=config.harden_steps,
            lr=config.harden_lr,
            batch_size=config.harden_batch_size,
            threshold=config.harden_threshold,
            max_new_tokens=config.target_max_new_tokens or config.max_new_tokens,
            context_window=target.context_window,
            add_special_tokens=config.mode == "text",
            max_attacks=config.harden_max_attacks,
            seed=config.seed,
        )

    def observe(self, data: TensorDictBase) -> int:
        """Archive the successful attacks of a training batch; returns how many were new."""
        contexts, probes, scores = attacks_from(data, self.scorer_name)
        return self.hardener.add(target_inputs(self.hardener.tokenizer, contexts, probes, self.mode), scores)

    def after_step(self, step: int) -> dict[str, float]:
        """Metrics of a hardening round when ``step`` is a multiple of ``harden_every``, else the archive size."""
        if step % self.every:
            return {"harden_archive": len(self.hardener.attacks)}
        return {"harden_archive": len(self.hardener.attacks), **self.hardener.round()}

    def state_dict(self) -> dict:
        return self.hardener.state_dict()

    def load_state_dict(self, state: Mapping) -> None:
        self.hardener.load_state_dict(state)
