"""The client's half of the session protocol (docs/internals.md section 6), on the I/O loop thread.

It owns the Link and the Channel: seals batches (one MESSAGE frame whose plaintext ends with the
bytes of the small uploads, then the larger uploads' BULK frames), sending a batch that is the
previous one with ids shifted as a Repeat, and packs them into as few blobs as the transport allows; opens replies and decrypts results
straight into preallocated arrays; keeps every unacknowledged batch, and on `GraphUnknown`
resends from that batch with the graph registered first. User threads never touch it except
through `call_soon_threadsafe` (and the futures it resolves).

When the link drops and a `resumer` is set (client/reconnect.py), the session is resumed on a new
link instead of failing: the worker says which batch it applied last, every later batch goes again
in full, in order, and the worker sends again the replies this side had not taken in whole (each
batch tells it, as `received`, the last Reply ack taken in with all its bytes).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from emberlink.client.executor import ExecutorStats
from emberlink.client.reconnect import Resumed, Resumer
from emberlink.errors import EmberlinkError, ProtocolError, RemoteError, TransportError, WorkerLost
from emberlink.protocol import messages as m
from emberlink.protocol.channel import (
    BULK,
    CHUNK_SIZE,
    MAX_PLAINTEXT,
    MESSAGE,
    OVERHEAD,
    Channel,
    pack_frames,
    split_frames,
)
from emberlink.transport.base import Link

log = logging.getLogger("emberlink.client")

PROGRESS_BYTES = 64 << 20
"""Transfers larger than this show a progress bar when stderr is a terminal."""


@dataclass(slots=True)
class OutBatch:
    """A batch as the client keeps it until acknowledged: its messages and the uploads' arrays."""

    seq: int
    messages: list[m.ClientMessage]
    bulks: list[np.ndarray]
    nbytes: int


@dataclass(slots=True)
class Counters:
    """What `dev.stats()` reports for a remote device; written on the loop, read anywhere."""

    path: str
    bytes_sent: int = 0
    bytes_received: int = 0
    round_trips: int = 0
    bytes_uploaded: int = 0  # array bytes handed to upload() (written by the user's thread)
    batches_sent: int = 0
    batches_resent: int = 0
    batches_repeated: int = 0  # sent as a Repeat of the batch before
    graphs_registered: int = 0
    graph_replays: int = 0
    graph_cache_misses: int = 0
    resumes: int = 0  # times the session was resumed on a new link
    resume_ms: int = 0  # how long the last resume took, from the drop noticed to the worker's answer

    def as_dict(self) -> ExecutorStats:
        # Each field is a key of ExecutorStats of its type (checked by a test, see ExecutorStats).
        return cast(ExecutorStats, {name: getattr(self, name) for name in self.__dataclass_fields__})


@dataclass(slots=True)
class _Incoming:
    """A Result whose bytes are still arriving."""

    rid: int
    array: np.ndarray
    view: memoryview | None
    remaining: int
    bar: Any = None


@dataclass(slots=True)
class Flow:
    """Acknowledgement callbacks into the executor (which owns flow control on the user side)."""

    on_ack: Callable[[int, int], None]
    on_dead: Callable[[EmberlinkError], None]
    futures: dict[int, Future[Any]] = field(default_factory=dict)


def _progress(total: int, what: str) -> Any:
    """A tqdm bar for a large transfer when stderr is a terminal, else None."""
    if total <= PROGRESS_BYTES or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=what, leave=False)


