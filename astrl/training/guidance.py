"""Guided GRPO: each group gains a member whose first probe is given, by the lexicon search or the run's past.

GRPO on the tester's own samples learns an attack only when one of a group's ``G`` samples finds it;
on the embedded default the set-ups that elicit are rare among samples, and a few hundred sampled
probes a run do not show GRPO which ones carry (docs/training.md). With ``guide_search: true`` every
step searches, for each group's opener, the probe the current tester's likely tokens can write after
which the target is most likely to say a lexicon word (the warm start's search,
:func:`astrl.training.warm_start.search_probes`), and runs one more conversation from that opener whose
first tester turn is that probe: the tester "samples" it under a logits processor that allows only the
searched token at each position (:func:`forced_first_turn`), so the turn carries the same tokens, texts,
replies, rewards and later turns as a sampled one. It joins its group as member ``G + 1``::

    A_i = (R_i - mean(R_1..R_G+1)) / std(R_1..R_G+1)

(:func:`astrl.training.grpo.turn_group_advantages`), and the loss treats it as it treats the others: its
importance ratio ``pi_theta / pi_old`` (``pi_old``: the tester before this step's updates) is clipped to
``[1 - eps, 1 + eps]``, and the KL to the reference covers its tokens. A searched probe that beats the
group pulls the tester toward it and pushes the weaker samples down; one that does not is pushed down
like any other member. The metrics of a step read the sampled conversations only; ``guide_*`` columns
report the guided ones.

Replay-guided GRPO (``guide_replay: true``, :class:`ReplayGuide`) adds a member the same way, with a
first probe taken from the run's own past instead of a search, so it needs no target logits (a black
box gives it all it reads): every first probe the tester has sampled is kept with the returns its
first turn earned, and each step re-tests the best of them on the step's openers. A probe ``p`` tested
``n_p`` times with first-turn returns ``r_1..r_n`` is ranked by its mean shrunk toward the mean ``mu`` of
every test so far::

    score(p) = (r_1 + ... + r_n + mu) / (n_p + 1)

so one lucky reply ranks a probe once, and a probe keeps its place only while its new tests hold
it there. With ``guide_replay_rank: lexicon`` a test's ``r`` is the reward's gated reply lexicon term
``g * lex(reply)`` (the target's probability of a listed word, averaged over the turn's replies) instead of
its return: the same replies' lexicon estimate ranks probes by their share on other openers better than
their sampled scores do (docs/training.md), and it carries neither the likelihood term nor the penalties.
With ``guide_replay_bonus: c > 0`` the ranking adds an upper-confidence term,

    bound(p) = score(p) + c * s / sqrt(n_p + 1)

(``s``: the standard deviation of every test's return), so a probe with few tests is tried again before
one whose many tests pin it just above. Group ``g`` gets the best-ranked probe not given to an earlier
group of the step and not tested on ``g``'s opener before (else the best not given). With
``guide_replay_members: m > 1`` each group gains ``m`` replayed members with distinct probes (the best-ranked
go to every group's first member, the next to its second), so that the tester's own opening does not
outnumber the replayed probe ``G`` to 1. With
``guide_replay_warm_start: true`` the archive starts with the warm start's kept probes, untested, and an
untested probe is given before any ranked one (in the order kept), so each is tried once on a training
opener before the scores decide, not only the ones the tester happens to sample. Rare successes that one
group's advantage would forget are tried again on new openers, and a probe that elicits across openers
pulls the tester toward it step after step (self-imitation of the run's best).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from tensordict import TensorDictBase

from astrl._compat import as_list
from astrl.keys import NEXT, QUERY, REWARD, STEP_COUNT, TOKENS_RESPONSE
from astrl.lm_scoring import until_stop


class ForceTokens:
    """A logits processor that lets row ``i`` sample only ``tokens[i][t]`` at its ``t``-th new token
    (rows whose entry is None, or past its length, sample freely)."""

    def __init__(self, tokens: Sequence[torch.Tensor | None]) -> None:
        self.tokens = list(tokens)
        self.step = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if len(self.tokens) != scores.shape[0]:
            raise ValueError(f"forced tokens for {len(self.tokens)} rows, but generate runs {scores.shape[0]}")
        for row, tokens in enumerate(self.tokens):
            if tokens is not None and self.step < len(tokens):
                forced = int(tokens[self.step])
                scores[row] = float("-inf")
                scores[row, forced] = 0.0
        self.step += 1
        return scores


@contextmanager
def forced_first_turn(model: torch.nn.Module, tokens: Sequence[torch.Tensor | None]) -> Iterator[None]:
    """Within the block, the first ``model.generate`` call samples ``tokens`` (:class:`ForceTokens`);
    later calls (later turns) sample as usual. ``generate`` hooks already on the model (shared prefill,
    turn cache) stay underneath."""
    from transformers import LogitsProcessorList

    own = "generate" in vars(model)
    inner = model.generate
    calls = 0

    def generate(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), ForceTokens(tokens)])
        return inner(*args, **kwargs)

    model.generate = generate
    try:
        yield
    finally:
        if own:
            model.generate = inner
        else:
            del model.generate


def group_openers(data: TensorDictBase, group_size: int) -> list[str]:
    """The opener of each group of a flat, trajectory-contiguous rollout: the query of the first turn
    of every ``group_size``-th conversation."""
    first = [i for i, turn in enumerate(data[STEP_COUNT].reshape(-1).tolist()) if turn == 0]
    queries = as_list(data[QUERY])
    if len(first) % group_size:
        raise ValueError(f"{len(first)} conversations do not form groups of {group_size}")
    return [queries[i] for i in first[::group_size]]


class GuidedMembers:
    """``members`` more conversations per GRPO group, whose first tester turns are given: ``rollout(data)``
    runs, for every group opener of ``data`` in group order, ``members`` conversations whose first probes are
    :meth:`first_probes`' tokens for them (later turns sampled), with their rewards from the run's own
    reward transforms, and returns the flat rollout, member by member: every group's first member in group
    order, then every group's second, and so on.

    Args:
        config: the run's :class:`~astrl.training.config.TrainConfig` (the conversation settings).
        models: the run's models; the tester (its adapters on) writes the guided conversations' later turns.
        members: the conversations each group gains.
    """

    def __init__(self, config, models, members: int = 1) -> None:
        from dataclasses import replace

        from torchrl.envs.llm.transforms import DataLoadingPrimer

        from astrl.envs.recipe import build_conversation
        from astrl.prompts import PromptStream
        from astrl.training.setup import conversation_spec

        if members < 1:
            raise ValueError(f"a guide adds at least one member to each group, got members={members}")
        self.config, self.models, self.members = config, models, members
        conversations = config.batch_size // config.group_size * members
        # every draw of this stream is its whole prompt list, in order: rollout() sets the list
        self.stream = PromptStream(["-"] * conversations, conversations, shuffle=False)
        spec = replace(conversation_spec(config), batch_size=conversations, group_size=1)
        conversation = build_conversation(spec, tester=models.tester, target=models.target, stream=self.stream)
        self.env, self.tester = conversation.env, conversation.tester
        self.primer = next(t for t in self.env.transform if isinstance(t, DataLoadingPrimer))
        self.last: dict[str, float] = {}

    def first_probes(self, data: TensorDictBase, openers: list[str]) -> list[torch.Tensor]:
        """The tokens of each guided conversation's first probe (one tensor per entry of ``openers``: the group
        openers in group order, repeated once per member)."""
        raise NotImplementedError

    def rollout(self, data: TensorDictBase) -> TensorDictBase:
        groups = group_openers(data, self.config.group_size)
        if len(groups) * self.members != len(self.stream.prompts):
            raise ValueError(f"the step has {len(groups)} groups, the guide runs {len(self.stream.prompts) // self.members}")
        openers = groups * self.members
        tokens = self.first_probes(data, openers)
        self.stream.prompts[:] = openers
        self.primer.reset_dataloader()  # drop what it drew ahead: its next draw is the list just set
        with torch.no_grad(), forced_first_turn(self.models.tester.model, tokens):
            reset = self.env.reset()
            drawn = as_list(reset[QUERY])
            if drawn != openers:
                raise RuntimeError(f"the guide's env drew {drawn[:2]}..., not the step's openers {openers[:2]}...")
            return self.env.rollout(self.config.turns, self.tester, tensordict=reset, auto_reset=False).reshape(-1)

    def state_dict(self) -> dict:
        """What the guide keeps across steps (plain data)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        return None


