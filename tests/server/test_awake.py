"""The worker's loop kept polling after a reply: for how long, and when it is not."""

from __future__ import annotations

import asyncio

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
    spin.close()
    assert await turns_after_reply(spin, yields) == 0  # a closed session's loop is left to sleep


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


def test_a_worker_that_serves_one_session_starts_a_window_at_each_reply_and_ends_it_at_the_next_blob(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SPIN_ENV, "300000")  # 0.3 s
    with InProcessWorker(tcp=True) as worker, worker.device(transport="tcp") as dev:
        x = dev.tensor(np.arange(6, dtype=np.float32))
        assert float((x * 2).sum()) == 30.0
        (session,) = worker.worker.sessions
        spin = session._awake
        assert spin._replied_at and spin.window == pytest.approx(0.3), "the reply opened no window"
        assert float((x * 3).sum()) == 45.0  # the next blob ended it, and its reply opened another
        assert spin._replied_at and spin._next
