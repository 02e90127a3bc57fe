"""Samplers that turn tester-target exchanges into training data.

* :class:`TreeSampler`: trees of probes grown level by level, batched across nodes and trees;
  each sibling group's best and worst child form a preference pair for DPO / IPO.
* :class:`WeakSupervision`: with some probability per batch, known-harmful texts forced as the
  preferred probes of those pairs.
"""

from astrl.sampling.tree import PAIR_KEYS, TreeSampler, pair_batch
from astrl.sampling.weak import WeakSupervision

__all__ = ["PAIR_KEYS", "TreeSampler", "WeakSupervision", "pair_batch"]
