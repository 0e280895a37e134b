"""One client session on the worker: handshake, frames in and out, bulk buffers; the asyncio half.

The event loop moves bytes: it opens frames, decrypts uploads straight into preallocated arrays
(the backend's pinned host buffers on a GPU), and seals replies. Applying batches (and every
backend call) happens on the device thread through `BatchRunner`, in arrival order, with two
exceptions, both for a batch that finds the device thread idle and both saving its two thread
hand-offs: on a backend that `runs_inline` (the NumPy one), a light batch (`BatchRunner.light`:
small arrays, small compiled graphs); and, where plans replay as captured CUDA graphs and this
is the worker's only session, a batch of captured replays (`BatchRunner.light_captured`), whose
read of the result then waits for the GPU on the loop (see `_submit`). A frame that does not open
or decode ends this session alone, with `Error(0, "refused", ...)`; every other session carries on.

A link that drops does not end the session: it is detached, keeping its tensors, for the resume
window, and a client that proves it owns it on a new link (server/detached.py, protocol/resume.py)
carries on where it was: the worker finishes what it received, tells the client the last batch
it applied, and sends again the replies the client had not taken in (it keeps each until a later
batch's `received` says it arrived).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from emberlink.errors import ErrorCode, ProtocolError, TransportError
from emberlink.protocol import messages as m
from emberlink.protocol.channel import (
    BULK,
    MAX_PLAINTEXT,
    MESSAGE,
    OVERHEAD,
    Channel,
    Kind,
    pack_frames,
    split_frames,
)
from emberlink.protocol.dtypes import ITEMSIZE
from emberlink.protocol.handshake import WorkerHandshake
from emberlink.protocol.identity import AllowPolicy, Identity
from emberlink.protocol.limits import MAX_UNACKED_BYTES
from emberlink.protocol.resume import is_token
from emberlink.server.detached import Attach, ReplyLog, Resumable, ResumeRegistry
from emberlink.server.device import DeviceThread
from emberlink.server.graphs import GraphView
from emberlink.server.runner import BatchRunner, Incoming, Outgoing
from emberlink.server.store import Failure, Quota, TensorStore
from emberlink.transport.base import Link, bind

log = logging.getLogger("emberlink.server")

INLINE_ENV = "EMBERLINK_INLINE"
"""Set to 0 to apply every batch on the device thread (to measure what applying on the loop saves)."""

HOST_BUFFER_BYTES = 64 << 10
"""Frames and uploads from this size on are decrypted into the backend's host buffers..."""
MAX_HOST_BUFFER_BYTES = 64 << 20
"""...uploads up to this size (a batch, not a data set)."""

HANDSHAKE_TIMEOUT = 10.0
MAX_REPLY_MESSAGES = 32_768
FINAL_SEND_TIMEOUT = 5.0


class Host(Protocol):
    """What a session needs from the worker serving it (server/worker.py's Worker), named here so
    that this module does not import the worker, which imports it."""

    identity: Identity
    allow: AllowPolicy
    device: DeviceThread
    sessions: set[Session]
    held: Quota
    max_session_bytes: int | None
    chunk_size: int
    resumes: ResumeRegistry

    def limits(self) -> dict[str, int]: ...
    def graphs_of(self, client: str) -> GraphView: ...
    def stats_for(self, session: Session) -> dict[str, m.StatValue]: ...


class State(enum.Enum):
    HANDSHAKE = "handshake"
    OPEN = "open"
    DETACHED = "detached"  # the link dropped; kept for the resume window
    DRAINING = "draining"
    CLOSED = "closed"


