"""Tree sampling of preference pairs (the ASTPrompter / ASTRA-RL ``ASTSampler``).

From each root state (an opener), the tester writes ``tree_width`` probes; the target answers
each and every child is scored, exactly as one step of the red-team environment; every child is
expanded again until ``tree_depth``. Within each sibling group (the ``tree_width`` children of one
state) the best and the worst child form a preference pair for DPO / IPO.

All nodes of a level, across all trees, go through one tester call, one target call and one
scoring pass: the work per level is batched, whatever the number of trees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, lazy_stack
from torchrl.envs import StepCounter, Transform
from torchrl.envs.llm.transforms import DataLoadingPrimer

from astrl._compat import Chat, as_list, chats_to_history, history_to_chats
from astrl.argtypes import require
from astrl.envs.recipe import Conversation, opener_stream
from astrl.envs.redteam import make_redteam_env
from astrl.envs.transforms import TargetTurn
from astrl.keys import (
    BEST,
    CHOSEN_MASK,
    CHOSEN_NODE,
    CHOSEN_PROBE,
    CHOSEN_REWARD,
    CHOSEN_TOKENS,
    CONTEXT,
    DEPTH,
    GROUP,
    GROUPS,
    HISTORY,
    NODES,
    NUM_GROUPS,
    NUM_PAIRS,
    NUM_SKIPPED,
    OPENERS,
    PAIRS,
    PARENT,
    PROBE,
    PROMPT_TOKENS,
    QUERY,
    REJECTED_MASK,
    REJECTED_NODE,
    REJECTED_PROBE,
    REJECTED_REWARD,
    REJECTED_TOKENS,
    REPLY,
    RESPONSE_MASK,
    RESPONSE_TOKENS,
    REWARD,
    REWARD_GAP,
    REWARD_TERMS,
    SCORES,
    TARGET_CONTEXT,
    TARGET_RESPONSE,
    TEXT,
    TEXT_PROMPT,
    TOKENS_PROMPT,
    TOKENS_RESPONSE,
    TREE,
    WORST,
)
from astrl.lm_scoring import response_mask, stop_ids
from astrl.prompts import PromptStream
from astrl.ragged import as_rows
from astrl.rewards.novelty import load_novelty_states, novelty_transforms
from astrl.scorers import Scorer

_NODE_ROWS = (TARGET_CONTEXT, PROMPT_TOKENS, RESPONSE_TOKENS, RESPONSE_MASK, CONTEXT)
PAIR_KEYS = (
    PROMPT_TOKENS,
    CHOSEN_TOKENS,
    REJECTED_TOKENS,
    CHOSEN_MASK,
    REJECTED_MASK,
    CHOSEN_REWARD,
    REJECTED_REWARD,
    REWARD_GAP,
    CHOSEN_PROBE,
    REJECTED_PROBE,
    DEPTH,
    TREE,
    GROUP,
    CHOSEN_NODE,
    REJECTED_NODE,
)


def check_tree_shape(tree_width: int, tree_depth: int, min_reward_gap: float) -> None:
    """Raise a clear error for a tree that cannot give preference pairs."""
    if tree_width < 2:
        raise ValueError(f"tree_width must be >= 2 (a preference pair needs two siblings), got {tree_width}")
    if tree_depth < 1:
        raise ValueError(f"tree_depth must be >= 1, got {tree_depth}")
    require("min_reward_gap", min_reward_gap, at_least=0)


class TreeSampler:
    """Sample trees of tester-target exchanges and turn sibling groups into preference pairs.

    Each call to :meth:`sample` draws ``num_trees`` openers from the prompt stream and grows one
    full tree per opener: level ``d`` (``1..tree_depth``) holds ``num_trees * tree_width**d``
    nodes. The target's reply and the reward of every node come from the same transforms as
    :func:`~astrl.envs.make_redteam_env` builds (``TargetTurn``, ``ScoreReward`` and, with
    ``reward="astprompter"``, ``ASTPrompterReward``), applied to the whole level at once.

    Args:
        tester: the tester policy (:func:`astrl.policies.make_policy`, ``pad_output=False``).
        target: the target policy.
        scorers: scorers of the target's reply; the first (or ``reward_scorer``) gives the reward.
        prompts: openers, or a :class:`~astrl.prompts.PromptStream` with ``batch_size == num_trees``.
        num_trees: trees grown per :meth:`sample` call.
        tree_width: probes sampled from every state (>= 2: a pair needs two siblings).
        tree_depth: levels of probes below each opener (>= 1).
        min_reward_gap: a sibling group makes a pair only if ``best - worst >= min_reward_gap``;
            a group whose rewards are all equal never makes one.
        mode: as in :func:`~astrl.envs.make_redteam_env`.
        env_options: the other keyword settings of :func:`~astrl.envs.make_redteam_env`
            (``tester_system_prompt``, ``target_system_prompt``, ``reward_scorer``, ``advance``, ``reward``,
            ``reward_options``, ``novelty``, ``reply_samples``), with its defaults; no ``reward_shaping``. Novelty terms score
            each level against the probes of earlier levels and calls: siblings of one level do not count
            against each other.
        seed: seeds the opener order and the sampling of each call (generation runs under a
            forked torch RNG seeded from ``seed`` and the call count, so the global RNG is left
            untouched and a resumed sampler draws the same batch). ``None`` uses the global RNG.
    """

    def __init__(
        self,
        tester,
        target,
        scorers: Mapping[str, Scorer] | Sequence[Scorer],
        prompts: Sequence[str] | PromptStream,
        *,
        num_trees: int = 4,
        tree_width: int = 2,
        tree_depth: int = 3,
        min_reward_gap: float = 0.0,
        mode: str = "chat",
        seed: int | None = 0,
        **env_options,
    ) -> None:
        if num_trees < 1:
            raise ValueError(f"num_trees must be >= 1, got {num_trees}")
        if env_options.get("reward_shaping"):
            raise ValueError("TreeSampler does not apply reward_shaping (its rewards are each node's own env step)")
        check_tree_shape(tree_width, tree_depth, min_reward_gap)
        if getattr(tester, "pad_output", False):
            raise ValueError("the tester policy must be built with pad_output=False (astrl.policies.make_policy does)")
        if isinstance(prompts, PromptStream):
            if prompts.batch_size != num_trees:
                raise ValueError(f"PromptStream batch_size {prompts.batch_size} differs from num_trees {num_trees}")
            self.prompt_stream = prompts
        else:
            self.prompt_stream = PromptStream(list(prompts), num_trees, seed=seed or 0)
        # The env validates the settings and builds the transforms; its own opener stream is unused.
        self.env = make_redteam_env(
            tester,
            target,
            scorers,
            list(self.prompt_stream.prompts),
            batch_size=num_trees,
            max_turns=tree_depth,
            mode=mode,
            **env_options,
        )
        self.transforms: list[Transform] = [t for t in self.env.transform if not isinstance(t, (DataLoadingPrimer, StepCounter))]
        self.target_turn = next(t for t in self.transforms if isinstance(t, TargetTurn))
        self.tester, self.target = tester, target
        self.mode = mode
        self.num_trees, self.tree_width, self.tree_depth = num_trees, tree_width, tree_depth
        self.min_reward_gap = float(min_reward_gap)
        self.seed = seed
        self.calls = 0
        self.stop_token_ids = stop_ids(tester.tokenizer, tester.model)

    @classmethod
    def from_conversation(cls, conversation: Conversation, *, tree_width: int = 2, min_reward_gap: float = 0.0) -> TreeSampler:
        """A sampler over a :func:`~astrl.envs.build_conversation` result: its policies, scorers and
        settings, ``spec.batch_size`` trees of depth ``spec.turns`` a call, seeded by ``spec.seed``,
        openers from its stream (the spec's :func:`~astrl.envs.recipe.opener_stream` when it has none).
        Build it with ``env=False``: an env's opener loader draws a batch from the stream when made."""
        if conversation.env is not None:
            raise ValueError("build the conversation with env=False: its env has already drawn openers from its stream")
        spec = conversation.spec
        stream = conversation.stream if conversation.stream is not None else opener_stream(spec)
        return cls(
            conversation.tester,
            conversation.target,
            conversation.scorers,
            stream,
            num_trees=spec.batch_size,
            tree_width=tree_width,
            tree_depth=spec.turns,
            min_reward_gap=min_reward_gap,
            seed=spec.seed,
            **spec.env_options(),
        )

    # -- public API ------------------------------------------------------------------------------
    @property
    def nodes_per_call(self) -> int:
        """Tester turns generated by one :meth:`sample` call."""
        return sum(self.num_trees * self.tree_width**d for d in range(1, self.tree_depth + 1))

    def sample(self) -> TensorDict:
        """Grow ``num_trees`` trees and return their preference pairs, sibling groups and nodes.

        Returns a TensorDict with empty batch size holding:

        * ``pairs``: a 1-D lazily stacked TensorDict (one entry per kept sibling group) with the
          keys of :data:`PAIR_KEYS`: the tester's ``prompt_tokens`` (the ids it read, shared by the
          siblings), the generated ``chosen_tokens`` / ``rejected_tokens`` and their
          ``chosen_mask`` / ``rejected_mask`` (tokens up to and including the first EOS), the
          rewards, ``reward_gap``, the probe texts, ``depth`` (1-based), ``tree``, ``group`` and
          the node indices. When every group is skipped it is an empty TensorDict of shape ``(0,)``.
        * ``groups``: shape ``(G,)``: ``tree``, ``depth``, ``parent`` (node index of the state, -1
          for an opener), ``nodes`` and ``rewards`` (``(G, tree_width)``), ``best``, ``worst``,
          ``gap`` and ``kept``.
        * ``nodes``: shape ``(N,)``, lazily stacked: ``tree``, ``depth``, ``parent`` (-1 under an
          opener), ``group``, ``probe``, ``reply``, ``target_context``, ``reward``, ``scores`` (and ``reward_terms``
          with the ASTPrompter reward), ``prompt_tokens``, ``response_tokens``, ``response_mask``.
        * ``openers`` (one string per tree), ``num_pairs``, ``num_skipped``, ``num_groups``.
        """
        with self._rng(), torch.no_grad(), self._frozen():
            openers = self.prompt_stream.next_batch()
            states = self._roots(openers)
            levels = []
            for depth in range(1, self.tree_depth + 1):
                level, states = self._expand(states)
                level[DEPTH] = depth
                levels.append(level)
        self.calls += 1
        return self._collect(openers, levels)

    def state_dict(self) -> dict:
        """Position of the prompt stream, the call count (which seeds the next call) and the
        history of the novelty terms."""
        return {
            "prompt_stream": self.prompt_stream.state_dict(),
            "calls": self.calls,
            "seed": self.seed,
            "novelty": [t.state_dict() for t in novelty_transforms(self.transforms)],
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a state from :meth:`state_dict`: the next :meth:`sample` gives the same batch."""
        missing = {"prompt_stream", "calls", "seed"} - set(state)
        if missing:
            raise KeyError(f"TreeSampler state is missing {sorted(missing)}")
        self.prompt_stream.load_state_dict(state["prompt_stream"])
        self.calls, self.seed = int(state["calls"]), state["seed"]
        load_novelty_states(novelty_transforms(self.transforms), state.get("novelty", []))

    # -- tree growth -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _frozen(self) -> Iterator[None]:
        """Sample without dropout (tester and target in eval mode, restored afterwards)."""
        with _eval_mode(self.tester.model), _eval_mode(self.target.model):
            yield

    def _device(self) -> torch.device:
        return next(self.tester.model.parameters()).device

    @contextlib.contextmanager
    def _rng(self) -> Iterator[None]:
        if self.seed is None:
            yield
            return
        device = self._device()
        devices = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed((self.seed * 1_000_003 + self.calls) % 2**63)
            yield

    def _roots(self, openers: list[str]) -> list:
        """The tester's view of each opener (system prompt, window fitting), as the env's reset builds it."""
        base = self.env.base_env
        query = TensorDict({QUERY: openers}, batch_size=[len(openers)])
        reset = base._reset(query)
        reset = self.target_turn._reset(query, reset)
        return self._states(reset)

    def _states(self, td: TensorDictBase) -> list:
        if self.mode == "chat":
            return history_to_chats(td[HISTORY].prompt)
        return as_list(td[TEXT_PROMPT])

    def _tester_input(self, states: list) -> TensorDict:
        from torchrl.modules.llm.policies import ChatHistory, Text

        n = len(states)
        if self.mode == "chat":
            return TensorDict({HISTORY: ChatHistory(prompt=chats_to_history(states), batch_size=(n,))}, batch_size=(n,))
        return TensorDict({TEXT: Text(prompt=states, batch_size=(n,))}, batch_size=(n,))

    def _expand(self, states: list[Chat] | list[str]) -> tuple[dict, list]:
        """One level: ``tree_width`` probes from every state, the target's replies, the rewards."""
        children = [s for s in states for _ in range(self.tree_width)]
        out = self.tester(self._tester_input(children))
        nxt = self.env.base_env._step(out)  # the tester's view now ends with its probe
        for transform in self.transforms:  # target reply, scores, reward: the env's own step, level-wide
            nxt = transform._step(out, nxt)
        prompts = [t.reshape(-1).cpu() for t in as_rows(out.get(TOKENS_PROMPT, as_list=True))]
        responses = [t.reshape(-1).cpu() for t in as_rows(out.get(TOKENS_RESPONSE, as_list=True))]
        level = {
            PROMPT_TOKENS: prompts,
            RESPONSE_TOKENS: responses,
            RESPONSE_MASK: [response_mask(r, self.stop_token_ids) for r in responses],
            PROBE: as_list(nxt[PROBE]),
            REPLY: as_list(nxt[TARGET_RESPONSE]),
            TARGET_CONTEXT: as_list(nxt[TARGET_CONTEXT]),  # what the target read before the probe
            REWARD: nxt[REWARD].reshape(-1).float().cpu(),
            SCORES: nxt[SCORES].cpu(),
            REWARD_TERMS: nxt.get(REWARD_TERMS, None),
        }
        return level, self._states(nxt)

    # -- output ----------------------------------------------------------------------------------
    def _collect(self, openers: list[str], levels: list[dict]) -> TensorDict:
        width = self.tree_width
        node_tds, group_rows, pair_tds = [], [], []
        node_offset = group_offset = 0
        parent_offset = -1  # global index of the first node of the previous level (-1: openers)
        for level in levels:
            depth, n = level[DEPTH], len(level[PROBE])
            index = torch.arange(n)
            tree = index // width**depth
            parent = index // width + parent_offset if parent_offset >= 0 else torch.full((n,), -1)
            group = index // width + group_offset
            rewards = level[REWARD].reshape(-1, width)
            best, worst = rewards.argmax(1), rewards.argmin(1)
            gap = rewards.max(1).values - rewards.min(1).values
            kept = (gap > 0) & (gap >= self.min_reward_gap)
            first = torch.arange(0, n, width)
            group_rows.append(
                {
                    TREE: tree[first],
                    DEPTH: torch.full((n // width,), depth),
                    PARENT: parent[first],
                    "nodes": (node_offset + index).reshape(-1, width),
                    "rewards": rewards,
                    BEST: node_offset + first + best,
                    WORST: node_offset + first + worst,
                    "gap": gap,
                    "kept": kept,
                }
            )
            dense = TensorDict(
                {
                    TREE: tree,
                    DEPTH: torch.full((n,), depth),
                    PARENT: parent,
                    GROUP: group,
                    REWARD: level[REWARD],
                    SCORES: level[SCORES],
                },
                batch_size=[n],
            )
            if level[REWARD_TERMS] is not None:
                dense[REWARD_TERMS] = level[REWARD_TERMS].cpu()
            for i, node in enumerate(dense.unbind(0)):
                node[PROBE], node[REPLY] = level[PROBE][i], level[REPLY][i]
                for key in _NODE_ROWS:
                    if key in level:
                        node[key] = level[key][i]
                node_tds.append(node)
            for g in kept.nonzero().flatten().tolist():
                c, r = g * width + int(best[g]), g * width + int(worst[g])
                pair_tds.append(self._pair(level, c, r, depth, int(tree[c]), group_offset + g, node_offset))
            parent_offset = node_offset
            node_offset += n
            group_offset += n // width
        groups = TensorDict({k: torch.cat([row[k] for row in group_rows]) for k in group_rows[0]}, batch_size=[group_offset])
        num_pairs = len(pair_tds)
        pairs = lazy_stack(pair_tds) if pair_tds else TensorDict(batch_size=[0])
        return TensorDict(
            {
                PAIRS: pairs,
                GROUPS: groups,
                NODES: lazy_stack(node_tds),
                OPENERS: openers,
                NUM_PAIRS: torch.tensor(num_pairs),
                NUM_SKIPPED: torch.tensor(group_offset - num_pairs),
                NUM_GROUPS: torch.tensor(group_offset),
            },
            batch_size=[],
        )

    @staticmethod
    def _pair(level: dict, chosen: int, rejected: int, depth: int, tree: int, group: int, offset: int) -> TensorDict:
        rewards, probes = level[REWARD], level[PROBE]
        pair = TensorDict(
            {
                CHOSEN_REWARD: rewards[chosen],
                REJECTED_REWARD: rewards[rejected],
                REWARD_GAP: rewards[chosen] - rewards[rejected],
                CHOSEN_PROBE: probes[chosen],
                REJECTED_PROBE: probes[rejected],
                DEPTH: torch.tensor(depth),
                TREE: torch.tensor(tree),
                GROUP: torch.tensor(group),
                CHOSEN_NODE: torch.tensor(offset + chosen),
                REJECTED_NODE: torch.tensor(offset + rejected),
            },
            batch_size=[],
        )
        if PROMPT_TOKENS in level:  # the tester's exact ids (policies with tokens)
            responses, masks = level[RESPONSE_TOKENS], level[RESPONSE_MASK]
            pair[PROMPT_TOKENS] = level[PROMPT_TOKENS][chosen]
            pair[CHOSEN_TOKENS], pair[REJECTED_TOKENS] = responses[chosen], responses[rejected]
            pair[CHOSEN_MASK], pair[REJECTED_MASK] = masks[chosen], masks[rejected]
        if CONTEXT in level:  # the text state the probes followed (text-only policies, e.g. a System)
            pair[CONTEXT] = level[CONTEXT][chosen]
        return pair


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Sample without dropout; the module's previous mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def pair_batch(pairs: Sequence[TensorDictBase]) -> LazyStackedTensorDict:
    """Stack pairs from several :meth:`TreeSampler.sample` calls (or any pair TensorDicts) into one batch."""
    members = [p for td in pairs for p in (td.unbind(0) if td.batch_dims else [td])]
    if not members:
        raise ValueError("no preference pairs to stack")
    return lazy_stack(members)