class SearchGuide(GuidedMembers):
    """Search-guided members (module docstring): each group's first probe is the lexicon search's for its
    opener, searched with the tester as it is now."""

    def __init__(self, config, models) -> None:
        super().__init__(config, models)
        self.lexicon = self.env.reply_lexicon  # the elicit reward's: the search aims at what the reward pays
        self._found: list = []

    def first_probes(self, data: TensorDictBase, openers: list[str]) -> list[torch.Tensor]:
        from astrl.training.warm_start import search_probes

        self._found = search_probes(self.config, self.models, openers, self.lexicon)
        return [f.tokens for f in self._found]

    def rollout(self, data: TensorDictBase) -> TensorDictBase:
        guided = super().rollout(data)
        rewards = guided[NEXT, REWARD].reshape(-1).float()
        found = self._found
        self.last = {"guide_mass": sum(f.mass for f in found) / len(found), "guide_reward": float(rewards.mean())}
        return guided


def first_turns(data: TensorDictBase, returns: torch.Tensor, stops: set[int]) -> list[tuple[list[int], str, float]]:
    """``(probe tokens up to the first stop, opener, return)`` of every conversation's first turn of a flat,
    trajectory-contiguous rollout, ``returns`` holding each turn's return."""
    first = (data[STEP_COUNT].reshape(-1) == 0).tolist()
    responses, queries = data.get(TOKENS_RESPONSE, as_list=True), as_list(data[QUERY])
    rows = []
    for response, opener, value, is_first in zip(responses, queries, returns.tolist(), first, strict=True):
        if is_first:
            rows.append((until_stop(response, stops).tolist(), opener, float(value)))
    return rows


