"""YAML files as plain data: configs and run files are read with ``safe_load``, never as code."""

from __future__ import annotations

from pathlib import Path

import yaml

from astrl.errors import ConfigError


def yaml_problem(err: Exception) -> str:
    """A YAML error in one line; tags such as ``!!python/object`` are refused (configs are data, never code)."""
    text = " ".join(str(err).split())
    if "python/" in text:
        return f"python object tags are not allowed in astrl configs ({text})"
    return text


def read_yaml_mapping(path: str | Path) -> dict:
    """A YAML file holding a mapping (``{}`` when empty); any problem is a one-line :class:`ConfigError` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not plain YAML data: {yaml_problem(err)}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {' '.join(str(err).split())}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys to values")
    return loaded
