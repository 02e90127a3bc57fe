"""Evaluation of a tester against a target: metrics, judges, reports and comparisons.

* :mod:`astrl.evaluation.metrics`: pure metric functions (ASR, rates, self-BLEU, clustering, bootstrap);
* :mod:`astrl.evaluation.run`: the ``astrl eval`` job (:class:`EvalConfig`, :func:`run_eval`);
* :mod:`astrl.evaluation.report`: plots, ``report.md`` and ``report.html``;
* :mod:`astrl.evaluation.archive`: the attack archive (``attacks.jsonl``), re-exported from :mod:`astrl.archive`;
* :mod:`astrl.evaluation.compare`: the ``astrl compare`` table.
"""

from astrl.evaluation.records import EvaluationError

__all__ = ["EvaluationError"]
