"""The device-thread half of a session: applies batches to the tensor store; no I/O, no asyncio.

A `BatchRunner` is called only on the device thread, one batch at a time in arrival order. It
implements the worker's side of docs/internals.md section 6: batches apply strictly in seq order;
a batch naming a graph that is neither cached nor registered earlier in it is not applied at all
(`GraphUnknown`), and every later batch is discarded until that seq comes again; the graphs a
batch uses are held (pinned) for the whole batch; failures poison only the ids they would have
produced. A ProtocolError raised here ends the session.

Governance (server/limits.py): a batch is applied in turns (`apply` with a deadline returns with
`Incoming.done` false, to be called again on the session's next turn); an Execute whose outputs
would leave the id space ends the session; one whose graph a limit refused, or whose plan's peak
bytes do not fit the session's quota or the worker's budget, poisons its outputs; a Read's bytes
stay charged to the session until its reply has been sent (store.py: an array's charge lasts as long
as the array), and a non-contiguous value is made contiguous in the store at its first read, so
later reads copy nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from emberlink.errors import EmberlinkError, ErrorCode, ExecutionError, ProtocolError
from emberlink.graph_replay.backend import Backend
from emberlink.graph_replay.captured import HostUploads, open_captures
from emberlink.graph_replay.plan import Plan
from emberlink.protocol import messages as m
from emberlink.protocol.dtypes import DTYPES
from emberlink.server.graphs import GraphView, Prepared, Refusal
from emberlink.server.store import ID_BYTES, Failure, Hold, Quota, TensorStore, keep_charged

log = logging.getLogger(__name__)

INLINE_BYTES = 64 << 10
"""A batch is light (may be applied on the event loop, where `Backend.runs_inline`) when no upload, no graph's
values in total, and no non-contiguous read exceeds this many bytes..."""
INLINE_STEPS = 64
"""...no graph has more steps than this..."""
INLINE_MESSAGES = 64
"""...the batch has at most this many messages, and registers no graph (compiling is not tiny).
Where plans replay as captured CUDA graphs the rule is `light_captured`'s instead."""

REPLY_MESSAGE_BYTES = 64
"""What a small reply message (Done, Error, GraphUnknown) counts toward a session's queued replies."""
STAT_BYTES = 96
"""What one entry of a StatsReply counts against the session's quota while the reply waits to be sent."""

_DTYPE_NAMES = {np.dtype(name): name for name in DTYPES}
"""dtype -> wire name; `ndarray.dtype.name` is a slow Python property on the per-step path."""

# The message classes `apply` dispatches on, as module globals: one lookup each, not two, per
# message of every batch.
_Execute = m.Execute
_Upload = m.Upload
_Read = m.Read
_Drop = m.Drop
_Sync = m.Sync
_Stats = m.Stats
_Close = m.Close


@dataclass(slots=True)
class Outgoing:
    """What applying a batch produced: messages for the client, the arrays its Results carry, and
    the bytes they keep charged to the session until the reply has been sent (`release`)."""

    ack: int
    messages: list[m.WorkerMessage] = field(default_factory=list)
    bulks: list[np.ndarray] = field(default_factory=list)
    close: str | None = None  # the client's Close reason: end the session after this reply
    holds: list[Hold] | None = None  # made on the first (a StatsReply's); most replies hold none
    nbytes: int = 0  # results' bytes plus an estimate of the messages': what waits to be sent

    def release(self) -> None:
        """Free what this reply kept charged (once it is sent, or will never be). Idempotent."""
        holds, self.holds = self.holds, None
        for hold in holds or ():
            hold.release()


@dataclass(slots=True)
class Incoming:
    """A received batch with its uploads' bytes (one array per Upload, or why it could not be
    stored), the plans its Registers were compiled to off the device thread, and how far applying
    it has got (a batch may take several turns on the device)."""

    batch: m.Batch
    uploads: list[np.ndarray | Failure | None]  # None once applied
    reserved: int  # bytes of these uploads held in flight (Incoming-side), not yet the session's
    prepared: Prepared | None = None
    registers: bool = False  # whether it holds a Register (compiled before it is applied)
    done: bool = False
    out: Outgoing | None = None
    plans: dict[bytes, Plan | Refusal] | None = None
    position: int = 0
    next_upload: int = 0


