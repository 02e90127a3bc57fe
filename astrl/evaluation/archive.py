"""The attack archive, under its evaluation path: :mod:`astrl.archive` holds it (training uses it too)."""

from astrl.archive import (
    ARCHIVE_FILE,
    FIELDS,
    Attack,
    AttackArchive,
    conversation_turns,
    eval_turns,
    normalize_probe,
)

__all__ = [
    "ARCHIVE_FILE",
    "FIELDS",
    "Attack",
    "AttackArchive",
    "conversation_turns",
    "eval_turns",
    "normalize_probe",
]
