"""Which way to reach a worker: its direct addresses first, its relay when direct fails or stalls; picks
a Link and nothing else (the handshake and the session are client/remote.py's).

Every choice is one staggered race (happy eyeballs, RFC 8305): the attempts are ordered, the first
starts at once, and each next one starts as soon as an attempt fails, or after a head start if none
has connected by then; the first Link up wins, the attempts still running are
cancelled, and one that came up too is closed. Direct addresses race that way among themselves:
the ticket's raw TCP ones first (transport/tcp.py: a fraction of gRPC's round trip, same sealed
frames), then its gRPC ones, each kind in order, `ATTEMPT_DELAY_S` apart, so a tcp port that a
firewall drops costs a session that much, not a connect timeout. The direct path as a whole then
races the relay, if the ticket names one, with a head start of `DIRECT_HEAD_START_S`. A relay-only
ticket goes straight to the relay. An error names every attempt that failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from emberlink.errors import TransportError
from emberlink.protocol.ticket import Ticket
from emberlink.transport import grpc, tcp
from emberlink.transport.base import Link

log = logging.getLogger("emberlink.client")

DIRECT_HEAD_START_S = 1.0
"""How long the direct path has to itself before the relay is tried alongside it."""
ATTEMPT_DELAY_S = 0.25
"""How long one direct address has to itself before the next is tried alongside it (RFC 8305's
"Connection Attempt Delay", whose recommended value this is): on loopback or a LAN a tcp connect
answers in well under a millisecond, so the fast path is never raced by a live worker's gRPC."""

GRPC = "grpc"
TCP = "tcp"
RELAY = "relay"
DIRECT = "direct"
"""The race's name for the direct path, before it knows whether tcp or grpc answered."""

Attempt = tuple[str, Callable[[], Coroutine[Any, Any, tuple[str, Link]]]]
"""What an attempt is called in errors, and the coroutine that makes it: (path, Link)."""


def _direct_attempt(
    path: str, connect: Callable[..., Coroutine[Any, Any, Link]], host: str, port: int, timeout: float
) -> Attempt:
    async def attempt() -> tuple[str, Link]:
        return path, await connect(host, port, timeout=timeout)

    return path, attempt


async def connect_direct(
    ticket: Ticket, timeout: float, *, attempt_delay: float = ATTEMPT_DELAY_S
) -> tuple[str, Link]:
    """("tcp" or "grpc", a Link) to the first of the ticket's addresses that connects, tcp ones tried
    first and each next one `attempt_delay` later (or at once when an attempt fails)."""
    attempts = [_direct_attempt(TCP, tcp.connect, host, port, timeout) for host, port in ticket.tcp]
    attempts += [_direct_attempt(GRPC, grpc.connect, host, port, timeout) for host, port in ticket.addrs]
    if not attempts:
        raise TransportError("the ticket has no direct address")
    path, link = await first_up(attempts, attempt_delay)
    if path != attempts[0][0]:
        log.info(
            "worker %s: its %s address did not connect first; using %s", ticket.node_id, attempts[0][0], path
        )
    return path, link


async def connect_relay(ticket: Ticket, timeout: float) -> Link:
    """A Link through the ticket's NATS relay."""
    if ticket.relay is None:
        raise TransportError(f"the ticket of worker {ticket.node_id} names no relay")
    try:
        from emberlink.transport import nats
    except ImportError as e:
        raise TransportError(f"relay {ticket.relay}: {e}") from e
    return await nats.connect(ticket.relay, ticket.node_id, timeout=timeout)


async def _relay(ticket: Ticket, timeout: float) -> tuple[str, Link]:
    return RELAY, await connect_relay(ticket, timeout)


async def open_link(
    ticket: Ticket, *, timeout: float, head_start: float = DIRECT_HEAD_START_S
) -> tuple[str, Link]:
    """(path, Link) to the worker `ticket` names: "tcp", "grpc" or "relay"; TransportError naming every failure."""
    attempts: list[Attempt] = []
    if ticket.addrs or ticket.tcp:
        attempts.append((DIRECT, lambda: connect_direct(ticket, timeout)))
    if ticket.relay is not None:
        attempts.append((RELAY, lambda: _relay(ticket, timeout)))
    try:
        path, link = await first_up(attempts, head_start)
    except TransportError as e:
        raise TransportError(f"cannot reach worker {ticket.node_id}: {e}") from e
    if path == RELAY and len(attempts) > 1:
        log.info("worker %s: direct path failed or stalled, using the relay", ticket.node_id)
    return path, link


async def first_up(attempts: Sequence[Attempt], delay: float) -> tuple[str, Link]:
    """The first of `attempts` to come up. Each starts `delay` after the one before it, or at once when
    an attempt fails; the others are cancelled, and closed if they came up as well. TransportError
    naming every attempt, with its error, if none comes up."""
    loop = asyncio.get_running_loop()
    running: dict[asyncio.Task[tuple[str, Link]], int] = {}
    errors: dict[int, str] = {}
    started = 0

    def start_next() -> None:
        nonlocal started
        name, make = attempts[started]
        running[loop.create_task(make(), name=f"connect {name}")] = started
        started += 1

    try:
        while started < len(attempts) or running:
            if not running:
                start_next()
            waiting = started < len(attempts)
            done, _ = await asyncio.wait(
                running, timeout=delay if waiting else None, return_when=asyncio.FIRST_COMPLETED
            )
            failed = False
            for task in done:
                index = running.pop(task)
                error = task.exception()
                if error is None:
                    return task.result()
                if not isinstance(error, TransportError):
                    raise error
                errors[index], failed = str(error), True
            if waiting and (failed or not done) and running:  # a failure, or the head start ran out
                start_next()
    finally:
        await _abandon(running)
    raise TransportError(
        "; ".join(f"{attempts[i][0]}: {errors[i]}" for i in sorted(errors)) or "nothing to try"
    )


async def _abandon(running: dict[asyncio.Task[tuple[str, Link]], int]) -> None:
    """Cancel the attempts still running; close the Link of any that came up before it heard."""
    for task in running:
        task.cancel()
    if not running:
        return
    await asyncio.wait(running)
    for task in running:
        if not task.cancelled() and task.exception() is None:
            await task.result()[1].close()


__all__ = [
    "ATTEMPT_DELAY_S",
    "DIRECT_HEAD_START_S",
    "GRPC",
    "RELAY",
    "TCP",
    "Attempt",
    "connect_direct",
    "connect_relay",
    "first_up",
    "open_link",
]
