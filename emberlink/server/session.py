"""One client session on the worker: handshake, governance, the device queue; the asyncio pump around the protocol.

The session protocol itself (seqs, acks, flow limits, Repeat expansion, where BULK bytes go, reply
framing, the reply log kept for a resume) is protocol/session.py's `WorkerConnection`; this pump
feeds it frames from the Link, decides where uploads' bytes go (quota and budget first: the
backend's pinned host buffers on a GPU), sends what it seals, and acts on its events. Registers are compiled on the
worker's compile thread, and applying batches (every backend call) happens on the device thread
through `BatchRunner`, in arrival order, in this session's lane (sessions take turns on the
device), with two exceptions, both for a batch that finds the device idle and both saving its two
thread hand-offs: on a backend that `runs_inline` (the NumPy one), a light batch
(`BatchRunner.light`: small arrays, small compiled graphs); and, where plans replay as captured
CUDA graphs and this is the worker's only session, a batch of captured replays
(`BatchRunner.light_captured`), whose read of the result then waits for the GPU on the loop (see
`_submit`). After a step's reply, the loop polls for a while instead of sleeping, so that the next
step's batch finds it awake (server/awake.py).

A link that drops does not end the session: it is detached, keeping its tensors (still charged to
the worker's budget), for the resume window, and a client that proves it owns it on a new link
(server/detached.py, protocol/resume.py) carries on where it was: the worker finishes what it
received, tells the client the last batch it applied, and sends again the replies the client had
not taken in (it keeps each until a later batch's `received` says it arrived).

Rules (governance, server/limits.py):
- A frame that does not open or decode, or breaks flow control (more than MAX_UNACKED_BATCHES
  batches or MAX_UNACKED_BYTES of uploads ahead of the acks sent), ends this session alone with
  `Error(0, "refused", ...)`; every other session carries on.
- Any other exception in any of the session's tasks (receiving, compiling, applying, sending)
  ends it with `Error(0, "remote", ...)`, logged once with the client's NodeId.
- A session is admitted only if the worker's budget has `SESSION_BYTES` for it.
- Replies waiting to be sent stay charged to the session (results, stats); while more than
  `max_reply_bytes` of them wait, the session's frames are not read (paused); a send that makes
  no progress for `reply_timeout` seconds ends the session. Frames are not read either while
  MAX_BACKLOG of the session's batches wait for the device, so a session sends at the pace the
  device applies its work, and its decoding cannot crowd the others out of the event loop.
- The loop's work per frame is bounded: a batch has at most MAX_BATCH_MESSAGES messages, a reply
  frame at most MAX_REPLY_FRAME_BYTES and MAX_REPLY_MESSAGES; a session's receiving and sending
  yield to the others every YIELD_SECONDS.
- A link that drops detaches the session (above); only the end of the resume window, or an error,
  ends it. The reply watchdog watches the current link only.
- Whatever way it ends, everything the session held is freed, without relying on the cycle
  collector: its tasks hold no exceptions, and cleanup drops every reference to its data.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import itertools
import logging
import os
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, assert_never

import numpy as np

from emberlink.errors import ErrorCode, ProtocolError, TransportError
from emberlink.protocol import messages as m
from emberlink.protocol.channel import BULK, Channel, split_frames
from emberlink.protocol.dtypes import ITEMSIZE
from emberlink.protocol.handshake import WorkerHandshake
from emberlink.protocol.identity import AllowPolicy, Identity
from emberlink.protocol.limits import MAX_UNACKED_BATCHES, MAX_UNACKED_BYTES
from emberlink.protocol.resume import is_token
from emberlink.protocol.session import MAX_KEPT_REPLIES, BatchArrived, BulkComplete, WorkerConnection
from emberlink.server import awake
from emberlink.server.detached import Attach, Resumable, ResumeRegistry
from emberlink.server.device import AGAIN, DeviceThread, Turn
from emberlink.server.graphs import Compiler, GraphView, Prepared
from emberlink.server.limits import (
    INTERNAL_ERROR_TEXT,
    MAX_BACKLOG,
    SESSION_BYTES,
    TURN_SECONDS,
    WorkerLimits,
)
from emberlink.server.runner import BatchRunner, Incoming, Outgoing
from emberlink.server.store import Failure, Quota, TensorStore
from emberlink.transport.base import Blob, CallbackLink, Link, bind, offer_receiver

log = logging.getLogger("emberlink.server")

INLINE_ENV = "EMBERLINK_INLINE"
"""Set to 0 to apply every batch on the device thread (to measure what applying on the loop saves)."""

HOST_BUFFER_BYTES = 64 << 10
"""Frames and uploads from this size on are decrypted into the backend's host buffers..."""
MAX_HOST_BUFFER_BYTES = 64 << 20
"""...uploads up to this size (a batch, not a data set)."""

HANDSHAKE_TIMEOUT = 10.0
FINAL_SEND_TIMEOUT = 5.0
YIELD_SECONDS = 0.001
"""The loop yields to other sessions once a session's receiving or sending has run this long
without yielding (checked between frames and between blobs)."""

ACK_DELAY = 0.02
"""Longest an ack alone waits for a reply to ride on (`Session._defer_ack`), in seconds: longer
than a training step takes, or its ack goes alone after all (at 1 ms, a host DataLoader's upload
batch on a 2-core machine went alone 87% of the time with the worker under cProfile). Nothing
waits on it: flow control is acked at once past a quarter of the window, and a parked tcp link
is taken back when a thread must wait for acks."""


class Host(Protocol):
    """What a session needs from the worker serving it (server/worker.py's Worker), named here so
    that this module does not import the worker, which imports it."""

    identity: Identity
    allow: AllowPolicy
    device: DeviceThread
    compiler: Compiler
    sessions: set[Session]
    held: Quota
    limits: WorkerLimits
    chunk_size: int
    resumes: ResumeRegistry

    def welcome_limits(self) -> dict[str, int]: ...
    def graphs_of(self, client: str) -> GraphView: ...
    def stats_for(self, session: Session) -> dict[str, m.StatValue]: ...


