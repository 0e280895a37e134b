"""A worker running in this process, on its own event-loop thread: for `emberlink demo`, tests, benches.

It listens on loopback gRPC (port 0) and, optionally, on an in-process memory endpoint. The
memory transport is single-loop, so clients of that endpoint run their session on this same
loop (`loop_thread`); gRPC clients can live anywhere.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Awaitable, Coroutine
from typing import Any, Self, TypeVar

from emberlink.client.loop import LoopThread
from emberlink.protocol.identity import AllowPolicy, Identity
from emberlink.protocol.ticket import Ticket
from emberlink.server.worker import Worker

T = TypeVar("T")
log = logging.getLogger("emberlink.server")
_names = itertools.count(1)


class BackgroundWorker:
    """`Worker` + listeners on a `LoopThread`. Use as a context manager or call `stop()`."""

    def __init__(
        self,
        identity: Identity | None = None,
        allow: AllowPolicy | None = None,
        *,
        grpc: bool = True,
        memory: bool = False,
        host: str = "127.0.0.1",
        loop_thread: LoopThread | None = None,
        **worker_options: Any,
    ) -> None:
        self.identity = identity if identity is not None else Identity.generate(os.urandom)
        self.allow = allow if allow is not None else AllowPolicy.allow_any()
        self._owns_loop = loop_thread is None
        self.loop_thread = loop_thread if loop_thread is not None else LoopThread("emberlink-worker")
        self.port: int | None = None
        self.memory_name: str | None = None
        self.hub: Any = None
        self._listeners: list[Any] = []
        self._stopped = False
        try:
            self.worker: Worker = self.loop_thread.call(self._start(grpc, memory, host, worker_options), 30)
        except BaseException:
            if self._owns_loop:
                self.loop_thread.stop()
            raise
        self.host = host

    async def _start(self, grpc: bool, memory: bool, host: str, options: dict[str, Any]) -> Worker:
        worker = Worker(self.identity, self.allow, **options)
        if grpc:
            from emberlink.transport.grpc import GrpcListener

            listener = GrpcListener(host, 0, worker.handle)
            self.port = await listener.start()
            self._listeners.append(listener)
        if memory:
            from emberlink.transport.memory import MemoryHub, MemoryListener

            self.hub = MemoryHub()
            self.memory_name = f"worker-{next(_names)}"
            mem = MemoryListener(self.memory_name, worker.handle, hub=self.hub)
            await mem.start()
            self._listeners.append(mem)
        return worker

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    @property
    def ticket(self) -> str:
        """The ticket of the gRPC listener."""
        if self.port is None:
            raise RuntimeError("this worker has no gRPC listener")
        return str(Ticket(self.node_id, ((self.host, self.port),)))

    def call(self, fn: Awaitable[T] | Coroutine[Any, Any, T], timeout: float | None = 30) -> T:
        """Run a coroutine on the worker's loop and wait for it."""
        return self.loop_thread.call(fn, timeout)  # type: ignore[arg-type]

    def drain(self, timeout: float = 30) -> None:
        """What SIGTERM does: finish queued work and end every session with going_away."""
        self.call(self._drain(), timeout)

    async def _drain(self) -> None:
        await self.worker.drain()
        for listener in self._listeners:
            await listener.stop(1.0)
        self._listeners.clear()

    def stop(self) -> None:
        if self._stopped or not self.loop_thread.alive:
            return
        self._stopped = True
        try:
            self.call(self._drain(), 30)
        finally:
            self.worker.close()
            if self._owns_loop:
                self.loop_thread.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
