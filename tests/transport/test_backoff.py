"""The one back-off the NATS listener, the presence beacon and the worker's relay start share."""

from __future__ import annotations

import asyncio

import pytest

from emberlink.transport.backoff import Backoff


def test_backoff_doubles_each_delay_up_to_its_cap_and_starts_over_after_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)

    monkeypatch.setattr(asyncio, "sleep", sleep)  # what Backoff.sleep awaits

    async def failures(backoff: Backoff, n: int) -> None:
        for _ in range(n):
            await backoff.sleep()

    backoff = Backoff()
    asyncio.run(failures(backoff, 7))
    assert slept == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    backoff.reset()
    asyncio.run(failures(backoff, 2))
    assert slept[7:] == [0.1, 0.2]