class State(enum.Enum):
    HANDSHAKE = "handshake"
    OPEN = "open"
    DETACHED = "detached"  # the link dropped; kept for the resume window
    DRAINING = "draining"
    CLOSED = "closed"


REPLY_NOW_BYTES = 16 << 10
"""A reply of at most this many result bytes is sealed and written where its batch finished when
the sender task is idle and the link can write at once (`Session._reply_now`). Larger ones go
through the sender, which yields the loop between their blobs."""


@dataclass(slots=True)
class _Sealed:
    """A reply sealed and begun where it was applied (`Session._reply_now`): the blobs the link
    could not take at once, which the sender sends before anything else."""

    out: Outgoing
    blobs: Iterator[bytes | bytearray]


@dataclass(slots=True)
class _Final:
    """The last thing the sender says before the session ends (None: nothing, just stop)."""

    error: m.Error | None


class Session:
    """A client session over one transport Link."""

    def __init__(self, worker: Host, link: Link) -> None:
        self._worker = worker
        self._link = link
        self._loop = asyncio.get_running_loop()
        self._limits = worker.limits
        self.peer = link.peer
        self.client: str | None = None
        self.state = State.HANDSHAKE
        self.started = time.monotonic()
        self.bytes_in = 0
        self.bytes_out = 0
        self.quota = Quota(worker.limits.max_session_bytes, parent=worker.held)
        # Uploads received but not yet applied: real memory (so the worker's budget counts them), but
        # not yet the session's, whose quota is charged in batch order when they are applied.
        self.inflight = Quota(None, parent=worker.held)
        self._admitted = False
        self._store: TensorStore | None = TensorStore(self.quota, worker.limits.max_session_tensors)
        self._runner: BatchRunner | None = None
        self._lane = worker.device.lane(f"session {self.peer}")
        self._channel: Channel | None = None
        self._ended: asyncio.Future[tuple[str, m.Error | None]] = self._loop.create_future()
        self._crashed = False
        self._sender_crashed = False
        # Replies applied and not yet sent, and their bytes (results, stats: see runner.Outgoing).
        self._outbox: deque[Outgoing | _Sealed | _Final] = deque()
        self._outbox_ready = asyncio.Event()
        self._sender_idle = False  # the sender task waits for the outbox (nothing being sent)
        self._nowait: Callable[[Blob], bool] | None = None  # the link's send_nowait, if it has one
        self.queued_reply_bytes = 0
        self._readable = asyncio.Event()  # set when a reason to leave frames unread may have gone
        self._reader_waits = False
        self._backlog = 0  # batches received whole and not yet applied (compiling, queued, running)
        self._sending_since: float | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._deferred_ack = 0  # the last ack `_defer_ack` held back (sent once a reply covers it)
        self._ack_timer: asyncio.TimerHandle | None = None
        # The protocol's state (protocol/session.py), from the handshake on.
        self._conn: WorkerConnection[Outgoing] | None = None
        # The batch whose bulk is still arriving, and where each of its uploads' bytes go.
        self._incoming: Incoming | None = None
        self._targets: list[tuple[memoryview | None, int]] = []
        # Batches received behind one whose Registers are being compiled (order is kept).
        self._compiling: Incoming | None = None
        self._waiting: deque[Incoming] = deque()
        self._receiver: asyncio.Task[None] | None = None
        self._receiving = False  # the receiver task holds a blob (the link's callback must wait)
        self._receive_failed = False  # a blob taken by the link's callback ended this link's service
        self._handed: deque[None] = deque()  # device-thread replies handed to the loop, not yet run
        self._inline = worker.device.backend.runs_inline
        # The loop kept polling after a step's reply (server/awake.py), one for all its sessions.
        self._awake = awake.shared(self._loop)
        self._inline_captured = os.environ.get(INLINE_ENV, "1") != "0"
        self._host_buffer = worker.device.backend.host_buffer
        # Resume (server/detached.py): the session's credential and waiting room, whether the current
        # link dropped, and the link it was offered through (None: the opening one).
        self._resumable: Resumable | None = None
        self._first_id: str | None = None
        self._link_lost = False
        self._attach: Attach | None = None

    # -- life cycle ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the session until the client leaves, it breaks the protocol, the worker drains, or
        its link dropped and no resume came within the window."""
        try:
            hs = await self._handshake()
            if hs is None:
                return
            assert self.client is not None and self._channel is not None
            token = hs.client_token or b""
            if is_token(token):  # this link resumes another session: carry it while that session uses it
                self.state = State.CLOSED
                await self._worker.resumes.carry(
                    self._link, self._channel, self.client, token, hs.transcript, hs.resume_secret
                )
                return
            await self._serve(hs)
        finally:
            await self._cleanup()

    async def _serve(self, hs: WorkerHandshake) -> None:
        assert self.client is not None and self._store is not None and self._channel is not None
        # (the buffer function holds the backend, not the session: no reference cycle)
        self._conn = WorkerConnection(
            self._channel, self._worker.chunk_size, _pinned(self._host_buffer), HOST_BUFFER_BYTES
        )
        self._runner = BatchRunner(
            self._worker.device.backend,
            self._store,
            self._worker.graphs_of(self.client),
            self._stats_of_worker,
            self.inflight,
        )
        refusal = self._worker.resumes.refusal(self.client)
        if refusal is not None:  # --max-client-sessions: this client has as many as it may
            log.warning("session %s: client %s refused: %s", self.id, self.client, refusal)
            reason = await self._serve_link(m.Error(0, ErrorCode.REFUSED, refusal))
        elif self._worker.held.reserve(SESSION_BYTES):
            self._admitted = True
            self.state = State.OPEN
            self._resumable = self._worker.resumes.open(self.client, hs.resume_secret, self._taken_over)
            log.info("session %s: client %s connected from %s", self.id, self.client, self.peer)
            self._watch()
            reason = await self._serve_links()
        else:
            failure = self._worker.held.refusal(SESSION_BYTES, "a new session")
            log.warning("session %s: client %s refused: %s", self.id, self.client, failure.message)
            reason = await self._serve_link(m.Error(0, failure.code, failure.message))
        log.info(
            "session %s: client %s ended (%s): %d bytes in, %d bytes out, %.3f s",
            self.id,
            self.client,
            reason,
            self.bytes_in,
            self.bytes_out,
            time.monotonic() - self.started,
        )

    async def _serve_links(self) -> str:
        """Serve link after link: a dropped one detaches the session until a resume brings the next."""
        assert self._resumable is not None
        while True:
            reason = await self._serve_link()
            if not self._link_lost or self.state is State.DRAINING:
                return reason
            while True:
                self.state = State.DETACHED
                log.info(
                    "session %s: %s; kept %g s for client %s to resume",
                    self.id,
                    reason,
                    self._resumable.window,
                    self.client,
                )
                attach = await self._resumable.wait()
                if attach is None:
                    return (
                        self._resumable.ended or f"{reason}; not resumed within {self._resumable.window:g} s"
                    )
                if await self._reattach(attach):
                    break
            self.state = State.OPEN

    async def _serve_link(self, refusal: m.Error | None = None) -> str:
        """Run the sender and receiver on the current link until the session ends or the link drops
        (`refusal`: only say it, and end)."""
        self._link_lost = False
        self._sending_since = None
        self._ended = self._loop.create_future()
        if refusal is not None:
            self._end("refused: the worker is full", refusal)
        elif self._resumable is not None and self._resumable.offered:
            self._lose("the client resumed on a newer link")  # one came while this one was taken up
        sender = asyncio.create_task(self._send_loop(), name=f"send {self.peer}")
        link = self._link
        if refusal is None:
            self._receive_failed = self._receiving = False
            self._receiver = asyncio.create_task(self._receive_loop(), name=f"recv {self.peer}")
            # Blobs taken as they arrive, where the link can: see _take_blob for the figure. The
            # task above still takes what the callback leaves, and sees the link end.
            offer_receiver(link, functools.partial(self._take_blob, link))  # (no Python frame of its own)
        self._nowait = link.send_nowait if isinstance(link, CallbackLink) else None
        try:
            reason, final = await self._ended
        except asyncio.CancelledError:
            offer_receiver(link, None)
            self._nowait = None
            for task in (self._receiver, sender):
                if task is not None:
                    task.cancel()
            raise
        offer_receiver(link, None)
        self._nowait = None
        if self._receiver is not None:
            self._receiver.cancel()
            self._receiver = None
        if self._link_lost:
            sender.cancel()
            self._sending_since = None  # the watchdog watches the next link
            self._discard_partial()
            await self._let_go()
        else:
            await self._say_last(sender, final)
        return reason

    def _discard_partial(self) -> None:
        """Forget a batch whose bulk bytes were still arriving: the client sends it again on a new link."""
        incoming, self._incoming = self._incoming, None
        if incoming is not None:
            self._drop(incoming)
        self._targets.clear()
        assert self._conn is not None
        self._conn.discard_partial()

    async def _let_go(self) -> None:
        """Close the current link and free whatever carried it."""
        link, attach = self._link, self._attach
        self._attach = None
        try:
            await link.close()
        except Exception as e:  # noqa: BLE001 - a dead link may fail to close; it is gone either way
            log.debug("session %s: closing the dropped link: %s", self.id, e)
        if attach is not None:
            attach.release()

    def _taken_over(self) -> None:
        """A resume arrived while this session still held a link: that link is dropped for the new one."""
        if self.state is State.OPEN:
            self._lose("the client resumed on a new link")

    async def _refuse_resume(self, why: str) -> None:
        """Tell the client on the resumed link that its session is lost (`worker_lost`), then let
        that link go."""
        assert self._conn is not None and self._attach is not None
        self._conn.channel = self._attach.channel
        try:
            await self._link.send(self._conn.final(m.Error(0, ErrorCode.WORKER_LOST, why), 0))
        except TransportError:
            pass
        await self._let_go()

    async def _reattach(self, attach: Attach) -> bool:
        """Take up a resumed link: finish the batches received on the old one, tell the client the last
        applied, then send again the replies it had not taken in. False if the new link dropped too."""
        assert self._runner is not None and self._resumable is not None and self._conn is not None
        resumable = self._resumable
        conn = self._conn
        # Every batch received on the old link is applied: compiled first, then through our lane.
        while (self._compiling is not None or self._waiting) and resumable.ended is None:
            await asyncio.sleep(0.005)
        await self._lane.run(lambda: None)
        self._link, self._channel, self._attach = attach.link, attach.channel, attach
        self.peer = attach.link.peer
        if resumable.ended is not None:  # it ended meanwhile (its Close, or a refusal, applied)
            await self._refuse_resume(f"the session ended: {resumable.ended}")
            return False
        self._release_outbox()  # every Outgoing still queued is in the reply log
        if not conn.replies.covers(attach.received):  # the log forgot replies the client lacks
            reason = (
                f"the session cannot resume: the replies after {attach.received} were not kept "
                f"(the client confirmed none of the last {MAX_KEPT_REPLIES})"
            )
            await self._refuse_resume(reason)
            resumable.give_up(reason)  # no later resume could be whole either: it ends now
            return False
        applied = self._runner.applied
        try:
            blob = conn.resume(attach.channel, applied, attach.received)
            await self._link.send(blob)
        except TransportError as e:
            log.info("session %s: the resumed link dropped at once: %s", self.id, e)
            await self._let_go()
            return False
        self.bytes_out += len(blob)
        for out in conn.replies:
            self._outbox.append(out)
            self.queued_reply_bytes += out.nbytes
        if self._outbox:
            self._outbox_ready.set()
        log.info(
            "session %s: client %s resumed from %s at batch %d, %d replies sent again",
            self.id,
            self.client,
            self.peer,
            applied,
            len(conn.replies),
        )
        return True

    async def _say_last(self, sender: asyncio.Task[None], final: m.Error | None) -> None:
        """Let the sender flush what is queued and `final`, for at most FINAL_SEND_TIMEOUT seconds."""
        if sender.done():  # it lost the link (nothing more can be said) or crashed: say `final` here
            if final is not None and self._sender_crashed and self._conn is not None:
                blob = self._conn.final(final, self.applied)
                try:
                    await asyncio.wait_for(self._link.send(blob), FINAL_SEND_TIMEOUT)
                except (TimeoutError, TransportError):
                    pass
            return
        if final is not None and final.code != ErrorCode.GOING_AWAY:
            # Refused or failed: the replies not yet begun are dropped (never sealed, so the frame
            # counters stay in step), so the error goes out right after the reply being sent.
            self._release_outbox()
        self._outbox.append(_Final(final))
        self._outbox_ready.set()
        # As long as the sender makes progress (a slow reader still hears why its session ended);
        # FINAL_SEND_TIMEOUT seconds without a byte sent, and it is over.
        sent = -1
        try:
            while not sender.done() and self.bytes_out != sent:
                sent = self.bytes_out
                await asyncio.wait([sender], timeout=FINAL_SEND_TIMEOUT)
        finally:
            sender.cancel()

    @property
    def id(self) -> str:
        """The session id of the session's first link (a resumed link has its own; logs keep this one)."""
        if self._first_id is None and self._channel is not None:
            self._first_id = self._channel.session_id.hex()
        return self._first_id or "-"

    @property
    def applied(self) -> int:
        """The highest batch seq applied."""
        return self._runner.applied if self._runner is not None else 0

    @property
    def paused(self) -> bool:
        """Whether the session's frames are left unread: its replies waiting to be sent are over
        `max_reply_bytes` (the client is not reading them)."""
        return self.queued_reply_bytes > self._limits.max_reply_bytes

    @property
    def ending(self) -> bool:
        """Whether the session has been told to end (it may still be saying its last words)."""
        return self._ended.done()

    def stats(self) -> dict[str, m.StatValue]:
        """This session's figures for a StatsReply: what it holds, its traffic, its batch counters."""
        stats: dict[str, m.StatValue] = {
            "session_tensors": len(self._store) if self._store is not None else 0,
            "session_bytes": self.quota.used,
            "session_peak_bytes": self.quota.peak,
            "session_bytes_in": self.bytes_in,
            "session_bytes_out": self.bytes_out,
            "session_queued_reply_bytes": self.queued_reply_bytes,
        }
        if self._runner is not None:
            stats.update({f"session_{k}": v for k, v in self._runner.counters.as_dict().items()})
        return stats

    def _stats_of_worker(self) -> dict[str, m.StatValue]:
        return self._worker.stats_for(self)

    def _end(self, reason: str, final: m.Error | None = None) -> None:
        if not self._ended.done():
            self._ended.set_result((reason, final))
        elif self.state is State.DETACHED and self._resumable is not None:
            self._resumable.give_up(reason)  # e.g. its Close applied, or it failed, after the link dropped

    def _lose(self, reason: str) -> None:
        """The link dropped: end this link's service; the session waits for a resume."""
        if not self._ended.done():
            self._link_lost = True
        self._end(reason)

    def _crash(self, error: BaseException, where: str) -> None:
        """An unexpected exception in one of this session's tasks: log it once, end the session."""
        if self._crashed or (self._ended.done() and self.state is not State.DETACHED):
            traceback.clear_frames(error.__traceback__)
            return
        self._crashed = True
        log.error(
            "session %s: client %s: %s failed, ending the session",
            self.id,
            self.client,
            where,
            exc_info=error,
        )
        traceback.clear_frames(error.__traceback__)  # what its frames held is freed now
        self._end(
            f"{where} failed", m.Error(0, ErrorCode.REMOTE, f"{INTERNAL_ERROR_TEXT}: {type(error).__name__}")
        )

    def _refuse(self, error: ProtocolError) -> None:
        # The text only: a log record that kept the exception would keep its frames' data alive.
        text = str(error)
        traceback.clear_frames(error.__traceback__)
        log.warning("session %s: client %s broke the protocol: %s", self.id, self.client, text)
        self._end("refused", m.Error(0, ErrorCode.REFUSED, text))

    async def _cleanup(self) -> None:
        """Free everything the session holds and drop every reference to its data."""
        self.state = State.CLOSED
        self._end("closed")
        resumable, self._resumable = self._resumable, None  # it holds `_taken_over`: no cycle
        if resumable is not None:
            resumable.close()
        if self._attach is not None:
            self._attach.release()  # the link's own handler closes it when it returns
            self._attach = None
        if self._conn is not None:
            for out in self._conn.replies:  # one posted while detached was never in the outbox: release it
                out.release()
            self._conn.replies.clear()
            self._conn.discard_partial()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        if self._receiver is not None:
            self._receiver.cancel()
        self._receiver = None
        held: list[Incoming] = [*self._waiting]
        for incoming in (self._incoming, self._compiling):
            if incoming is not None:
                held.append(incoming)
        self._incoming = self._compiling = None
        self._waiting.clear()
        self._targets.clear()
        for incoming in held:
            self._drop(incoming)
        self._release_outbox()
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.closed = True  # batches still queued in our lane are discarded from now on
            await self._lane.run(runner.close)
        self._release_outbox()  # replies posted by batches that finished meanwhile
        self._store = None
        if self._admitted:
            self._admitted = False
            self._worker.held.release(SESSION_BYTES)

    def _release_outbox(self) -> None:
        """Drop the replies not yet begun (one being sent is the sender's to release)."""
        for item in self._outbox:
            if isinstance(item, _Sealed):
                item = item.out
            if isinstance(item, Outgoing):
                item.release()
                self.queued_reply_bytes -= item.nbytes
        self._outbox.clear()

    async def drain(self) -> None:
        """Stop reading, finish the batches already received, then end with `going_away`."""
        if self.state is State.DETACHED and self._resumable is not None:
            self._resumable.give_up("worker shutting down")
            return
        if self.state is not State.OPEN:
            return
        self.state = State.DRAINING
        if self._receiver is not None:
            self._receiver.cancel()
        while self._compiling is not None and not self._ended.done():
            await asyncio.sleep(0.01)
        await self._lane.run(lambda: None)  # every queued batch of ours has been applied
        self._end("worker shutting down", m.Error(0, ErrorCode.GOING_AWAY, "the worker is shutting down"))

    # -- handshake -------------------------------------------------------------------------------------

    async def _handshake(self) -> WorkerHandshake | None:
        worker = self._worker
        hs = WorkerHandshake(worker.identity, worker.allow, os.urandom, worker.welcome_limits())
        try:
            hello = bytes(await asyncio.wait_for(self._link.recv(), HANDSHAKE_TIMEOUT))
            self.bytes_in += len(hello)
            welcome = hs.receive_hello(hello)
            await bind(self._link, hs.link_secret)  # before Welcome: see transport/nats.py's rules
            await self._link.send(welcome)
            self.bytes_out += len(welcome)
            auth = bytes(await asyncio.wait_for(self._link.recv(), HANDSHAKE_TIMEOUT))
            self.bytes_in += len(auth)
            self._channel, self.client = hs.receive_auth(auth)
        except ProtocolError as e:
            log.warning("refused session from %s: %s", self.peer, str(e))
            return None
        except TimeoutError:
            log.info("session from %s: no handshake within %s s", self.peer, HANDSHAKE_TIMEOUT)
            return None
        except TransportError as e:
            log.info("session from %s ended during the handshake: %s", self.peer, str(e))
            return None
        return hs

    # -- receiving ---------------------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        try:
            while True:
                blob = await self._link.recv()
                if self._receive_failed:
                    return  # a blob the callback took broke the session: nothing after it is read
                self._receiving = True
                self.bytes_in += len(blob)
                frames = split_frames(blob)
                if not self._on_one_frame(frames):
                    await self._on_frames(frames)
                del blob, frames
                self._receiving = False
        except ProtocolError as e:
            self._refuse(e)
        except TransportError as e:
            self._lose(f"link lost: {e}")
        except Exception as e:  # noqa: BLE001 - any failure ends this session alone (logged in _crash)
            self._crash(e, "receiving")

    def _on_one_frame(self, frames: list[memoryview]) -> bool:
        """Take in a blob of one frame when nothing makes it wait (the common case, without the
        yielding machinery); False, having done nothing, otherwise."""
        if len(frames) == 1 and (
            frames[0][1] == BULK
            or (self.queued_reply_bytes <= self._limits.max_reply_bytes and self._backlog < MAX_BACKLOG)
        ):
            self._on_frame(frames[0])
            return True
        return False

    def _take_blob(self, link: Link, blob: bytes | memoryview) -> bool:
        """The link's callback, on the loop: take in a one-frame blob now, as the receiver task would;
        False, leaving it to that task, when the task holds one, the blob must wait, or this link's
        service is over. Its figure, with the client's: ClientSession.start."""
        self._awake.arrived()
        if self._receiving or self._receive_failed or link is not self._link or self.state is not State.OPEN:
            return False
        if self._ended.done():
            return False
        try:
            frames = split_frames(blob)
            if not self._on_one_frame(frames):
                return False
        except ProtocolError as e:
            self._receive_failed = True
            self._refuse(e)
        except Exception as e:  # noqa: BLE001 - any failure ends this session alone (logged in _crash)
            self._receive_failed = True
            self._crash(e, "receiving")
        self.bytes_in += len(blob)
        return True

    def _must_wait(self) -> bool:
        """Whether the next batch must wait: replies unread (the watchdog ends a client that never
        reads them) or MAX_BACKLOG batches waiting for the device."""
        return self.paused or self._backlog >= MAX_BACKLOG

    def _on_frame(self, frame: memoryview) -> None:
        assert self._conn is not None
        event = self._conn.receive_frame(frame)
        if event is None:
            return
        if isinstance(event, BatchArrived):
            self._arrived(event)
        elif isinstance(event, BulkComplete):
            incoming, self._incoming = self._incoming, None
            assert incoming is not None
            self._submit(incoming)
        else:
            assert_never(event)

    async def _on_frames(self, frames: list[memoryview]) -> None:
        began = time.perf_counter()
        for frame in frames:
            if self._ended.done():
                return
            if frame[1] == BULK:
                self._on_frame(frame)
                continue
            while self._must_wait():  # the next batch is read once replies went out or batches applied
                self._reader_waits = True
                self._readable.clear()
                await self._readable.wait()
                self._reader_waits = False
                began = time.perf_counter()
            self._on_frame(frame)
            if time.perf_counter() - began > YIELD_SECONDS:
                await asyncio.sleep(0)  # one session's blob does not hold the loop for long
                began = time.perf_counter()

    def _arrived(self, event: BatchArrived) -> None:
        """A batch's MESSAGE frame is in: decide where each upload's bytes go, and send it on its
        way once they are all in."""
        assert self._conn is not None
        batch, plaintext, start = event.batch, event.plaintext, event.start
        incoming = Incoming(batch, [], 0)
        try:
            for msg in batch.messages:
                if type(msg) is m.Upload:
                    # Appended at once: no local may keep an array alive while the batch is
                    # applied (inline, below in this call), or a Drop in it could not free it.
                    incoming.uploads.append(self._prepare_upload(msg, incoming, plaintext, start))
                    if msg.inline:
                        start += msg.nbytes
                elif type(msg) is m.Register:
                    incoming.registers = True
        except BaseException:
            self._drop(incoming)
            self._targets.clear()
            raise
        del event, plaintext
        whole = self._conn.expect(self._targets)
        self._targets.clear()
        if whole:
            self._submit(incoming)
        else:
            self._incoming = incoming

    def _upload_array(self, msg: m.Upload) -> np.ndarray:
        """Where an upload's BULK bytes are decrypted to: the backend's host buffer (pinned memory
        on a GPU) for a batch-sized one, ordinary memory otherwise (a data set uploaded once
        should not hold page-locked memory)."""
        if HOST_BUFFER_BYTES <= msg.nbytes <= MAX_HOST_BUFFER_BYTES:
            buffer = self._host_buffer(msg.nbytes)
            if buffer is not None:
                return buffer.view(msg.dtype).reshape(msg.shape)  # type: ignore[no-any-return]
        return np.empty(msg.shape, dtype=msg.dtype)

    def _prepare_upload(
        self, msg: m.Upload, incoming: Incoming, plaintext: bytes | memoryview, start: int
    ) -> np.ndarray | Failure:
        """The array an upload's bytes are decrypted into (or, inline, read from `plaintext` at
        `start`), or why there is none (its bytes then go to scratch).

        The session's quota is checked when the batch is applied, in order, so a Drop earlier in
        the stream counts whatever the timing; here only an upload larger than the whole quota is
        refused at once, and one the worker's budget has no room for (a client that ignores flow
        control is cut off by the connection).
        """
        limit = self.quota.limit
        if limit is not None and msg.nbytes > limit:
            return self._skip(
                msg,
                Failure(
                    ErrorCode.QUOTA,
                    f"upload {msg.tid}: {msg.nbytes} bytes is larger than the session quota of {limit}",
                ),
            )
        if not self.inflight.reserve(msg.nbytes):
            return self._skip(msg, self.inflight.refusal(msg.nbytes, f"upload {msg.tid}"))
        incoming.reserved += msg.nbytes
        if msg.inline:
            return _inline_array(msg, plaintext, start)
        try:
            array = self._upload_array(msg)
        except (MemoryError, ValueError) as e:
            self.inflight.release(msg.nbytes)
            incoming.reserved -= msg.nbytes
            return self._skip(
                msg, Failure(ErrorCode.OUT_OF_MEMORY, f"upload {msg.tid} of {msg.nbytes} bytes: {e}")
            )
        if msg.nbytes:
            self._targets.append((array.data.cast("B"), msg.nbytes))
        return array

    def _skip(self, msg: m.Upload, failure: Failure) -> Failure:
        """A refused upload: the runner poisons its id; its BULK bytes are decrypted into scratch."""
        if msg.nbytes and not msg.inline:
            self._targets.append((None, msg.nbytes))
        return failure

    # -- to the device, in order --------------------------------------------------------------------------

    def _submit(self, incoming: Incoming) -> None:
        """Send a received batch on its way: compile its Registers first if it has any to compile,
        and keep every later batch behind it."""
        self._backlog += 1
        if self._compiling is not None or self._waiting:
            self._waiting.append(incoming)
            return
        try:
            compile_first = incoming.registers and self._needs_compiling(incoming)
        except BaseException:
            self._drop(incoming)
            raise
        if compile_first:
            self._compile(incoming)
            return
        self._dispatch(incoming)

    def _drop(self, incoming: Incoming) -> None:
        """Let go of a batch that will never be applied: its uploads' reserved bytes are free."""
        if incoming.reserved:
            self.inflight.release(incoming.reserved)
            incoming.reserved = 0
        incoming.uploads = []

    def _needs_compiling(self, incoming: Incoming) -> bool:
        """Whether a Register of the batch must go to the compile thread (else: prepared here)."""
        if not incoming.registers:
            return False
        assert self._runner is not None
        registers = [msg for msg in incoming.batch.messages if type(msg) is m.Register]
        graphs = self._runner.graphs
        prepared: Prepared = {}
        for msg in registers:
            plan = graphs.cached(msg.gid, msg.graph)
            if plan is None:
                return True
            prepared[msg.gid] = plan
        incoming.prepared = prepared
        return False

    def _compile(self, incoming: Incoming) -> None:
        assert self._runner is not None
        self._compiling = incoming
        graphs = self._runner.graphs
        registers = [msg for msg in incoming.batch.messages if type(msg) is m.Register]

        def prepare() -> Prepared:
            return {msg.gid: graphs.prepare(msg.gid, msg.graph) for msg in registers}

        future = self._worker.compiler.submit(prepare)
        future.add_done_callback(lambda f: self._call_soon(self._compiled, f))

    def _compiled(self, future: Any) -> None:
        """On the loop: the batch being compiled is ready (or broke); send it and those behind it."""
        try:
            self._compiled_batch(future)
        except Exception as e:  # noqa: BLE001 - any failure ends this session alone (logged in _crash)
            self._crash(e, "compiling a graph")

    def _compiled_batch(self, future: Any) -> None:
        incoming, self._compiling = self._compiling, None
        if incoming is None or self.state is State.CLOSED or future.cancelled():
            return  # cleanup released it, or the worker is stopping
        error = future.exception()
        if error is not None:
            self._drop(incoming)
            if isinstance(error, ProtocolError):
                self._refuse(error)
            else:
                self._crash(error, "compiling a graph")
            return
        incoming.prepared = future.result()
        self._dispatch(incoming)
        while self._waiting and self._compiling is None:
            incoming = self._waiting.popleft()
            try:
                compile_next = self._needs_compiling(incoming)
            except ProtocolError as e:
                self._drop(incoming)
                self._refuse(e)
                return
            if compile_next:
                self._compile(incoming)
            else:
                self._dispatch(incoming)

    def _dispatch(self, incoming: Incoming) -> None:
        # The hand-off to the device thread and back, measured on the H200 (bench/gpu_step.py,
        # small MLP step jitted, EMBERLINK_INLINE=0 against the default): 1.709 against 1.577 ms
        # a step with resident data, 2.048 against 1.999 ms with host batches, so a single
        # session's captured replays skip it. It stays where work is not bounded by a launch (an
        # eager plan on a GPU: milliseconds of CPU) and where several sessions share the loop (a
        # read waiting on the loop for one session's GPU work would stall the others' frames);
        # those cases were not measured. Not measured either: a client reading each loss a step
        # late on a GPU-bound step, where the device thread would let the loop decode the next
        # batch while the GPU works.
        device = self._worker.device
        runner = self._runner
        assert runner is not None
        if self._inline:
            if device.run_here_if_idle(self._apply_here, incoming, runner.light):
                return
        elif (
            runner.replays_captured
            and self._inline_captured
            and len(self._worker.sessions) == 1
            and device.run_here_if_idle(self._apply_here, incoming, runner.light_captured)
        ):
            return
        self._lane.post(self._apply, incoming)

    def _apply_here(self, incoming: Incoming, light: Callable[[m.Batch], bool]) -> bool:
        """On the loop, the device idle and locked: apply a light batch now; False if it is not light."""
        if not light(incoming.batch):
            return False
        assert self._runner is not None
        self._runner.counters.applied_on_loop += 1
        # Its reply is queued at once when nothing the device thread handed over is still waiting
        # on the loop (one loop iteration fewer a step); else with call_soon, behind those.
        self._settle(incoming, self._loop.call_soon if self._handed else _call_now, None, free_after=True)
        return True

    # -- device thread -------------------------------------------------------------------------------------

    def _apply(self, incoming: Incoming) -> Turn | None:
        """On the device thread: one turn of applying a batch; AGAIN: more of it next turn."""
        more = self._settle(incoming, self._hand_over, time.perf_counter() + TURN_SECONDS)
        return AGAIN if more else None

    def _hand_over(self, fn: Callable[..., None], arg: object) -> None:
        """From the device thread: fn(arg) on the loop, counted in `_handed` until it has run."""
        self._handed.append(None)  # deque.append and popleft are atomic: no lock with the loop

        def run(arg: object) -> None:
            self._handed.popleft()
            fn(arg)

        self._call_soon(run, arg)

    def _settle(
        self,
        incoming: Incoming,
        call_soon: Callable[[Callable[..., None], Any], object],
        deadline: float | None,
        *,
        free_after: bool = False,
    ) -> bool:
        """Apply (a turn of) one batch; its reply, or what ends the session, goes through call_soon.
        True when the batch is not done. `free_after` (on the loop, the reply written in
        call_soon): what its Drops free waits until then (`BatchRunner.let_go`). Not on the device
        thread, where freeing after the hand-over would hold the GIL while the loop writes the
        reply (measured, the small MLP on NumPy: the hand-over 34-38 -> 40-42 µs)."""
        runner = self._runner
        if runner is None:
            return False
        try:
            try:
                out = runner.apply(incoming, deadline, free_after=free_after)
            except ProtocolError as e:
                runner.discard(incoming)
                call_soon(self._refuse, e)
                return False
            except Exception as e:  # noqa: BLE001 - any failure ends this session alone (logged in _crash)
                runner.discard(incoming)
                call_soon(self._crash_applying, e)
                return False
            if not incoming.done:
                return True
            call_soon(self._finished, out)  # inline: the reply is written by the time it returns
            return False
        finally:
            runner.let_go()  # what the batch's Drops freed, after its reply

    def _crash_applying(self, error: BaseException) -> None:
        self._crash(error, "applying a batch")

    def _call_soon(self, fn: Callable[..., None], arg: object) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:
            pass  # the loop is gone: the whole worker is stopping

    def _finished(self, out: Outgoing | None) -> None:
        """On the loop: a batch is applied (or discarded); its reply, if any, goes out, or, when it
        would say nothing but its ack and the client's window is far from full, rides on the next
        reply (`_defer_ack`)."""
        self._backlog -= 1
        if self._reader_waits:
            self._readable.set()
        if out is None:
            return
        if self.state is State.CLOSED or self._conn is None:
            out.release()
            return
        if not out.messages and out.close is None and self._defer_ack(out.ack):
            return
        self._post(out)

    def _defer_ack(self, ack: int) -> bool:
        """Whether the reply to batch `ack`, an ack alone, may wait for the next reply (acks are
        cumulative) or ACK_DELAY, whichever comes first. A batch of uploads only (a DataLoader's
        next batch, sent while the step before runs) was answered at once: a sealed frame the
        worker wrote and the client's I/O thread woke for, every step, between one step's reply and
        the next step's batch. Not while the client's window is a quarter used (so an honest
        client never waits on a deferred ack), nor on a link that is not open."""
        conn = self._conn
        assert conn is not None
        if (
            self.state is not State.OPEN
            or ack - conn.acked > MAX_UNACKED_BATCHES // 4
            or conn.unacked_bytes > MAX_UNACKED_BYTES // 4
        ):
            return False
        self._deferred_ack = ack
        if self._ack_timer is None:
            self._ack_timer = self._loop.call_later(ACK_DELAY, self._send_deferred_ack)
        return True

    def _send_deferred_ack(self) -> None:
        """ACK_DELAY after an ack was deferred: send it if no reply has carried it meanwhile."""
        self._ack_timer = None
        conn = self._conn
        if self.state is State.OPEN and conn is not None and self._deferred_ack > conn.acked:
            self._post(Outgoing(self._deferred_ack))

    def _post(self, out: Outgoing) -> None:
        """Queue a reply (or write it at once when the sender is idle and it is small)."""
        assert self._conn is not None
        self._conn.replies.keep(out)
        if self.state is not State.DETACHED:  # detached: it goes out from the reply log on the next link
            self._outbox.append(out)
            self.queued_reply_bytes += out.nbytes
            nowait = self._nowait
            if (
                nowait is not None
                and self._sender_idle
                and out.nbytes <= REPLY_NOW_BYTES
                and len(self._outbox) == 1
                and self.state is State.OPEN
            ):
                self._reply_now(out, nowait)
            else:
                self._outbox_ready.set()
        if out.close is not None:
            self._end(f"closed by the client: {out.close}")

    # -- sending ---------------------------------------------------------------------------------------------

    def _reply_now(self, out: Outgoing, nowait: Callable[[Blob], bool]) -> None:
        """Seal and write the one queued reply from here, the sender task idle: its wake-up skipped
        (the jitted tiny step over tcp: 315-332 -> 304-313 µs, bench/remote_step.py --tiny 2,
        three interleaved runs each on a loaded machine). What the link
        cannot take at once is left to the task, ahead of anything queued later."""
        assert self._conn is not None
        self._outbox.popleft()
        try:
            blobs = iter(self._conn.reply(out.ack, out.messages, out.bulks))  # (read, not kept)
            for blob in blobs:
                if not nowait(blob):
                    self._outbox.appendleft(_Sealed(out, itertools.chain([blob], blobs)))
                    self._outbox_ready.set()
                    return
                self.bytes_out += len(blob)
        except Exception as e:  # noqa: BLE001 - any failure ends this session alone (logged in _crash)
            self._crash(e, "sending")
        self._sent(out)
        self._conn.predict()  # while the client works on this one
        self._awake.replied()  # the client's next step finds the loop awake (measured: server/awake.py)

    def _sent(self, out: Outgoing) -> None:
        """A reply is out (or never will be): its arrays are let go."""
        out.release()
        self.queued_reply_bytes -= out.nbytes
        if self._reader_waits and not self.paused:
            self._readable.set()

    async def _send_loop(self) -> None:
        try:
            while True:
                if not self._outbox:
                    self._outbox_ready.clear()
                    self._sender_idle = True
                    try:
                        await self._outbox_ready.wait()
                    finally:
                        self._sender_idle = False
                    continue
                if isinstance(self._outbox[0], _Sealed):  # (no local holds it: see _send_queued)
                    await self._send_sealed()
                    continue
                if await self._send_queued():
                    return
                if not self._outbox and self._conn is not None:
                    self._conn.predict()
        except TransportError as e:
            self._lose(f"link lost while sending: {e}")
        except Exception as e:  # noqa: BLE001 - any failure ends this session alone (logged in _crash)
            self._sender_crashed = True
            self._crash(e, "sending")

    async def _send_sealed(self) -> None:
        """Send the rest of the reply `_reply_now` began."""
        sealed = self._outbox.popleft()
        assert isinstance(sealed, _Sealed)
        try:
            for blob in sealed.blobs:
                await self._link.send(blob)
                self.bytes_out += len(blob)
        finally:
            self._sent(sealed.out)

    async def _send_queued(self) -> bool:
        """Send everything queued as one reply; True after the final one. A helper, so that nothing
        keeps the replies' arrays alive while the loop waits for more: a result dropped right after
        its read must not stay in the worker's memory until the next reply."""
        items = list(self._outbox)
        self._outbox.clear()
        final = items[-1] if isinstance(items[-1], _Final) else None
        outs = [o for o in items if isinstance(o, Outgoing)]
        try:
            if outs or (final is not None and final.error is not None):
                await self._send_reply(outs, final.error if final is not None else None)
        finally:
            for out in outs:
                out.release()
                self.queued_reply_bytes -= out.nbytes
            if self._reader_waits and not self.paused:
                self._readable.set()
        return final is not None

    async def _send_reply(self, outs: list[Outgoing], final: m.Error | None) -> None:
        assert self._conn is not None
        messages: list[m.WorkerMessage]
        if len(outs) == 1 and final is None:  # the common one: one step's reply, sent as it is
            ack, messages, bulks = outs[0].ack, outs[0].messages, outs[0].bulks
        else:
            ack = max((o.ack for o in outs), default=self.applied)
            messages = [msg for o in outs for msg in o.messages]
            bulks = [b for o in outs for b in o.bulks]
            if final is not None:
                messages.append(final)
        began = time.perf_counter()
        for blob in self._conn.reply(ack, messages, bulks):
            self._sending_since = self._loop.time()
            await self._link.send(blob)
            self._sending_since = None
            self.bytes_out += len(blob)
            if time.perf_counter() - began > YIELD_SECONDS:
                await asyncio.sleep(0)  # one session's reply does not hold the loop for long
                began = time.perf_counter()

    def _watch(self) -> None:
        """End the session when a send has made no progress for `reply_timeout` seconds."""
        timeout = self._limits.reply_timeout
        since = self._sending_since
        if since is not None and self._loop.time() - since >= timeout:
            self._watchdog = None
            log.warning(
                "session %s: client %s stopped reading replies for %.1f s", self.id, self.client, timeout
            )
            self._end(
                "the client stopped reading replies",
                m.Error(
                    0,
                    ErrorCode.REFUSED,
                    f"the client stopped reading replies for {timeout:g} s (its session is over)",
                ),
            )
            return
        self._watchdog = self._loop.call_later(max(timeout / 4, 0.01), self._watch)


