"""A worker running inside this process, on an event-loop thread: for `emberlink demo`, tests, benches.

It listens on loopback gRPC and raw TCP (port 0 each), as `emberlink worker` does by default, and,
optionally, on an in-process memory endpoint; `tcp=False` or `grpc=False` leaves one out. By default
it runs on the process's I/O loop (`transport.loop.io_loop`), the one remote devices use: the memory
transport is single-loop, so clients of that endpoint must share the worker's loop, and a loop
that carried gRPC is never closed (see transport/loop.py), so no extra loop is made and thrown away.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Coroutine
from typing import Any, Self, TypeVar

from emberlink.protocol.identity import AllowPolicy, Identity
from emberlink.protocol.ticket import Ticket
from emberlink.server.worker import Worker
from emberlink.transport.loop import LoopThread, host_worker, io_loop

T = TypeVar("T")
log = logging.getLogger("emberlink.server")
_names = itertools.count(1)


class BackgroundWorker:
    """`Worker` plus listeners on a loop thread. A context manager; or call `stop()`."""

    def __init__(
        self,
        identity: Identity | None = None,
        allow: AllowPolicy | None = None,
        *,
        grpc: bool = True,
        memory: bool = False,
        tcp: bool = True,
        host: str = "127.0.0.1",
        loop_thread: LoopThread | None = None,
        **worker_options: Any,
    ) -> None:
        self.identity = identity if identity is not None else Identity.generate(os.urandom)
        self.allow = allow if allow is not None else AllowPolicy.allow_any()
        self.loop_thread = loop_thread if loop_thread is not None else io_loop()
        host_worker()  # clients of this process must not spin while it works (settings.spin_seconds)
        self.host = host
        self.port: int | None = None
        self.tcp_port: int | None = None
        self.memory_name: str | None = None
        self.hub: Any = None
        self._listeners: list[Any] = []
        self._stopped = False
        self.worker = Worker(self.identity, self.allow, **worker_options)
        try:
            self.call(self._start(grpc, memory, tcp), 30)
        except BaseException:
            self.stop()
            raise

    async def _start(self, grpc: bool, memory: bool, tcp: bool) -> None:
        if tcp:
            from emberlink.transport.tcp import TcpListener

            tcp_listener = TcpListener(self.host, 0, self.worker.handle)
            self.tcp_port = await tcp_listener.start()
            self._listeners.append(tcp_listener)
        if grpc:
            from emberlink.transport.grpc import GrpcListener

            listener = GrpcListener(self.host, 0, self.worker.handle)
            self.port = await listener.start()
            self._listeners.append(listener)
        if memory:
            from emberlink.transport.memory import MemoryHub, MemoryListener

            self.hub = MemoryHub()
            self.memory_name = f"worker-{next(_names)}"
            mem = MemoryListener(self.memory_name, self.worker.handle, hub=self.hub)
            await mem.start()
            self._listeners.append(mem)

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    @property
    def ticket(self) -> str:
        """The ticket of the gRPC listener, and of the raw TCP one if there is one."""
        if self.port is None and self.tcp_port is None:
            raise RuntimeError("this worker has neither a gRPC nor a tcp listener")
        grpc = ((self.host, self.port),) if self.port is not None else ()
        tcp = ((self.host, self.tcp_port),) if self.tcp_port is not None else ()
        return str(Ticket(self.node_id, grpc, tcp=tcp))

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30) -> T:
        """Run a coroutine on the worker's loop and wait for it."""
        return self.loop_thread.call(coro, timeout)

    def drain(self, timeout: float = 30) -> None:
        """What SIGTERM does: stop accepting, finish queued work, end every session with going_away."""
        self.call(self._drain(), timeout)

    async def _drain(self) -> None:
        await self.worker.drain()
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            await listener.stop(1.0)

    def stop(self) -> None:
        """Drain, stop the listeners and the device thread. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.loop_thread.alive:
                self.call(self._drain(), 30)
        finally:
            self.worker.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
