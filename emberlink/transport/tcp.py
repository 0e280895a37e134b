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
growing a buffer; a large blob's length prefix goes in one write with its first slice. Received
bodies are read straight into the buffer they are delivered in (`TcpLink.get_buffer`). Uses
whatever event loop runs it; `event_loop_factory` (transport/loop.py) picks
uvloop where installed.

Owned by a user thread (Linux): a client's synchronous round trip (send a batch, wait for its
reply) costs the event loop two wake-ups and the user's thread one when the loop does the I/O. So
a link can hand its socket to one user thread at a time, which writes and reads it itself,
blocking. Who may touch the socket is the link's `Mode`, changed under a lock:
- LOOP: the loop's transport reads and writes, as above; no other thread touches the socket.
- PARKED: the loop has paused reading with nothing queued to write or half-parsed (`allow_parking`
  says when the session has nothing outstanding either), and no user thread has handed it work
  that has not run yet (`call_on_loop`); nobody touches the socket.
- OWNED: the user thread that claimed it (`try_claim`, from PARKED only) writes (`write_direct`)
  and reads (`read_direct`) until it `release`s it: back to PARKED, or to LOOP when it cannot
  finish alone (a write that would block, the link broke) or the loop asked for it.
The loop never touches the socket unless the mode is LOOP: it takes the socket back (`take_back`)
before it writes, reads or closes, waiting for an owner's release (it rings the owner's bell, an
eventfd in the owner's poll, so it comes at once) and running what waited after it. An owner sends
heartbeats and notices silence itself while it waits; a link parked for `KEEPALIVE_S` with
nothing said either way goes back to the loop at the next keepalive tick. An owner polls without
sleeping for a while before it sleeps (`spin_setting`), while answers come that fast (`read_direct`).
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import cast

import numpy as np

from emberlink.errors import TransportError, TransportTimeout
from emberlink.settings import spin_seconds
from emberlink.transport.base import MAX_BLOB, Blob, Handler, OnBlob, check_size
from emberlink.transport.loop import worker_here
from emberlink.transport.sessions import SessionSet

_PREFIX = 4
_HEARTBEAT = 0xFFFF_FFFF
_HEARTBEAT_BYTES = _HEARTBEAT.to_bytes(_PREFIX, "big")

#: Blobs up to this size go out as one write of prefix and body together (one segment, one syscall).
SMALL = 64 * 1024
#: Larger blobs are written in slices of this size with a drain between.
SLICE = 1024 * 1024
#: The loop reads up to this much at a time between blobs' bodies: many small blobs (a step's
#: frames) at once, and at most this much of a large blob is copied into its body from here; the
#: rest of the body the kernel copies straight into it.
_READ_BUFFER = 64 * 1024
#: A client's host batches over this link go in BULK frames of this size, each its own blob written
#: as soon as it is sealed, so the worker opens one while the client seals the next (client/session.py,
#: `Pipelined`); gRPC and the relay keep the worker's 1 MiB chunks. A sealed chunk (38 bytes more)
#: and its length prefix fit SMALL: one write. Measured, the jitted 401 KB host-batch step
#: (bench/remote_step.py --upload, one sweep): 694 µs unpipelined, chunks of 32 KiB 622, 64 KiB 573,
#: 96 KiB 636, 128 KiB 632.
PIPELINE_CHUNK = SMALL - 64
#: Received blobs queued beyond this many bytes (unread by the session) pause reading the socket.
RECV_BUFFER_BYTES = 2 * MAX_BLOB

KEEPALIVE_S = 0.5
DEAD_AFTER_S = 2.5

#: How long close() lets written blobs drain to a peer before it cuts the connection.
_CLOSE_WAIT_S = 1.0


#: Bytes a user thread asks the socket for at a time when it reads a reply itself.
_DIRECT_READ = 256 * 1024
#: How long an owner that waits for bytes polls the socket without sleeping first (while the last
#: wait ended within that time) on fewer than `SPIN_CPUS` CPUs, unless `SPIN_ENV` says otherwise
#: (settings.spin_seconds: 2 ms on more CPUs).
SPIN_FEW_CPUS_S = 200e-6
_DIRECT = hasattr(os, "eventfd") and hasattr(select, "poll")  # Linux: user threads may own the socket


