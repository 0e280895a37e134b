"""An in-process transport (a pair of bounded queues) for tests and demos; no sockets, no threads."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

from emberlink.errors import TransportError
from emberlink.transport.base import Blob, Handler, check_blob
from emberlink.transport.sessions import SessionSet

#: Blobs a sender may have queued before `send` waits for the receiver (backpressure).
DEFAULT_CAPACITY = 64

_counter = itertools.count(1)


class _Pipe:
    """One direction of a pair: a bounded FIFO with a writer end and a reader end."""

    def __init__(self, capacity: int) -> None:
        self._items: deque[bytes] = deque()
        self._capacity = capacity
        self.writer_closed = False
        self.reader_closed = False
        self._getters: deque[asyncio.Future[None]] = deque()
        self._putters: deque[asyncio.Future[None]] = deque()

    @staticmethod
    def _wake_one(waiters: deque[asyncio.Future[None]]) -> None:
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _wake_all(self) -> None:
        for waiters in (self._getters, self._putters):
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(None)

    async def _wait(self, waiters: deque[asyncio.Future[None]]) -> None:
        fut = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            # A wake-up that raced with our cancellation belongs to the next waiter.
            if fut.done() and not fut.cancelled():
                self._wake_one(waiters)
            raise

    async def put(self, blob: bytes) -> None:
        while True:
            if self.writer_closed:
                raise TransportError("link is closed")
            if self.reader_closed:
                raise TransportError("peer closed the link")
            if len(self._items) < self._capacity:
                break
            await self._wait(self._putters)
        self._items.append(blob)
        self._wake_one(self._getters)

    async def get(self) -> bytes:
        while True:
            if self.reader_closed:
                raise TransportError("link is closed")
            if self._items:
                blob = self._items.popleft()
                self._wake_one(self._putters)
                return blob
            if self.writer_closed:
                raise TransportError("peer closed the link")
            await self._wait(self._getters)

    def close_writer(self) -> None:
        self.writer_closed = True
        self._wake_all()

    def close_reader(self) -> None:
        self.reader_closed = True
        self._items.clear()
        self._wake_all()


class MemoryLink:
    """One end of an in-process pair."""

    def __init__(self, inbound: _Pipe, outbound: _Pipe, peer: str) -> None:
        self._inbound = inbound
        self._outbound = outbound
        self.peer = peer

    async def send(self, blob: Blob) -> None:
        await self._outbound.put(check_blob(blob))

    async def recv(self) -> bytes:
        return await self._inbound.get()

    async def close(self) -> None:
        self._outbound.close_writer()
        self._inbound.close_reader()

    def cut(self) -> None:
        """Break the pair as a network fault does (for tests): whatever is in flight either way is
        lost, and both ends' next send or recv raises TransportError."""
        self._outbound.close_reader()
        self._inbound.close_reader()


def pair(*, capacity: int = DEFAULT_CAPACITY, name: str | None = None) -> tuple[MemoryLink, MemoryLink]:
    """Two connected links; each `send` waits while `capacity` blobs are queued unread."""
    label = name or f"pair-{next(_counter)}"
    a_to_b, b_to_a = _Pipe(capacity), _Pipe(capacity)
    return (
        MemoryLink(b_to_a, a_to_b, f"memory:{label}/b"),
        MemoryLink(a_to_b, b_to_a, f"memory:{label}/a"),
    )


class MemoryHub:
    """A namespace of in-process endpoints. Tests make their own; `DEFAULT_HUB` serves the rest."""

    def __init__(self) -> None:
        self._endpoints: dict[str, MemoryListener] = {}

    def _register(self, name: str, listener: MemoryListener) -> None:
        if name in self._endpoints:
            raise TransportError(f"memory endpoint {name!r} is already listening")
        self._endpoints[name] = listener

    def _unregister(self, name: str, listener: MemoryListener) -> None:
        if self._endpoints.get(name) is listener:
            del self._endpoints[name]

    async def connect(self, name: str, *, capacity: int = DEFAULT_CAPACITY) -> MemoryLink:
        listener = self._endpoints.get(name)
        if listener is None:
            raise TransportError(f"no memory endpoint named {name!r} is listening")
        return listener._accept(capacity)


DEFAULT_HUB = MemoryHub()


class MemoryListener:
    """Serves `handler` on a named in-process endpoint of `hub`."""

    def __init__(self, name: str, handler: Handler, *, hub: MemoryHub | None = None) -> None:
        self.name = name
        self._hub = hub if hub is not None else DEFAULT_HUB
        self._sessions = SessionSet(handler, "memory")
        self._serial = itertools.count(1)

    async def start(self) -> str:
        """Register the endpoint; returns its name."""
        self._hub._register(self.name, self)
        return self.name

    def _accept(self, capacity: int) -> MemoryLink:
        client, worker = pair(capacity=capacity, name=f"{self.name}#{next(self._serial)}")
        self._sessions.spawn(worker)
        return client

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new sessions, give running ones `grace` seconds, then close them."""
        self._hub._unregister(self.name, self)
        await self._sessions.stop(grace)


async def connect(name: str, *, hub: MemoryHub | None = None, capacity: int = DEFAULT_CAPACITY) -> MemoryLink:
    """Open a session to the `MemoryListener` registered as `name`."""
    return await (hub if hub is not None else DEFAULT_HUB).connect(name, capacity=capacity)
