"""Argument types of the command line that check their range as they parse, so that a number out of
range ends the command at once, before anything is imported or loaded; and the flags made from a
settings dataclass, one per field."""

from __future__ import annotations

import argparse
import dataclasses
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


def add_setting_flags(parser: argparse.ArgumentParser, kind: type, *, default=argparse.SUPPRESS) -> None:
    """One flag per field of the settings dataclass ``kind`` (``--probe-gate`` sets ``probe_gate``; a bool
    is a switch), with the field's help and choices. A flag not given is ``default`` (by default absent
    from the parsed arguments, so the field keeps its own default; :func:`given_settings` reads them back)."""
    for spec in dataclasses.fields(kind):
        help_text = f"{spec.metadata['help']} (default: {spec.default})".replace("%", "%%")
        options = {"dest": spec.name, "default": default, "help": help_text}
        if spec.type == "bool":
            options["action"] = "store_true"
        else:
            options["type"] = {"float": float, "int": int}.get(spec.type.split(" ")[0], str)
            options["choices"] = spec.metadata.get("choices")
        parser.add_argument("--" + spec.name.replace("_", "-"), **options)


def given_settings(args: argparse.Namespace, kind: type, *, unset=argparse.SUPPRESS) -> dict:
    """The flags of :func:`add_setting_flags` that were given (not ``unset``), as keywords of ``kind``."""
    values = {spec.name: getattr(args, spec.name, unset) for spec in dataclasses.fields(kind)}
    return {name: value for name, value in values.items() if value is not unset}
