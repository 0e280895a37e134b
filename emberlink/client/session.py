"""The client's session pump (docs/internals.md section 6), on the I/O loop thread: moves frames between the Link and the ClientConnection; no protocol rules here.

The protocol itself (seqs, acks, templates, resend on `GraphUnknown`, layout, the received mark)
is protocol/session.py's `ClientConnection`. This pump sends the frames it gives, packed into as
few blobs as the transport allows, feeds it the blobs that arrive, and acts on its events:
resolves the futures user threads wait on and tells the executor about acks. Results are
decrypted straight into arrays allocated here. User threads never touch it except through
`hand_over` (`call_soon_threadsafe`), the futures it resolves, and `request_direct` (below).

Over a link a user thread can own (the raw TCP link's, transport/tcp.py), a batch that a thread
waits for at once (a blocking read, `sync`) may skip the loop: `request_direct`, on that thread,
seals and writes it and reads until its answer has come, when the session has nothing else
outstanding (the link is parked then: the loop touches neither it nor the connection until the
thread releases it). Anything that needs the loop meanwhile makes the thread release at once.
Between its write and its read the thread may run work that sends more (`after_sent`: the host
DataLoader's next batch), whose batches it writes too (`send_owned`), after the one it waits for;
a batch nobody waits for also goes from a thread that finds the link parked (`send_owned`).

When the link drops and a `resumer` is set (client/reconnect.py), the session is resumed on a new
link instead of failing: the worker says which batch it applied last, every later batch goes again
in full, in order, and the worker sends again the replies this side had not taken in whole (each
batch tells it, as `received`, the last Reply ack taken in with all its bytes).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, assert_never, cast, runtime_checkable

import numpy as np

from emberlink.client.executor import ExecutorStats
from emberlink.client.reconnect import Resumed, Resumer
from emberlink.errors import (
    ConfigError,
    EmberlinkError,
    ProtocolError,
    RemoteError,
    TransportError,
    WorkerLost,
)
from emberlink.protocol import messages as m
from emberlink.protocol import session as s
from emberlink.protocol.channel import CHUNK_SIZE, OVERHEAD, Channel, pack_frames
from emberlink.protocol.session import (
    Acknowledged,
    GraphUnknownResent,
    ReplyReady,
    RequestFailed,
    ResultArrived,
    ResultProgress,
    SessionEnded,
    Staged,
)
from emberlink.settings import env_number
from emberlink.transport.base import Blob, CallbackLink, Link, OwnableLink, offer_receiver

log = logging.getLogger("emberlink.client")

PROGRESS_BYTES = 64 << 20
"""Transfers larger than this show a progress bar when stderr is a terminal."""

SEND_NOW_BYTES = 64 << 10
"""A batch with at most this many upload bytes is sealed and written where it is submitted when the
sender task is idle and the link can write at once (`ClientSession._send_now`)."""
DIRECT_BYTES = 1 << 20
"""A batch with at most this many upload bytes (one blob, or its pipelined chunks' blobs) may be
sent and answered on the thread that waits for it (`ClientSession.request_direct`): the MLP step's
400 KB host batch is."""
PIPELINE_ENV = "EMBERLINK_PIPELINE_CHUNK"
"""Bytes: the BULK chunk size of uploads over a link that pipelines them (`Pipelined`), instead of
the link's own `pipeline_chunk`; 0: none smaller than the worker's (what gRPC and the relay use),
for measuring what pipelining saves (bench/remote_step.py --upload)."""


@runtime_checkable
class Pipelined(Protocol):
    """A link that hands each blob to the peer's session as it arrives and costs little per blob
    (the raw TCP link's): a host batch goes over it in BULK frames of `pipeline_chunk` bytes, each
    written as soon as it is sealed, so that the worker decrypts one while this side seals the
    next (docs/internals.md, "Pipelined uploads"). Measured on the 2-core machine (client and
    worker on a CPU each), the jitted step with a 401 KB host batch, a small op and a scalar read
    (bench/remote_step.py --upload 9 --quick): 598 µs laid out in one MESSAGE frame, 570 µs
    pipelined; the worker has the batch whole 72 instead of 109 µs after the client's last write."""

    pipeline_chunk: int


def pipeline_setting(link: Link) -> int:
    """The BULK chunk size of uploads over `link` when it pipelines them (`PIPELINE_ENV` says
    otherwise), else 0: the worker's chunk size goes."""
    if not isinstance(link, Pipelined):
        return 0
    chunk = env_number(PIPELINE_ENV, int, "bytes")
    if chunk is None:
        return link.pipeline_chunk
    if chunk and not s.MIN_CHUNK_SIZE <= chunk <= s.MAX_CHUNK_SIZE:
        raise ConfigError(
            f"{PIPELINE_ENV} must be 0 or between {s.MIN_CHUNK_SIZE} and {s.MAX_CHUNK_SIZE} bytes, got {chunk!r}"
        )
    return chunk


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
class Flow:
    """Acknowledgement callbacks into the executor (which owns flow control on the user side):
    `on_ack(batches, upload bytes, staging buffers freed)`, on whichever thread takes the reply."""

    on_ack: Callable[[int, int, tuple[Staged, ...]], None]
    on_dead: Callable[[EmberlinkError], None]
    futures: dict[int, Future[Any]] = field(default_factory=dict)
    waited: set[int] = field(default_factory=set)  # rids of futures a thread waits for at once


def _progress(total: int, what: str) -> Any:
    """A tqdm bar for a large transfer when stderr is a terminal, else None."""
    if total <= PROGRESS_BYTES or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=what, leave=False)


def _result_target(flow: Flow) -> s.ResultTarget:
    """Where a Result's bytes go: a fresh array, its bytes' view None when nobody waits for it.
    A closure over the flow, not the session, so the connection holds no cycle back."""

    def target(msg: m.Result) -> tuple[Any, memoryview | None]:
        if msg.rid not in flow.futures:
            return None, None
        array = np.empty(msg.shape, dtype=msg.dtype)
        return array, array.data.cast("B") if msg.nbytes else None  # (no view of zeros in a shape)

    return target


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
        self._loop = asyncio.get_running_loop()
        self._counters = counters
        self._flow = flow
        self._worker = worker
        self._conn = s.ClientConnection(
            channel,
            s.chunk_size_of(limits, CHUNK_SIZE),
            graphs,
            _result_target(flow),
            templates=templates,
            counters=counters,
        )
        self._finished_upto = 0  # highest seq sent completely
        self._wake = asyncio.Event()
        self._nowait: Callable[[Blob], bool] | None = None  # the link's send_nowait, if it has one
        self._ownable: OwnableLink | None = None  # the link, if a user thread can own it
        self._owning = False  # a user thread owns the link (request_direct)
        self._waited = False  # the last answer settled was one a thread waited for at once
        self._owner_then: list[Callable[[], None]] = []  # what it leaves for the loop to do
        self._owner: int | None = None  # the owning thread's id while it runs its after-sent work
        self._idle = False  # the sender task waits for work (nothing of it is being sent)
        self._unsent: tuple[int, Iterator[bytes | bytearray]] | None = None  # (seq, blobs) for the task
        self._bars: dict[int, Any] = {}  # rid -> progress bar of a large result arriving
        self.dead: EmberlinkError | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Resume: the reconnection in progress.
        self.resumer: Resumer | None = None
        self._resuming: asyncio.Task[None] | None = None
        self._pipeline(link)

    def _pipeline(self, link: Link) -> None:
        """Lay uploads out for `link`: over one that pipelines them (`Pipelined`), in BULK chunks
        of its size, each frame its own blob (sent as soon as sealed); else in the worker's
        chunks, frames packed into blobs of BLOB_TARGET (gRPC and the relay stream fastest so)."""
        chunk = pipeline_setting(link)
        self._conn.pipeline_chunk = chunk if 0 < chunk < self._conn.chunk_size else 0

    @property
    def closing(self) -> bool:
        """Whether a Close went out: a dropped link then ends the session."""
        return self._conn.closing

    @property
    def chunk_size(self) -> int:
        return self._conn.chunk_size

    def start(self) -> None:
        link = self._link
        self._tasks = [
            asyncio.create_task(self._send_loop(), name=f"send {link.peer}"),
            asyncio.create_task(self._recv_loop(), name=f"recv {link.peer}"),
        ]
        # Blobs taken as they arrive, where the link can, on both ends: the jitted tiny step over
        # tcp went from 304-321 to 291-292 µs (bench/remote_step.py --tiny 3, two interleaved
        # runs each). The task above still takes what the callback leaves and sees the link end.
        offer_receiver(link, lambda blob: self._take_blob(link, blob))
        self._nowait = link.send_nowait if isinstance(link, CallbackLink) else None
        self._ownable = link if isinstance(link, OwnableLink) else None
        if self._ownable is not None:
            self._ownable.allow_parking(self._idle_session)

    # -- sending ---------------------------------------------------------------------------------------

    def submit(
        self,
        messages: list[m.ClientMessage],
        bulks: list[np.ndarray],
        nbytes: int,
        staged: Staged | None = None,
    ) -> None:
        """Queue one batch (called on the loop through call_soon_threadsafe)."""
        if self.dead is not None:
            return
        ownable = self._ownable
        if (
            ownable is not None
            and not ownable.loop_has_it
            and not ownable.take_back(functools.partial(self.submit, messages, bulks, nbytes, staged))
        ):
            return  # a user thread owns the link: once it has released it
        conn = self._conn
        now = (
            self._idle
            and not conn.pending()
            and self._unsent is None  # (what an owner left unwritten goes first)
            and self._resuming is None
            and nbytes <= SEND_NOW_BYTES
        )
        conn.submit(messages, bulks, nbytes, staged)
        nowait = self._nowait
        if now and nowait is not None:
            self._send_now(nowait)
        else:
            self._wake.set()

    def _send_now(self, nowait: Callable[[Blob], bool]) -> None:
        """Seal and write the batch just queued from here, the sender task idle: its wake-up
        skipped (the jitted tiny step over tcp: 324-336 -> 313-318 µs, bench/remote_step.py --tiny 2,
        three interleaved runs each on a loaded machine). What
        the link cannot take at once is left to the task."""
        try:
            if not self._write_next(nowait, retry_refused=True):
                self._wake.set()
        except EmberlinkError as e:
            self.fail(e)

    def _write_next(self, write: Callable[[bytes | bytearray], bool], *, retry_refused: bool) -> bool:
        """Seal the next queued batch and `write` its blobs until one is refused. True when all
        went: the next batch is predicted then, while the worker works on this one. False leaves
        the rest in `_unsent` for the send task, the refused blob too with `retry_refused` (the
        link's `send_nowait` writes nothing when it refuses; an owner's `write_direct` leaves what
        it could not write to the link itself)."""
        seq, _, frames = self._conn.next_frames_of()
        blobs = self._blobs(frames)
        for blob in blobs:
            if not write(blob):
                self._unsent = (seq, itertools.chain([blob], blobs) if retry_refused else blobs)
                return False
            self._counters.bytes_sent += len(blob)
        self._finished_upto = max(self._finished_upto, seq)
        self._conn.predict()
        return True

    # -- a user thread's own round trip ---------------------------------------------------------------

    def hand_over(
        self,
        messages: list[m.ClientMessage],
        bulks: list[np.ndarray],
        nbytes: int,
        staged: Staged | None = None,
    ) -> None:
        """From a user thread: `submit` the batch on the loop (no thread claims the link before)."""
        ownable = self._ownable
        if ownable is not None:
            ownable.call_on_loop(functools.partial(self.submit, messages, bulks, nbytes, staged))
        else:
            self._loop.call_soon_threadsafe(self.submit, messages, bulks, nbytes, staged)

    def request_direct(
        self,
        messages: list[m.ClientMessage],
        bulks: list[np.ndarray],
        nbytes: int,
        staged: Staged | None,
        answer: Future[Any],
        after_sent: Callable[[], None] | None = None,
    ) -> bool:
        """From a user thread that waits for `answer` at once: send the batch and read until
        `answer` is settled on this thread, if the link is parked (nothing else outstanding);
        False, having done nothing, if not (`submit` it through the loop then). The thread
        releases the link to the loop when something needs it: `answer` is then the loop's to
        settle. Measured on the jitted tiny step over tcp (uvloop, worker in another process,
        bench/step_trace.py, three interleaved runs each): the step 256-315 -> 237-251 µs, the
        client's CPU a step (user thread + I/O thread) 126-163 -> 112-119 µs.

        `after_sent` (when True is returned) runs on this thread once the batch is out and before
        it reads: still owning the link if the batch went whole, so that a batch it flushes goes
        from here too, after this one (`send_owned`); the host DataLoader's next batch is sealed
        and written there while the worker runs this step, with no hand-off to the loop and back
        (the small MLP's loader step on the H200: see data.py)."""
        link = self._ownable
        if self._owner is not None and self._owner == threading.get_ident():
            if self._owning:  # a read inside this thread's after_sent work: the loop must read for both
                self._release(False)
            return False
        if link is None or nbytes > DIRECT_BYTES or not link.try_claim():
            return False
        if (
            not self._round_trip_owned(link, messages, bulks, nbytes, staged, answer, after_sent)
            and after_sent
        ):
            after_sent()  # the batch did not go whole from here: the link is the loop's now
        return True

    def _round_trip_owned(
        self,
        link: OwnableLink,
        messages: list[m.ClientMessage],
        bulks: list[np.ndarray],
        nbytes: int,
        staged: Staged | None,
        answer: Future[Any],
        after_sent: Callable[[], None] | None,
    ) -> bool:
        """request_direct's round trip on the claimed link; whether it ran `after_sent`."""
        # This thread owns the link: the loop touches neither it nor the connection until released.
        keep = ran = False
        then = self._owner_then
        self._owning = True
        try:
            if not self._write_owned(link, messages, bulks, nbytes, staged):
                return ran
            if after_sent is not None:
                ran = True
                self._owner = threading.get_ident()
                try:
                    after_sent()
                finally:
                    self._owner = None
                if not self._owning:  # it let the link go (`read_acks`)
                    return ran
            while not answer.done() and not then:
                if not link.read_direct(self._take_direct):
                    return ran
            keep = not then and self._idle_session()
        except EmberlinkError as e:
            then.append(functools.partial(self.fail, e))
        finally:
            if self._owning:
                self._release(keep)
        return ran

    def _release(self, keep: bool) -> None:
        """The owning thread gives the link up (parked again if `keep` and nothing needs the loop)."""
        assert self._ownable is not None
        then = self._owner_then
        self._owning = False
        self._owner_then = []
        self._ownable.release(keep, _in_order(then) if then else None)

    def send_owned(
        self,
        messages: list[m.ClientMessage],
        bulks: list[np.ndarray],
        nbytes: int,
        staged: Staged | None,
    ) -> bool:
        """From a user thread, for a batch nobody waits for: seal and write it on this thread if it
        owns the link already, running its `after_sent` work (`request_direct`: right after the
        batch it waits for, as the wire had them), or can claim it (parked: the host DataLoader's
        first batch of an epoch), parking it again after; False, having done nothing, if not
        (`hand_over` it then). A batch over DIRECT_BYTES, or one behind bytes the loop must write
        first, lets an owner's link go to the loop (its answer is then the loop's to settle)."""
        link = self._ownable
        if link is None:
            return False
        if self._owner == threading.get_ident():
            if not self._owning:
                return False
            if self._owner_then or nbytes > DIRECT_BYTES:
                self._release(False)
                return False
            self._write_owned(link, messages, bulks, nbytes, staged)
            return True
        if nbytes > DIRECT_BYTES or not link.try_claim():
            return False
        self._owning = True
        keep = False
        try:
            keep = self._write_owned(link, messages, bulks, nbytes, staged) and self._idle_session()
        finally:
            self._release(keep)
        return True

    def _write_owned(
        self,
        link: OwnableLink,
        messages: list[m.ClientMessage],
        bulks: list[np.ndarray],
        nbytes: int,
        staged: Staged | None,
    ) -> bool:
        """Queue and write one batch on the owning thread; whether it went whole (else what is
        left, or the failure, is the loop's once the link is released)."""
        try:
            self._conn.submit(messages, bulks, nbytes, staged)
            if self._write_next(link.write_direct, retry_refused=False):
                return True
            self._owner_then.append(self._wake.set)  # the rest goes from the loop, in order
        except EmberlinkError as e:
            self._owner_then.append(functools.partial(self.fail, e))
        return False

    def read_acks(self) -> None:
        """From a user thread about to wait for acknowledgements (flow control): make sure the
        link is read. An owner in its `after_sent` work lets it go to the loop; a parked link (it
        may park with batches unacknowledged, `_idle_session`) is taken back by the loop."""
        if self._owner == threading.get_ident():
            if self._owning:
                self._release(False)
        elif self._ownable is not None:
            self._ownable.call_on_loop(self._take_link)

    def _take_link(self) -> None:
        ownable = self._ownable
        if ownable is not None and not ownable.loop_has_it:
            ownable.take_back(_nothing)

    def _take_direct(self, blob: bytes | memoryview) -> bool:
        """The owning thread's receiver (as `_take_blob` is the loop's); what only the loop may
        do is left in `_owner_then`."""
        self._counters.bytes_received += len(blob)
        try:
            self._on_events(self._conn.receive(blob))
        except TransportError as e:
            why = f"lost worker {self._worker}: {e}"
            self._owner_then.append(lambda: self._link_lost(why))
        except EmberlinkError as e:
            self._owner_then.append(functools.partial(self.fail, e))
        return True

    def _idle_session(self) -> bool:
        """Whether the link may park: nothing is outstanding (no answer awaited, no batch queued
        or half sent), and the last answer was one a thread waited for at once, so the next batch
        is likely one too (a loop that reads its losses late would only pay for parking and
        taking the link back each step: +10 µs of the loop's CPU a step, measured). Batches sent
        whole but not yet acknowledged do not keep it from parking: their acks wait in the socket
        for the next thread to read it (the host DataLoader's next batch is one such, every step,
        and its ack comes with the next step's answer, or the worker's ACK_DELAY after it); a
        thread that must wait for acks (flow control) asks for the link first (`read_acks`)."""
        conn = self._conn
        return (
            self._waited
            and not self._flow.futures
            and not conn.pending()
            and self._unsent is None
            and self._idle
            and self._resuming is None
            and self.dead is None
            and not conn.closing
        )

    async def _send_loop(self) -> None:
        conn = self._conn
        try:
            while True:
                while not conn.pending() and self._unsent is None:
                    self._wake.clear()
                    self._idle = True
                    try:
                        await self._wake.wait()
                    finally:
                        self._idle = False
                if self._unsent is not None:
                    (seq, blobs), self._unsent = self._unsent, None
                    for blob in blobs:
                        await self._link.send(blob)
                        self._counters.bytes_sent += len(blob)
                    self._finished_upto = max(self._finished_upto, seq)
                    continue
                seq, nbytes, frames = conn.next_frames_of()
                if nbytes > PROGRESS_BYTES:
                    frames = self._with_progress(frames, nbytes)
                await self._send_frames(frames)
                self._finished_upto = max(self._finished_upto, seq)
                if not conn.pending():
                    conn.predict()
        except TransportError as e:
            self._link_lost(f"lost worker {self._worker} while sending: {e}")
        except EmberlinkError as e:
            self.fail(e)

    @staticmethod
    def _with_progress(frames: Iterator[bytes | bytearray], nbytes: int) -> Iterator[bytes | bytearray]:
        bar = _progress(nbytes, "upload")
        if bar is None:
            return frames
        return _counted(frames, bar)

    def _blobs(self, frames: Iterator[bytes | bytearray]) -> Iterator[bytes | bytearray]:
        """The blobs that carry `frames`: over a link that pipelines uploads, each frame alone,
        handed on as soon as it is sealed (`pack_frames` would seal the next before it gives
        this one); else packed up to BLOB_TARGET."""
        return frames if self._conn.pipeline_chunk else pack_frames(frames)

    async def _send_frames(self, frames: Iterator[bytes | bytearray]) -> None:
        for blob in self._blobs(frames):
            await self._link.send(blob)
            self._counters.bytes_sent += len(blob)

    # -- receiving -------------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        try:
            while True:
                blob = await self._link.recv()
                self._counters.bytes_received += len(blob)
                self._on_events(self._conn.receive(blob))
        except TransportError as e:
            self._link_lost(f"lost worker {self._worker}: {e}")
        except EmberlinkError as e:
            self.fail(e)

    def _take_blob(self, link: Link, blob: bytes | memoryview) -> bool:
        """The link's callback: take in `blob` now (False, leaving it to recv, once this link is done)."""
        if link is not self._link or self.dead is not None or self._resuming is not None:
            return False
        self._counters.bytes_received += len(blob)
        try:
            self._on_events(self._conn.receive(blob))
        except TransportError as e:
            self._link_lost(f"lost worker {self._worker}: {e}")
        except EmberlinkError as e:
            self.fail(e)
        return True

    def _on_events(self, events: list[s.ClientEvent]) -> None:
        for event in events:
            match event:
                case Acknowledged():
                    self._flow.on_ack(event.batches, event.nbytes, event.staged)
                case ResultArrived():
                    self._resolve(event.rid, event.value)
                case ReplyReady():
                    self._resolve(event.rid, event.value)
                case RequestFailed():
                    fut = self._flow.futures.pop(event.rid, None)
                    self._flow.waited.discard(event.rid)
                    if fut is not None and not fut.done():
                        fut.set_exception(RemoteError.from_wire(event.code, event.message))
                case SessionEnded():
                    raise _SessionOver(RemoteError.from_wire(event.error.code, event.error.message))
                case GraphUnknownResent():
                    if self._owning:
                        self._owner_then.append(self._wake.set)
                    else:
                        self._wake.set()
                case ResultProgress():
                    self._progress(event)
                case _:
                    assert_never(event)

    def _progress(self, event: ResultProgress) -> None:
        bar = self._bars.get(event.rid)
        if bar is None:
            if event.remaining == 0 or event.rid not in self._flow.futures:
                return
            bar = _progress(event.nbytes + event.remaining, "download")
            if bar is None:
                return
            self._bars[event.rid] = bar
        bar.update(event.nbytes)
        if event.remaining == 0:
            bar.close()
            del self._bars[event.rid]

    def _close_bars(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()

    def _resolve(self, rid: int, value: Any) -> None:
        flow = self._flow
        fut = flow.futures.pop(rid, None)
        if fut is not None and not fut.done():  # a duplicate answer is ignored
            self._waited = rid in flow.waited
            flow.waited.discard(rid)
            fut.set_result(value)

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
            resumed = await self.resumer.resume(self._conn.received, why)
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
        self._link = resumed.link
        self._pipeline(resumed.link)  # (the new link may be another transport's)
        self._unsent = None  # sealed for the old link: the batch goes again in full
        self._counters.path = resumed.path
        self._close_bars()  # a result cut short: the worker sends it again
        self._on_events(self._conn.resume(resumed.channel, resumed.applied))
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
        self._close_bars()
        self._conn.link_lost()
        futures = self._flow.futures
        for rid in list(futures):
            fut = futures.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_exception(error)
        self._flow.waited.clear()
        self._flow.on_dead(error)
        for task in [*self._tasks, self._resuming]:
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        asyncio.get_running_loop().create_task(self._link.close())

    async def drain(self, timeout: float) -> None:
        """Wait until everything queued has been sent (or the session died), at most `timeout` s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.dead is None and (self._conn.pending() or self._finished_upto < self._conn.submitted):
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
        self._conn.closing = True
        for task in [*self._tasks, self._resuming]:
            if task is not None:
                task.cancel()
        await self._link.close()
        if self.dead is None:
            self.dead = WorkerLost(f"the session with worker {self._worker} is closed")


def _nothing() -> None:
    pass


def _in_order(calls: list[Callable[[], None]]) -> Callable[[], None]:
    def run() -> None:
        for call in calls:
            call()

    return run


def _counted(frames: Iterator[bytes | bytearray], bar: Any) -> Iterator[bytes | bytearray]:
    """`frames`, the upload bar advanced by each one's plaintext bytes."""
    try:
        for frame in frames:
            bar.update(len(frame) - OVERHEAD)
            yield frame
    finally:
        bar.close()


class _SessionOver(ProtocolError):
    """Internal: the worker ended the session with Error(0, ...); carries that error."""

    def __init__(self, error: RemoteError) -> None:
        super().__init__(str(error))
        self.error = error