@dataclass(slots=True)
class Counters:
    batches: int = 0
    executes: int = 0
    registers: int = 0
    uploads: int = 0
    reads: int = 0
    failures: int = 0
    graph_unknown: int = 0
    discarded_batches: int = 0
    captured_replays: int = 0  # executes run as one launch of a captured CUDA graph
    applied_on_loop: int = 0  # batches applied on the event loop (no thread hand-off)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class BatchRunner:
    """Applies one session's batches to its store. Device thread only."""

    def __init__(
        self,
        backend: Backend,
        store: TensorStore,
        graphs: GraphView,
        stats: Callable[[], dict[str, m.StatValue]],
        inflight: Quota,
    ) -> None:
        self._backend = backend
        self._inflight = inflight
        self._store = store
        self.graphs = graphs
        self._stats = stats
        self.applied = 0  # highest seq applied
        self._resync: int | None = None  # discarding until this seq arrives again
        self._first_failure: Failure | None = None
        self.closed = False
        self.counters = Counters()
        self._light: dict[bytes, bool] = {}  # gid -> whether its plan is light (see `light`)
        self._captured: set[bytes] = set()  # gids whose plan ran as a captured graph last time
        # Plans replayed as captured CUDA graphs (cuda workers), charged to this session's quota
        # and to the client's cache entry of the plan; None where capture cannot serve.
        self._captures = open_captures(backend, admit=self._admit_capture, release=self._release_capture)
        self._peaks: dict[bytes, int] = {}  # gid -> its plan's peak bytes (graphs.Costs, memoized here)
        self._host_uploads = HostUploads()  # uploads in host memory that captured replays read
        # Arrays a Drop freed (uncharged already) that nothing may use, kept until `let_go`.
        self._later: list[Any] = []

    # -- one batch ----------------------------------------------------------------------------------

    def apply(
        self, incoming: Incoming, deadline: float | None = None, *, free_after: bool = False
    ) -> Outgoing | None:
        """Apply a batch, or as much of it as fits before `deadline` (`time.perf_counter()`; at
        least one message): None when it was discarded or is not done (`incoming.done`).
        `free_after`: what a Drop followed only by Reads frees waits for `let_go` (the caller
        writes the reply first)."""
        batch = incoming.batch
        if self.closed:
            self.discard(incoming)
            return None
        out = incoming.out
        if out is None:
            if self._resync is not None:
                if batch.seq != self._resync:
                    self.counters.discarded_batches += 1
                    self.discard(incoming)
                    return None
                self._resync = None
            if batch.seq != self.applied + 1:
                self.discard(incoming)
                raise ProtocolError(f"batch {batch.seq} out of order; expected batch {self.applied + 1}")
            found = self._plans_for(batch, incoming.prepared)
            if isinstance(found, m.GraphUnknown):
                self._resync = batch.seq
                self.counters.graph_unknown += 1
                self.discard(incoming)
                return Outgoing(self.applied, [found], nbytes=REPLY_MESSAGE_BYTES)
            self._release(incoming)  # from here the uploads are charged to the session's quota, in order
            out = incoming.out = Outgoing(batch.seq)
            incoming.plans = found
        plans = incoming.plans
        assert plans is not None  # set on the first turn
        messages = batch.messages
        n = len(messages)
        i = incoming.position
        while i < n:
            msg = messages[i]
            i += 1
            # Dispatch on the exact type, commonest first (a `match` of class patterns is a chain
            # of isinstance checks: a Read went through four of them on every step).
            if type(msg) is _Execute:
                self._execute(msg, plans[msg.gid])
            elif type(msg) is _Upload:
                k = incoming.next_upload
                incoming.next_upload = k + 1
                self._upload(msg, incoming.uploads[k])
                incoming.uploads[k] = None  # the store's from now on: a Drop later frees it
            elif type(msg) is _Read:
                self._read(msg, out)
            elif type(msg) is _Drop:
                # Followed by reads alone (a step's Drop, then the read of its loss): the arrays
                # it frees are let go of after the reply is out (`let_go`), not before it.
                later = self._later if free_after and _reads_only(messages, i) else None
                self._store.drop_many(msg.ids, later)
                self._host_uploads.forget(msg.ids)
            elif type(msg) is _Sync:
                self._sync(msg, out)
            elif type(msg) is _Stats:
                self._stats_reply(msg, out)
            elif type(msg) is _Close:
                out.close = msg.reason
                break
            # else: a Register, handled while resolving the batch's graphs
            if deadline is not None and i < n and time.perf_counter() > deadline:
                incoming.position = i
                return None
        incoming.done = True
        incoming.out = None
        incoming.uploads = []
        self.applied = batch.seq
        self.counters.batches += 1
        out.nbytes += REPLY_MESSAGE_BYTES * len(out.messages)
        return out

    def let_go(self) -> None:
        """Free the arrays the last batch's Drops left to free after its reply (`drop_many`'s
        `later`): the reply's write does not wait for their deallocation."""
        if self._later:
            self._later.clear()

    @property
    def replays_captured(self) -> bool:
        """Whether plans here replay as captured CUDA graphs (a cuda worker with nvmath-python)."""
        return self._captures is not None

    def light_captured(self, batch: m.Batch) -> bool:
        """Whether applying `batch` takes little CPU where plans replay as captured graphs: it
        registers nothing and every Execute names a plan that ran captured last time (a replay is
        one launch; uploads stay in host memory until staged, reads wait for the GPU)."""
        if len(batch.messages) > INLINE_MESSAGES:
            return False
        captured = self._captured
        for msg in batch.messages:
            t = type(msg)
            if (t is m.Execute and msg.gid not in captured) or t is m.Register:  # type: ignore[union-attr]
                return False
        return True

    def discard(self, incoming: Incoming) -> None:
        """Drop a batch that will not be applied (further): its uploads and any reply it began."""
        incoming.done = True
        self._release(incoming)
        if incoming.out is not None:
            incoming.out.release()
            incoming.out = None
        incoming.uploads = []

    def light(self, batch: m.Batch) -> bool:
        """Whether applying `batch` is bounded tiny work (INLINE_*): a few small arrays and small
        graphs already compiled. Call it only where applying could start (device idle)."""
        if len(batch.messages) > INLINE_MESSAGES:
            return False
        for msg in batch.messages:
            if type(msg) is m.Execute:
                if not self._light.get(msg.gid, False):  # unknown: applied once on the device thread
                    return False
            elif type(msg) is m.Upload:
                if msg.nbytes > INLINE_BYTES:
                    return False
            elif type(msg) is m.Read:
                value = self._store.peek(msg.tid)  # None: made by this batch (light), or an Error
                if value is not None and not value.flags.c_contiguous and value.nbytes > INLINE_BYTES:
                    return False
            elif type(msg) is m.Register:
                return False
        return True

    def _release(self, incoming: Incoming) -> None:
        if incoming.reserved:
            self._inflight.release(incoming.reserved)
            incoming.reserved = 0

    def _plans_for(
        self, batch: m.Batch, prepared: Prepared | None
    ) -> dict[bytes, Plan | Refusal] | m.GraphUnknown:
        """Every graph the batch executes, its Registers compiled already (`prepared`, off this
        thread); pinned by the dict."""
        plans: dict[bytes, Plan | Refusal] = {}
        for msg in batch.messages:
            if type(msg) is m.Register:
                found = prepared.get(msg.gid) if prepared is not None else None
                if found is None:  # every Register is prepared before its batch is posted
                    raise ProtocolError(f"Register of graph {msg.gid.hex()} reached the device uncompiled")
                plans[msg.gid] = found
                self.counters.registers += 1
            elif type(msg) is m.Execute and msg.gid not in plans:
                plan = self.graphs.get(msg.gid)
                if plan is None:
                    return m.GraphUnknown(batch.seq, msg.gid)
                plans[msg.gid] = plan
                if msg.gid not in self._light:
                    if len(self._light) >= 4096:
                        self._light.clear()
                    self._light[msg.gid] = (
                        len(plan.steps) <= INLINE_STEPS and sum(s.nbytes for s in plan.specs) <= INLINE_BYTES
                    )
        return plans

    # -- messages -----------------------------------------------------------------------------------

    def _fail(self, tids: Sequence[int] | range, failure: Failure) -> None:
        for tid in tids:
            self._store.poison(tid, failure)
        self.counters.failures += 1
        if self._first_failure is None:
            self._first_failure = failure

    def _upload(self, msg: m.Upload, array: np.ndarray | Failure | None) -> None:
        self.counters.uploads += 1
        if array is None:
            raise ProtocolError(f"upload {msg.tid} has no bytes")  # cannot happen: one array per Upload
        if isinstance(array, Failure):
            self._fail((msg.tid,), array)
            return
        store = self._store
        quota = store.quota
        store.drop(msg.tid)  # an upload replaces its id: the old value's bytes are free first
        self._host_uploads.forget((msg.tid,))  # and the new value has been read by no replay
        need = msg.nbytes + ID_BYTES
        if not quota.reserve(need):
            self._fail((msg.tid,), quota.refusal(need, f"upload {msg.tid}"))
            return
        try:
            # With captures, an upload stays in host memory until a plan uses it: a captured graph
            # copies it to the device itself (one node of the graph); `HostUploads.eager` the rest,
            # and `HostUploads.place` an upload a second replay reads.
            value = array if self._captures is not None else self._backend.from_numpy(array)
        except EmberlinkError as e:
            quota.release(need)
            self._fail((msg.tid,), Failure(getattr(e, "code", ErrorCode.EXECUTION), str(e)))
            return
        except MemoryError as e:
            quota.release(need)
            self._fail((msg.tid,), Failure(ErrorCode.OUT_OF_MEMORY, f"storing upload {msg.tid}: {e}"))
            return
        store.put(msg.tid, value, msg.nbytes, charged=True, dropped=True)

    def _execute(self, msg: m.Execute, plan: Plan | Refusal) -> None:
        self.counters.executes += 1
        if isinstance(plan, Refusal):
            self._fail(_outputs(msg, plan.outputs), plan.failure)
            return
        outs = _outputs(msg, len(plan.outputs))
        store = self._store
        try:
            inputs = store.get_many(msg.inputs)
        except LookupError as e:
            self._fail(outs, e.args[0])
            return
        need = self._peaks.get(msg.gid)
        if need is None:
            if len(self._peaks) >= 4096:
                self._peaks.clear()
            need = self._peaks[msg.gid] = self.graphs.costs.of(plan).peak_bytes
        quota = store.quota
        if not quota.reserve(need):
            self._fail(
                outs, quota.refusal(need, f"graph {msg.gid.hex()} at its peak (intermediates included)")
            )
            return
        try:
            if self._captures is not None:
                inputs = self._host_uploads.prepare(
                    self._captures, plan, msg.inputs, inputs, self._to_device, self._backend.from_numpy
                )
                results = self._captures.run(plan, inputs, msg.bindings, msg.gid)
                self.counters.captured_replays = self._captures.replays
                if self._captures.captured(plan):
                    self._captured.add(msg.gid)
                else:
                    self._captured.discard(msg.gid)
            else:
                results = self._backend.run(plan, inputs, msg.bindings)
        except BaseException as e:  # noqa: BLE001 - sorted by _fail_run, which re-raises the rest
            quota.release(need)
            self._fail_run(outs, e)
            return
        nbytes = self._backend.nbytes
        # The reservation becomes the outputs' charge: one quota update for the whole Execute.
        store.put_many(outs, results, [nbytes(value) for value in results], reserved=need)

    def _fail_run(self, outs: range, error: BaseException) -> None:
        """Poison an Execute's outputs with why its run failed (re-raising what is no run failure)."""
        if isinstance(error, ExecutionError):
            self._fail(outs, Failure(error.code, error.message))
        elif isinstance(error, EmberlinkError):
            self._fail(outs, Failure(ErrorCode.EXECUTION, str(error)))
        elif isinstance(error, MemoryError):
            self._fail(outs, Failure(ErrorCode.OUT_OF_MEMORY, f"out of memory: {error}"))
        elif isinstance(error, Exception):  # a backend bug is the computation's failure, not the session's
            log.error("backend failed running a graph", exc_info=error)
            self._fail(outs, Failure(ErrorCode.EXECUTION, f"{type(error).__name__}: {error}"))
        else:
            raise error

    def _to_device(self, tid: int, a: np.ndarray) -> Any:
        """Upload tid's host array to the device; the store keeps the device copy from now on."""
        moved = self._backend.from_numpy(a)
        self._store.put(tid, moved, self._backend.nbytes(moved), charged=False)
        return moved

    def _read(self, msg: m.Read, out: Outgoing) -> None:
        self.counters.reads += 1
        store = self._store
        try:
            value = store.get(msg.tid)
        except LookupError as e:
            failure: Failure = e.args[0]
            out.messages.append(m.Error(msg.rid, failure.code, failure.message))
            return
        host = self._backend.to_numpy(value)
        if host is not value:  # a copy: counted while the reply (or the store) holds it
            host = _c_order(host)
            quota = store.quota
            stored = isinstance(value, np.ndarray)  # a host array: the copy replaces it in the store
            need = host.nbytes + (ID_BYTES if stored else 0)
            if not quota.reserve(need):
                failure = quota.refusal(need, f"read {msg.rid}: a copy of tensor {msg.tid}")
                out.messages.append(m.Error(msg.rid, failure.code, failure.message))
                return
            if stored:
                # A non-contiguous host array: its contiguous copy becomes the tensor, so the next
                # read of it copies nothing (and this one is counted once, as the tensor's bytes).
                host = self._backend.from_numpy(host)
                store.put(msg.tid, host, host.nbytes, charged=True)
            else:  # a device array's host copy, for this reply only
                keep_charged(quota, host, host.nbytes)
        # A stored array stays charged while this reply holds it, even if the id is dropped first.
        out.messages.append(
            m.Result(msg.rid, _DTYPE_NAMES.get(host.dtype) or host.dtype.name, host.shape, host.nbytes)
        )
        out.bulks.append(host)
        out.nbytes += host.nbytes

    def _sync(self, msg: m.Sync, out: Outgoing) -> None:
        self._backend.synchronize()
        failure, self._first_failure = self._first_failure, None
        if failure is None:
            out.messages.append(m.Done(msg.rid))
        else:
            out.messages.append(m.Error(msg.rid, failure.code, failure.message))

    def _stats_reply(self, msg: m.Stats, out: Outgoing) -> None:
        stats = self._stats()
        size = STAT_BYTES * len(stats)
        quota = self._store.quota
        if not quota.reserve(size):
            failure = quota.refusal(size, f"stats {msg.rid}: the reply")
            out.messages.append(m.Error(msg.rid, failure.code, failure.message))
            return
        if out.holds is None:
            out.holds = []
        out.holds.append(Hold(quota, size))
        out.nbytes += size
        out.messages.append(m.StatsReply(msg.rid, stats))

    def close(self) -> None:
        """Free everything the session holds; later batches are discarded."""
        self.closed = True
        self._store.clear()
        if self._captures is not None:
            self._captures.close()

    def _admit_capture(self, gid: bytes | None, plan: Plan, nbytes: int) -> bool:
        quota = self._store.quota
        if not quota.reserve(nbytes):
            return False
        if gid is not None and not self.graphs.charge(gid, plan, nbytes):
            quota.release(nbytes)
            return False
        return True

    def _release_capture(self, gid: bytes | None, plan: Plan | None, nbytes: int) -> None:
        self._store.quota.release(nbytes)
        if gid is not None and plan is not None:  # a plan that is gone took its cache entry with it
            self.graphs.charge(gid, plan, -nbytes)


def _reads_only(messages: tuple[m.ClientMessage, ...], start: int) -> bool:
    """Whether every message from `start` on is a Read (nothing after a Drop there allocates on
    the device, so what it freed may wait for the reply)."""
    for k in range(start, len(messages)):
        if type(messages[k]) is not _Read:
            return False
    return True


def _outputs(msg: m.Execute, count: int) -> range:
    """The ids an Execute's `count` outputs get; ProtocolError (the session ends) past MAX_ID."""
    base = msg.out_base
    if count and base + count - 1 > m.MAX_ID:
        raise ProtocolError(f"Execute: output ids {base}..{base + count - 1} pass the largest id {m.MAX_ID}")
    return range(base, base + count)


def _c_order(a: np.ndarray) -> np.ndarray:
    """a, or a C-ordered copy (np.ascontiguousarray would turn a 0-d array into 1-d)."""
    return a if a.flags.c_contiguous else np.array(a, order="C")
