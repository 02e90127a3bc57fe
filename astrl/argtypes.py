"""Settings fields and their checks, for configs and the command line alike: a field declared with its
help and its range or choices (:func:`setting`), checked in a config (:func:`check_settings`) and as its
flag parses (:func:`add_setting_flags`, one flag per field), both through :func:`value_problem`; and
argument types that check their range as they parse, so that a number out of range ends the command
at once, before anything is imported or loaded."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def _number(kind: type, text: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None


def checked(kind: type, checks: dict, name: str | None = None) -> Callable[[str], Any]:
    """An argument type: a ``kind`` number (int or float) that passes ``checks`` (``at_least``, ``above``,
    ``at_most``, ``below``, ``choices``, as :func:`setting` declares them; a float must also be finite),
    refused with :func:`value_problem`'s message as it parses. ``name``: the type's name in messages."""

    def parse(text: str):
        value = _number(kind, text)
        problem = value_problem(value, checks, text)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = name or kind.__name__
    return parse


def at_least(low: int) -> Callable[[str], int]:
    """An integer ``>= low``."""
    return checked(int, {"at_least": low}, f"int >= {low}")


fraction = checked(float, {"above": 0, "at_most": 1}, "fraction")  # in (0, 1] (nucleus sampling's top-p)
threshold = checked(float, {"at_least": 0, "below": 1}, "threshold")  # in [0, 1) (a score above it is toxic)


def range_text(metadata: dict) -> str:
    """The range a field's ``metadata`` declares (:func:`setting`), as its messages and ``astrl train --keys``
    write it: ``in [0, 1)``, ``>= 1``, ``> 0``, ``<= 0``; ``""`` where it declares none."""
    low = f"[{metadata['at_least']}" if "at_least" in metadata else f"({metadata['above']}" if "above" in metadata else ""
    high = f"{metadata['at_most']}]" if "at_most" in metadata else f"{metadata['below']})" if "below" in metadata else ""
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {low[1:]}"
    if high:
        return f"{'<=' if high[-1] == ']' else '<'} {high[:-1]}"
    return ""


def value_problem(
    value: Any, metadata: dict, given: str | None = None, *, nullable: bool = False, null: str = " (or null)"
) -> str | None:
    """What is wrong with ``value`` under the checks in a field's ``metadata`` (:func:`setting`), as
    "must be ..., got ..." (``given``: the value as typed); ``None``: nothing; ``nullable`` names the other
    choice with ``null``. A float must be finite (nan and inf pass no range). The config checks, the
    command-line flags and the library's own argument checks (:func:`require`) share it."""
    null = null if nullable else ""
    if "choices" in metadata and value not in metadata["choices"]:
        return f"must be one of {metadata['choices']}{null}, got {value!r}"
    got = str(value) if given is None else given
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number{null}, got {got}"
    inside = (
        ("at_least" not in metadata or value >= metadata["at_least"])
        and ("above" not in metadata or value > metadata["above"])
        and ("at_most" not in metadata or value <= metadata["at_most"])
        and ("below" not in metadata or value < metadata["below"])
    )
    return None if inside else f"must be {range_text(metadata)}{null}, got {got}"


CHECKS = ("at_least", "above", "at_most", "below", "choices")  # the keywords of setting() and require()


def require(name: str, value: Any, *, nullable: bool = False, error: type[Exception] = ValueError, **checks: Any) -> None:
    """Raise ``error("NAME must be ..., got ...")`` (a ``ValueError`` unless given) unless ``value`` passes
    ``checks`` (the ``at_least``, ``above``, ``at_most``, ``below`` and ``choices`` of :func:`setting`; a
    float must be finite; ``nullable``: ``None`` passes): a setting's check, for the arguments of the
    library's classes and functions."""
    unknown = set(checks) - set(CHECKS)
    if unknown:
        raise TypeError(f"require() takes the checks {list(CHECKS)}, got {sorted(unknown)}")
    if value is None and nullable:
        return
    problem = value_problem(value, checks, nullable=nullable, null=" or None")
    if problem:
        raise error(f"{name} {problem}")


