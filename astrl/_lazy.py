"""Packages whose public names are imported on first use, so that importing a package (and the
command line's argument checks) does not pay for torch, tensordict and torchrl."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name in ``exports`` comes from the module it maps to.

    Assign them in the package's ``__init__``: ``__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)``.
    """

    def __getattr__(name: str) -> object:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