def _call_now(fn: Callable[..., None], arg: object) -> None:
    fn(arg)


def _pinned(host_buffer: Callable[[int], Any]) -> Callable[[int], memoryview]:
    """Where a large frame (a batch with an inline upload) is decrypted: the backend's host buffer
    (pinned memory on a GPU), from which a captured graph's upload copies it where it lies, with
    no copy on the host; else fresh memory that is not zero-filled (`Channel.open`'s plaintext
    is: measured, a 401 KB batch's memset was ~2.5% of a cpu worker's CPU)."""

    def plaintext_buffer(n: int) -> memoryview:
        buffer = host_buffer(n)
        return np.empty(n, np.uint8).data if buffer is None else memoryview(buffer)

    return plaintext_buffer


def _inline_array(msg: m.Upload, plaintext: bytes | memoryview, start: int) -> np.ndarray:
    """An inline upload's array: a read-only view of the plaintext when it is most of it (no copy;
    the store keeps the plaintext alive, at most twice the array's bytes), else its own copy, so
    that a small array never pins a large plaintext."""
    if not msg.nbytes:
        return np.empty(msg.shape, msg.dtype)
    count = msg.nbytes // ITEMSIZE[msg.dtype]
    array = np.frombuffer(plaintext, msg.dtype, count, start).reshape(msg.shape)
    return array if 2 * msg.nbytes >= len(plaintext) else array.copy()


__all__ = ["Host", "Session", "State"]
