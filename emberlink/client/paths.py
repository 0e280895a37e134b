"""Which way to reach a worker: its direct addresses first, its relay when direct fails or stalls; picks
a Link and nothing else (the handshake and the session are client/remote.py's).

The direct path tries the ticket's raw TCP addresses first (transport/tcp.py: a fraction of
gRPC's round trip, same sealed frames), then its gRPC addresses, each kind in order; the first that
connects wins. A ticket with direct addresses and a relay gets a head start for the direct path: the relay is tried as soon as every direct address failed, or after
`DIRECT_HEAD_START_S` if direct has not connected by then, whichever is first; the first Link up
wins and the other attempt is abandoned. A relay-only ticket goes straight to the relay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from emberlink.errors import TransportError
from emberlink.protocol.ticket import Ticket
from emberlink.transport import grpc, tcp
from emberlink.transport.base import Link

log = logging.getLogger("emberlink.client")

DIRECT_HEAD_START_S = 1.0
"""How long the direct path has to itself before the relay is tried alongside it."""

GRPC = "grpc"
TCP = "tcp"
RELAY = "relay"
DIRECT = "direct"
"""The race's name for the direct path, before it knows whether tcp or grpc answered."""


async def connect_direct(ticket: Ticket, timeout: float) -> tuple[str, Link]:
    """("tcp" or "grpc", a Link) to the first of the ticket's addresses that answers: tcp ones first."""
    errors: list[str] = []
    for path, connect, addrs in ((TCP, tcp.connect, ticket.tcp), (GRPC, grpc.connect, ticket.addrs)):
        for host, port in addrs:
            try:
                return path, await connect(host, port, timeout=timeout)
            except TransportError as e:
                errors.append(str(e))
    raise TransportError("; ".join(errors) or "the ticket has no direct address")


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
    attempts: list[tuple[str, Callable[[], Coroutine[Any, Any, tuple[str, Link]]]]] = []
    if ticket.addrs or ticket.tcp:
        attempts.append((DIRECT, lambda: connect_direct(ticket, timeout)))
    if ticket.relay is not None:
        attempts.append((RELAY, lambda: _relay(ticket, timeout)))
    if len(attempts) == 1:
        which, attempt = attempts[0]
        try:
            return await attempt()
        except TransportError as e:
            raise TransportError(f"cannot reach worker {ticket.node_id} ({which}): {e}") from e
    return await _race(ticket, attempts, head_start)


async def _race(
    ticket: Ticket,
    attempts: list[tuple[str, Callable[[], Coroutine[Any, Any, tuple[str, Link]]]]],
    head_start: float,
) -> tuple[str, Link]:
    loop = asyncio.get_running_loop()
    tasks: dict[asyncio.Task[tuple[str, Link]], str] = {}
    errors: list[str] = []
    (first_path, first), (second_path, second) = attempts
    tasks[loop.create_task(first(), name=f"connect {first_path}")] = first_path
    try:
        done, _ = await asyncio.wait(tasks, timeout=head_start)
        if not done or _failed(done):
            tasks[loop.create_task(second(), name=f"connect {second_path}")] = second_path
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                path = tasks.pop(task)
                error = task.exception()
                if error is None:
                    if path != first_path:
                        log.info("worker %s: direct path failed or stalled, using the relay", ticket.node_id)
                    return task.result()
                if not isinstance(error, TransportError):
                    raise error
                errors.append(f"{path}: {error}")
    finally:
        if tasks:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled() and task.exception() is None:
                    await task.result()[1].close()  # both came up: keep the winner only
    raise TransportError(f"cannot reach worker {ticket.node_id}: " + "; ".join(errors))


def _failed(done: set[asyncio.Task[tuple[str, Link]]]) -> bool:
    return any(task.exception() is not None for task in done)


__all__ = ["DIRECT_HEAD_START_S", "GRPC", "RELAY", "TCP", "connect_direct", "connect_relay", "open_link"]
