"""Env transforms of the red-team loop: the target's reply and the scorer reward.

Both act inside ``env.step``, after the tester (the acting policy) wrote its probe, so the
environment composes with any TorchRL collector and with other transforms.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Mapping, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Composite, NonTensor, Unbounded
from torchrl.envs import Transform

from astrl._compat import Chat, as_list, chats_to_history, history_to_chats, render_chats
from astrl.argtypes import require
from astrl.envs.truncation import fit_chats, fit_texts
from astrl.keys import (
    HISTORY,
    PROBE,
    REPLY_SCORES,
    REWARD,
    SCORES,
    TARGET_CONTEXT,
    TARGET_LEXICON,
    TARGET_MASK,
    TARGET_RESPONSE,
    TARGET_RESPONSES,
    TARGET_TOKENS,
    TEXT,
    TEXT_PROMPT,
    TEXT_RESPONSE,
    TOKENS_RESPONSE,
)
from astrl.names import MODES
from astrl.scorers import Scorer, checked_scores

# the step output's keys under their earlier names here (astrl.keys is where they are defined)
PROBE_KEY, RESPONSE_KEY, SCORES_KEY = PROBE, TARGET_RESPONSE, SCORES
RESPONSE_TOKENS_KEY, RESPONSE_MASK_KEY = TARGET_TOKENS, TARGET_MASK
_MARK = "\ue000"  # a private-use character that marks where the probe goes in a rendered template

Advance = Callable[[str, str, str], str]


def concatenate(context: str, probe: str, response: str) -> str:
    """Default text-mode state update: ``context + probe + response``."""
    return context + probe + response


def policy_limits(policy, name: str) -> tuple[object, int, int]:
    """(tokenizer, context window, max new tokens) of a policy made by :func:`astrl.policies.make_policy`."""
    tokenizer = getattr(policy, "tokenizer", None)
    window = getattr(policy, "context_window", None)
    generation = getattr(policy, "generation", None)
    if tokenizer is None or window is None or generation is None:
        raise TypeError(
            f"the {name} policy needs .tokenizer, .context_window and .generation (build it with astrl.policies.make_policy)"
        )
    return tokenizer, int(window), int(generation.max_new_tokens)


def target_view(tester_chat: Chat, system_prompt: str | None) -> Chat:
    """The conversation as the target sees it: tester turns are ``user``, its own are ``assistant``."""
    swap = {"user": "assistant", "assistant": "user"}
    messages = [{"role": swap[m["role"]], "content": m["content"]} for m in tester_chat if m["role"] in swap]
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + messages


def contexts_around_last(tokenizer, chats: Sequence[Chat]) -> list[tuple[str, str]]:
    """Each chat rendered as the policy renders it for ``tokenizer``'s model (with the generation
    prompt; :func:`astrl._compat.render_chats`), split around the last message's content: the text a
    model read before that message, and what it reads after it up to its own reply."""
    marked = [c[:-1] + [{"role": c[-1]["role"], "content": _MARK}] for c in chats]
    texts = render_chats(tokenizer, marked)
    cut = [t.rfind(_MARK) for t in texts]
    if min(cut) < 0:
        raise ValueError("the target's chat template does not render message content verbatim; cannot locate the probe")
    return [(t[:i], t[i + len(_MARK) :]) for t, i in zip(texts, cut, strict=True)]


def contexts_before_last(tokenizer, chats: Sequence[Chat]) -> list[str]:
    """The text before each chat's last message content (:func:`contexts_around_last`)."""
    return [before for before, _ in contexts_around_last(tokenizer, chats)]


def strip_special_tokens(text: str, tokenizer, *others) -> str:
    """``text`` without the special tokens (EOS, pad, chat markers) of ``tokenizer`` and of ``others``
    written in it (longest first)."""
    markers = {m for tok in (tokenizer, *others) for m in getattr(tok, "all_special_tokens", ()) if m}
    for token in sorted(markers, key=len, reverse=True):
        text = text.replace(token, "")
    return text