@dataclass(slots=True)
class _Target:
    """Where the BULK frames of one Upload go: an array's bytes, or nowhere when the quota refused it."""

    view: memoryview | None
    remaining: int


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
        self.peer = link.peer
        self.client: str | None = None
        self.state = State.HANDSHAKE
        self.started = time.monotonic()
        self.bytes_in = 0
        self.bytes_out = 0
        self.quota = Quota(worker.max_session_bytes, parent=worker.held)
        # Uploads received but not yet applied: real memory (so the worker's total counts them), but
        # not yet the session's, whose quota is charged in batch order when they are applied.
        self.inflight = Quota(None, parent=worker.held)
        self._store = TensorStore(self.quota)
        self._runner: BatchRunner | None = None
        self._channel: Channel | None = None
        self._outbox: asyncio.Queue[Outgoing | _Final] = asyncio.Queue()
        self._ended: asyncio.Future[tuple[str, m.Error | None]] = self._loop.create_future()
        # The batch whose bulk is still arriving, and where each of its uploads' bytes go.
        self._incoming: Incoming | None = None
        self._targets: deque[_Target] = deque()
        # The previous batch received (expanded): what a Repeat repeats. The client's is the batch it
        # sent last; frames arrive in the order they were sent, so both sides hold the same one.
        self._template: tuple[m.ClientMessage, ...] | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._inline = worker.device.backend.runs_inline
        self._inline_captured = os.environ.get(INLINE_ENV, "1") != "0"
        self._host_buffer = worker.device.backend.host_buffer
        # Resume (server/detached.py): the session's credential and waiting room, whether the current
        # link dropped, the link it was offered through (None: the opening one), and the replies
        # the client has not confirmed, to send again on a new link.
        self._resumable: Resumable | None = None
        self._first_id: str | None = None
        self._link_lost = False
        self._attach: Attach | None = None
        self._replies = ReplyLog(worker.held)

    # -- life cycle ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the session until the client leaves, it breaks the protocol, the worker drains, or
        its link dropped and no resume came within the window."""
        hs = await self._handshake()
        if hs is None:
            self.state = State.CLOSED
            return
        assert self.client is not None and self._channel is not None
        token = hs.client_token or b""
        if is_token(token):  # this link resumes another session: carry it while that session uses it
            self.state = State.CLOSED
            await self._worker.resumes.carry(
                self._link, self._channel, self.client, token, hs.transcript, hs.resume_secret
            )
            return
        self._runner = BatchRunner(
            self._worker.device.backend,
            self._store,
            self._worker.graphs_of(self.client),
            lambda: self._worker.stats_for(self),
            self.inflight,
        )
        self.state = State.OPEN
        self._resumable = self._worker.resumes.open(self.client, hs.resume_secret, self._taken_over)
        log.info("session %s: client %s connected from %s", self.id, self.client, self.peer)
        try:
            reason = await self._serve_links()
        finally:
            await self._cleanup()
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

    async def _serve_link(self) -> str:
        """Run the sender and receiver on the current link until the session ends or the link drops."""
        self._link_lost = False
        self._ended = self._loop.create_future()
        if self._resumable is not None and self._resumable.offered:
            self._lose("the client resumed on a newer link")  # one came while this one was taken up
        sender = asyncio.create_task(self._send_loop(), name=f"send {self.peer}")
        self._receiver = asyncio.create_task(self._receive_loop(), name=f"recv {self.peer}")
        try:
            reason, final = await self._ended
        except asyncio.CancelledError:
            self._receiver.cancel()
            sender.cancel()
            raise
        self._receiver.cancel()
        if not self._link_lost and (final is not None or not sender.done()):
            self._outbox.put_nowait(_Final(final))
            try:
                await asyncio.wait_for(asyncio.shield(sender), FINAL_SEND_TIMEOUT)
            except (TimeoutError, TransportError):
                pass
        sender.cancel()
        if self._link_lost:
            self._discard_partial()
            await self._let_go()
        return reason

    def _discard_partial(self) -> None:
        """Forget a batch whose bulk bytes were still arriving: the client sends it again on a new link."""
        incoming, self._incoming = self._incoming, None
        if incoming is not None and incoming.reserved:
            self.inflight.release(incoming.reserved)
        self._targets.clear()

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

    async def _reattach(self, attach: Attach) -> bool:
        """Take up a resumed link: finish the batches received on the old one, tell the client the last
        applied, then send again the replies it had not taken in. False if the new link dropped too."""
        assert self._runner is not None
        await self._worker.device.run(lambda: None)  # every batch received on the old link is applied
        self._link, self._channel, self._attach = attach.link, attach.channel, attach
        self.peer = attach.link.peer
        assert self._resumable is not None
        if self._resumable.ended is not None:  # it ended meanwhile (its Close, or a refusal, applied)
            error = m.Error(0, ErrorCode.WORKER_LOST, f"the session ended: {self._resumable.ended}")
            try:
                await self._link.send(self._channel.seal(m.encode_reply(m.Reply(0, (error,))), MESSAGE))
            except TransportError:
                pass
            await self._let_go()
            return False
        self._template = None  # the first batch on the new link has no previous one to repeat
        self._replies.confirm(attach.received)
        while not self._outbox.empty():  # every Outgoing still queued is in the reply log
            self._outbox.get_nowait()
        confirm = m.Reply(self._runner.applied, ())
        try:
            blob = self._channel.seal(m.encode_reply(confirm), MESSAGE)
            await self._link.send(blob)
        except TransportError as e:
            log.info("session %s: the resumed link dropped at once: %s", self.id, e)
            await self._let_go()
            return False
        self.bytes_out += len(blob)
        for out in self._replies:
            self._outbox.put_nowait(out)
        log.info(
            "session %s: client %s resumed from %s at batch %d, %d replies sent again",
            self.id,
            self.client,
            self.peer,
            self._runner.applied,
            len(self._replies),
        )
        return True

    @property
    def id(self) -> str:
        """The session id of the session's first link (a resumed link has its own; logs keep this one)."""
        if self._first_id is None and self._channel is not None:
            self._first_id = self._channel.session_id.hex()
        return self._first_id or "-"

    def stats(self) -> dict[str, m.StatValue]:
        """This session's figures for a StatsReply: what it holds, its traffic, its batch counters."""
        stats: dict[str, m.StatValue] = {
            "session_tensors": len(self._store),
            "session_bytes": self.quota.used,
            "session_peak_bytes": self.quota.peak,
            "session_bytes_in": self.bytes_in,
            "session_bytes_out": self.bytes_out,
        }
        if self._runner is not None:
            stats.update({f"session_{k}": v for k, v in self._runner.counters.as_dict().items()})
        return stats

    def _end(self, reason: str, final: m.Error | None = None) -> None:
        if not self._ended.done():
            self._ended.set_result((reason, final))
        elif self.state is State.DETACHED and self._resumable is not None:
            self._resumable.give_up(reason)  # e.g. its Close applied after the link dropped

    def _lose(self, reason: str) -> None:
        """The link dropped: end this link's service; the session waits for a resume."""
        if not self._ended.done():
            self._link_lost = True
        self._end(reason)

    async def _cleanup(self) -> None:
        self.state = State.CLOSED
        if self._resumable is not None:
            self._resumable.close()
        if self._attach is not None:
            self._attach.release()  # the link's own handler closes it when it returns
            self._attach = None
        self._replies.clear()
        incoming, self._incoming = self._incoming, None
        if incoming is not None and incoming.reserved:
            self.inflight.release(incoming.reserved)
        self._targets.clear()
        runner = self._runner
        if runner is not None:
            # Behind any batch still queued for this session, which the closed runner discards.
            await self._worker.device.run(runner.close)

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
        await self._worker.device.run(lambda: None)  # every queued batch of ours has been applied
        self._end("worker shutting down", m.Error(0, ErrorCode.GOING_AWAY, "the worker is shutting down"))

    # -- handshake -------------------------------------------------------------------------------------

    async def _handshake(self) -> WorkerHandshake | None:
        worker = self._worker
        hs = WorkerHandshake(worker.identity, worker.allow, os.urandom, worker.limits())
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
            log.warning("refused session from %s: %s", self.peer, e)
            return None
        except TimeoutError:
            log.info("session from %s: no handshake within %s s", self.peer, HANDSHAKE_TIMEOUT)
            return None
        except TransportError as e:
            log.info("session from %s ended during the handshake: %s", self.peer, e)
            return None
        return hs

    # -- receiving ---------------------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        try:
            while True:
                blob = await self._link.recv()
                self.bytes_in += len(blob)
                for frame in split_frames(blob):
                    if frame[1] == BULK:
                        self._on_bulk(frame)
                    else:
                        self._on_message(frame)
        except ProtocolError as e:
            log.warning("session %s: client %s broke the protocol: %s", self.id, self.client, e)
            self._end("refused", m.Error(0, ErrorCode.REFUSED, str(e)))
        except TransportError as e:
            self._lose(f"link lost: {e}")

    def _on_message(self, frame: memoryview) -> None:
        assert self._channel is not None
        if self._incoming is not None:
            raise ProtocolError("a batch arrived before the bulk bytes of the previous one")
        kind, plaintext = self._open(frame)
        if kind is not MESSAGE:
            raise ProtocolError(f"expected a MESSAGE frame, got {kind.name}")
        batch, start = m.decode_batch_prefix(plaintext)
        batch = m.expand_batch(batch, self._template)
        m.check_tail(batch, len(plaintext) - start)
        self._template = batch.messages
        if batch.received:
            self._replies.confirm(batch.received)
        held = self.inflight.used
        if held and held + sum(u.nbytes for u in batch.messages if type(u) is m.Upload) > MAX_UNACKED_BYTES:
            raise ProtocolError(
                f"client sent more than {MAX_UNACKED_BYTES} bytes of uploads without waiting for acks"
            )
        incoming = Incoming(batch, [], 0)
        for msg in batch.messages:
            if type(msg) is m.Upload:
                upload = self._prepare_upload(msg, incoming, plaintext, start)
                if msg.inline:
                    start += msg.nbytes
                incoming.uploads.append(upload)
        if self._targets:
            self._incoming = incoming
        else:
            self._submit(incoming)

    def _open(self, frame: memoryview) -> tuple[Kind, bytes | memoryview]:
        """A frame's kind and plaintext. A large one (a batch with an inline upload) is decrypted
        straight into the backend's host buffer (pinned memory on a GPU), from which a captured
        graph's upload copies it where it lies, with no copy on the host."""
        assert self._channel is not None
        n = len(frame) - OVERHEAD
        buffer = self._host_buffer(n) if n >= HOST_BUFFER_BYTES else None
        if buffer is None:
            return self._channel.open(frame)
        view = memoryview(buffer)
        kind, _ = self._channel.open_into(frame, view)
        return kind, view

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
        `start`), or why there is none.

        The quota itself is checked when the batch is applied, in order, so a Drop earlier in the
        stream counts whatever the timing; here only an upload larger than the whole quota is
        refused at once (a client that ignores flow control is cut off in `_on_message`).
        """
        limit = self.quota.limit
        if limit is not None and msg.nbytes > limit:
            if msg.nbytes and not msg.inline:
                self._targets.append(_Target(None, msg.nbytes))
            return Failure(
                ErrorCode.QUOTA,
                f"an upload of {msg.nbytes} bytes is larger than the session quota of {limit}",
            )
        held = self.inflight.used
        if held and held + msg.nbytes > MAX_UNACKED_BYTES:
            raise ProtocolError(
                f"client sent more than {MAX_UNACKED_BYTES} bytes of uploads without waiting for acks"
            )
        self.inflight.charge(msg.nbytes)
        incoming.reserved += msg.nbytes
        if msg.inline:
            return _inline_array(msg, plaintext, start)
        try:
            array = self._upload_array(msg)
        except MemoryError as e:
            # Like a refused upload: the runner poisons the id, the bytes go to scratch.
            self.inflight.release(msg.nbytes)
            incoming.reserved -= msg.nbytes
            if msg.nbytes:
                self._targets.append(_Target(None, msg.nbytes))
            return Failure(ErrorCode.OUT_OF_MEMORY, f"upload {msg.tid} of {msg.nbytes} bytes: {e}")
        if msg.nbytes:
            self._targets.append(_Target(array.data.cast("B"), msg.nbytes))
        return array

    def _on_bulk(self, frame: memoryview) -> None:
        assert self._channel is not None
        if not self._targets:
            raise ProtocolError("BULK frame without an upload announcing it")
        target = self._targets[0]
        n = self._channel.open_bulk(frame, target.view, target.remaining, "upload")
        target.remaining -= n
        if target.remaining == 0:
            self._targets.popleft()
            if not self._targets and self._incoming is not None:
                incoming, self._incoming = self._incoming, None
                self._submit(incoming)

    def _submit(self, incoming: Incoming) -> None:
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
        device.post(self._apply, incoming)

    def _apply_here(self, incoming: Incoming, light: Callable[[m.Batch], bool]) -> bool:
        """On the loop, the device idle and locked: apply a light batch now; False if it is not light."""
        if not light(incoming.batch):
            return False
        assert self._runner is not None
        self._runner.counters.applied_on_loop += 1
        # call_soon, not a direct call: replies the device thread handed over with
        # call_soon_threadsafe before it went idle are already queued, and go out first.
        self._settle(incoming, self._loop.call_soon)
        return True

    # -- device thread -------------------------------------------------------------------------------------

    def _apply(self, incoming: Incoming) -> None:
        """On the device thread: apply one batch and hand its reply to the event loop."""
        self._settle(incoming, self._call_soon)

    def _settle(self, incoming: Incoming, call_soon: Callable[[Callable[[Any], None], Any], object]) -> None:
        """Apply one batch; its reply (or the refusal that ends the session) goes through call_soon."""
        assert self._runner is not None
        try:
            out = self._runner.apply(incoming)
        except ProtocolError as e:
            call_soon(self._refuse, e)
            return
        except Exception as e:
            log.exception("session %s: applying a batch failed", self.id)
            call_soon(self._refuse, ProtocolError(f"internal error: {type(e).__name__}"))
            return
        if out is not None:
            call_soon(self._post, out)

    def _call_soon(self, fn: Callable[[Any], None], arg: object) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:
            pass  # the loop is gone: the whole worker is stopping

    def _refuse(self, error: ProtocolError) -> None:
        log.warning("session %s: client %s broke the protocol: %s", self.id, self.client, error)
        self._end("refused", m.Error(0, ErrorCode.REFUSED, str(error)))

    def _post(self, out: Outgoing) -> None:
        self._replies.keep(out)
        if self.state is not State.DETACHED:  # detached: it goes out from the reply log on the next link
            self._outbox.put_nowait(out)
        if out.close is not None:
            self._end(f"closed by the client: {out.close}")

    # -- sending ---------------------------------------------------------------------------------------------

    async def _send_loop(self) -> None:
        try:
            while True:
                if await self._send_queued(await self._outbox.get()):
                    return
        except TransportError as e:
            self._lose(f"link lost while sending: {e}")

    async def _send_queued(self, first: Outgoing | _Final) -> bool:
        """Send `first` and everything queued behind it as one reply; True after the final one.
        A helper, so that nothing keeps the replies' arrays alive while the loop waits for more: a
        result dropped right after its read must not stay in the worker's memory until the next reply."""
        items = [first]
        while not self._outbox.empty():
            items.append(self._outbox.get_nowait())
        final = items[-1] if isinstance(items[-1], _Final) else None
        outs = [o for o in items if isinstance(o, Outgoing)]
        if outs or (final is not None and final.error is not None):
            await self._send_reply(outs, final.error if final is not None else None)
        return final is not None

    async def _send_reply(self, outs: list[Outgoing], final: m.Error | None) -> None:
        assert self._channel is not None
        ack = max((o.ack for o in outs), default=self._runner.applied if self._runner else 0)
        messages: list[m.WorkerMessage] = [msg for o in outs for msg in o.messages]
        bulks = [b for o in outs for b in o.bulks]
        if final is not None:
            messages.append(final)
        await self._send_frames(self._reply_frames(ack, messages, bulks))

    def _reply_frames(
        self, ack: int, messages: list[m.WorkerMessage], bulks: list[np.ndarray]
    ) -> Iterator[bytes | bytearray]:
        """The reply's frames: per part of at most MAX_REPLY_MESSAGES messages, one MESSAGE frame
        carrying inline, in message order, every result that still fits in one chunk together with
        those before it (so a step's loss goes back in one frame), then the others' BULK frames."""
        assert self._channel is not None
        channel = self._channel
        chunk = self._worker.chunk_size
        pending = iter(bulks)
        for start in range(0, max(len(messages), 1), MAX_REPLY_MESSAGES):
            part = messages[start : start + MAX_REPLY_MESSAGES]
            arrays = [next(pending) for msg in part if type(msg) is m.Result and msg.nbytes]
            head, tail, later = _reply_layout(ack, part, arrays, chunk)
            if tail and len(head) + sum(a.nbytes for a in tail) > MAX_PLAINTEXT:
                head, tail, later = _reply_layout(ack, part, arrays, 0)  # a huge reply: all in BULK
            if tail:
                yield channel.seal_parts([head, *(a.data.cast("B") for a in tail)], MESSAGE)
            else:
                yield channel.seal(head, MESSAGE)
            for array in later:
                yield from channel.seal_chunks(array.data.cast("B"), chunk)

    async def _send_frames(self, frames: Iterator[bytes | bytearray]) -> None:
        for blob in pack_frames(frames):
            await self._link.send(blob)
            self.bytes_out += len(blob)


def _reply_layout(
    ack: int, part: list[m.WorkerMessage], arrays: list[np.ndarray], room: int
) -> tuple[bytes, list[np.ndarray], list[np.ndarray]]:
    """`(msgpack reply, inline results' arrays, BULK results' arrays)`: results inline in message
    order while they fit in `room` bytes together."""
    wire: list[m.WorkerMessage] = []
    tail: list[np.ndarray] = []
    later: list[np.ndarray] = []
    results = iter(arrays)
    for msg in part:
        if type(msg) is m.Result and msg.nbytes:
            array = next(results)
            if msg.nbytes <= room:
                room -= msg.nbytes
                tail.append(array)
                msg = m.Result(msg.rid, msg.dtype, msg.shape, msg.nbytes, True)
            else:
                later.append(array)
        wire.append(msg)
    return m.encode_reply(m.Reply(ack, tuple(wire))), tail, later


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