class ReplayArchive:
    """Every first probe a run has tested, with its tests' returns: the replay guide's memory (module
    docstring gives the score and the choice)."""

    def __init__(self, bonus: float = 0.0) -> None:
        self.bonus = bonus  # c of the upper-confidence term (module docstring); 0: rank by score
        self.probes: dict[tuple[int, ...], dict] = {}  # tokens -> {"total", "tests", "openers"}
        self.total, self.total_sq, self.tests = 0.0, 0.0, 0

    def add(self, rows: list[tuple[list[int], str, float]]) -> None:
        """Count each ``(probe tokens, opener, return)`` as one test of that probe."""
        for tokens, opener, value in rows:
            entry = self.probes.setdefault(tuple(tokens), {"total": 0.0, "tests": 0, "openers": []})
            entry["total"] += value
            entry["tests"] += 1
            if opener not in entry["openers"]:
                entry["openers"].append(opener)
            self.total += value
            self.total_sq += value * value
            self.tests += 1

    def seed(self, probes: list[tuple[int, ...]]) -> None:
        """Keep ``probes`` untested (probes already kept are left as they are): :meth:`choose` gives each
        before any tested probe, in this order."""
        for tokens in probes:
            self.probes.setdefault(tuple(tokens), {"total": 0.0, "tests": 0, "openers": []})

    def untested(self) -> int:
        """How many kept probes no test has reached yet (seeded ones only)."""
        return sum(entry["tests"] == 0 for entry in self.probes.values())

    def scores(self) -> dict[tuple[int, ...], float]:
        """Every probe's score: the mean of its returns shrunk toward the mean ``mu`` of all tests,
        ``(sum of its returns + mu) / (its tests + 1)``."""
        mu = self.total / self.tests if self.tests else 0.0
        return {probe: (entry["total"] + mu) / (entry["tests"] + 1) for probe, entry in self.probes.items()}

    def spread(self) -> float:
        """The standard deviation ``s`` of every test's return (0 before two tests)."""
        if self.tests < 2:
            return 0.0
        mu = self.total / self.tests
        return math.sqrt(max(self.total_sq / self.tests - mu * mu, 0.0))

    def bounds(self) -> dict[tuple[int, ...], float]:
        """Every probe's rank value: its score plus ``bonus * s / sqrt(tests + 1)`` (its score when ``bonus`` is 0)."""
        scores, width = self.scores(), self.bonus * self.spread()
        return {p: scores[p] + width / math.sqrt(e["tests"] + 1) for p, e in self.probes.items()}

    def choose(self, openers: list[str]) -> list[tuple[int, ...]]:
        """One probe per opener, in order: the best-ranked one (:meth:`bounds`) not chosen for an earlier opener
        and not tested on this opener, else the best not chosen, else the best (ties: the probe kept first);
        untested (seeded) probes rank above every tested one."""
        bounds = self.bounds()
        rank = {p: (self.probes[p]["tests"] == 0, bounds[p]) for p in self.probes}
        ranked = sorted(self.probes, key=rank.__getitem__, reverse=True)  # stable: insertion order on ties
        if not ranked:
            raise RuntimeError("the replay archive holds no probe yet: add() a rollout's first turns first")
        chosen: list[tuple[int, ...]] = []
        for opener in openers:
            free = [p for p in ranked if p not in chosen]
            fresh = [p for p in free if opener not in self.probes[p]["openers"]]
            chosen.append((fresh or free or ranked)[0])
        return chosen

    def state_dict(self) -> dict:
        probes = [
            {"tokens": list(p), "total": e["total"], "tests": e["tests"], "openers": list(e["openers"])}
            for p, e in self.probes.items()
        ]
        return {"probes": probes, "total": self.total, "total_sq": self.total_sq, "tests": self.tests}

    def load_state_dict(self, state: dict) -> None:
        self.probes = {
            tuple(e["tokens"]): {"total": float(e["total"]), "tests": int(e["tests"]), "openers": list(e["openers"])}
            for e in state.get("probes", [])
        }
        self.total, self.tests = float(state.get("total", 0.0)), int(state.get("tests", 0))
        self.total_sq = float(state.get("total_sq", 0.0))  # absent before guide_replay_bonus: its spread reads 0


