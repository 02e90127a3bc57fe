"""Argument types of the command line that check their range as they parse, so that a number out of
range ends the command at once, before anything is imported or loaded."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _number(kind: type, text: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None


def at_least(low: int) -> Callable[[str], int]:
    """An integer ``>= low``."""

    def parse(text: str) -> int:
        value = _number(int, text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def positive(text: str) -> float:
    """A float ``> 0``."""
    value = _number(float, text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A float in ``(0, 1]`` (nucleus sampling's top-p)."""
    value = _number(float, text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def threshold(text: str) -> float:
    """A float in ``[0, 1)`` (a score above it is toxic)."""
    value = _number(float, text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value
