"""A stateful fuzz of one worker session: valid and mutated batches, frame by frame.

A hypothesis RuleBasedStateMachine plays a client with an allowed key: it uploads, registers,
executes, reads, drops, repeats, and sends batches mutated structurally (shapes, ids, dtypes,
graphs, Repeat, chunk order and sizes) or byte by byte before sealing. Invariants: the worker
never crashes (a fresh session always works), a batch is either answered (its ack arrives, and
every value read is the one a model of the session predicts) or the session ends with an
`Error(0, ...)` and a closed link, never silence; and whatever happened, once a session is over
the worker's memory is back to where it was before it began.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import emberlink.testing
from emberlink.errors import TransportError
from emberlink.graph_replay.canonical import encode_graph, graph_id
from emberlink.graph_replay.ir import TensorSpec
from emberlink.protocol import messages as m
from emberlink.protocol.channel import BULK, MESSAGE, split_frames
from emberlink.server.limits import Limits
from emberlink.testing import InProcessWorker

from ..graph_replay.graphs import Builder
from .server_harness import WireClient

WAIT = 10.0
SIZES = (1, 3, 64, 1000)


@pytest.fixture(scope="module")
def fuzz_worker() -> Iterator[InProcessWorker]:
    limits = Limits(max_session_bytes=4 << 20, max_worker_bytes=64 << 20, max_graph_nodes=64, reply_timeout=5)
    # A hung-up session is detached for the resume window: a short one, so that each example's
    # teardown also checks that a detached session's end frees everything it held.
    worker = emberlink.testing.worker(limits=limits, resume_window=0.2)
    SessionMachine.worker = worker
    yield worker
    worker.stop()


def _scale(n: int) -> tuple[bytes, bytes]:
    g = Builder([TensorSpec("float32", (n,))], ["float"])
    body = encode_graph(g.graph([g.add("multiply", 0, 1)]))
    return graph_id(body), body


GRAPHS = {n: _scale(n) for n in SIZES}


class SessionMachine(RuleBasedStateMachine):
    worker: ClassVar[InProcessWorker]

    def __init__(self) -> None:
        super().__init__()
        self.client: WireClient | None = None
        self.seq = 0
        self.rid = 0
        self.next_tid = 1
        self.values: dict[int, np.ndarray] = {}  # what each live tensor id holds, as the model says
        self.registered: set[bytes] = set()
        self.previous: list[m.ClientMessage] | None = None
        self.sessions = 0
        self.endings = 0

    # -- plumbing -----------------------------------------------------------------------------------

    def call(self, coro: Any) -> Any:
        return self.worker.call(coro, 60)

    def baseline(self) -> tuple[int, int]:
        worker = self.worker.worker
        return worker.held.used, worker.device.backend.memory_stats()["in_use_bytes"]

    @initialize()
    def connect(self) -> None:
        self._open()

    def _open(self) -> None:
        self.client = self.call(WireClient.connect(self.worker))
        self.seq = 0
        self.values.clear()
        self.registered.clear()  # a new session is a new client: its graph cache is empty
        self.previous = None
        self.sessions += 1

    def _ids(self) -> int:
        tid = self.next_tid
        self.next_tid += 1
        return tid

    def _rid(self) -> int:
        self.rid += 1
        return self.rid

    def _send(
        self, messages: list[m.ClientMessage], bulks: list[np.ndarray], plaintext: bytes | None = None
    ) -> list[m.WorkerMessage] | None:
        """Send one batch (or `plaintext` sealed as its MESSAGE frame); its reply messages, or None
        if the worker ended the session (always with an Error)."""
        assert self.client is not None
        self.seq += 1
        client, seq = self.client, self.seq
        if plaintext is None:
            self.call(client.send(seq, messages, bulks))
        else:
            self.call(client.link.send(client.channel.seal(plaintext, MESSAGE)))
        self.previous = messages
        return self._outcome(messages)

    def _outcome(self, messages: list[m.ClientMessage]) -> list[m.WorkerMessage] | None:
        """Wait for the reply to batch `self.seq`. A worker still waiting for bytes the batch
        announced gets a probe (the next batch), which must be answered or end the session."""
        assert self.client is not None
        client = self.client
        got: list[m.WorkerMessage] = []
        arrays: list[np.ndarray] = []
        probed = False
        while True:
            try:
                reply, results = self.call(asyncio.wait_for(client.reply(), 1.0 if not probed else WAIT))
            except TimeoutError:
                assert not probed, "the worker neither answered nor ended the session"
                probed = True
                self.seq += 1
                self.call(client.send(self.seq, [m.Sync(self._rid())]))
                continue
            except TransportError:
                raise AssertionError("the worker closed the link without an Error") from None
            got.extend(reply.messages)
            arrays.extend(results)
            if any(type(x) is m.Error and x.rid == 0 for x in reply.messages):
                assert self.call(asyncio.wait_for(client.ended(), WAIT)), "the link stayed open"
                self._ended()
                return None
            unknown = [x for x in reply.messages if type(x) is m.GraphUnknown]
            if unknown:  # a graph it never had: go on from that batch with one it can apply
                self.call(client.send(unknown[0].seq, [m.Sync(self._rid())]))
                self.seq = max(self.seq, unknown[0].seq)
                self.previous = [m.Sync(self.rid)]
                messages = []
                continue
            if reply.ack >= self.seq:
                self._check_results(messages, got, arrays)
                return got

    def _ended(self) -> None:
        self.endings += 1
        self.client = None
        self._wait_for_memory()
        self._open()

    def _wait_for_memory(self) -> None:
        async def settled() -> None:
            for _ in range(500):
                if not self.worker.worker.sessions and self.baseline() == (0, 0):
                    return
                await asyncio.sleep(0.01)

        self.call(settled())
        assert not self.worker.worker.sessions, "an ended session is still open"
        assert self.baseline() == (0, 0), f"memory held after the session ended: {self.baseline()}"

    def _check_results(
        self, messages: list[m.ClientMessage], got: list[m.WorkerMessage], arrays: list[np.ndarray]
    ) -> None:
        """Every Result answers a Read the model can predict, with the model's value."""
        reads = {x.rid: x.tid for x in messages if type(x) is m.Read}
        results = iter(arrays)
        for msg in got:
            if type(msg) is m.Result:
                value = next(results)
                want = self.values.get(reads.get(msg.rid, -1))
                if want is not None:
                    np.testing.assert_array_equal(value, want)

    # -- valid traffic ----------------------------------------------------------------------------------

    @rule(
        n=st.sampled_from(SIZES),
        dtype=st.sampled_from(["float32", "int32", "uint8", "float64"]),
        data=st.data(),
    )
    def upload_and_read(self, n: int, dtype: str, data: st.DataObject) -> None:
        x = (np.arange(n) % 7).astype(dtype)
        tid = self._ids()
        inline = data.draw(st.booleans())
        msg = m.Upload(tid, dtype, (n,), x.nbytes, inline)
        rid = self._rid()
        batch: list[m.ClientMessage] = [msg, m.Read(rid, tid)]
        self.values[tid] = x
        if inline:
            got = self._send(batch, [], m.encode_batch(m.Batch(self.seq + 1, tuple(batch))) + x.tobytes())
        else:
            got = self._send(batch, [x])
        if got is not None:
            assert [type(r) for r in got if getattr(r, "rid", None) == rid] in ([m.Result], [m.Error])

    @rule(n=st.sampled_from(SIZES), scale=st.floats(-4, 4, allow_nan=False), register=st.booleans())
    def execute(self, n: int, scale: float, register: bool) -> None:
        gid, body = GRAPHS[n]
        x = np.linspace(-1, 1, n, dtype=np.float32)
        tid, out, rid = self._ids(), self._ids(), self._rid()
        batch: list[m.ClientMessage] = [m.Upload(tid, "float32", (n,), x.nbytes)]
        if register or gid not in self.registered:
            batch.append(m.Register(gid, body))
        batch += [m.Execute(gid, (tid,), (scale,), out), m.Read(rid, out)]
        self.values[out] = x * np.float32(scale)
        self.values[tid] = x
        if self._send(batch, [x]) is not None:
            self.registered.add(gid)

    @precondition(lambda self: bool(self.values))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.values)))
        self.values.pop(tid)
        self._send([m.Drop((tid,)), m.Sync(self._rid())], [])

    @rule()
    def sync_and_stats(self) -> None:
        self._send([m.Sync(self._rid()), m.Stats(self._rid())], [])

    @precondition(lambda self: self.previous is not None)
    @rule(
        id_shift=st.integers(-5, 5) | st.just(m.MAX_ID),
        rid_shift=st.integers(-3, 3),
        patches=st.none()
        | st.dictionaries(st.integers(0, 12), st.integers(0, 20) | st.just(m.MAX_ID), min_size=1, max_size=3),
    )
    def repeat(self, id_shift: int, rid_shift: int, patches: dict[int, int] | None) -> None:
        # The model does not follow a Repeat's effects: forget what it may have overwritten.
        self.values.clear()
        self._send(
            [
                m.Repeat(
                    id_shift, rid_shift, None, None if patches is None else tuple(sorted(patches.items()))
                )
            ],
            [],
        )

    # -- hostile traffic ---------------------------------------------------------------------------------

    @rule(
        mutation=st.sampled_from(
            ["shape", "nbytes", "dtype", "huge_dims", "tid", "out_base", "gid", "forged", "bindings", "seq"]
        )
    )
    def structurally_mutated(self, mutation: str) -> None:
        n = 3
        gid, body = GRAPHS[n]
        x = np.ones(n, np.float32)
        tid, out = self._ids(), self._ids()
        upload = m.Upload(tid, "float32", (n,), x.nbytes)
        execute = m.Execute(gid, (tid,), (2.0,), out)
        register = m.Register(gid, body)
        if mutation == "shape":
            upload = m.Upload(tid, "float32", (n + 1,), (n + 1) * 4)  # the bulk is short by 4 bytes
        elif mutation == "nbytes":
            upload = m.Upload(tid, "float32", (n,), 0)
        elif mutation == "dtype":
            upload = m.Upload(tid, "int32", (n,), x.nbytes)  # the graph wants float32
        elif mutation == "huge_dims":
            upload = m.Upload(tid, "float32", (0, 1 << 40, 1 << 40), 0)
        elif mutation == "tid":
            upload = m.Upload(m.MAX_ID, "float32", (n,), x.nbytes)
        elif mutation == "out_base":
            execute = m.Execute(gid, (tid,), (2.0,), m.MAX_ID)
        elif mutation == "gid":
            execute = m.Execute(b"\x07" * 16, (tid,), (2.0,), out)
        elif mutation == "forged":
            register = m.Register(gid, GRAPHS[64][1])
        elif mutation == "bindings":
            execute = m.Execute(gid, (tid,), (), out)
        batch: list[m.ClientMessage] = [
            upload,
            register,
            execute,
            m.Read(self._rid(), out),
            m.Sync(self._rid()),
        ]
        bulks = [x] if upload.nbytes == x.nbytes or mutation == "shape" else []
        if mutation == "seq":
            self.seq += 1  # skips one: out of order
        self.values.pop(out, None)
        self._send(batch, bulks)

    @rule(data=st.data())
    def byte_mutated(self, data: st.DataObject) -> None:
        x = np.ones(4, np.float32)
        tid = self._ids()
        plain = bytearray(
            m.encode_batch(
                m.Batch(self.seq + 1, (m.Upload(tid, "float32", (4,), 16, True), m.Sync(self._rid())))
            )
        )
        plain += x.tobytes()
        where = data.draw(st.integers(0, len(plain) - 1))
        how = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        if how == "flip":
            plain[where] ^= data.draw(st.integers(1, 255))
        elif how == "insert":
            plain[where:where] = bytes([data.draw(st.integers(0, 255))])
        else:
            del plain[where]
        self._send([], [], bytes(plain))

    @rule(reverse=st.booleans(), chunk=st.sampled_from([1, 7, 1000]))
    def chunks_out_of_order_or_odd_sizes(self, reverse: bool, chunk: int) -> None:
        assert self.client is not None
        x = np.arange(1000, dtype=np.float32)
        tid, rid = self._ids(), self._rid()
        messages: list[m.ClientMessage] = [m.Upload(tid, "float32", x.shape, x.nbytes), m.Read(rid, tid)]
        client = self.client
        self.seq += 1
        frames: list[bytes | bytearray] = [
            client.channel.seal(m.encode_batch(m.Batch(self.seq, tuple(messages))), MESSAGE)
        ]
        frames += client.channel.seal_chunks(x.data.cast("B"), chunk)
        if reverse:
            frames[1], frames[2] = frames[2], frames[1]  # the counters no longer follow each other
        else:
            self.values[tid] = x
        self.call(client.link.send(b"".join(frames)))
        self.previous = messages
        got = self._outcome(messages)
        assert got is None or not reverse, "reordered frames were accepted"

    @rule(data=st.binary(min_size=1, max_size=200))
    def garbage(self, data: bytes) -> None:
        assert self.client is not None
        client = self.client
        self.seq += 1

        async def go() -> bool:
            await client.link.send(data)
            try:
                while True:
                    blob = await asyncio.wait_for(client.link.recv(), WAIT)
                    for frame in split_frames(blob):
                        kind, plain = client.channel.open(frame)
                        if kind is BULK:
                            continue
                        if any(type(r) is m.Error and r.rid == 0 for r in m.decode_reply(plain).messages):
                            return await asyncio.wait_for(client.ended(), WAIT)
            except TransportError:
                return True  # garbage that is not a frame: the link is closed at once

        assert self.call(go())
        self._ended()

    # -- invariants ---------------------------------------------------------------------------------------

    @invariant()
    def the_worker_has_at_most_this_session(self) -> None:
        assert len(self.worker.worker.sessions) <= 1

    def teardown(self) -> None:
        if self.client is not None:
            client = self.client
            self.call(client.close())
            self.client = None
        self._wait_for_memory()

        # The worker still serves: a fresh session answers.
        async def fresh() -> list[m.WorkerMessage]:
            c = await WireClient.connect(self.worker)
            await c.send(1, [m.Sync(1)])
            reply, _ = await asyncio.wait_for(c.reply(), WAIT)
            await c.close()
            return list(reply.messages)

        assert self.call(fresh()) == [m.Done(1)]
        self._wait_for_memory()


SessionMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("EMBERLINK_FUZZ_EXAMPLES", "25")),
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_a_fuzzed_session_never_crashes_the_worker_nor_leaves_anything_behind(
    fuzz_worker: InProcessWorker,
) -> None:
    SessionMachine.TestCase("runTest").runTest()
