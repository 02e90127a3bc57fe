"""How errors read: one line that names the offending value."""

from __future__ import annotations


def one_line(err: BaseException) -> str:
    """An exception's message on one line (its type name when it has no message)."""
    return " ".join(str(err).split()) or type(err).__name__


class ModelLoadError(RuntimeError):
    """A model identifier could not be resolved or loaded."""


class ScorerError(ValueError):
    """A scorer name or a scorer's output is invalid."""


class ConfigError(ValueError):
    """A configuration file or override is invalid."""


class FolderInUseError(OSError):
    """A run or eval folder is being written by another astrl job."""
