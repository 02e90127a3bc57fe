"""``HFASTSystem``: an :class:`ASTSystem` over Hugging Face causal LMs (any id, folder, or ``smollm2-135m``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from astrl.lm_scoring import mean_logprobs, stop_ids, token_logprobs
from astrl.models import LoadedModel, load_model, save_model
from astrl.prefill import TurnCache
from astrl.ragged import pad_rows
from astrl.rewards.reference import make_reference
from astrl.system.ast import ASTSystem


class HFASTSystem(ASTSystem):
    """Tester, target and baseline as Hugging Face causal LMs, each with its own tokenizer.

    Args:
        tester, target, baseline: a model id, a local folder, ``"smollm2-135m"`` or a
            :class:`~astrl.models.LoadedModel`. The tester is trained (all its weights, or only its
            adapters when it is a PEFT model); target and baseline are frozen. ``baseline=None``
            makes a frozen copy of the tester; the same identifier for target and baseline loads
            one shared copy.
        scorer: harm scorer for the reward (see :class:`ASTSystem`).
        device: where the models live (``"cuda"`` or ``"cpu"``).
        max_new_tokens: tokens generated per probe and per reply.
        temperature, top_p, top_k, do_sample: explicit generation settings (``top_k=0``: off).
        seed: generation runs under a forked RNG seeded from ``seed`` and the call count, so
            rollouts are reproducible and the global RNG is untouched; ``None`` uses the global RNG.
        dtype: weights dtype when loading by name.
        turn_cache: keep each model's KV cache between ``generate`` calls, so that a tree's next level
            prefills only what its parents' calls have not read (:class:`astrl.prefill.TurnCache`).
        alpha, zeta, gamma, reward, probe_penalty, elicit_gate, reply_samples, reply_transform: the reward, its
            weights and the replies it averages (see :class:`ASTSystem`).

    Every tokenizer pads on the left with a pad token distinct from EOS. A context longer than
    ``max_ctx - max_new_tokens`` (``max_ctx`` = the model's window, e.g. 1024 for GPT-2) keeps its
    most recent tokens. Log-probs score the continuation's own tokenization after the context's
    (context tokens never count) in one right-padded forward per batch.
    """

    def __init__(
        self,
        tester: str | LoadedModel,
        target: str | LoadedModel,
        baseline: str | LoadedModel | None = None,
        scorer="profanity",
        device: str | torch.device = "cpu",
        *,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        do_sample: bool = True,
        seed: int | None = 0,
        dtype: str = "float32",
        alpha: float = 1.0,
        zeta: float = 0.5,
        gamma: float = 0.1,
        reward: str = "astprompter",
        probe_penalty: float = 1.0,
        elicit_gate: bool = False,
        reply_samples: int = 1,
        reply_transform: str = "prob",
        turn_cache: bool = True,
    ) -> None:
        super().__init__(
            scorer,
            alpha=alpha,
            zeta=zeta,
            gamma=gamma,
            reward=reward,
            probe_penalty=probe_penalty,
            elicit_gate=elicit_gate,
            reply_samples=reply_samples,
            reply_transform=reply_transform,
        )
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature <= 0 and do_sample:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        self.device = torch.device(device)
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = (
            int(max_new_tokens),
            float(temperature),
            float(top_p),
            int(top_k),
        )
        self.do_sample, self.seed, self.calls = bool(do_sample), seed, 0
        self._load_models(tester, target, baseline, dtype)
        if self.tester.model is self.target.model:
            raise ValueError("tester and target are the same module: pass an identifier or a separate copy for the target")
        self.tester.model.eval()  # no dropout: the solvers' first ratio is exactly 1
        if turn_cache:
            self._cache_turns()
        for lm in (self.tester, self.target, self.baseline):
            if lm.context_window <= self.max_new_tokens:
                raise ValueError(
                    f"max_new_tokens={self.max_new_tokens} leaves no room in {lm.name}'s window of {lm.context_window}"
                )

    def _load(self, spec, dtype: str) -> LoadedModel:
        """``spec`` on this System's device: a :class:`LoadedModel` moved there, or an id or folder loaded there."""
        if isinstance(spec, LoadedModel):
            spec.model.to(self.device)
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"models are given as an id, a folder or a LoadedModel, got {type(spec).__name__}")
        return load_model(spec, dtype=dtype, device=self.device)

    def _load_models(self, tester, target, baseline, dtype: str) -> None:
        """Set ``tester`` (trainable), ``target`` and ``baseline`` (frozen, in eval mode); a missing baseline
        is a frozen copy of the tester, and one named as the target is the target itself."""
        self.tester = self._load(tester, dtype)
        if not any(p.requires_grad for p in self.tester.model.parameters()):
            self.tester.model.requires_grad_(True)  # a PEFT tester keeps its adapters as the only trainable weights
        self.target = self._load(target, dtype)
        if baseline is None:
            self.baseline = LoadedModel(
                self.tester.name, make_reference(self.tester.model), self.tester.tokenizer, self.tester.context_window
            )
        elif isinstance(baseline, str) and isinstance(target, str) and baseline == target:
            self.baseline = self.target
        else:
            self.baseline = self._load(baseline, dtype)
        for frozen in (self.target, self.baseline):
            frozen.model.requires_grad_(False)
            frozen.model.eval()

    def _cache_turns(self) -> None:
        """Keep the tester's and the target's KV caches between ``generate`` calls (:class:`TurnCache`)."""
        for lm in (self.tester, self.target):
            if not isinstance(lm.model.generate, TurnCache):
                TurnCache(lm.model)
        self.target.model.generate.keep_states = True  # the likelihood term scores the probe the target read

    # -- generation ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _rng(self) -> Iterator[None]:
        if self.seed is None:
            yield
            return
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed((self.seed * 1_000_003 + self.calls) % 2**63)
            yield

    def _generate(self, lm: LoadedModel, prompts: Sequence[str]) -> list[str]:
        tokenizer = lm.tokenizer
        budget = lm.context_window - self.max_new_tokens
        encoded = [ids[-budget:] for ids in tokenizer(list(prompts), add_special_tokens=False)["input_ids"]]
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        encoded = [ids if ids else [start] for ids in encoded]
        batch = tokenizer.pad({"input_ids": encoded}, padding=True, return_tensors="pt").to(self.device)
        settings = {"do_sample": self.do_sample, "max_new_tokens": self.max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
        if self.do_sample:
            settings.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        with self._rng(), torch.no_grad():
            out = lm.model.generate(**batch, **settings)
        self.calls += 1
        stops = stop_ids(tokenizer, lm.model) | {tokenizer.pad_token_id}
        texts = []
        for row in out[:, batch["input_ids"].shape[1] :].tolist():
            end = next((i for i, t in enumerate(row) if t in stops), len(row))
            texts.append(row[:end])
        return tokenizer.batch_decode(texts, skip_special_tokens=True)

    def rollout_prompt_with_tester(self, prompts: Sequence[str]) -> list[str]:
        return self._generate(self.tester, prompts)

    def rollout_prompt_with_target(self, prompts: Sequence[str]) -> list[str]:
        return self._generate(self.target, prompts)

    # -- log-probs -------------------------------------------------------------------------------
    def _token_rows(self, lm: LoadedModel, contexts: Sequence[str], continuations: Sequence[str]) -> list[torch.Tensor]:
        tokenizer = lm.tokenizer
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        prefixes = [torch.tensor(ids or [start]) for ids in tokenizer(list(contexts), add_special_tokens=False)["input_ids"]]
        conts = [
            torch.tensor(ids, dtype=torch.long) for ids in tokenizer(list(continuations), add_special_tokens=False)["input_ids"]
        ]
        return token_logprobs(lm.model, prefixes, conts, pad_token_id=tokenizer.pad_token_id, max_length=lm.context_window)

    @staticmethod
    def _padded(rows: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """``(B, T)`` per-token log-probs, ``0.0`` after each continuation (keeps the graph)."""
        return pad_rows(rows, dtype=torch.float32, device=device)

    def _logprobs(self, lm: LoadedModel, contexts, continuations, *, grad: bool) -> torch.Tensor:
        with contextlib.nullcontext() if grad else torch.no_grad():
            rows = self._token_rows(lm, contexts, continuations)
            return self._padded(rows, self.device)

    def get_tester_logprobs(self, contexts: Sequence[str], continuations: Sequence[str]) -> torch.Tensor:
        return self._logprobs(self.tester, contexts, continuations, grad=True)

    def get_target_logprobs(self, contexts: Sequence[str], continuations: Sequence[str]) -> torch.Tensor:
        return self._logprobs(self.target, contexts, continuations, grad=False)

    def get_baseline_logprobs(self, contexts: Sequence[str], continuations: Sequence[str]) -> torch.Tensor:
        return self._logprobs(self.baseline, contexts, continuations, grad=False)

    def probe_logprob(self, contexts: Sequence[str], probes: Sequence[str]) -> torch.Tensor:
        """Exact mean per-token log-prob of each probe under the target (its own token count)."""
        with torch.no_grad():
            rows = self._token_rows(self.target, contexts, probes)
        return mean_logprobs(rows, self.empty_probe_logprob)

    # -- training --------------------------------------------------------------------------------
    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for p in self.tester.model.parameters() if p.requires_grad)

    def save(self, folder) -> None:
        """Save the tester and its tokenizer (``save_pretrained``) into ``folder``."""
        save_model(self.tester.model, self.tester.tokenizer, folder)