class ClientSession:
    """Sends batches and handles replies for one remote executor; runs on its loop only."""

    def __init__(
        self,
        link: Link,
        channel: Channel,
        limits: dict[str, int],
        graphs: dict[bytes, bytes],
        counters: Counters,
        flow: Flow,
        worker: str,
        *,
        templates: bool = True,
    ) -> None:
        self._link = link
        self._channel = channel
        self.chunk_size = min(max(limits.get("chunk_size", CHUNK_SIZE), 4096), 4 << 20)
        self._graphs = graphs
        self._counters = counters
        self._flow = flow
        self._worker = worker
        self._next_seq = 1
        self._unacked: dict[int, OutBatch] = {}
        self._queue: deque[OutBatch] = deque()
        self._sent_upto = 0  # highest seq whose sending has started
        self._finished_upto = 0  # highest seq sent completely
        self._wake = asyncio.Event()
        self._results: deque[_Incoming] = deque()
        # Step templates: the messages of the batch sent last (expanded), which the worker keeps too.
        self.templates = templates
        self._template: tuple[m.ClientMessage, ...] | None = None
        self.dead: EmberlinkError | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Resume: the last Reply ack taken in whole (told to the worker with every batch), the one of
        # a reply whose result bytes are still coming, and the reconnection in progress.
        self.resumer: Resumer | None = None
        self.closing = False  # a Close went out: a dropped link now ends the session
        self._received = 0
        self._receiving = 0
        self._resuming: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._send_loop(), name=f"send {self._link.peer}"),
            asyncio.create_task(self._recv_loop(), name=f"recv {self._link.peer}"),
        ]

    # -- sending ---------------------------------------------------------------------------------------

    def submit(self, messages: list[m.ClientMessage], bulks: list[np.ndarray], nbytes: int) -> None:
        """Queue one batch (called on the loop through call_soon_threadsafe)."""
        if self.dead is not None:
            return
        batch = OutBatch(self._next_seq, messages, bulks, nbytes)
        self._next_seq += 1
        if messages and type(messages[-1]) is m.Close:
            self.closing = True
        self._unacked[batch.seq] = batch
        self._queue.append(batch)
        self._wake.set()

    async def _send_loop(self) -> None:
        try:
            while True:
                while not self._queue:
                    self._wake.clear()
                    await self._wake.wait()
                batch = self._queue.popleft()
                resent = batch.seq <= self._sent_upto
                if resent:
                    self._counters.batches_resent += 1
                self._sent_upto = max(self._sent_upto, batch.seq)
                self._counters.batches_sent += 1
                await self._send_frames(self._frames(batch, resent))
                self._finished_upto = max(self._finished_upto, batch.seq)
        except TransportError as e:
            self._link_lost(f"lost worker {self._worker} while sending: {e}")
        except EmberlinkError as e:
            self.fail(e)

    def _layout(
        self, batch: OutBatch, inline: bool
    ) -> tuple[tuple[m.ClientMessage, ...], list[np.ndarray], list[np.ndarray]]:
        """The batch's messages with the uploads that travel inline marked, those uploads' arrays
        and the others'. Inline, in message order: every upload that still fits in one chunk
        together with the inline ones before it; the rest go in BULK frames."""
        if not batch.bulks:
            return tuple(batch.messages), [], []
        messages: list[m.ClientMessage] = []
        tail: list[np.ndarray] = []
        bulks: list[np.ndarray] = []
        arrays = iter(batch.bulks)
        room = self.chunk_size if inline else 0
        for msg in batch.messages:
            if type(msg) is m.Upload and msg.nbytes:
                array = next(arrays)
                if msg.nbytes <= room:
                    room -= msg.nbytes
                    tail.append(array)
                    msg = m.Upload(msg.tid, msg.dtype, msg.shape, msg.nbytes, True)
                else:
                    bulks.append(array)
            messages.append(msg)
        return tuple(messages), tail, bulks

    def _frames(self, batch: OutBatch, resent: bool = False) -> Iterator[bytes | bytearray]:
        channel = self._channel
        messages, tail, bulks = self._layout(batch, True)
        wire: tuple[m.ClientMessage, ...] = messages
        repeat = None
        # A batch resent after GraphUnknown always goes in full; otherwise a batch that is the one
        # sent just before with ids shifted goes as a Repeat. The worker expands a Repeat against
        # the batch it received just before, which is the one sent just before: same frames, same order.
        if self.templates and not resent and self._template is not None:
            repeat = m.repeat_of(self._template, messages)
            if repeat is not None:
                wire = (repeat,)
                self._counters.batches_repeated += 1
        head = m.encode_batch(m.Batch(batch.seq, wire, self._received))
        if tail and len(head) + sum(a.nbytes for a in tail) > MAX_PLAINTEXT:
            messages, tail, bulks = self._layout(batch, False)  # a huge batch: every upload in BULK
            wire = messages
            head = m.encode_batch(m.Batch(batch.seq, wire, self._received))
            if repeat is not None:
                self._counters.batches_repeated -= 1
        self._template = messages
        if tail:
            yield channel.seal_parts([head, *(a.data.cast("B") for a in tail)], MESSAGE)
        else:
            yield channel.seal(head, MESSAGE)
        bar = _progress(batch.nbytes, "upload")
        for array in bulks:
            for frame in channel.seal_chunks(array.data.cast("B"), self.chunk_size):
                if bar is not None:
                    bar.update(len(frame) - OVERHEAD)
                yield frame
        if bar is not None:
            bar.close()

    async def _send_frames(self, frames: Iterator[bytes | bytearray]) -> None:
        for blob in pack_frames(frames):
            await self._link.send(blob)
            self._counters.bytes_sent += len(blob)

    # -- receiving -------------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        try:
            while True:
                blob = await self._link.recv()
                self._counters.bytes_received += len(blob)
                for frame in split_frames(blob):
                    if frame[1] == BULK:
                        self._on_bulk(frame)
                    else:
                        self._on_reply(frame)
        except TransportError as e:
            self._link_lost(f"lost worker {self._worker}: {e}")
        except EmberlinkError as e:
            self.fail(e)

    def _on_reply(self, frame: memoryview) -> None:
        if self._results:
            raise ProtocolError("worker sent a reply before the bytes of its previous result")
        kind, plaintext = self._channel.open(frame)
        if kind is not MESSAGE:
            raise ProtocolError(f"expected a MESSAGE frame, got {kind.name}")
        reply, start = m.decode_reply_prefix(plaintext)
        m.check_reply_tail(reply, len(plaintext) - start)
        self._acknowledge(reply.ack)
        for msg in reply.messages:
            match msg:
                case m.Result(inline=True):
                    self._on_inline_result(msg, plaintext, start)
                    start += msg.nbytes
                case m.Result():
                    self._on_result(msg)
                case m.Done():
                    self._resolve(msg.rid, None)
                case m.StatsReply():
                    self._resolve(msg.rid, dict(msg.stats))
                case m.Error():
                    self._on_error(msg)
                case m.GraphUnknown():
                    self._resend(msg)
        if self._results:
            self._receiving = reply.ack  # taken in whole once its results' bytes are in
        else:
            self._received = max(self._received, reply.ack)

    def _acknowledge(self, ack: int) -> None:
        batches = nbytes = 0
        unacked = self._unacked
        while unacked:
            seq = next(iter(unacked))
            if seq > ack:
                break
            nbytes += unacked.pop(seq).nbytes
            batches += 1
        if batches:
            self._flow.on_ack(batches, nbytes)

    def _resolve(self, rid: int, value: Any) -> None:
        fut = self._flow.futures.pop(rid, None)
        if fut is not None and not fut.done():  # a duplicate answer is ignored
            fut.set_result(value)

    def _on_error(self, msg: m.Error) -> None:
        error = RemoteError.from_wire(msg.code, msg.message)
        if msg.rid == 0:
            raise _SessionOver(error)
        fut = self._flow.futures.pop(msg.rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(error)

    def _on_result(self, msg: m.Result) -> None:
        array = np.empty(msg.shape, dtype=msg.dtype)
        if msg.nbytes == 0:
            self._resolve(msg.rid, array)
            return
        view = array.data.cast("B") if msg.rid in self._flow.futures else None
        self._results.append(_Incoming(msg.rid, array, view, msg.nbytes, _progress(msg.nbytes, "download")))

    def _on_inline_result(self, msg: m.Result, plaintext: bytes, start: int) -> None:
        """A result whose bytes came in the reply's own frame, at `start` of its plaintext."""
        if msg.rid not in self._flow.futures:
            return  # nobody waits for it any more
        array = np.empty(msg.shape, dtype=msg.dtype)
        array.data.cast("B")[:] = memoryview(plaintext)[start : start + msg.nbytes]
        self._resolve(msg.rid, array)

    def _on_bulk(self, frame: memoryview) -> None:
        if not self._results:
            raise ProtocolError("BULK frame without a result announcing it")
        target = self._results[0]
        n = self._channel.open_bulk(frame, target.view, target.remaining, "result")
        target.remaining -= n
        if target.bar is not None:
            target.bar.update(n)
        if target.remaining == 0:
            self._results.popleft()
            if target.bar is not None:
                target.bar.close()
            self._resolve(target.rid, target.array)
            if not self._results:
                self._received = max(self._received, self._receiving)

    def _resend(self, msg: m.GraphUnknown) -> None:
        """The worker lacks a graph that batch `msg.seq` executes: register it there and resend."""
        first = self._unacked.get(msg.seq)
        if first is None:
            return  # stale: that batch was acknowledged already
        body = self._graphs.get(msg.gid)
        if body is None:
            raise ProtocolError(f"worker asked for graph {msg.gid.hex()}, which this client never sent")
        self._counters.graph_cache_misses += 1
        first.messages.insert(0, m.Register(msg.gid, body))
        resend = [b for seq, b in self._unacked.items() if msg.seq <= seq <= self._sent_upto]
        seqs = {b.seq for b in resend}
        self._queue = deque(resend + [b for b in self._queue if b.seq not in seqs])
        self._wake.set()

    # -- resuming --------------------------------------------------------------------------------------

    def _link_lost(self, why: str) -> None:
        """The link broke: resume on a new one if this session may, else the session is over."""
        if self.dead is not None or self._resuming is not None:
            return
        if self.resumer is None or self.closing or self.resumer.window <= 0:
            self.fail(WorkerLost(why))
            return
        self._resuming = asyncio.get_running_loop().create_task(
            self._resume(why), name=f"resume {self._worker}"
        )

    async def _resume(self, why: str) -> None:
        assert self.resumer is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        for task in self._tasks:
            task.cancel()
        loop.create_task(self._link.close())  # a dead link may take a while to close: not waited for
        log.warning("%s; resuming the session on a new link", why)
        try:
            resumed = await self.resumer.resume(self._received, why)
        except EmberlinkError as e:
            self._resuming = None
            self.fail(e)
            return
        self._resuming = None
        self._counters.resumes += 1
        self._counters.resume_ms = round((loop.time() - started) * 1000)
        self._take_up(resumed)
        log.warning(
            "resumed the session with worker %s over %s after %.2f s (it had applied batch %d)",
            self._worker,
            resumed.path,
            loop.time() - started,
            resumed.applied,
        )

    def _take_up(self, resumed: Resumed) -> None:
        """Carry on over a resumed link: everything the worker had not applied goes again, in full."""
        self._link, self._channel = resumed.link, resumed.channel
        self._counters.path = resumed.path
        for target in self._results:  # a result cut short: the worker sends it again
            if target.bar is not None:
                target.bar.close()
        self._results.clear()
        self._template = None  # the worker's template is gone with the old link
        self._acknowledge(resumed.applied)
        self._queue = deque(self._unacked.values())
        self._finished_upto = min(self._finished_upto, resumed.applied)
        self.start()
        self._wake.set()

    # -- ending ----------------------------------------------------------------------------------------

    def fail(self, error: EmberlinkError) -> None:
        """The session is over: every waiting future and every later call gets `error`."""
        if isinstance(error, _SessionOver):
            error = error.error
        if self.dead is not None:
            return
        self.dead = error
        for target in self._results:
            if target.bar is not None:
                target.bar.close()
        self._results.clear()
        futures = self._flow.futures
        for rid in list(futures):
            fut = futures.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_exception(error)
        self._flow.on_dead(error)
        for task in [*self._tasks, self._resuming]:
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        asyncio.get_running_loop().create_task(self._link.close())

    async def drain(self, timeout: float) -> None:
        """Wait until everything queued has been sent (or the session died), at most `timeout` s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.dead is None and (self._queue or self._finished_upto < self._next_seq - 1):
            if loop.time() > deadline:
                return
            await asyncio.sleep(0.005)

    async def shutdown(self, timeout: float) -> None:
        """End the session politely: a Close (so the worker frees it at once rather than keeping it
        for a resume), at most `timeout` s to send what is queued, then close."""
        if self.dead is None and not self.closing:
            self.submit([m.Close("client closed")], [], 0)
        await self.drain(timeout)
        await self.close()

    async def close(self) -> None:
        self.closing = True
        for task in [*self._tasks, self._resuming]:
            if task is not None:
                task.cancel()
        await self._link.close()
        if self.dead is None:
            self.dead = WorkerLost(f"the session with worker {self._worker} is closed")


class _SessionOver(ProtocolError):
    """Internal: the worker ended the session with Error(0, ...); carries that error."""

    def __init__(self, error: RemoteError) -> None:
        super().__init__(str(error))
        self.error = error