class Mode(Enum):
    """Who does a link's socket I/O (see "Owned by a user thread" in the module docstring)."""

    LOOP = "loop"  # the event loop, through its transport
    PARKED = "parked"  # nobody: the loop stopped reading, with nothing to write; a user thread may claim it
    OWNED = "owned"  # one user thread, blocking, until it releases the socket


def spin_setting() -> float:
    """How long an owner polls before it sleeps (settings.spin_seconds)."""
    return spin_seconds(SPIN_FEW_CPUS_S, alone=not worker_here())


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class TcpLink(asyncio.BufferedProtocol):
    """One end of a session, either side: the connection's protocol and the session's Link.

    The loop reads into buffers of the link's own (`get_buffer`): a blob's body once its length
    is known, so a large blob (a batch's upload) is copied once, by the kernel, into the buffer
    that is delivered, and small blobs into one reused buffer from which each is copied out."""

    pipeline_chunk = PIPELINE_CHUNK

    def __init__(self, peer: str = "tcp:?", on_made: Callable[[TcpLink], None] | None = None) -> None:
        self.peer = peer
        self._on_made = on_made
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._frames: deque[bytes | memoryview] = deque()
        self._queued = 0
        self._recv_waiter: asyncio.Future[None] | None = None
        self._head = bytearray()
        self._body: memoryview | None = None  # the blob being received, once its length is known
        self._filled = 0
        self._inbuf = memoryview(bytearray(_READ_BUFFER))  # where the loop reads between bodies
        self._vectored = False  # whether the transport's writelines writes without joining first
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
        # Ownership of the socket (module docstring): the mode and what goes with it, under _owner_lock.
        self._owner_lock = threading.Lock()
        self._mode = Mode.LOOP
        self._fd = -1  # the socket's, for an owner's I/O (-1: no owner ever)
        self._bell = -1  # eventfd the loop rings to ask an owner to release
        self._poll: select.poll | None = None
        self._wanted = False  # the loop asked the owner to release
        self._handed: deque[None] = deque()  # one per call handed to the loop (`call_on_loop`) not yet run
        self._handing_back = False  # an owner released to the loop, whose `_back` has not run yet
        self._on_back: list[Callable[[], None]] = []  # loop work waiting for the socket, in order
        self._owner_take: OnBlob | None = None  # the owner's receiver while it reads
        self._owner_failed: str | None = None  # why the owner gave up on the link (the loop fails it)
        self._owner_rest: bytes | None = None  # what the owner could not write: the loop writes it first
        self._park_paused = False  # reading paused by parking (not by a full receive buffer)
        self._parkable: Callable[[], bool] | None = None  # whether the session has nothing outstanding
        self._spin_s = 0.0  # how long an owner polls before it sleeps (set by the first claim)
        self._spinning = True  # the last wait of an owner ended within _spin_s: spin again

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        # uvloop's writelines is one writev; asyncio's joins the buffers first before Python 3.12.
        self._vectored = type(transport).__module__.startswith("uvloop") or sys.version_info >= (3, 12)
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if _DIRECT and sock.family in (socket.AF_INET, socket.AF_INET6):
                self._fd = sock.fileno()
        if self.peer == "tcp:?":
            name = self._transport.get_extra_info("peername")
            if isinstance(name, tuple):
                self.peer = f"tcp:{_address(name[0], name[1])}"
        self._timer = self._loop.call_later(KEEPALIVE_S, self._tick)
        if self._on_made is not None:
            self._on_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the loop reads next: the rest of the body being received (it lands where it is
        delivered from), else the reused read buffer."""
        body = self._body
        if body is not None:
            return body[self._filled :]
        return self._inbuf

    def buffer_updated(self, nbytes: int) -> None:
        body = self._body
        if body is not None:
            self._last_in = time.monotonic()
            self._filled += nbytes
            if self._filled == len(body):
                self._body = None
                self._deliver(body)
        else:
            self._take_in(self._inbuf[:nbytes])
        parkable = self._parkable
        if parkable is not None and parkable():
            self._park()

    def _take_in(self, data: bytes | memoryview) -> None:
        """Parse `data` (a buffer that is reused once this returns, unless it is `bytes`), handing
        each whole blob to `_deliver` (on the loop, or on an owner's thread)."""
        self._last_in = time.monotonic()
        end = len(data)
        if end > _PREFIX and self._body is None and not self._head and self._ended is None:
            n = int.from_bytes(data[:_PREFIX], "big")
            if n == end - _PREFIX:  # exactly one whole blob (a step's frame): no parsing loop
                self._deliver(data[_PREFIX:] if type(data) is bytes else bytes(data[_PREFIX:]))
                return
        view = memoryview(data)
        pos, end = 0, len(data)
        while pos < end and self._ended is None and self._owner_failed is None:
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
                    why = (
                        f"peer {self.peer} sent a malformed length prefix: {n} bytes is over the "
                        f"transport limit of {MAX_BLOB} bytes"
                    )
                    if self._mode is Mode.OWNED:
                        self._owner_failed = why  # the loop fails the link once the owner releases
                    else:
                        self._fail(why)
                    return
                if end - pos >= n:  # the whole blob is in this chunk: the common case for small ones
                    self._deliver(bytes(view[pos : pos + n]))
                    pos += n
                    continue
                # Not zero-filled: every byte is written before it is delivered.
                self._body, self._filled = np.empty(n, np.uint8).data, 0
            else:
                take = min(len(body) - self._filled, end - pos)
                body[self._filled : self._filled + take] = view[pos : pos + take]
                self._filled += take
                pos += take
                if self._filled == len(body):
                    self._body = None
                    self._deliver(body)

    def eof_received(self) -> bool:
        self._end(self._eof_why())
        return False  # close our side too once our queued writes are out

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self._end(f"connection to {self.peer} lost: {type(exc).__name__}: {exc}")
        else:
            self._end(f"peer {self.peer} closed the session")
        if self._timer is not None:
            self._timer.cancel()
        self._on_blob = self._parkable = None  # (they hold the session: no cycle outlives the connection)
        with self._owner_lock:  # LOOP already (only the loop closes the transport): no claim from now on
            self._mode, self._fd = Mode.LOOP, -1
            if self._bell >= 0:
                os.close(self._bell)
                self._bell = -1
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
            and self._mode is Mode.LOOP
            and not self._handing_back
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
        if self._mode is not Mode.LOOP or self._handing_back or self._park_paused:
            await self._own()
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
                for start in range(0, n, SLICE):
                    piece = view[start : start + SLICE]
                    if start:
                        transport.write(piece)
                    elif self._vectored:  # the prefix in the same syscall and segment as the body
                        transport.writelines((head, piece))
                    else:
                        transport.write(head)
                        transport.write(piece)
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
        await self._own()
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

    # -- ownership by a user thread (module docstring) -------------------------------------------

    def allow_parking(self, idle: Callable[[], bool] | None) -> None:
        """Park the socket after an arrival whenever `idle()` says the session has nothing
        outstanding, so that a user thread may claim it (None: never park)."""
        self._parkable = idle if self._fd >= 0 else None

    def try_claim(self) -> bool:
        """Make the calling thread the socket's owner if it is parked; whether it now is."""
        with self._owner_lock:
            if self._mode is not Mode.PARKED or self._handed:
                return False
            if self._poll is None:
                self._spin_s = spin_setting()
                self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                self._poll = select.poll()
                self._poll.register(self._fd, select.POLLIN)
                self._poll.register(self._bell, select.POLLIN)
            self._mode = Mode.OWNED
            self._wanted = False
            return True

    def call_on_loop(self, fn: Callable[[], None]) -> None:
        """From a user thread: run `fn` on the loop (which takes the socket back first, if it
        needs it). Until it has run, no thread claims the socket and the loop does not park it,
        so work handed over this way cannot be overtaken by a claimer's; an owner is asked to
        release now."""
        self._handed.append(None)  # (atomic: no lock on the common path; checked under it)
        if self._mode is Mode.OWNED:
            with self._owner_lock:
                if self._mode is Mode.OWNED:
                    self._ring()
        self._loop.call_soon_threadsafe(self._loop_call, fn)

    def _loop_call(self, fn: Callable[[], None]) -> None:
        self._handed.popleft()
        fn()

    @property
    def loop_has_it(self) -> bool:
        """On the loop: whether it has the socket now, reading (`take_back` is then not needed)."""
        return self._mode is Mode.LOOP and not self._handing_back and not self._park_paused

    def take_back(self, then: Callable[[], None]) -> bool:
        """On the loop, before it does I/O or session work on this link: True when the loop has
        the socket (reading resumed). False when an owner has it: asked to release, and `then`
        runs on the loop once it has, after whatever waited before it."""
        with self._owner_lock:
            if self._mode is Mode.OWNED or self._handing_back:
                self._on_back.append(then)
                if self._mode is Mode.OWNED:
                    self._ring()
                return False
            self._mode = Mode.LOOP
        self._resume_parked()
        return True

    def release(self, keep: bool, then: Callable[[], None] | None = None) -> None:
        """The owner gives the socket up: parked again if `keep` and nothing needs the loop, else
        to the loop, which writes what the owner could not, fails the link if the owner found it
        broken, then runs what waited for it, and `then`."""
        with self._owner_lock:
            self._owner_take = None
            if then is not None:
                self._on_back.append(then)
            if (
                then is None
                and keep
                and not self._wanted
                and self._owner_failed is None
                and self._owner_rest is None
                and not self._head
                and self._body is None
            ):
                self._mode = Mode.PARKED
                return
            self._mode = Mode.LOOP
            self._wanted = False
            self._handing_back = True
        self._loop.call_soon_threadsafe(self._back)

    def write_direct(self, blob: bytes | bytearray) -> bool:
        """The owner writes `blob` now; False when it could not write it whole: the rest, or the
        failure, is the loop's once the owner releases the socket, which it must then do before
        it writes anything else."""
        check_size(blob)
        return self._write_owned(len(blob).to_bytes(_PREFIX, "big"), blob)

    def read_direct(self, take: OnBlob) -> bool:
        """The owner waits for bytes, at most `KEEPALIVE_S` (sending a heartbeat if it wrote
        nothing for as long), and hands each whole blob that arrives to `take`, which must take
        it. False when the owner must release the socket to the loop: the loop asked for it, or
        the link is broken (the loop then fails it, saying why).

        It polls without sleeping for up to `_spin_s` first, yielding the CPU to any other thread
        that wants it, as long as the last wait ended within that time (a reply on loopback or a
        LAN; a slower one makes the next wait sleep at once, until a wait is short again), as CUDA
        spins on a synchronize while it has the cores: a sleeping thread costs the peer's write
        that wakes it, and itself, the wake-up of an idle CPU. Measured on the 2-core machine,
        the jitted tiny step over tcp (client on CPU 0, worker on CPU 1, bench/step_trace.py's
        stages, interleaved runs): 214 -> 165 µs a step (a write to a sleeping reader costs ~11
        µs more here, the sleeper's wake-up and cold caches the rest), for ~40 µs more of the
        client's CPU a step; with client and worker on one CPU, 202 -> 197 µs (the worker runs
        during the client's write there, the answer is in before the client polls)."""
        poll = self._poll
        assert poll is not None and self._mode is Mode.OWNED
        self._owner_take = take
        readable = False
        ready = None
        start = time.perf_counter()
        if self._spinning and self._spin_s:
            end = start + self._spin_s
            while not (ready := poll.poll(0)) and time.perf_counter() < end:
                os.sched_yield()
        if not ready:
            ready = poll.poll(KEEPALIVE_S * 1000)
            self._spinning = time.perf_counter() - start <= self._spin_s
        for fd, _ in ready:
            if fd == self._bell:
                try:
                    os.eventfd_read(self._bell)
                except BlockingIOError:
                    pass
            else:
                readable = True
        if self._wanted:
            return False
        now = time.monotonic()
        if now - self._last_out >= KEEPALIVE_S and not self._write_owned(_HEARTBEAT_BYTES):
            return False  # (a peer's heartbeats wake the poll: ours go whether or not it timed out)
        if not readable:
            if now - self._last_in > DEAD_AFTER_S:
                self._owner_failed = f"no sign of life from peer {self.peer} for {now - self._last_in:.1f} s"
                return False
            return True
        try:
            data = os.read(self._fd, _DIRECT_READ)
        except BlockingIOError:
            return True
        except OSError as e:
            self._owner_failed = f"connection to {self.peer} lost: {type(e).__name__}: {e}"
            return False
        if not data:
            self._owner_failed = self._eof_why()
            return False
        self._take_in(data)
        return self._owner_failed is None

    def _write_owned(self, head: bytes, body: bytes | bytearray = b"") -> bool:
        try:
            sent = os.writev(self._fd, (head, body)) if body else os.write(self._fd, head)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            self._owner_failed = f"send to {self.peer} failed: {type(e).__name__}: {e}"
            return False
        self._last_out = time.monotonic()
        if sent < len(head) + len(body):
            self._owner_rest = (head + body)[sent:]
            return False
        return True

    def _ring(self) -> None:
        """Ask the owner to release (under _owner_lock)."""
        if not self._wanted:
            self._wanted = True
            os.eventfd_write(self._bell, 1)

    def _park(self) -> None:
        """On the loop, after an arrival: stop reading and let a user thread claim the socket, if
        nothing is in flight on this link."""
        transport = self._transport
        if (
            self._mode is not Mode.LOOP
            or self._handing_back
            or transport is None
            or transport.is_closing()
            or self._ended is not None
            or self._closed
            or self._frames
            or self._head
            or self._body is not None
            or self._read_paused
            or self._write_paused
            or self._send_lock.locked()
            or transport.get_write_buffer_size()
        ):
            return
        with self._owner_lock:  # a claimer waits for the whole of it (pause_reading may let go of the GIL)
            if self._handed:
                return
            if not self._park_paused:
                transport.pause_reading()
                self._park_paused = True
            self._mode = Mode.PARKED

    def _resume_parked(self) -> None:
        """On the loop, holding the socket: read again if parking paused reading (the silence
        meanwhile is not counted against the peer, as while a full buffer pauses it)."""
        if self._park_paused:
            self._park_paused = False
            transport = self._transport
            if transport is not None and not transport.is_closing():
                self._last_in = time.monotonic()
                transport.resume_reading()

    def _back(self) -> None:
        """On the loop, once an owner released the socket to it: the owner's unwritten bytes go
        first, or its failure ends the link; then what waited for the socket runs, in order."""
        rest, self._owner_rest = self._owner_rest, None
        failed, self._owner_failed = self._owner_failed, None
        with self._owner_lock:
            self._handing_back = False
            waiting, self._on_back = self._on_back, []
        transport = self._transport
        if failed is not None:
            self._fail(failed)
        elif rest is not None and transport is not None and not transport.is_closing():
            transport.write(rest)
            self._resume_parked()
        else:
            self._resume_parked()
        for then in waiting:
            then()

    async def _own(self) -> None:
        """On the loop: wait until the loop has the socket."""
        while True:
            back = self._loop.create_future()

            def wake(back: asyncio.Future[None] = back) -> None:
                if not back.done():
                    back.set_result(None)

            if self.take_back(wake):
                return
            await back

    def _eof_why(self) -> str:
        if self._body is not None or self._head:
            got = self._filled + _PREFIX if self._body is not None else len(self._head)
            want = len(self._body) + _PREFIX if self._body is not None else _PREFIX
            return f"peer {self.peer} closed the connection in the middle of a blob ({got} of {want} bytes)"
        return f"peer {self.peer} closed the session"

    # -- internals -------------------------------------------------------------------------------

    def _deliver(self, frame: bytes | memoryview) -> None:
        owner_take = self._owner_take
        if owner_take is not None:  # an owner reads: it takes every blob (its session cannot decline one)
            owner_take(frame)
            return
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
        if self._mode is not Mode.LOOP or self._handing_back or self._park_paused:
            # Owned: its owner keeps the link alive meanwhile. Parked and quiet: the loop reads
            # again (liveness, heartbeats); parked by a user thread that keeps it busy: left so.
            quiet = now - self._last_in >= KEEPALIVE_S or now - self._last_out >= KEEPALIVE_S
            if self._mode is Mode.OWNED or not quiet or not self.take_back(lambda: None):
                self._timer = self._loop.call_later(KEEPALIVE_S, self._tick)
                return
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
