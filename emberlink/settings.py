"""Numbers set by EMBERLINK_* environment variables: one reader, which checks that the text is a
number; each caller keeps its own default and bounds. Reads the environment only when called."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from emberlink.errors import ConfigError

N = TypeVar("N", int, float)


def env_number(name: str, parse: Callable[[str], N], unit: str) -> N | None:
    """$`name` read with `parse` (int or float), a number of `unit`; None when unset or blank.
    ConfigError naming the variable when it is no number."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return None
    try:
        return parse(text)
    except ValueError:
        raise ConfigError(f"{name} must be a number of {unit}, got {text!r}") from None
