"""The transport interface every session is written against; no I/O and no knowledge of what blobs hold."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from emberlink.errors import TransportError

#: The largest blob any transport accepts. Sessions send frames of at most ~1 MiB plus framing; the
#: slack lets a session pack a few frames into one blob. gRPC's receive limit is set from this.
MAX_BLOB = 8 * 1024 * 1024

Blob = bytes | bytearray | memoryview
"""What `Link.send` takes: bytes, or a buffer the caller does not touch again once sent."""


class Link(Protocol):
    """One session's ordered, reliable pipe of whole byte blobs.

    `recv` raises `TransportError` once the link is closed or broken: after `close()`, when the
    peer closed (the message says so), and when the peer or the network died. Blobs the peer sent
    before closing are still delivered first.
    """

    peer: str

    async def send(self, blob: Blob) -> None: ...

    async def recv(self) -> bytes | memoryview: ...

    async def close(self) -> None: ...


@runtime_checkable
class BindableLink(Link, Protocol):
    """A link that must be tied to the session's keys once the handshake has made them (the relay's:
    anyone on a relay can publish on it). Its transport's module says when each end binds."""

    async def bind(self, secret: bytes) -> None: ...


async def bind(link: Link, secret: bytes) -> None:
    """Tie `link` to the session's link secret where its transport needs that; nothing otherwise."""
    if isinstance(link, BindableLink):
        await link.bind(secret)


OnBlob = Callable[[bytes | memoryview], bool]
"""A session pump's fast path for received blobs: called on the loop, in order, with each blob as it
arrives; True when it took the blob, False to leave it (and every later one until `recv` has taken
them) for `recv`."""


@runtime_checkable
class CallbackLink(Link, Protocol):
    """A link that can hand blobs to a callback as they arrive instead of queueing them for a task
    that awaits `recv` (the raw TCP link's: a queue and a task wake-up cost ~19 µs a blob).

    `recv` still raises when the link ends, and still returns the blobs the callback left, in order.
    """

    def set_receiver(self, on_blob: OnBlob | None) -> None: ...

    def send_nowait(self, blob: Blob) -> bool: ...


@runtime_checkable
class OwnableLink(CallbackLink, Protocol):
    """A link whose socket a user thread can own for a synchronous round trip, doing the I/O
    itself instead of the event loop (the raw TCP link's, on Linux; transport/tcp.py says how).

    On the loop: `allow_parking`, `loop_has_it`, `take_back`. On user threads: `try_claim`, `call_on_loop`; and,
    by the owner only, `write_direct`, `read_direct` and `release`.
    """

    def allow_parking(self, idle: Callable[[], bool] | None) -> None: ...

    @property
    def loop_has_it(self) -> bool: ...

    def take_back(self, then: Callable[[], None]) -> bool: ...

    def try_claim(self) -> bool: ...

    def call_on_loop(self, fn: Callable[[], None]) -> None: ...

    def write_direct(self, blob: bytes | bytearray) -> bool: ...

    def read_direct(self, take: OnBlob) -> bool: ...

    def release(self, keep: bool, then: Callable[[], None] | None = None) -> None: ...


def offer_receiver(link: Link, on_blob: OnBlob | None) -> bool:
    """Hand `link`'s blobs to `on_blob` as they arrive where its transport can (None: stop); whether it can."""
    if isinstance(link, CallbackLink):
        link.set_receiver(on_blob)
        return True
    return False


Handler = Callable[[Link], Awaitable[None]]
"""A worker's per-session coroutine. The link is closed when it returns."""


class Listener(Protocol):
    """Accepts sessions and runs a `Handler` for each."""

    async def start(self) -> object: ...

    async def stop(self, grace: float | None = None) -> None: ...


def check_size(blob: Blob) -> None:
    """Refuse a blob larger than any transport may carry."""
    if len(blob) > MAX_BLOB:
        raise TransportError(f"blob of {len(blob)} bytes exceeds the transport limit of {MAX_BLOB} bytes")


def check_blob(blob: Blob) -> bytes:
    """Return `blob` as `bytes`, refusing what no transport may carry."""
    check_size(blob)
    if type(blob) is bytes:
        return blob
    if isinstance(blob, (bytearray, memoryview)):
        return bytes(blob)
    raise TypeError(f"a blob must be bytes, not {type(blob).__name__}")
