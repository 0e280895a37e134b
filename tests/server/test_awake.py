"""A worker's event loop polls, not sleeps, for a while after each reply (server/awake.py), where the
machine has the cores for it, and sleeps again once that window passes without a reply."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from emberlink.errors import ConfigError
from emberlink.server.awake import Awake, keeper
from emberlink.settings import SPIN_CPUS, SPIN_ENV, SPIN_S, spin_seconds
from emberlink.testing import InProcessWorker
from emberlink.transport import loop, tcp
from emberlink.transport.loop import LoopThread


class Counted(Awake):
    """An Awake that counts the loop's turns it kept ready."""

    __slots__ = ("ticks",)

    def __init__(self, loop: asyncio.AbstractEventLoop, window: float) -> None:
        super().__init__(loop, window)
        self.ticks = 0

    def _tick(self) -> None:
        self.ticks += 1
        super()._tick()


@pytest.mark.parametrize(
    ("cpus", "alone", "want"),
    [(SPIN_CPUS, True, SPIN_S), (SPIN_CPUS - 2, True, 0.5e-3), (64, False, 0.5e-3)],
    ids=["the-cores-for-it", "fewer-cores", "sharing-its-process"],
)
def test_the_spin_window_is_spin_s_with_the_cores_and_a_process_to_itself_else_the_callers_own(
    monkeypatch: pytest.MonkeyPatch, cpus: int, alone: bool, want: float
) -> None:
    monkeypatch.delenv(SPIN_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert spin_seconds(0.5e-3, alone=alone) == want


def test_a_worker_loop_on_its_main_thread_polls_by_default_and_one_on_a_loop_thread_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SPIN_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))

    async def window() -> float:
        return keeper(asyncio.get_running_loop()).window

    assert asyncio.run(window()) == SPIN_S  # `emberlink worker`: the loop is the main thread's
    on_thread = LoopThread("test-awake")
    try:
        assert on_thread.call(window(), 10) == 0.0  # beside clients in one process
    finally:
        on_thread.stop()


def test_a_client_does_not_spin_long_in_a_process_a_worker_serves_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SPIN_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(loop, "_worker_here", False)
    assert tcp.spin_setting() == SPIN_S
    with InProcessWorker():
        assert tcp.spin_setting() == tcp.SPIN_FEW_CPUS_S


def test_a_spin_window_set_in_microseconds_is_used_on_any_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPIN_ENV, "0")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert spin_seconds(1e-3) == 0.0
    monkeypatch.setenv(SPIN_ENV, "1500")
    assert spin_seconds(0.0) == pytest.approx(1.5e-3)
    monkeypatch.setenv(SPIN_ENV, "-5")
    with pytest.raises(ConfigError, match=SPIN_ENV):
        spin_seconds(0.0)


def test_a_poked_loop_keeps_polling_through_the_window_then_sleeps() -> None:
    asyncio.run(poked_then_quiet())


async def poked_then_quiet() -> None:
    awake = Counted(asyncio.get_running_loop(), 0.02)
    awake.poke()
    assert awake.polling
    await asyncio.sleep(0.1)  # five windows: the loop ran our callback turn after turn, then stopped
    ticks = awake.ticks
    assert ticks > 10 and not awake.polling
    await asyncio.sleep(0.05)
    assert awake.ticks == ticks, "an idle loop kept polling after its window"
    awake.poke()  # a new reply opens a new window
    assert awake.polling
    await asyncio.sleep(0.1)
    assert awake.ticks > ticks + 10 and not awake.polling


def test_a_window_of_zero_never_keeps_the_loop_polling() -> None:
    async def main() -> Counted:
        awake = Counted(asyncio.get_running_loop(), 0.0)
        awake.poke()
        await asyncio.sleep(0.01)
        return awake

    awake = asyncio.run(main())
    assert not awake.polling and awake.ticks == 0


def test_one_keeper_serves_every_session_of_a_loop_its_window_read_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SPIN_ENV, "300")
    loop = asyncio.new_event_loop()
    try:
        first = keeper(loop)
        monkeypatch.setenv(SPIN_ENV, "900")
        assert keeper(loop) is first and first.window == pytest.approx(300e-6)
        other = asyncio.new_event_loop()
        assert keeper(other).window == pytest.approx(900e-6)
        other.close()
    finally:
        loop.close()


def test_a_worker_keeps_polling_after_it_answers_a_step_and_sleeps_once_its_client_is_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SPIN_ENV, "300000")  # 0.3 s: long enough to see from this thread
    with InProcessWorker(grpc=True) as worker, worker.device(transport="grpc") as dev:
        x = dev.tensor(np.arange(6, dtype=np.float32))
        assert float((x * 2).sum()) == 30.0
        (session,) = worker.worker.sessions
        assert session._awake.polling, "no polling window after the reply"
        end = time.monotonic() + 10
        while session._awake.polling and time.monotonic() < end:
            time.sleep(0.05)
        assert not session._awake.polling, "the worker's loop kept polling with its client quiet"
