"""The staggered race that picks a link (client/paths.py `first_up`), with attempts of our own: no
network here (tests/e2e/test_tcp_path.py races real sockets)."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from emberlink.client.paths import Attempt, first_up
from emberlink.errors import TransportError
from emberlink.transport.base import Link


class FakeLink:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def test_the_first_link_up_wins_and_a_loser_that_came_up_too_is_closed() -> None:
    links = {"a": FakeLink("a"), "b": FakeLink("b")}
    b_started = asyncio.Event()
    hung_cancelled = False

    async def a() -> tuple[str, Link]:
        await b_started.wait()
        return "a", cast(Link, links["a"])

    async def b() -> tuple[str, Link]:
        b_started.set()  # a comes up in the same turn of the loop: both are up when the race looks
        return "b", cast(Link, links["b"])

    async def hung() -> tuple[str, Link]:
        nonlocal hung_cancelled
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            hung_cancelled = True
            raise
        raise AssertionError("unreachable")

    async def race() -> tuple[str, Link]:
        return await first_up([("hung", hung), ("a", a), ("b", b)], 0)

    path, link = asyncio.run(race())
    assert cast(FakeLink, link) is links[path]
    loser = links["b" if path == "a" else "a"]
    assert loser.closed and not links[path].closed
    assert hung_cancelled


def test_a_failed_attempt_starts_the_next_at_once_and_every_failure_is_named() -> None:
    started: list[str] = []

    def failing(name: str) -> Attempt:
        async def attempt() -> tuple[str, Link]:
            started.append(name)
            raise TransportError(f"{name} refused")

        return name, attempt

    async def race() -> tuple[str, Link]:
        # a head start of a day: only failures can start the next attempts
        return await first_up([failing("tcp"), failing("grpc"), failing("relay")], 86400)

    with pytest.raises(TransportError) as raised:
        asyncio.run(race())
    assert started == ["tcp", "grpc", "relay"]
    assert str(raised.value) == "tcp: tcp refused; grpc: grpc refused; relay: relay refused"


def test_an_attempt_that_stalls_past_the_head_start_is_raced_by_the_next() -> None:
    stalled_cancelled = asyncio.Event()

    async def stalled() -> tuple[str, Link]:
        try:
            await asyncio.Event().wait()
        finally:
            stalled_cancelled.set()
        raise AssertionError("unreachable")

    async def quick() -> tuple[str, Link]:
        return "grpc", cast(Link, FakeLink("grpc"))

    async def race() -> tuple[str, bool]:
        path, _ = await first_up([("tcp", stalled), ("grpc", quick)], 0.01)
        return path, stalled_cancelled.is_set()

    assert asyncio.run(race()) == ("grpc", True)
