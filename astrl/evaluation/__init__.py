"""Evaluation of a tester against a target: metrics, judges, reports and comparisons.

* :mod:`astrl.evaluation.metrics`: pure metric functions (ASR, rates, self-BLEU, clustering, bootstrap);
* :mod:`astrl.evaluation.run`: the ``astrl eval`` job (:class:`EvalConfig`, :func:`run_eval`);
* :mod:`astrl.evaluation.report`: plots, ``report.md`` and ``report.html``;
* :mod:`astrl.evaluation.archive`: the attack archive (``attacks.jsonl``), re-exported from :mod:`astrl.archive`;
* :mod:`astrl.evaluation.compare`: the ``astrl compare`` table;
* :mod:`astrl.evaluation.settings`: the report settings eval and replay share (:class:`ReportSettings`).
"""

from astrl._lazy import lazy_exports

_EXPORTS = {"EvaluationError": "astrl.evaluation.records"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
