"""A client and a worker connection wired back to back in memory, driven synchronously (no I/O).

The worker end applies batches to a dict of arrays, as server/runner.py does in outline: in seq
order, `GraphUnknown` for an Execute whose graph it lacks (then every batch discarded until that
seq comes again), a Read answered with a Result carrying the array, Sync with Done, Stats with a
StatsReply. An "Execute" here copies its first input to `out_base` (what the graph computes does not
matter to the protocol).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from emberlink.protocol import messages as m
from emberlink.protocol import session as s
from emberlink.protocol.channel import Channel, pack_frames

KEYS = (b"\x01" * 8, b"\x02" * 32, b"\x03" * 32)


def channels() -> tuple[Channel, Channel]:
    return Channel.pair(*KEYS)


@dataclass(slots=True)
class Reply:
    ack: int
    messages: list[m.WorkerMessage]
    arrays: list[np.ndarray]

    def release(self) -> None:
        """Nothing is charged here (the worker's Outgoing releases its holds)."""


@dataclass
class MiniWorker:
    """The worker's end: a WorkerConnection and a toy runner."""

    conn: s.WorkerConnection[Reply]
    graphs: set[bytes] = field(default_factory=set)
    forget_graphs_once: set[bytes] = field(default_factory=set)
    store: dict[int, np.ndarray] = field(default_factory=dict)
    applied: int = 0
    resync: int | None = None
    pending: Any = None  # (batch, uploads) whose bulk is arriving
    out: list[Reply] = field(default_factory=list)  # applied, not yet sent
    closed: str | None = None

    def take(self, blob: bytes | bytearray) -> None:
        from emberlink.protocol.channel import split_frames

        for frame in split_frames(blob):
            event = self.conn.receive_frame(frame)
            if event is None:
                continue
            if isinstance(event, s.BatchArrived):
                self._arrived(event)
            else:
                batch, uploads = self.pending
                self.pending = None
                self._apply(batch, uploads)

    def _arrived(self, event: s.BatchArrived) -> None:
        batch, start = event.batch, event.start
        uploads: list[np.ndarray] = []
        targets: list[tuple[memoryview, int]] = []
        for msg in batch.messages:
            if type(msg) is m.Upload:
                array = np.empty(msg.shape, msg.dtype)
                if msg.inline:
                    array.reshape(-1).view(np.uint8)[:] = np.frombuffer(
                        event.plaintext, np.uint8, msg.nbytes, start
                    )
                    start += msg.nbytes
                else:
                    targets.append((array.reshape(-1).view(np.uint8).data, msg.nbytes))
                uploads.append(array)
        if self.conn.expect(targets):
            self._apply(batch, uploads)
        else:
            self.pending = (batch, uploads)

    def _apply(self, batch: m.Batch, uploads: list[np.ndarray]) -> None:
        if self.resync is not None:
            if batch.seq != self.resync:
                return
            self.resync = None
        assert batch.seq == self.applied + 1, (batch.seq, self.applied)
        known = set(self.graphs)
        for msg in batch.messages:
            if type(msg) is m.Register:
                known.add(msg.gid)
            elif type(msg) is m.Execute and msg.gid not in known:
                self.resync = batch.seq
                self.out.append(Reply(self.applied, [m.GraphUnknown(batch.seq, msg.gid)], []))
                return
        reply = Reply(batch.seq, [], [])
        arrays = iter(uploads)
        for msg in batch.messages:
            match msg:
                case m.Register():
                    self.graphs.add(msg.gid)
                case m.Upload():
                    self.store[msg.tid] = next(arrays)
                case m.Execute():
                    self.store[msg.out_base] = self.store[msg.inputs[0]].copy()
                case m.Read():
                    array = self.store.get(msg.tid)
                    if array is None:
                        reply.messages.append(m.Error(msg.rid, "unknown_tensor", f"no tensor {msg.tid}"))
                    else:
                        reply.messages.append(m.Result(msg.rid, array.dtype.name, array.shape, array.nbytes))
                        reply.arrays.append(np.ascontiguousarray(array))
                case m.Drop():
                    for tid in msg.ids:
                        self.store.pop(tid, None)
                case m.Sync():
                    reply.messages.append(m.Done(msg.rid))
                case m.Stats():
                    reply.messages.append(m.StatsReply(msg.rid, {"tensors": len(self.store)}))
                case m.Close():
                    self.closed = msg.reason
                case m.Repeat():
                    raise AssertionError("a Repeat reached the runner unexpanded")
        self.applied = batch.seq
        self.out.append(reply)
        self.conn.replies.keep(reply)
        for gid in self.forget_graphs_once & self.graphs:  # evicted from the cache after this batch
            self.graphs.discard(gid)
            self.forget_graphs_once.discard(gid)

    def flush(self) -> Iterator[bytes | bytearray]:
        """The blobs of every reply applied since the last flush."""
        out, self.out = self.out, []
        for reply in out:
            yield from self.conn.reply(reply.ack, reply.messages, reply.arrays)


class Waiter:
    """What the client's pump keeps: arrays for the Results it waits for, and what arrived."""

    def __init__(self) -> None:
        self.wanted: set[int] = set()
        self.answers: dict[int, list[Any]] = {}
        self.acked_batches = 0
        self.acked_bytes = 0
        self.freed: list[s.Staged] = []  # staging buffers handed back by acks, in order
        self.ended: m.Error | None = None
        self.resent: list[int] = []

    def target(self, msg: m.Result) -> tuple[Any, memoryview | None]:
        if msg.rid not in self.wanted:
            return None, None
        array = np.empty(msg.shape, msg.dtype)
        return array, array.data.cast("B") if msg.nbytes else None  # (no view of a zero dim)

    def on(self, events: list[s.ClientEvent]) -> None:
        for event in events:
            match event:
                case s.Acknowledged():
                    self.acked_batches += event.batches
                    self.acked_bytes += event.nbytes
                    self.freed.extend(event.staged)
                case s.ResultArrived():
                    self.answers.setdefault(event.rid, []).append(event.value)
                case s.ReplyReady():
                    self.answers.setdefault(event.rid, []).append(event.value)
                case s.RequestFailed():
                    self.answers.setdefault(event.rid, []).append((event.code, event.message))
                case s.SessionEnded():
                    self.ended = event.error
                case s.GraphUnknownResent():
                    self.resent.append(event.seq)
                case s.ResultProgress():
                    pass


class Pair:
    """A ClientConnection and a MiniWorker joined by a lossless in-memory link."""

    def __init__(self, chunk_size: int = 1 << 12, templates: bool = True, pipeline_chunk: int = 0) -> None:
        client_channel, worker_channel = channels()
        self.graph_bodies: dict[bytes, bytes] = {}
        self.waiter = Waiter()
        self.client = s.ClientConnection(
            client_channel,
            chunk_size,
            self.graph_bodies,
            self.waiter.target,
            templates=templates,
            pipeline_chunk=pipeline_chunk,
        )
        self.worker = MiniWorker(s.WorkerConnection(worker_channel, chunk_size))
        self.wire_up: list[bytes | bytearray] = []  # blobs client -> worker not yet delivered
        self.wire_down: list[bytes | bytearray] = []

    def send_all(self) -> None:
        """The client seals everything queued onto the wire (as its pump would)."""
        while (frames := self.client.next_frames()) is not None:
            self.wire_up.extend(pack_frames(frames))
            self.client.predict()  # as the pump does once a batch is out

    def deliver_up(self) -> None:
        blobs, self.wire_up = self.wire_up, []
        for blob in blobs:
            self.worker.take(blob)
        self.wire_down.extend(self.worker.flush())
        self.worker.conn.predict()  # as the pump does once a reply is out

    def deliver_down(self) -> None:
        blobs, self.wire_down = self.wire_down, []
        for blob in blobs:
            self.waiter.on(self.client.receive(blob))

    def run(self, rounds: int = 100) -> None:
        """Until nothing moves (AssertionError if it still moves after `rounds` round trips)."""
        for _ in range(rounds):
            self.send_all()
            if not self.wire_up and not self.wire_down:
                return
            self.deliver_up()
            self.deliver_down()
        raise AssertionError(f"the session still moves after {rounds} round trips")

    def resume(self) -> None:
        """The link dropped (whatever was on the wire is lost) and the session resumes on a new one."""
        self.wire_up.clear()
        self.wire_down.clear()
        self.worker.pending = None
        self.worker.out.clear()
        client_channel, worker_channel = Channel.pair(b"\x09" * 8, b"\x0a" * 32, b"\x0b" * 32)
        confirm = self.worker.conn.resume(worker_channel, self.worker.applied, self.client.received)
        self.waiter.on(self.client.resume(client_channel, self.worker.applied))
        # the worker's confirmation, then the replies the client had not taken in
        self.waiter.on(self.client.receive(confirm))
        for reply in self.worker.conn.replies:
            for blob in self.worker.conn.reply(reply.ack, reply.messages, reply.arrays):
                self.waiter.on(self.client.receive(blob))
