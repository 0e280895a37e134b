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


def env_microseconds(name: str) -> float | None:
    """$`name`, a number of microseconds from 0 to 1,000,000, in seconds; None when unset or blank.
    ConfigError naming the variable otherwise (the spin windows: here and server/awake.py)."""
    us = env_number(name, float, "microseconds")
    if us is None:
        return None
    if not 0 <= us <= 1_000_000:
        raise ConfigError(f"{name} must be between 0 and 1000000 microseconds, got {us!r}")
    return us * 1e-6


SPIN_ENV = "EMBERLINK_SPIN_US"
SPIN_S = 2e-3
"""How long a client that waits for its answer polls before it sleeps, where it may use SPIN_CPUS CPUs."""
SPIN_CPUS = 4


def spin_seconds(few_cpus: float, *, alone: bool = True) -> float:
    """How long a client's thread that waits for its answer over raw TCP polls without sleeping
    (transport/tcp.py's `read_direct`). $SPIN_ENV in microseconds (0: never); unset, SPIN_S where
    this process may run on SPIN_CPUS or more CPUs, as CUDA spins on a synchronize while it has the
    cores, else `few_cpus` (on two cores a spinning side takes the CPU its peer needs). `alone`
    false (a worker serves from this process too, as `emberlink.testing` runs one) gets `few_cpus`
    too: a thread that spins holding Python's GIL between polls keeps the worker's thread from
    running, up to the 5 ms switch interval.

    Measured on the H200 machine (16 CPUs; the small MLP's jitted step on a worker over tcp, one
    process, the variants' blocks interleaved, two runs, median µs a step): batches uploaded
    beforehand 717 / 682 with the client spinning 200 µs, 626 / 546 with it spinning 2 ms; a
    resident DataLoader 960 / 752 and 679 / 547. A step's answer comes in ~0.5 ms there: the client
    spun 200 µs, then slept, and paid an idle CPU's wake-up (with cold caches) every step."""
    seconds = env_microseconds(SPIN_ENV)
    if seconds is None:
        return SPIN_S if alone and len(os.sched_getaffinity(0)) >= SPIN_CPUS else few_cpus
    return seconds
