"""In-process workers for tests: a real worker and real clients over the memory transport; not for
serving anything outside this process.

    import emberlink.testing

    with emberlink.testing.worker() as w:      # device="cpu"; "cuda:0" serves a GPU
        dev = w.device()                       # a remote Device: one session, as w.client
        print(dev.tensor([1.0, 2.0]).sum().item())

Everything but the network is what a deployment runs: the worker's and the client's keys are
generated in memory, the worker admits only the identities on its allow-list (`w.client`, and each
one `w.new_client()` makes), and every session does the full handshake and seals every frame. The
memory transport runs on the process's I/O loop (transport/loop.py), which the clients share.
`grpc=True` adds a gRPC listener on loopback, for `w.device(transport="grpc")` and `w.ticket`;
`tcp=True` a raw TCP listener (transport/tcp.py), for `w.device(transport="tcp")` (and in `w.ticket`).
"""

from __future__ import annotations

import os
from collections.abc import Coroutine
from typing import Any, Literal, Self, TypeVar

from emberlink.client.device import Device
from emberlink.client.remote import connect_link, connect_ticket
from emberlink.errors import ConfigError
from emberlink.protocol.identity import AllowPolicy, Identity
from emberlink.protocol.ticket import Ticket
from emberlink.server.background import BackgroundWorker
from emberlink.server.worker import Worker
from emberlink.transport import memory
from emberlink.transport.base import Link

T = TypeVar("T")

Transport = Literal["memory", "grpc", "tcp"]


class InProcessWorker:
    """A worker in this process serving `device` to its allow-listed clients. A context manager;
    or call `stop()`. `options` are the server Worker's (`max_session_bytes`, `graph_cache_bytes`,
    `chunk_size`, `backend`)."""

    def __init__(self, device: str = "cpu", *, grpc: bool = False, tcp: bool = False, **options: Any) -> None:
        self.client = Identity.generate(os.urandom)
        """The identity `device()` connects as unless told otherwise; on the allow-list."""
        self._admitted = {self.client.node_id}
        self._background = BackgroundWorker(
            allow=AllowPolicy.of(self._admitted), grpc=grpc, tcp=tcp, memory=True, device=device, **options
        )

    @property
    def worker(self) -> Worker:
        """The server-side Worker (its sessions, graph cache, device thread)."""
        return self._background.worker

    @property
    def node_id(self) -> str:
        return self._background.node_id

    @property
    def ticket(self) -> str:
        """The ticket of the gRPC and raw TCP listeners (`grpc=True` or `tcp=True` only)."""
        if self._background.port is None and self._background.tcp_port is None:
            raise ConfigError("this worker has no network listener: start it with grpc=True or tcp=True")
        return self._background.ticket

    def new_client(self) -> Identity:
        """A new client identity, admitted from now on."""
        identity = Identity.generate(os.urandom)
        self._admitted.add(identity.node_id)
        # Each session's handshake reads the worker's policy when it starts.
        self.worker.allow = AllowPolicy.of(self._admitted)
        return identity

    def device(
        self,
        *,
        identity: Identity | None = None,
        transport: Transport = "memory",
        timeout: float = 10.0,
        resume_window: float | None = None,
    ) -> Device:
        """A remote Device on this worker: a new session as `identity` (default `self.client`).

        An identity not on the allow-list is refused with AuthError, as a real worker refuses it.
        A dropped link is resumed on a new one for `resume_window` seconds (see `Device.remote`).
        """
        who = identity if identity is not None else self.client
        if transport in ("grpc", "tcp"):
            ticket = self._ticket_for(transport)
            executor = connect_ticket(ticket, who, timeout=timeout, resume_window=resume_window)
            return Device(executor, f"remote({ticket})")
        if transport != "memory":
            raise ConfigError(f"transport must be 'memory', 'grpc' or 'tcp', got {transport!r}")
        background = self._background

        async def reconnect(_timeout: float) -> tuple[str, Link]:
            return "memory", await self.open_link()

        executor = connect_link(
            self.open_link,
            self.node_id,
            who,
            path="memory",
            loop_thread=background.loop_thread,
            timeout=timeout,
            reconnect=reconnect,
            resume_window=resume_window,
        )
        return Device(executor, f"remote(memory:{background.memory_name})")

    def _ticket_for(self, transport: str) -> Ticket:
        """The ticket with only `transport`'s address, so the session goes over that one."""
        ticket = Ticket.parse(self.ticket)
        if transport == "tcp":
            if not ticket.tcp:
                raise ConfigError("this worker has no tcp listener: start it with tcp=True")
            return Ticket(ticket.node_id, (), tcp=ticket.tcp)
        if not ticket.addrs:
            raise ConfigError("this worker has no gRPC listener: start it with grpc=True")
        return Ticket(ticket.node_id, ticket.addrs)

    async def open_link(self) -> Link:
        """A raw memory Link to the worker, before any handshake (for tests that speak the session
        protocol frame by frame). Call it on the worker's loop (`call`)."""
        background = self._background
        assert background.memory_name is not None and background.hub is not None
        return await memory.connect(background.memory_name, hub=background.hub)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30) -> T:
        """Run a coroutine on the worker's loop and wait for it."""
        return self._background.call(coro, timeout)

    def drain(self, timeout: float = 30) -> None:
        """What SIGTERM does: stop accepting, finish queued work, end every session with going_away."""
        self._background.drain(timeout)

    def stop(self) -> None:
        """Drain, stop the listeners and the device thread. Idempotent."""
        self._background.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def worker(device: str = "cpu", *, grpc: bool = False, tcp: bool = False, **options: Any) -> InProcessWorker:
    """Start a worker in this process on `device` (`cpu`, `cuda:0`, ...); see the module docstring."""
    return InProcessWorker(device, grpc=grpc, tcp=tcp, **options)


__all__ = ["InProcessWorker", "Transport", "worker"]