def clean_responses(
    tokens: Sequence[torch.Tensor], tokenizer, max_new_tokens: int
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Cut generated ids at the first EOS/pad, decode them, and pad them to ``max_new_tokens``.

    Returns the texts, the ids (EOS kept, right-padded with the pad id) and their mask.
    """
    stops = {tokenizer.pad_token_id, tokenizer.eos_token_id}
    ids = torch.full((len(tokens), max_new_tokens), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(tokens), max_new_tokens), dtype=torch.bool)
    texts = []
    for row, seq in enumerate(tokens):
        seq = seq.tolist()[:max_new_tokens]
        end = next((i for i, t in enumerate(seq) if t in stops), len(seq))
        keep = seq[: end + 1] if end < len(seq) and seq[end] == tokenizer.eos_token_id else seq[:end]
        ids[row, : len(keep)] = torch.tensor(keep, dtype=torch.long)
        mask[row, : len(keep)] = True
        texts.append(seq[:end])
    return tokenizer.batch_decode(texts, skip_special_tokens=True), ids, mask


class TargetTurn(Transform):
    """The target answers the tester's probe inside ``env.step`` (batched, no gradients).

    Chat mode: the tester's view (``("history", "prompt")``, ending with its probe) is turned
    into the target's view (roles swapped, the target's optional system prompt), clipped to the
    target's window, answered by ``target``, and the reply is appended to the tester's view as a
    ``user`` message. Text mode: the target continues ``context + probe`` and the new state is
    ``advance(context, probe, response)``.

    Writes ``probe`` and ``target_response`` (strings), ``target_context`` (the text the target
    read before the probe, in its own format: a rendered chat template or plain text), ``target_tokens`` (ids, right-padded to the
    target's ``max_new_tokens``) and ``target_mask`` to the step output; they are observations
    (the last exchange), empty after reset. After each step (and at
    reset) the tester's next observation is clipped to fit its own window, oldest turns first.

    With ``reply_samples`` K > 1 the target answers each probe K times in the same call (K adjacent
    rows with the same input, so a :class:`~astrl.prefill.TurnCache` reads their prompt once) and
    ``target_responses`` holds the K replies (shape ``(*batch, K)``); ``target_response``,
    ``target_tokens`` and ``target_mask`` are those of the first, the reply the conversation goes on
    with. With a ``lexicon`` (:class:`~astrl.rewards.lexicon.ReplyLexicon`), ``target_lexicon`` holds
    each reply's estimated probability of holding a listed word (shape ``(*batch, K)``), read from the
    target's next-token logits of this very call (the target must be a Transformers policy).
    """

    def __init__(
        self,
        target,
        *,
        tester_tokenizer,
        tester_window: int,
        tester_max_new_tokens: int,
        mode: str = "chat",
        target_system_prompt: str | None = None,
        advance: Advance | None = None,
        reply_samples: int = 1,
        lexicon=None,
    ) -> None:
        super().__init__()
        require("mode", mode, choices=MODES)
        if reply_samples < 1:
            raise ValueError(f"reply_samples must be >= 1, got {reply_samples}")
        self.reply_samples = reply_samples
        self.lexicon = lexicon
        self._masses: list[torch.Tensor] | None = None  # per-step lexicon masses of the target call in progress
        self._hook = None  # the target's TurnCache, which the lexicon reads each call's logits through
        if lexicon is not None:
            self._watch_logits(target)
        self.target = target
        self.mode = mode
        self.target_system_prompt = target_system_prompt
        self.advance = advance or concatenate
        self.target_tokenizer, self.target_window, self.target_max_new_tokens = policy_limits(target, "target")
        self.tester_tokenizer = tester_tokenizer
        self.tester_budget = tester_window - tester_max_new_tokens
        self.target_budget = self.target_window - self.target_max_new_tokens
        limits = (
            ("tester", self.tester_budget, tester_window, tester_max_new_tokens),
            ("target", self.target_budget, self.target_window, self.target_max_new_tokens),
        )
        for who, budget, window, max_new in limits:
            if budget < 1:
                raise ValueError(
                    f"{who} max_new_tokens {max_new} leaves no room for context in its window of {window} tokens "
                    f"(use at most {window - 1})"
                )

    def _watch_logits(self, target) -> None:
        """Read the lexicon mass of every reply position from the target's ``generate`` output."""
        from astrl.prefill import turn_cache_of

        model = getattr(target, "model", None)
        if model is None or not hasattr(model, "generate"):
            raise TypeError("a reply lexicon reads the target's generate logits: the target must be a Transformers policy")
        self._hook = turn_cache_of(model, install=True)  # the env may go first
        self._hook.observers.append(weakref.WeakMethod(self._observe))

    def _observe(self, out) -> None:
        if self._masses is None:  # a call of the same model by someone else (a tester sharing it)
            return
        logits = getattr(out, "logits", None)
        if not logits:
            raise ValueError("the target's generate returned no logits (is its generate replaced?)")
        self._masses.append(torch.stack([self.lexicon.step_stats(step) for step in logits], dim=1))

    # -- specs -------------------------------------------------------------------------
    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        shape = observation_spec.shape
        observation_spec[PROBE] = NonTensor(shape=shape, example_data="probe")
        observation_spec[TARGET_RESPONSE] = NonTensor(shape=shape, example_data="reply")
        observation_spec[TARGET_CONTEXT] = NonTensor(shape=shape, example_data="context")
        observation_spec[TARGET_TOKENS] = Unbounded(shape=(*shape, self.target_max_new_tokens), dtype=torch.long)
        observation_spec[TARGET_MASK] = Unbounded(shape=(*shape, self.target_max_new_tokens), dtype=torch.bool)
        if self.reply_samples > 1:
            observation_spec[TARGET_RESPONSES] = NonTensor(shape=(*shape, self.reply_samples), example_data="reply")
        if self.lexicon is not None:
            observation_spec[TARGET_LEXICON] = Unbounded(shape=(*shape, self.reply_samples))
        return observation_spec

    # -- reset: the opener must fit the tester's window ---------------------------------
    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        shape = tensordict_reset.batch_size
        n = shape.numel()
        tensordict_reset.set(PROBE, [""] * n)
        tensordict_reset.set(TARGET_RESPONSE, [""] * n)
        tensordict_reset.set(TARGET_CONTEXT, [""] * n)
        tensordict_reset.set(TARGET_TOKENS, torch.full((*shape, self.target_max_new_tokens), self.target_tokenizer.pad_token_id))
        tensordict_reset.set(TARGET_MASK, torch.zeros((*shape, self.target_max_new_tokens), dtype=torch.bool))
        if self.reply_samples > 1:
            tensordict_reset.set(TARGET_RESPONSES, [[""] * self.reply_samples for _ in range(n)])
        if self.lexicon is not None:
            tensordict_reset.set(TARGET_LEXICON, torch.zeros((*shape, self.reply_samples)))
        if self.mode == "chat":
            chats = fit_chats(history_to_chats(tensordict_reset[HISTORY].prompt), self.tester_tokenizer, self.tester_budget)
            self._set_tester_view(tensordict_reset, chats)
        else:
            prompts = as_list(tensordict_reset[TEXT_PROMPT])
            tensordict_reset[TEXT_PROMPT] = fit_texts(prompts, self.tester_tokenizer, self.tester_budget)
        return tensordict_reset

    @staticmethod
    def _set_tester_view(td: TensorDictBase, chats: list[Chat]) -> None:
        from torchrl.modules.llm.policies import ChatHistory

        td.set(HISTORY, ChatHistory(prompt=chats_to_history(chats), batch_size=td.batch_size))

    # -- step --------------------------------------------------------------------------
    def _answer(self, inputs: list, key) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """The target's replies to ``inputs`` (chats or texts) written at ``key``, ``reply_samples`` per
        input in one call: the replies of input i are rows ``i*K .. i*K+K-1``."""
        k = self.reply_samples
        if key == HISTORY and getattr(self.target, "renders_chats", False):  # each chat rendered once, for k rows
            inputs, key = render_chats(self.target_tokenizer, inputs), TEXT
        rows = [item for item in inputs for _ in range(k)]
        if key == HISTORY:
            from torchrl.modules.llm.policies import ChatHistory

            value = ChatHistory(prompt=chats_to_history(rows), batch_size=(len(rows),))
        else:
            from torchrl.modules.llm.policies import Text

            value = Text(prompt=rows, batch_size=(len(rows),))
        self._masses = [] if self.lexicon is not None else None
        logits = self._hook.with_logits() if self.lexicon is not None else contextlib.nullcontext()
        try:
            with torch.no_grad(), logits:  # the lexicon's logits: the target's wrapper asks for none
                out = self.target(TensorDict({key: value}, batch_size=(len(rows),)))
            masses = self._masses
        finally:
            self._masses = None
        tokens = out.get(TOKENS_RESPONSE, as_list=True)
        replies, ids, mask = clean_responses(tokens, self.target_tokenizer, self.target_max_new_tokens)
        self._lexicon_values = None
        if masses is not None:  # one generate call, or several in row order (a wrapper that splits batches)
            if not masses:
                raise RuntimeError("the reply lexicon saw no generate call of the target (is its generate replaced?)")
            width = min(max(m.shape[1] for m in masses), self.target_max_new_tokens)
            stats = torch.cat([torch.nn.functional.pad(m, (0, 0, 0, max(0, width - m.shape[1])))[:, :width] for m in masses])
            if stats.shape[0] != len(rows):
                raise RuntimeError(
                    f"the target's generate calls returned {stats.shape[0]} rows of logits for {len(rows)} replies"
                )
            mass = self.lexicon.reply_mass(stats, ids)
            self._lexicon_values = self.lexicon.estimate(mass, mask[:, :width]).reshape(len(inputs), k)
        return replies, ids, mask

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        if self.mode == "chat":
            probes, contexts, replies, ids, mask = self._step_chat(next_tensordict)
        else:
            probes, contexts, replies, ids, mask = self._step_text(tensordict, next_tensordict)
        k = self.reply_samples
        next_tensordict.set(PROBE, probes)
        next_tensordict.set(TARGET_CONTEXT, contexts)
        next_tensordict.set(TARGET_RESPONSE, replies[::k])
        next_tensordict.set(TARGET_TOKENS, ids[::k])
        next_tensordict.set(TARGET_MASK, mask[::k])
        if k > 1:
            next_tensordict.set(TARGET_RESPONSES, [replies[i : i + k] for i in range(0, len(replies), k)])
        if self.lexicon is not None:
            next_tensordict.set(TARGET_LEXICON, self._lexicon_values.reshape(*next_tensordict.batch_size, k))
        return next_tensordict

    def _step_chat(self, next_td: TensorDictBase):
        tester_chats = history_to_chats(next_td[HISTORY].prompt)
        # a chat marker the tester spelled in plain text ("<|im_end|>") would be read back by a chat
        # template as the end of its turn: the probe both sides keep is the text without it
        tokenizers = (self.target_tokenizer, self.tester_tokenizer)
        probes = [strip_special_tokens(chat[-1]["content"], *tokenizers) for chat in tester_chats]
        tester_chats = [chat[:-1] + [{**chat[-1], "content": p}] for chat, p in zip(tester_chats, probes, strict=True)]
        target_chats = fit_chats(
            [target_view(c, self.target_system_prompt) for c in tester_chats], self.target_tokenizer, self.target_budget
        )
        replies, ids, mask = self._answer(target_chats, HISTORY)
        first = replies[:: self.reply_samples]  # the conversation goes on with each probe's first reply
        grown = [chat + [{"role": "user", "content": reply}] for chat, reply in zip(tester_chats, first, strict=True)]
        self._set_tester_view(next_td, fit_chats(grown, self.tester_tokenizer, self.tester_budget))
        return probes, contexts_before_last(self.target_tokenizer, target_chats), replies, ids, mask

    def _step_text(self, td: TensorDictBase, next_td: TensorDictBase):
        contexts = as_list(td[TEXT_PROMPT])
        # plain text: the tester's end-of-sequence (or any special token it wrote) ends the probe, it is not
        # text the target reads (the target would read "<|im_end|>" as the end of a chat turn)
        probes = [strip_special_tokens(p, self.tester_tokenizer) for p in as_list(td[TEXT_RESPONSE])]
        target_text = fit_texts([c + p for c, p in zip(contexts, probes, strict=True)], self.target_tokenizer, self.target_budget)
        replies, ids, mask = self._answer(target_text, TEXT)
        first = replies[:: self.reply_samples]  # the conversation goes on with each probe's first reply
        states = [self.advance(c, p, r) for c, p, r in zip(contexts, probes, first, strict=True)]
        next_td.set(TEXT_PROMPT, fit_texts(states, self.tester_tokenizer, self.tester_budget))
        # what the target read before the probe ("" when the probe itself had to be clipped)
        seen = [t[: len(t) - len(p)] if t.endswith(p) else "" for t, p in zip(target_text, probes, strict=True)]
        return probes, seen, replies, ids, mask


class ScoreReward(Transform):
    """Score the target's reply with every scorer and use one of them as the reward.

    Writes ``("scores", NAME)`` (shape ``(*batch,)``, in [0, 1], higher = more harmful) for each
    scorer and ``reward`` (shape ``(*batch, 1)``) from the scorer named ``reward_scorer``
    (default: the first one). With ``reply_samples`` K > 1 (the target's K replies to each probe at
    ``target_responses``), every reply is scored in one call per scorer: ``("reply_scores", NAME)``
    (shape ``(*batch, K)``) holds them, ``("scores", NAME)`` the first reply's (the one the
    conversation shows), and the reward is the reward scorer's mean over the K replies.
    """

    def __init__(
        self,
        scorers: Mapping[str, Scorer] | Sequence[Scorer],
        *,
        reward_scorer: str | None = None,
        in_key: str = TARGET_RESPONSE,
        reply_samples: int = 1,
    ) -> None:
        super().__init__()
        if reply_samples < 1:
            raise ValueError(f"reply_samples must be >= 1, got {reply_samples}")
        self.reply_samples = reply_samples
        if not isinstance(scorers, Mapping):
            scorers = {s.name: s for s in scorers}
        if not scorers:
            raise ValueError("ScoreReward needs at least one scorer")
        self.scorers = dict(scorers)
        self.reward_scorer = reward_scorer or next(iter(self.scorers))
        require("reward_scorer", self.reward_scorer, choices=tuple(self.scorers))
        self.in_key = in_key

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        shape = observation_spec.shape
        observation_spec[SCORES] = Composite({name: Unbounded(shape=shape) for name in self.scorers}, shape=shape)
        if self.reply_samples > 1:
            samples = (*shape, self.reply_samples)
            observation_spec[REPLY_SCORES] = Composite({name: Unbounded(shape=samples) for name in self.scorers}, shape=shape)
        return observation_spec

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        shape = tensordict_reset.batch_size
        zeros = TensorDict({name: torch.zeros(shape) for name in self.scorers}, batch_size=shape)
        tensordict_reset.set(SCORES, zeros)
        if self.reply_samples > 1:
            samples = (*shape, self.reply_samples)
            tensordict_reset.set(REPLY_SCORES, TensorDict({n: torch.zeros(samples) for n in self.scorers}, batch_size=shape))
        return tensordict_reset

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        reward_spec[REWARD] = Unbounded(shape=(*reward_spec.shape, 1))
        return reward_spec

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        shape = next_tensordict.batch_size
        if self.reply_samples > 1:
            rows = as_list(next_tensordict[TARGET_RESPONSES])
            texts = [reply for row in rows for reply in row]
            samples = (*shape, self.reply_samples)
            every = {name: checked_scores(scorer, texts).reshape(samples) for name, scorer in self.scorers.items()}
            next_tensordict.set(REPLY_SCORES, TensorDict(every, batch_size=shape))
            scores = TensorDict({name: values[..., 0] for name, values in every.items()}, batch_size=shape)
            reward = every[self.reward_scorer].mean(-1)
        else:
            texts = as_list(next_tensordict[self.in_key])
            scores = {name: checked_scores(scorer, texts).reshape(shape) for name, scorer in self.scorers.items()}
            scores = TensorDict(scores, batch_size=shape)
            reward = scores[self.reward_scorer]
        next_tensordict.set(SCORES, scores)
        next_tensordict.set(REWARD, reward.unsqueeze(-1))
        return next_tensordict