def setting(
    default: Any = None,
    help: str = "",
    *,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A dataclass field with its ``help`` and its check, read by :func:`check_settings` and the flags
    (:func:`add_setting_flags`): ``at_least`` (``value >= at_least``), ``above``
    (``value > above``), ``at_most`` (``<=``), ``below`` (``<``) and ``choices``; a float must also be finite."""
    checks = {"at_least": at_least, "above": above, "at_most": at_most, "below": below, "choices": choices}
    metadata = {"help": help, **{key: value for key, value in checks.items() if value is not None}}
    return dataclasses.field(default=default, metadata=metadata)


def check_settings(obj: Any, kind: type | None = None) -> None:
    """Check every field of the dataclass ``obj`` (``kind``: only those of that dataclass) against the checks
    declared with :func:`setting`; ``None`` passes where the field's type admits it (``int | None``: unset,
    filled in later, or off). Raises ``ValueError`` naming the field."""
    for spec in dataclasses.fields(kind or obj):
        value = getattr(obj, spec.name)
        nullable = "None" in str(spec.type)
        if value is None and (spec.default is None or nullable):
            continue
        problem = value_problem(value, spec.metadata, nullable=nullable)
        if problem:
            raise ValueError(f"{spec.name} {problem}")


FIELD_DEFAULT = object()  # add_setting_flags: a flag not given is its field's default


def _flag_type(spec: dataclasses.Field) -> Callable[[str], Any]:
    """The parser of a field's flag: its number type, with the field's checks (finite, and ``at_least``,
    ``above``, ``at_most``, ``below`` of :func:`setting`) applied as it parses
    (:func:`value_problem`)."""
    kind = {"float": float, "int": int}.get(spec.type.split(" ")[0], str)
    return kind if kind is str else checked(kind, spec.metadata)


def replaced_default(kind: type, name: str) -> Any:
    """The default that :func:`~astrl.envs.settings.with_defaults` replaced for the field ``name`` in
    whichever base of ``kind`` replaced it (a class made from several such bases, like a training
    config, holds one record per base); ``None`` where none did."""
    for klass in kind.__mro__:
        record = klass.__dict__.get("base_defaults", {})
        if name in record:
            return record[name]
    return None


def _default_text(kind: type, name: str, value: Any, unset: str | None) -> str:
    """A field's default as its flag's help gives it (``None`` as in a config, null); ``unset`` names where a
    ``None`` default is taken from ("the run's"), followed by the default that
    :func:`~astrl.envs.settings.with_defaults` replaced (the field's help says what its null means)."""
    if value is None and unset is not None:
        return f"{unset}, else {_default_text(kind, name, replaced_default(kind, name), None)}"
    return "null" if value is None else str(value)


def _fields(kind: type, names: Iterable[str] | None) -> list[dataclasses.Field]:
    """The fields of the dataclass ``kind``, in field order; ``names``: those only."""
    wanted = None if names is None else set(names)
    return [spec for spec in dataclasses.fields(kind) if wanted is None or spec.name in wanted]


def add_setting_flags(
    parser: argparse.ArgumentParser,
    kind: type,
    *,
    names: Iterable[str] | None = None,
    flags: Mapping[str, str] | None = None,
    default: Any = argparse.SUPPRESS,
    shown: str = "{}",
    unset: str | None = None,
) -> None:
    """One flag per field of the settings dataclass ``kind`` (``names``: those fields only, in field order):
    ``--probe-gate`` sets ``probe_gate`` (``flags`` renames some), a bool is a switch, with the field's help,
    choices and range checks. A flag not given is ``default``: by default absent from the parsed
    arguments, so the field keeps its own default (:func:`given_settings` reads them back);
    :data:`FIELD_DEFAULT`, the field's default. The help ends with ``(default: ...)``, the field's
    default written into ``shown`` (``"the config's, else {}"``), with ``unset`` for a ``None`` default
    (:func:`_default_text`)."""
    for spec in _fields(kind, names):
        value = _default_text(kind, spec.name, spec.default, unset)
        help_text = f"{spec.metadata['help']} (default: {shown.format(value)})".replace("%", "%%")
        options = {"dest": spec.name, "default": spec.default if default is FIELD_DEFAULT else default, "help": help_text}
        flag = (flags or {}).get(spec.name, "--" + spec.name.replace("_", "-"))
        if spec.type == "bool":
            options["action"] = "store_true"
        else:
            options["type"] = _flag_type(spec)
            options["choices"] = spec.metadata.get("choices")
            options["metavar"] = None if options["choices"] else flag[2:].replace("-", "_").upper()
        parser.add_argument(flag, **options)


def given_settings(args: argparse.Namespace, kind: type, *, names: Iterable[str] | None = None, unset=argparse.SUPPRESS) -> dict:
    """The flags of :func:`add_setting_flags` that were given (not ``unset``), as keywords of ``kind``
    (``names``: of those fields only)."""
    values = {spec.name: getattr(args, spec.name, unset) for spec in _fields(kind, names)}
    return {name: value for name, value in values.items() if value is not unset}
