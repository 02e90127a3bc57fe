"""Search-guided GRPO: each group gains a member whose first probe the lexicon search wrote.

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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from tensordict import TensorDictBase

from astrl._compat import as_list
from astrl.keys import NEXT, QUERY, REWARD, STEP_COUNT


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


class SearchGuide:
    """The guided members of each GRPO step (module docstring): ``rollout(data)`` searches a probe for
    every group opener of ``data`` and returns the flat rollout of one conversation per group whose first
    probe is the searched one, in group order, with its rewards from the run's own reward transforms.

    Args:
        config: the run's :class:`~astrl.training.config.TrainConfig` (``guide_search``, the search and
            conversation settings).
        models: the run's models; the tester (its adapters on) proposes the search's tokens and writes the
            guided conversations' later turns.
    """

    def __init__(self, config, models) -> None:
        from dataclasses import replace

        from torchrl.envs.llm.transforms import DataLoadingPrimer

        from astrl.envs.recipe import build_conversation
        from astrl.prompts import PromptStream
        from astrl.training.setup import conversation_spec

        self.config, self.models = config, models
        groups = config.batch_size // config.group_size
        # every draw of this stream is its whole prompt list, in order: rollout() sets the list
        self.stream = PromptStream(["-"] * groups, groups, shuffle=False)
        spec = replace(conversation_spec(config), batch_size=groups, group_size=1)
        conversation = build_conversation(spec, tester=models.tester, target=models.target, stream=self.stream)
        self.env, self.tester = conversation.env, conversation.tester
        self.primer = next(t for t in self.env.transform if isinstance(t, DataLoadingPrimer))
        self.lexicon = self.env.reply_lexicon  # the elicit reward's: the search aims at what the reward pays
        self.last: dict[str, float] = {}

    def rollout(self, data: TensorDictBase) -> TensorDictBase:
        from astrl.training.warm_start import search_probes

        openers = group_openers(data, self.config.group_size)
        if len(openers) != len(self.stream.prompts):
            raise ValueError(f"the step has {len(openers)} groups, the guide runs {len(self.stream.prompts)}")
        found = search_probes(self.config, self.models, openers, self.lexicon)
        self.stream.prompts[:] = openers
        self.primer.reset_dataloader()  # drop what it drew ahead: its next draw is the list just set
        with torch.no_grad(), forced_first_turn(self.models.tester.model, [f.tokens for f in found]):
            reset = self.env.reset()
            drawn = as_list(reset[QUERY])
            if drawn != openers:
                raise RuntimeError(f"the guide's env drew {drawn[:2]}..., not the step's openers {openers[:2]}...")
            guided = self.env.rollout(self.config.turns, self.tester, tensordict=reset, auto_reset=False).reshape(-1)
        rewards = guided[NEXT, REWARD].reshape(-1).float()
        self.last = {"guide_mass": sum(f.mass for f in found) / len(found), "guide_reward": float(rewards.mean())}
        return guided