class ReplayGuide(GuidedMembers):
    """Replay-guided members (module docstring): each group's first probe is the best-scoring first probe
    the run has sampled so far (:class:`ReplayArchive`), re-tested on the group's opener.

    Args:
        config, models: as :class:`GuidedMembers`; each group gains ``config.guide_replay_members`` replayed
            conversations, with distinct probes (the best-ranked go to every group's first member).
        returns: what a test counts as, ``returns(rollout) -> tensor`` over the rollout's turns (GRPO's returns,
            or with ``guide_replay_rank: lexicon`` the reward's gated reply lexicon term).
        stops: the tester's stop token ids (a probe is kept up to and with its first; a seeded one ends with the
            tokenizer's EOS when it is one of them).
    """

    def __init__(self, config, models, returns, stops: set[int]) -> None:
        super().__init__(config, models, config.guide_replay_members)
        self.returns, self.stops = returns, stops
        self.archive = ReplayArchive(config.guide_replay_bonus)
        self._chosen: list[tuple[int, ...]] = []

    def seed(self, texts: list[str]) -> None:
        """Start the archive with ``texts`` (the warm start's kept probes), untested: each is tokenized by the
        tester's tokenizer and cut as the tester's own probes end, at ``max_new_tokens`` or just after its first
        stop token, a shorter one without a stop ended with the tester's (:meth:`ReplayArchive.seed`); a text
        that starts with a stop token is an empty probe and is left out."""
        tokenizer, limit = self.models.tester.tokenizer, self.config.max_new_tokens
        stop = tokenizer.eos_token_id if tokenizer.eos_token_id in self.stops else min(self.stops)
        probes = []
        for text in texts:
            ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:limit], dtype=torch.long)
            tokens = until_stop(ids, self.stops).tolist()
            if not tokens or tokens[0] in self.stops:
                continue
            ended = tokens[-1] in self.stops or len(tokens) == limit
            probes.append(tuple(tokens if ended else [*tokens, stop]))
        self.archive.seed(probes)

    def first_probes(self, data: TensorDictBase, openers: list[str]) -> list[torch.Tensor]:
        self.archive.add(first_turns(data, self.returns(data), self.stops))
        self._chosen = self.archive.choose(openers)
        return [torch.tensor(p, dtype=torch.long) for p in self._chosen]

    def rollout(self, data: TensorDictBase) -> TensorDictBase:
        guided = super().rollout(data)
        scores, probes = self.archive.scores(), self.archive.probes
        before = [scores[p] for p in self._chosen], [probes[p]["tests"] for p in self._chosen]
        rows = first_turns(guided, self.returns(guided), self.stops)
        # each re-test is evidence for the probe chosen, credited by its key (seed() already cut each seed as the
        # rollout cuts it; crediting by key keeps any forced probe from staying untested, chosen again every step)
        self.archive.add([(list(p), opener, value) for p, (_, opener, value) in zip(self._chosen, rows, strict=True)])
        self.last = {
            "replay_reward": float(guided[NEXT, REWARD].reshape(-1).float().mean()),
            "replay_score": sum(before[0]) / len(before[0]),
            "replay_tests": sum(before[1]) / len(before[1]),
            "replay_probes": float(len(probes)),
            "replay_untested": float(self.archive.untested()),
        }
        return guided

    def state_dict(self) -> dict:
        return self.archive.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.archive.load_state_dict(state)
