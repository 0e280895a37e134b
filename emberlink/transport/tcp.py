"""The raw TCP transport: length-prefixed blobs on one TCP connection per session; never looks inside a blob.

Why it is safe without TLS: every blob a session sends is already a sealed frame (AES-GCM under the
handshake's keys, version, type, session and counter authenticated), exactly as on gRPC, which also
runs without TLS here. Why it exists: a 64-byte round trip costs a fraction of grpc.aio's.

Wire: each blob is a 4-byte big-endian length, then that many bytes. Lengths above `MAX_BLOB` are
never blobs; one of them, `_HEARTBEAT`, is a keepalive marker with no body. Anything else above
`MAX_BLOB` is a malformed prefix: the receiver says so and drops the connection.

Liveness, like gRPC's keepalive: a side that has sent nothing for `KEEPALIVE_S` sends a heartbeat
(between blobs, never inside one), and a side that has received nothing, not even a heartbeat, for
`DEAD_AFTER_S` drops the connection; recv then raises naming the silence. While this side has paused
reading (its user is not calling recv and `RECV_BUFFER_BYTES` are queued), the peer cannot be
heard, so silence is not counted against it.

Flow: blobs larger than `SLICE` are written a slice at a time with a drain between (one huge
write() is several times slower in asyncio), so a peer that stops reading blocks `send` instead of
growing a buffer. Uses whatever event loop runs it; `event_loop_factory` (transport/loop.py) picks
uvloop where installed.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import cast

from emberlink.errors import TransportError, TransportTimeout
from emberlink.transport.base import MAX_BLOB, Blob, Handler, OnBlob, check_size
from emberlink.transport.sessions import SessionSet

_PREFIX = 4
_HEARTBEAT = 0xFFFF_FFFF
_HEARTBEAT_BYTES = _HEARTBEAT.to_bytes(_PREFIX, "big")

#: Blobs up to this size go out as one write of prefix and body together (one segment, one syscall).
SMALL = 64 * 1024
#: Larger blobs are written in slices of this size with a drain between.
SLICE = 1024 * 1024
#: Received blobs queued beyond this many bytes (unread by the session) pause reading the socket.
RECV_BUFFER_BYTES = 2 * MAX_BLOB

KEEPALIVE_S = 0.5
DEAD_AFTER_S = 2.5

#: How long close() lets written blobs drain to a peer before it cuts the connection.
_CLOSE_WAIT_S = 1.0


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class TcpLink(asyncio.Protocol):
    """One end of a session, either side: the connection's protocol and the session's Link."""

    def __init__(self, peer: str = "tcp:?", on_made: Callable[[TcpLink], None] | None = None) -> None:
        self.peer = peer
        self._on_made = on_made
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._frames: deque[bytes | memoryview] = deque()
        self._queued = 0
        self._recv_waiter: asyncio.Future[None] | None = None
        self._head = bytearray()
        self._body: bytearray | None = None
        self._filled = 0
        self._ended: str | None = None  # why recv/send fail from now on (after queued blobs, for recv)
        self._closed = False
        self._lost: asyncio.Future[None] = self._loop.create_future()
        self._send_lock = asyncio.Lock()
        self._write_paused = False
        self._writable: asyncio.Future[None] | None = None
        self._read_paused = False
        self._last_in = self._last_out = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._on_blob: OnBlob | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.peer == "tcp:?":
            name = self._transport.get_extra_info("peername")
            if isinstance(name, tuple):
                self.peer = f"tcp:{_address(name[0], name[1])}"
        self._timer = self._loop.call_later(KEEPALIVE_S, self._tick)
        if self._on_made is not None:
            self._on_made(self)

    def data_received(self, data: bytes) -> None:
        self._last_in = time.monotonic()
        end = len(data)
        if end > _PREFIX and self._body is None and not self._head and self._ended is None:
            n = int.from_bytes(data[:_PREFIX], "big")
            if n == end - _PREFIX:  # exactly one whole blob (a step's frame): no parsing loop
                self._deliver(data[_PREFIX:])
                return
        view = memoryview(data)
        pos, end = 0, len(data)
        while pos < end and self._ended is None:
            body = self._body
            if body is None:
                if not self._head and end - pos >= _PREFIX:
                    n = int.from_bytes(view[pos : pos + _PREFIX], "big")
                    pos += _PREFIX
                else:
                    take = min(_PREFIX - len(self._head), end - pos)
                    self._head += view[pos : pos + take]
                    pos += take
                    if len(self._head) < _PREFIX:
                        return
                    n = int.from_bytes(self._head, "big")
                    self._head.clear()
                if n == _HEARTBEAT:
                    continue
                if n > MAX_BLOB:
                    self._fail(
                        f"peer {self.peer} sent a malformed length prefix: {n} bytes is over the "
                        f"transport limit of {MAX_BLOB} bytes"
                    )
                    return
                if end - pos >= n:  # the whole blob is in this chunk: the common case for small ones
                    self._deliver(bytes(view[pos : pos + n]))
                    pos += n
                    continue
                self._body, self._filled = bytearray(n), 0
            else:
                take = min(len(body) - self._filled, end - pos)
                body[self._filled : self._filled + take] = view[pos : pos + take]
                self._filled += take
                pos += take
                if self._filled == len(body):
                    self._body = None
                    self._deliver(memoryview(body))

    def eof_received(self) -> bool:
        if self._body is not None or self._head:
            got = self._filled + _PREFIX if self._body is not None else len(self._head)
            want = len(self._body) + _PREFIX if self._body is not None else _PREFIX
            self._end(
                f"peer {self.peer} closed the connection in the middle of a blob ({got} of {want} bytes)"
            )
        else:
            self._end(f"peer {self.peer} closed the session")
        return False  # close our side too once our queued writes are out

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self._end(f"connection to {self.peer} lost: {type(exc).__name__}: {exc}")
        else:
            self._end(f"peer {self.peer} closed the session")
        if self._timer is not None:
            self._timer.cancel()
        self._on_blob = None  # (it holds the session: no cycle outlives the connection)
        if not self._lost.done():
            self._lost.set_result(None)
        self._wake_writer()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer()

    # -- Link ------------------------------------------------------------------------------------

    def set_receiver(self, on_blob: OnBlob | None) -> None:
        """Hand each blob to `on_blob` as it arrives, while nothing waits for `recv` (CallbackLink)."""
        self._on_blob = on_blob

    def send_nowait(self, blob: Blob) -> bool:
        """Write a small `blob` now if nothing needs waiting for; False, having written nothing, if
        something does (a blob being written, a full buffer, a closed link): `send` it then."""
        n = len(blob)
        if (
            n <= SMALL
            and type(blob) is bytes
            and not self._write_paused
            and not self._send_lock.locked()
            and self._ended is None
            and not self._closed
        ):
            # A step's frame, nothing being written before it: one write, no lock to take (the
            # checks in `send`, all but the closing transport's, are the ones done here).
            transport = self._transport
            if transport is not None and not transport.is_closing():
                self._last_out = time.monotonic()
                transport.write(n.to_bytes(_PREFIX, "big") + blob)
                return True
        return False

    async def send(self, blob: Blob) -> None:
        if self.send_nowait(blob):
            if self._write_paused:  # this write filled the buffer: wait as the slow path does
                async with self._send_lock:
                    await self._drain()
            return
        check_size(blob)
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"a blob must be bytes, not {type(blob).__name__}")
        async with self._send_lock:
            self._check_writable()
            transport = self._transport
            assert transport is not None
            n = len(blob)
            head = n.to_bytes(_PREFIX, "big")
            self._last_out = time.monotonic()
            if n <= SMALL:
                transport.write(head + blob)
                if self._write_paused:
                    await self._drain()
                return
            view = memoryview(blob).cast("B")
            try:
                transport.write(head)
                for start in range(0, n, SLICE):
                    transport.write(view[start : start + SLICE])
                    self._last_out = time.monotonic()
                    if self._write_paused:
                        await self._drain()
            except BaseException:
                # Half a blob is on the wire: the stream cannot be resynchronised.
                self._fail(f"send to {self.peer} was interrupted in the middle of a blob")
                raise

    async def recv(self) -> bytes | memoryview:
        while True:
            if self._closed:
                raise TransportError(f"link to {self.peer} is closed")
            if self._frames:
                frame = self._frames.popleft()
                self._queued -= len(frame)
                if self._read_paused and self._queued <= RECV_BUFFER_BYTES // 2 and self._transport:
                    self._read_paused = False
                    self._last_in = time.monotonic()
                    self._transport.resume_reading()
                return frame
            if self._ended is not None:
                raise TransportError(self._ended)
            waiter = self._recv_waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._recv_waiter = None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._on_blob = None
        self._end(f"link to {self.peer} is closed")
        transport = self._transport
        if transport is None or transport.is_closing() and self._lost.done():
            return
        transport.close()  # writes what is queued, then FIN
        if transport.get_write_buffer_size():
            try:
                await asyncio.wait_for(asyncio.shield(self._lost), _CLOSE_WAIT_S)
            except TimeoutError:
                transport.abort()  # a peer that stopped reading must not make close() hang

    # -- internals -------------------------------------------------------------------------------

    def _deliver(self, frame: bytes | memoryview) -> None:
        on_blob = self._on_blob
        if on_blob is not None and not self._frames and on_blob(frame):
            return
        self._frames.append(frame)
        self._queued += len(frame)
        if self._queued > RECV_BUFFER_BYTES and not self._read_paused and self._transport is not None:
            self._read_paused = True
            self._transport.pause_reading()
        self._wake_reader()

    def _end(self, why: str) -> None:
        if self._ended is None:
            self._ended = why
        self._wake_reader()
        self._wake_writer()

    def _fail(self, why: str) -> None:
        """A broken stream: say why to recv (after the whole blobs before the break) and send; drop the connection."""
        self._end(why)
        if self._transport is not None:
            self._transport.abort()

    def _wake_reader(self) -> None:
        if self._recv_waiter is not None and not self._recv_waiter.done():
            self._recv_waiter.set_result(None)

    def _wake_writer(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def _check_writable(self) -> None:
        if self._closed:
            raise TransportError(f"link to {self.peer} is closed")
        if self._ended is not None:
            raise TransportError(self._ended)
        if self._transport is None or self._transport.is_closing():
            raise TransportError(f"send to {self.peer} failed: the connection is closing")

    async def _drain(self) -> None:
        while self._write_paused:
            self._check_writable()
            self._writable = self._loop.create_future()
            try:
                await self._writable
            finally:
                self._writable = None
        self._check_writable()

    def _tick(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        now = time.monotonic()
        if self._read_paused:
            self._last_in = now
        elif now - self._last_in > DEAD_AFTER_S:
            self._fail(f"no sign of life from peer {self.peer} for {now - self._last_in:.1f} s")
            return
        if now - self._last_out >= KEEPALIVE_S and not self._send_lock.locked() and not self._write_paused:
            transport.write(_HEARTBEAT_BYTES)
            self._last_out = now
        self._timer = self._loop.call_later(KEEPALIVE_S, self._tick)


class TcpListener:
    """Serves `handler` for every connection accepted on `host:port` (port 0 picks a free one)."""

    def __init__(self, host: str, port: int, handler: Handler) -> None:
        self.host = host
        self.port = port
        self._sessions = SessionSet(handler, "tcp")
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Bind and serve; returns the bound port."""
        loop = asyncio.get_running_loop()
        try:
            server = await loop.create_server(self._accept, self.host, self.port, reuse_address=True)
        except OSError as e:
            raise TransportError(
                f"cannot listen on tcp:{_address(self.host, self.port)}: {e.strerror}"
            ) from e
        self._server = server
        self.port = int(server.sockets[0].getsockname()[1])
        return self.port

    def _accept(self) -> TcpLink:
        return TcpLink(on_made=self._spawn)

    def _spawn(self, link: TcpLink) -> None:
        if self._server is None:  # stopping: a connection accepted in the meantime is dropped
            link._fail("worker is shutting down")
        else:
            self._sessions.spawn(link)

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new sessions, give running ones `grace` seconds, then close them and the port."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        await self._sessions.stop(grace)


async def connect(host: str, port: int, *, timeout: float = 10.0) -> TcpLink:
    """Open a session's connection to the worker at `host:port`; fails fast when nothing listens there."""
    where = f"tcp:{_address(host, port)}"
    loop = asyncio.get_running_loop()
    try:
        _, link = await asyncio.wait_for(loop.create_connection(lambda: TcpLink(where), host, port), timeout)
    except TimeoutError:
        raise TransportTimeout(
            f"no answer from tcp worker at {_address(host, port)} within {timeout} s"
        ) from None
    except OSError as e:
        raise TransportError(
            f"cannot connect to tcp worker at {_address(host, port)}: {e.strerror or e}"
        ) from e
    return link


__all__ = ["DEAD_AFTER_S", "KEEPALIVE_S", "SLICE", "TcpLink", "TcpListener", "connect"]
