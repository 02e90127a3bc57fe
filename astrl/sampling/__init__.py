"""Samplers that turn tester-target exchanges into training data.

* :class:`TreeSampler`: trees of probes grown level by level, batched across nodes and trees;
  each sibling group's best and worst child form a preference pair for DPO / IPO.
* :class:`WeakSupervision`: with some probability per batch, known-harmful texts forced as the
  preferred probes of those pairs.
* :func:`lexicon_beam_search`: for each opener, the probe (a chain of the tester's likely tokens)
  after which the target's next token is most likely a lexicon word; the warm start's ``search``.
"""

from astrl.sampling.search import SearchedProbe, lexicon_beam_search
from astrl.sampling.tree import PAIR_KEYS, TreeSampler, pair_batch
from astrl.sampling.weak import WeakSupervision

__all__ = ["PAIR_KEYS", "SearchedProbe", "TreeSampler", "WeakSupervision", "lexicon_beam_search", "pair_batch"]
