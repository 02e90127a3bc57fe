"""The results store: runs, turns, scores, attacks and replays of many runs in one SQLite file.

Each command still writes its own files (``metrics.json``, ``attacks.jsonl``, ...); the store
holds them too, so that attacks can be queried across runs (``astrl attacks``, ``astrl runs``, or
SQL: ``docs/store.md``). Pure standard library (``sqlite3``), no torch.

* :mod:`astrl.store.database`: where the file lives (:func:`store_path`), its schema, opening it safely;
* :mod:`astrl.store.records`: the turn and replay records the writer accepts;
* :mod:`astrl.store.writes`: what one write transaction does (attacks kept exact across replaced turns);
* :mod:`astrl.store.queries`: attacks under filters, runs with their headline numbers;
* :mod:`astrl.store.novelty`: dropping near-duplicate probes from an attack list;
* :mod:`astrl.store.export`: JSONL, CSV, replay archive and ``datasets`` exports;
* :mod:`astrl.store.store`: :class:`Store`, the object that ties them together.
"""

from astrl.store.database import SCHEMA_VERSION, STORE_ENV, StoreError, store_path
from astrl.store.export import FORMATS, export_attacks
from astrl.store.queries import FoundAttack, RunSummary
from astrl.store.records import TurnRow, replay_rows, turn_rows
from astrl.store.store import Store
from astrl.store.writes import Written

__all__ = [
    "FORMATS",
    "SCHEMA_VERSION",
    "STORE_ENV",
    "FoundAttack",
    "RunSummary",
    "Store",
    "StoreError",
    "TurnRow",
    "Written",
    "export_attacks",
    "replay_rows",
    "store_path",
    "turn_rows",
]
