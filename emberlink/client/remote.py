"""RemoteExecutor: a Device's executor whose buffers live on a worker (docs/internals.md sections 4, 6).

The user's thread records messages into a pending batch and hands whole batches to the I/O loop
thread (`transport.loop`), which owns the Link and the Channel (`client.session`). Only reads,
`sync()` and `memory_stats()` wait, each on its own future. Between flushes every message goes out
as one batch, normally in one transport blob. A session opened with a way to reconnect survives a
dropped link for the resume window (client/reconnect.py).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import math
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any

import numpy as np

from emberlink.client import paths
from emberlink.client.executor import Call, ExecutorStats
from emberlink.client.reconnect import DIRECT_HEAD_START_S, Connect, Resumer, resume_window_setting
from emberlink.client.session import ClientSession, Counters, Flow
from emberlink.errors import (
    AuthError,
    DeviceError,
    DTypeError,
    EmberlinkError,
    TransportError,
    TransportTimeout,
    WorkerLost,
)
from emberlink.graph_replay import canonical
from emberlink.graph_replay.ir import Graph
from emberlink.graph_replay.ops import binding_dtypes
from emberlink.protocol import messages as m
from emberlink.protocol.dtypes import DTYPES
from emberlink.protocol.handshake import VERSION as HANDSHAKE_VERSION
from emberlink.protocol.handshake import ClientHandshake
from emberlink.protocol.identity import Identity, default_key_path, load_or_create
from emberlink.protocol.limits import MAX_BATCH_MESSAGES, MAX_UNACKED_BATCHES, MAX_UNACKED_BYTES
from emberlink.protocol.resume import Credential
from emberlink.protocol.session import Staged, within_flow
from emberlink.protocol.ticket import Ticket
from emberlink.transport.base import Link, bind
from emberlink.transport.loop import LoopThread, io_loop

log = logging.getLogger("emberlink.client")

FLUSH_BYTES = 8 << 20
"""Pending upload bytes that start a batch on its way without waiting for a read."""
FLUSH_MESSAGES = MAX_BATCH_MESSAGES - 16
"""Pending messages that start a batch on its way; below the worker's limit by what may join a
batch after the check (a Register and its Execute, a resend's Register)."""
STAGE_FROM = 64 << 10
"""An upload of at least this many bytes that begins a batch (the per-step host batch) is copied
by Device.tensor straight into a staging buffer (`host_array`), and the batch's later uploads
after it while they fit: the batch's plaintext then needs no join before it is sealed."""
STAGE_MAX = 1 << 20
"""Staging buffers stop at this size (all of it travels inline, in the batch's one frame; over raw
TCP a host batch larger than the pipeline chunk goes in BULK frames instead, sealed from the
staging buffer as from any array: client/session.py's `Pipelined`)."""
STAGE_ROOM = 4096
"""Bytes left free before the staged uploads for the batch's head (a repeated step's is ~100)."""
SPARE_STAGES = 2
"""Staging buffers kept for the next batches once the worker has acknowledged theirs (a blocking
step's is back before the next step; one that reads its loss late, or a host DataLoader's, has
two in flight). Reused with the arrays already cut from them (`_Staging.array`), a step skips a
cold `np.empty`, slice, `view` and `reshape`. Measured on the 2-core machine over tcp (client on
CPU 0, worker on CPU 1; perf_counter around the calls, medians of 500 steps, interleaved runs of
the tree before and after): the jitted step with a 401 KB host batch (bench/remote_step.py's
`jit_upload_step`), host_array 10.4-11.2 -> 6.5-6.8 µs, Device.tensor 35.8-39.0 -> 33.1-34.4
µs (three runs each); the jitted small-MLP step with host batches (x and y), host_array
12.0-12.5 -> 7.5-8.0 µs and Device.tensor(x) 75.8-78.4 -> 66.6-67.0 µs (two runs each; its copy
of a cold 401 KB source is 47-55 µs of that). The whole upload step, untraced, with this and
channel.py's inlined seal checks against the tree before (four interleaved pairs of processes,
medians of 2,000 steps): 561/570/557/567 -> 542/554/530/537 µs; the MLP step (400 steps, ~4.5 ms
of NumPy on the worker) moved less than its noise. It saves no page faults: with malloc tuned
(transport/malloc.py) a freed buffer's pages came back warm before too (0.1-0.16 minor faults a
step, before and after)."""
_STAGE_VIEWS = 8
"""Arrays a staging buffer keeps cut (offset, shape, dtype): a step's uploads are the same each time."""
CLOSE_TIMEOUT = 2.0
REPLAY_ENV = "EMBERLINK_REPLAY"
"""Set to `0` to send every graph in full with every Execute and every batch in full (never as a
Repeat of the previous one): the design before graph replay, for measuring what replay saves
(bench/replay.py); `RemoteExecutor.replay` is the same switch, read when the session starts."""

LinkFactory = Callable[[], Awaitable[Link]]

_DTYPE_NAMES = {np.dtype(name): name for name in DTYPES}
"""dtype -> wire name; `ndarray.dtype.name` is a slow Python property on the per-step path."""


def load_client_identity(key: str | os.PathLike[str] | None) -> Identity:
    """The client's identity: `key` if given, else $EMBERLINK_KEY or ~/.config/emberlink/client.key,
    created on first use (logging its NodeId, which a worker's allow file needs)."""
    if key is not None:
        return Identity.load(key)
    path: Path = default_key_path()
    identity, created = load_or_create(path)
    if created:
        log.warning(
            "created client key %s; its NodeId is %s (add it to a worker's allow file)",
            path,
            identity.node_id,
        )
    return identity


def connect_ticket(
    ticket: Ticket, identity: Identity, *, timeout: float = 30.0, resume_window: float | None = None
) -> RemoteExecutor:
    """Open a session with the worker a ticket names, over the path `paths.open_link` picks: direct
    first, the relay when direct fails or stalls for about a second; a relay-only ticket goes
    straight to the relay. If the handshake fails on the direct path for a transport reason, the
    relay is tried once more. A dropped link is resumed, on whichever path answers, for
    `resume_window` seconds (default $EMBERLINK_RESUME_WINDOW, else 30; at most the worker's)."""

    async def reconnect(within: float) -> tuple[str, Link]:
        return await paths.open_link(ticket, timeout=within, head_start=DIRECT_HEAD_START_S)

    window = resume_window_setting(resume_window)
    loop_thread = io_loop()
    opening = loop_thread.submit(paths.open_link(ticket, timeout=timeout))
    try:
        path, link = opening.result(timeout + paths.DIRECT_HEAD_START_S + 1)
    except TimeoutError as e:  # only if the transports' own deadlines failed to fire
        if isinstance(e, TransportTimeout):
            raise
        opening.cancel()
        raise TransportTimeout(f"no path to worker {ticket.node_id} within {timeout} s") from e
    try:
        return connect_link(
            _given(link),
            ticket.node_id,
            identity,
            path=path,
            timeout=timeout,
            loop_thread=loop_thread,
            reconnect=reconnect,
            resume_window=window,
        )
    except (TransportError, WorkerLost) as e:
        if path == paths.RELAY or ticket.relay is None:
            raise
        log.info("worker %s: handshake over the direct path failed (%s); trying the relay", ticket.node_id, e)
    relay_link = loop_thread.call(paths.connect_relay(ticket, timeout), timeout + 1)
    return connect_link(
        _given(relay_link),
        ticket.node_id,
        identity,
        path=paths.RELAY,
        timeout=timeout,
        loop_thread=loop_thread,
        reconnect=reconnect,
        resume_window=window,
    )


def _given(link: Link) -> LinkFactory:
    """A LinkFactory for a Link that is already open."""

    async def factory() -> Link:
        return link

    return factory


def connect_link(
    factory: LinkFactory,
    worker_node_id: str,
    identity: Identity,
    *,
    path: str,
    timeout: float = 30.0,
    loop_thread: LoopThread | None = None,
    reconnect: Connect | None = None,
    resume_window: float | None = None,
) -> RemoteExecutor:
    """Open a session over the Link `factory` makes (on `loop_thread`, default the process's I/O loop).

    The worker must prove it holds `worker_node_id`'s key (AuthError otherwise, before anything but
    the handshake is sent); then one round trip confirms the worker admitted this client. With
    `reconnect` (a new Link within a timeout), a dropped link is resumed for `resume_window`
    seconds (default $EMBERLINK_RESUME_WINDOW, else 30), at most the window the worker announced.
    """
    loop_thread = loop_thread if loop_thread is not None else io_loop()
    pending = loop_thread.submit(_handshake(factory, worker_node_id, identity, timeout))
    try:
        link, channel, limits, secret = pending.result(timeout + 1)
    except TimeoutError as e:
        if isinstance(e, TransportTimeout):
            raise
        pending.cancel()  # the connect is abandoned; its task closes the link on cancellation
        raise TransportTimeout(f"no handshake with worker {worker_node_id} within {timeout} s") from e
    executor = RemoteExecutor(loop_thread, link, channel, limits, worker_node_id, identity.node_id, path)
    executor._confirm(timeout)
    if reconnect is not None:  # only now: a worker that refuses this client closes the link at once
        resumer = Resumer(reconnect, worker_node_id, identity, Credential(secret), 0.0)
        executor._session.resumer = resumer
        executor.set_resume_window(resume_window_setting(resume_window))
    return executor


async def _handshake(
    factory: LinkFactory, worker_node_id: str, identity: Identity, timeout: float
) -> tuple[Link, Any, dict[str, int], bytes]:
    link = await factory()
    try:
        hs = ClientHandshake(identity, worker_node_id, os.urandom)
        await link.send(hs.hello())
        try:
            welcome = bytes(await asyncio.wait_for(link.recv(), timeout))
        except TransportError as e:
            raise AuthError(
                f"worker at {link.peer} ended the handshake: it is probably not {worker_node_id}, "
                "the NodeId in the ticket, or it runs an emberlink of another protocol version "
                f"(this client speaks {HANDSHAKE_VERSION}; its log says which) ({e})"
            ) from e
        except TimeoutError as e:
            raise TransportTimeout(
                f"worker at {link.peer} did not answer the handshake within {timeout} s"
            ) from e
        auth, channel, limits = hs.receive_welcome(welcome)
        await bind(link, hs.link_secret)  # before Auth: see transport/nats.py's rules
        await link.send(auth)
    except BaseException:
        await link.close()
        raise
    return link, channel, limits, hs.resume_secret


class _Staging:
    """A batch's staging buffer (RemoteExecutor.host_array), reused for a later batch once the
    worker has acknowledged this one (SPARE_STAGES)."""

    __slots__ = ("buffer", "count", "handed", "used", "view", "views")

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.view = buffer.data  # the batch's `Staged` buffer; which stage an ack frees, by identity
        self.views: dict[tuple[int, tuple[int, ...], np.dtype[Any]], np.ndarray] = {}
        self.used = STAGE_ROOM
        self.count = 0  # the batch's first `count` uploads lie back to back from STAGE_ROOM
        self.handed: np.ndarray | None = None

    def reset(self) -> None:
        """Empty again (its batch acknowledged: nothing will be sealed from it any more)."""
        self.used = STAGE_ROOM
        self.count = 0
        self.handed = None

    def array(self, end: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """The bytes from `used` to `end` as an array of `shape` and `dtype` (cut once)."""
        key = (self.used, shape, dtype)
        out = self.views.get(key)
        if out is None:
            if len(self.views) >= _STAGE_VIEWS:
                self.views.clear()
            out = self.views[key] = self.buffer[self.used : end].view(dtype).reshape(shape)
        return out


class RemoteExecutor:
    """The Executor of `Device.remote(...)`; methods are called from the Device's thread."""

    def __init__(
        self,
        loop_thread: LoopThread,
        link: Link,
        channel: Any,
        limits: dict[str, int],
        worker_node_id: str,
        client_node_id: str,
        path: str,
    ) -> None:
        self._loop_thread = loop_thread
        self._loop = loop_thread.loop
        self.worker_node_id = worker_node_id
        self.client_node_id = client_node_id
        self.limits = dict(limits)
        self.counters = Counters(path)
        self._pending: list[m.ClientMessage] = []
        self._pending_bulks: list[np.ndarray] = []
        self._pending_bytes = 0
        # The pending batch's staging buffer (host_array): the buffer, where its next upload goes,
        # how many of the pending uploads lie there back to back, the array last handed out.
        self._stage: _Staging | None = None
        self._stage_size = 0  # bytes the last batch staged: the next buffer's size
        # Staging buffers of batches sent and not yet acknowledged (by id of their `view`), and
        # those whose batches were (SPARE_STAGES). Filled on whichever thread takes the ack
        # (`_on_ack`), emptied on this one: list.append and list.pop are atomic.
        self._lent: dict[int, _Staging] = {}
        self._spares: list[_Staging] = []
        self._graphs: dict[bytes, bytes] = {}
        self._as_f32: dict[bytes, tuple[bool, ...] | None] = {}  # per graph: bindings sent as float32
        # (bindings, their graph's as_f32, as sent) of the last Execute that converted some: a
        # jitted step passes the same tuple of constant bindings on every replay
        self._f32_last: tuple[tuple[Any, ...], tuple[bool, ...], tuple[Any, ...]] | None = None
        self.replay = os.environ.get(REPLAY_ENV, "1") != "0"
        self._rids = itertools.count(1)
        self._flow_cond = threading.Condition()
        self._unacked_batches = 0
        self._unacked_bytes = 0
        self._max_batches = (
            min(limits.get("max_unacked_batches", MAX_UNACKED_BATCHES), MAX_UNACKED_BATCHES) or 1
        )
        self._max_bytes = min(limits.get("max_unacked_bytes", MAX_UNACKED_BYTES), MAX_UNACKED_BYTES) or 1
        self._dead: EmberlinkError | None = None
        self._closed = False
        # The session (kept alive by its tasks on the loop) must not keep this executor alive.
        me = weakref.ref(self)

        def on_ack(batches: int, nbytes: int, staged: tuple[Staged, ...]) -> None:
            executor = me()
            if executor is not None:
                executor._on_ack(batches, nbytes, staged)

        def on_dead(error: EmberlinkError) -> None:
            executor = me()
            if executor is not None:
                executor._on_dead(error)

        self._flow = Flow(on_ack, on_dead)

        async def start() -> ClientSession:
            try:
                session = ClientSession(
                    link,
                    channel,
                    limits,
                    self._graphs,
                    self.counters,
                    self._flow,
                    worker_node_id,
                    templates=self.replay,
                )
            except BaseException:  # (e.g. a bad EMBERLINK_PIPELINE_CHUNK): the worker frees it at once
                await link.close()
                raise
            session.start()
            return session

        self._session: ClientSession = loop_thread.call(start(), 10)
        # A Device dropped without close() still ends its session, so the worker frees its memory.
        # At interpreter exit `_close_open_sessions` closes what is left and waits for it instead.
        self._finalizer = weakref.finalize(self, _abandon, self._loop, self._session)
        self._finalizer.atexit = False
        _OPEN.add(self)

    # -- loop-thread callbacks --------------------------------------------------------------------------

    def _on_ack(self, batches: int, nbytes: int, staged: tuple[Staged, ...]) -> None:
        with self._flow_cond:
            self._unacked_batches -= batches
            self._unacked_bytes -= nbytes
            for freed in staged:
                stage = self._lent.pop(id(freed.buffer), None)
                if stage is not None and len(self._spares) < SPARE_STAGES and self._dead is None:
                    stage.reset()
                    self._spares.append(stage)
            self._flow_cond.notify_all()

    def _on_dead(self, error: EmberlinkError) -> None:
        with self._flow_cond:
            self._dead = error
            self._lent.clear()
            self._spares.clear()
            self._flow_cond.notify_all()

    # -- handing work to the loop -----------------------------------------------------------------------

    def _check(self) -> None:
        if self._closed:
            raise DeviceError("this remote device is closed")
        dead = self._dead
        if dead is not None:
            if isinstance(dead, WorkerLost):
                raise type(dead)(dead.message) from dead
            raise WorkerLost(f"the session with worker {self.worker_node_id} is over: {dead}") from dead

    def _flush(self, answer: Future[Any] | None = None, after_sent: Callable[[], None] | None = None) -> bool:
        """Send the pending batch; `answer`: this thread waits for that future at once, so it may
        do the round trip itself (ClientSession.request_direct), running `after_sent` once the
        batch is out and before it reads. Whether it ran `after_sent` (else the caller does)."""
        if not self._pending:
            return False
        messages, bulks, nbytes = self._pending, self._pending_bulks, self._pending_bytes
        self._pending, self._pending_bulks, self._pending_bytes = [], [], 0
        staged = None
        stage = self._stage
        if stage is not None:
            self._stage = None
            if stage.count == len(bulks):  # every upload of the batch lies in it, in order
                staged = Staged(stage.view, STAGE_ROOM)
                self._stage_size = stage.used - STAGE_ROOM
                self._lent[id(stage.view)] = stage  # (before it can be acknowledged)
            # else its bytes go as arrays of their own: freed with the batch, never reused
        session = self._session
        with self._flow_cond:
            while self._dead is None and not within_flow(
                self._unacked_batches, self._unacked_bytes, nbytes, self._max_batches, self._max_bytes
            ):
                session.read_acks()  # (a parked or owned link is read by nobody meanwhile)
                self._flow_cond.wait()
            self._unacked_batches += 1
            self._unacked_bytes += nbytes
        self._check()
        if answer is not None:
            if session.request_direct(messages, bulks, nbytes, staged, answer, after_sent):
                return after_sent is not None
        elif session.send_owned(messages, bulks, nbytes, staged):
            return False
        session.hand_over(messages, bulks, nbytes, staged)
        return False

    def _request(
        self,
        make: Callable[[int], m.ClientMessage],
        wait: bool = False,
        after_sent: Callable[[], None] | None = None,
    ) -> Future[Any]:
        """Queue a message that the worker answers, flush, and return the future of the answer
        (`wait`: the caller waits for it at once; `after_sent`: run on this thread once it is on
        its way, before anything waits for it)."""
        self._check()
        rid = next(self._rids)
        fut: Future[Any] = Future()
        self._flow.futures[rid] = fut
        if wait:
            self._flow.waited.add(rid)
        self._pending.append(make(rid))
        self.counters.round_trips += 1
        ran = False
        try:
            ran = self._flush(fut if wait else None, after_sent)
        except EmberlinkError as e:
            self._flow.futures.pop(rid, None)
            self._flow.waited.discard(rid)
            _settle(fut, e)
        dead = self._dead
        if dead is not None:  # the session died before the loop could see this future
            self._flow.futures.pop(rid, None)
            self._flow.waited.discard(rid)
            _settle(fut, dead)
        if after_sent is not None and not ran:
            after_sent()
        return fut

    # -- Executor ---------------------------------------------------------------------------------------

    def host_array(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray | None:
        """Where Device.tensor copies an upload of `shape` and `dtype`: the next bytes of the
        pending batch's staging buffer (see STAGE_FROM), or None (it makes its own copy). The
        batch's plaintext is then sealed where it lies, one copy of a host batch fewer (the small
        MLP's 401 KB: a 9 µs join, ~25 µs on a loaded machine, and its 400 KB allocation). The
        buffer is an acknowledged batch's where one is kept (SPARE_STAGES)."""
        nbytes = dtype.itemsize * math.prod(shape)
        if not nbytes or not dtype.isnative:
            return None
        stage = self._stage
        if stage is None:
            if nbytes < STAGE_FROM or nbytes > STAGE_MAX - STAGE_ROOM or self._pending_bulks:
                return None
            stage = self._spare(STAGE_ROOM + max(nbytes, self._stage_size))  # (room for the rest too)
            if stage is None:
                size = min(max(nbytes + STAGE_FROM, self._stage_size), STAGE_MAX - STAGE_ROOM)
                stage = _Staging(np.empty(STAGE_ROOM + size, np.uint8))
            self._stage = stage
        end = stage.used + nbytes
        if end > len(stage.buffer) or stage.count != len(self._pending_bulks):
            return None
        out = stage.array(end, shape, dtype)
        stage.handed = out
        return out

    def _spare(self, nbytes: int) -> _Staging | None:
        """A staging buffer of at least `nbytes` whose batch was acknowledged, if one is kept."""
        spares = self._spares
        while spares:  # (only this thread takes from it)
            stage = spares.pop()
            if len(stage.buffer) >= nbytes:
                return stage
        return None

    def upload(self, buf: int, array: np.ndarray) -> None:
        self._check()
        stage = self._stage
        if stage is not None and array is stage.handed:  # the next bytes of the staging buffer
            stage.handed = None
            stage.used += array.nbytes
            stage.count += 1
        a = array if array.flags.c_contiguous else np.array(array, order="C")
        dtype = _DTYPE_NAMES.get(a.dtype)
        if dtype is None:
            native = a.dtype.newbyteorder("=")  # the wire carries native (little-endian) bytes
            dtype = _DTYPE_NAMES.get(native)
            if dtype is None:
                raise DTypeError(f"dtype {a.dtype} cannot be sent to a worker; allowed: {', '.join(DTYPES)}")
            a = a.astype(native)
        self._pending.append(m.Upload(buf, dtype, a.shape, a.nbytes))
        self.counters.bytes_uploaded += a.nbytes
        if a.nbytes:
            self._pending_bulks.append(a)
            self._pending_bytes += a.nbytes
        if self._pending_bytes >= FLUSH_BYTES or len(self._pending) >= FLUSH_MESSAGES:
            self._flush()

    def execute(self, graph: Graph, gid: bytes, call: Call) -> None:
        self._check()
        if gid not in self._graphs or not self.replay:
            body = canonical.encode_graph(graph)
            self._graphs[gid] = body
            self._pending.append(m.Register(gid, body))
            self.counters.graphs_registered += 1
        else:
            self.counters.graph_replays += 1
        outs = call.outputs
        base = outs[0] if outs else 0
        if tuple(outs) != tuple(range(base, base + len(outs))):
            raise DeviceError(f"output buffer ids must be consecutive, got {outs!r}")
        bindings = tuple(call.bindings)
        if gid not in self._as_f32:
            # Float bindings that every use casts to float32 travel as float32: same results, 4
            # bytes fewer each (a learning rate per parameter adds up on every replayed step).
            kinds = binding_dtypes(graph)
            self._as_f32[gid] = tuple(k == "float32" for k in kinds) if "float32" in kinds else None
        as_f32 = self._as_f32[gid]
        if as_f32 is not None:
            last = self._f32_last
            if last is not None and last[0] is bindings and last[1] is as_f32:
                bindings = last[2]  # the same tuple as last time (a replay's constant bindings)
            else:
                sent = tuple(
                    m.F32.of(b) if f and type(b) is float else b
                    for b, f in zip(bindings, as_f32, strict=True)
                )
                self._f32_last = (bindings, as_f32, sent)
                bindings = sent
        self._pending.append(m.Execute(gid, tuple(call.inputs), bindings, base))
        if len(self._pending) >= FLUSH_MESSAGES:
            self._flush()

    def read(
        self, buf: int, wait: bool = False, after_sent: Callable[[], None] | None = None
    ) -> Future[np.ndarray]:
        """The array in `buf` as a concurrent future (`.result()` waits; `numpy()` calls it). With
        `wait`, over the raw tcp link, the waiting thread may do the round trip itself, and
        `after_sent` runs there between its send and its read (ClientSession.request_direct)."""
        return self._request(lambda rid: m.Read(rid, buf), wait, after_sent)

    def drop(self, bufs: Sequence[int]) -> None:
        if self._dead is not None or self._closed or not bufs:
            return  # nothing is held for a dead session
        self._pending.append(m.Drop(tuple(sorted(bufs))))  # sorted ids make fewer runs on the wire
        if len(self._pending) >= FLUSH_MESSAGES:
            self._flush()

    def send(self) -> None:
        self._check()
        self._flush()

    def sync(self) -> None:
        self._request(m.Sync, wait=True).result()

    def stats(self) -> ExecutorStats:
        out = self.counters.as_dict()
        out["worker"] = self.worker_node_id
        return out

    def worker_stats(self) -> dict[str, int | float | str]:
        """The worker's whole StatsReply for this session (memory, traffic, this client's cache, ...)."""
        stats: dict[str, int | float | str] = self._request(m.Stats).result()
        return stats

    def memory_stats(self) -> dict[str, int]:
        stats = self.worker_stats()
        return {k: int(v) for k, v in stats.items() if k.endswith("_bytes") and isinstance(v, int)}

    def set_resume_window(self, seconds: float) -> None:
        """How long a dropped link is resumed for from now on: at most what the worker announced
        (0: a dropped link ends the session with WorkerLost)."""
        resumer = self._session.resumer
        if resumer is not None:
            announced = self.limits.get("resume_window_ms", 0) / 1000
            resumer.window = max(min(resume_window_setting(seconds), announced), 0.0)

    def close(self) -> None:
        """End the session (the worker frees everything it held for it). Idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self._stage = None
        with self._flow_cond:
            self._lent.clear()
            self._spares.clear()
        try:
            self._loop_thread.call(self._session.shutdown(CLOSE_TIMEOUT), CLOSE_TIMEOUT + 1)
        except (EmberlinkError, TimeoutError, RuntimeError) as e:  # closing must not fail a `with` block
            log.debug("closing the session with %s: %s", self.worker_node_id, e)
        self._dead = self._dead or WorkerLost(f"the session with worker {self.worker_node_id} is closed")

    # -- connecting -------------------------------------------------------------------------------------

    def _confirm(self, timeout: float) -> None:
        """One round trip: the worker admitted this client (it closes the link on a client it refuses)."""
        try:
            self._request(m.Sync).result(timeout)
        except WorkerLost as e:
            self.close()
            raise AuthError(
                f"worker {self.worker_node_id} closed the session after the handshake: this client "
                f"({self.client_node_id}) is not on its allow list, or it is shutting down"
            ) from e
        except TimeoutError as e:
            self.close()
            raise TransportTimeout(f"worker {self.worker_node_id} did not answer within {timeout} s") from e


_OPEN: weakref.WeakSet[RemoteExecutor] = weakref.WeakSet()
"""Remote executors not yet closed or collected."""


@atexit.register
def _close_open_sessions() -> None:
    """A script that ends with remote devices still open ends their sessions as `close()` would
    (waiting up to CLOSE_TIMEOUT each), so each worker frees them at once instead of keeping them
    detached for a resume that cannot come. (Scheduling the close from a finalizer at exit is not
    enough: the process is gone before the I/O thread sends it.)"""
    for executor in list(_OPEN):
        executor.close()


def _abandon(loop: asyncio.AbstractEventLoop, session: ClientSession) -> None:
    """Close a session whose executor was garbage-collected unclosed (never blocks, never raises)."""
    if session.dead is not None:
        return
    try:
        loop.call_soon_threadsafe(lambda: loop.create_task(session.shutdown(CLOSE_TIMEOUT)))
    except RuntimeError:
        pass  # the loop is gone: the process is exiting, and the link with it


def _settle(fut: Future[Any], error: BaseException) -> None:
    try:
        fut.set_exception(error)
    except InvalidStateError:
        pass
