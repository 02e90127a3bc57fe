"""Samplers that turn tester-target exchanges into training data.

* :class:`TreeSampler`: trees of probes grown level by level, batched across nodes and trees;
  each sibling group's best and worst child form a preference pair for DPO / IPO.
"""

from astrl.sampling.tree import PAIR_KEYS, TreeSampler, pair_batch

__all__ = ["PAIR_KEYS", "TreeSampler", "pair_batch"]
