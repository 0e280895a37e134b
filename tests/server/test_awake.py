"""The worker's loop kept polling after a reply: for how long, and when it is not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import pytest

from emberlink.errors import ConfigError
from emberlink.server import awake
from emberlink.server.awake import SPIN_BACKOFF, SPIN_ENV, SPIN_LATE, SPIN_S, Awake, spin_setting
from emberlink.testing import InProcessWorker


async def turns_after_reply(spin: Awake, yields: list[float]) -> int:
    """How many turns the loop took after one reply, waiting until the spin is over."""
    before = len(yields)
    spin.replied()
    while spin.spinning:
        await asyncio.sleep(0)
    return len(yields) - before


async def _test_a_blob_that_arrives_ends_the_spin_at_the_next_turn() -> None:
    yields: list[float] = []
    spin = Awake(asyncio.get_running_loop(), 10.0, lambda: yields.append(0.0))
    spin.replied()
    await asyncio.sleep(0)  # a turn or so: still spinning (the window is 10 s)
    assert spin.spinning
    spin.arrived()  # the next batch: it may go to the device thread, which must have the GIL
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not spin.spinning


def test_a_blob_that_arrives_ends_the_spin_at_the_next_turn() -> None:
    asyncio.run(_test_a_blob_that_arrives_ends_the_spin_at_the_next_turn())


def test_the_window_is_read_from_the_environment_in_microseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SPIN_ENV, raising=False)
    assert spin_setting() == SPIN_S
    monkeypatch.setenv(SPIN_ENV, "250")
    assert spin_setting() == pytest.approx(250e-6)
    monkeypatch.setenv(SPIN_ENV, "0")
    assert spin_setting() == 0
    for bad in ("-1", "2000000", "soon"):
        monkeypatch.setenv(SPIN_ENV, bad)
        with pytest.raises(ConfigError, match=SPIN_ENV):
            spin_setting()


async def _test_after_a_reply_the_loop_turns_until_the_window_closes_and_never_with_no_window() -> None:
    yields: list[float] = []
    loop = asyncio.get_running_loop()
    spin = Awake(loop, 0.005, lambda: yields.append(0.0))
    assert await turns_after_reply(spin, yields) > 0  # (and then stopped by itself)
    assert await turns_after_reply(Awake(loop, 0.0, lambda: yields.append(0.0)), yields) == 0


async def _test_a_client_slower_than_the_window_is_not_waited_for_until_one_answers_within_it() -> None:
    yields: list[float] = []
    spin = Awake(asyncio.get_running_loop(), 0.001, lambda: yields.append(0.0))
    assert await turns_after_reply(spin, yields) > 0
    await asyncio.sleep(0.005)  # the client's next blob comes after the window
    spin.arrived()
    assert await turns_after_reply(spin, yields) == 0
    spin.arrived()  # this one within the window (right after the reply)
    assert await turns_after_reply(spin, yields) > 0


async def _test_a_loop_whose_yields_keep_giving_the_cpu_away_stops_spinning_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each yield takes long: another thread (a client on the same core) wanted the CPU.
    monkeypatch.setattr(awake, "SPIN_GAP_S", 0.0)
    yields: list[float] = []
    spin = Awake(asyncio.get_running_loop(), 10.0, lambda: yields.append(0.0))
    for _ in range(SPIN_LATE):
        assert await turns_after_reply(spin, yields) == 1  # one yield, found late: the spin ends
    for _ in range(SPIN_BACKOFF):
        assert await turns_after_reply(spin, yields) == 0
    assert await turns_after_reply(spin, yields) == 1  # tried again after the back-off


def test_after_a_reply_the_loop_turns_until_the_window_closes_and_never_with_no_window() -> None:
    asyncio.run(_test_after_a_reply_the_loop_turns_until_the_window_closes_and_never_with_no_window())


def test_a_client_slower_than_the_window_is_not_waited_for_until_one_answers_within_it() -> None:
    asyncio.run(_test_a_client_slower_than_the_window_is_not_waited_for_until_one_answers_within_it())


def test_a_loop_whose_yields_keep_giving_the_cpu_away_stops_spinning_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asyncio.run(_test_a_loop_whose_yields_keep_giving_the_cpu_away_stops_spinning_for_a_while(monkeypatch))


def eventually(holds: Callable[[], object]) -> bool:
    """Whether `holds()` comes true within 10 s (the worker's loop notes a reply just after it
    writes it, so a client can read the reply first)."""
    end = time.monotonic() + 10
    while not holds():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def test_a_worker_that_serves_one_session_starts_a_window_at_each_reply_and_ends_it_at_the_next_blob(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with InProcessWorker(tcp=True) as worker, worker.device(transport="tcp") as dev:
        x = dev.tensor(np.arange(6, dtype=np.float32))
        assert float((x * 2).sum()) == 30.0
        (session,) = worker.worker.sessions
        spin = session._awake  # the loop's, made by an earlier session perhaps: its window set here
        monkeypatch.setattr(spin, "window", 0.3)
        assert eventually(lambda: spin._replied_at), "the reply opened no window"
        assert float((x * 3).sum()) == 45.0  # the next blob ended it, and its reply opened another
        assert eventually(lambda: spin._replied_at) and spin._next


def test_every_session_of_a_worker_shares_one_window_so_a_second_open_session_does_not_stop_it() -> None:
    with InProcessWorker(tcp=True) as worker, worker.device(transport="tcp") as idle:
        float(idle.tensor(np.ones(2, np.float32)).sum())
        with worker.device(transport="tcp") as dev:
            x = dev.tensor(np.arange(6, dtype=np.float32))
            first, second = worker.worker.sessions
            assert first._awake is second._awake is awake.shared(first._loop)
            spin = first._awake
            assert eventually(lambda: spin._replied_at)  # the idle session's reply
            spin.arrived()  # (as the next blob would: no reply since)
            assert not spin._replied_at
            assert float((x * 2).sum()) == 30.0  # a step of one session while another is open
            assert eventually(lambda: spin._replied_at), "a reply with two sessions open opened no window"
