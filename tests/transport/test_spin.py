"""How long a client's thread polls for its answer over raw TCP before it sleeps
(settings.spin_seconds): long where the machine has the cores and the process is the client's
alone, short on two cores or beside an in-process worker, as set where $EMBERLINK_SPIN_US says."""

from __future__ import annotations

import os

import pytest

from emberlink.errors import ConfigError
from emberlink.settings import SPIN_CPUS, SPIN_ENV, SPIN_S, spin_seconds
from emberlink.testing import InProcessWorker
from emberlink.transport import loop, tcp


@pytest.mark.parametrize(
    ("cpus", "alone", "want"),
    [(SPIN_CPUS, True, SPIN_S), (SPIN_CPUS - 2, True, 0.5e-3), (64, False, 0.5e-3)],
    ids=["the-cores-for-it", "fewer-cores", "sharing-its-process"],
)
def test_the_spin_is_spin_s_with_the_cores_and_a_process_to_itself_else_the_callers_own(
    monkeypatch: pytest.MonkeyPatch, cpus: int, alone: bool, want: float
) -> None:
    monkeypatch.delenv(SPIN_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert spin_seconds(0.5e-3, alone=alone) == want


def test_a_spin_set_in_microseconds_is_used_on_any_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv(SPIN_ENV, "0")
    assert spin_seconds(1e-3) == 0.0
    monkeypatch.setenv(SPIN_ENV, "1500")
    assert spin_seconds(0.0, alone=False) == pytest.approx(1.5e-3)
    monkeypatch.setenv(SPIN_ENV, "-5")
    with pytest.raises(ConfigError, match=SPIN_ENV):
        spin_seconds(0.0)


def test_a_client_does_not_spin_long_in_a_process_a_worker_serves_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SPIN_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(loop, "_worker_here", False)
    assert tcp.spin_setting() == SPIN_S
    with InProcessWorker():
        assert tcp.spin_setting() == tcp.SPIN_FEW_CPUS_S
