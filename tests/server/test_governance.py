"""Governance on the worker (issue 12): what an admitted but hostile or buggy client can no longer do.

Each test drives a worker the way an attacker with an allowed key would, frame by frame, and
checks the rule that stops it: sessions always end with an error and free what they held, memory
is counted (intermediates, reads, replies waiting to be sent) and bounded per session and per
worker, and work is bounded per plan and shared fairly on the device.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pytest

from emberlink.errors import ConfigError, TransportError
from emberlink.graph_replay.canonical import encode_graph, graph_id
from emberlink.graph_replay.ir import AttrValue, Graph, Node, TensorSpec
from emberlink.graph_replay.ops import check_attrs
from emberlink.protocol import messages as m
from emberlink.protocol.channel import MESSAGE, split_frames
from emberlink.protocol.handshake import ClientHandshake
from emberlink.protocol.limits import MAX_BATCH_MESSAGES, MAX_REPLY_FRAME_BYTES
from emberlink.protocol.resume import Credential
from emberlink.protocol.session import MAX_KEPT_REPLIES, ReplyLog
from emberlink.server.detached import ResumeRegistry
from emberlink.server.limits import SESSION_BYTES, DeviceCapacity, Limits
from emberlink.server.runner import Outgoing
from emberlink.server.session import Session, State
from emberlink.server.store import ID_BYTES
from emberlink.testing import InProcessWorker
from emberlink.transport import MAX_BLOB, memory

from ..graph_replay.graphs import Builder
from .server_harness import WireClient

F32 = "float32"
TIMEOUT = 20.0


def registered(graph: Graph) -> tuple[bytes, bytes]:
    body = encode_graph(graph)
    return graph_id(body), body


def upload(tid: int, array: np.ndarray) -> m.Upload:
    return m.Upload(tid, array.dtype.name, array.shape, array.nbytes)


def scale_graph(n: int) -> tuple[bytes, bytes]:
    """`x * s` for a float32 vector of n and a float binding."""
    g = Builder([TensorSpec(F32, (n,))], ["float"])
    return registered(g.graph([g.add("multiply", 0, 1)]))


def broadcast_sum_graph(n: int, dtype: str = F32) -> tuple[bytes, bytes]:
    """A one-element input broadcast to n elements, doubled (materialized) and summed: 4 output bytes."""
    g = Builder([TensorSpec(dtype, (1,))], ["float"])
    wide = g.add("broadcast_to", 0, shape=(n,))
    return registered(g.graph([g.add("sum", g.add("multiply", wide, 1))]))


def lazy_broadcast_sum_graph(n: int) -> tuple[bytes, bytes]:
    """The sum of one element broadcast to n elements (no intermediate array, n elements touched)."""
    g = Builder([TensorSpec(F32, (1,))], [])
    return registered(g.graph([g.add("sum", g.add("broadcast_to", 0, shape=(n,)))]))


def matmul_graph(n: int, dtype: str = "float64") -> tuple[bytes, bytes]:
    """ones(n, n) @ ones(n, n), summed: no input, a scalar output, 2 n^3 FLOPs."""
    g = Builder([], [])
    a = g.add("ones", shape=(n, n), dtype=dtype)
    return registered(g.graph([g.add("sum", g.add("matmul", a, a))]))


def chain_graph(nodes: int) -> tuple[bytes, bytes]:
    """A vector negated `nodes` times."""
    g = Builder([TensorSpec(F32, (4,))], [])
    v = 0
    for _ in range(nodes):
        v = g.add("negative", v)
    return registered(g.graph([v]))


def transpose_graph(n: int) -> tuple[bytes, bytes]:
    """The transpose of an n x n float32 matrix: a non-contiguous view of the input."""
    g = Builder([TensorSpec(F32, (n, n))], [])
    return registered(g.graph([g.add("permute_dims", 0, axes=(1, 0))]))


def two_outputs_graph() -> tuple[bytes, bytes]:
    g = Builder([TensorSpec(F32, (3,))], [])
    return registered(g.graph([g.add("negative", 0), g.add("abs", 0)]))


def run(worker: InProcessWorker, coro: Any, timeout: float = 60) -> Any:
    return worker.call(coro, timeout)


async def reply(c: WireClient, timeout: float = TIMEOUT) -> tuple[m.Reply, list[np.ndarray]]:
    return await asyncio.wait_for(c.reply(), timeout)


async def until_ack(c: WireClient, ack: int) -> list[m.WorkerMessage]:
    return await asyncio.wait_for(c.reply_until(ack), TIMEOUT)


async def final_error(c: WireClient) -> m.Error:
    """Read replies until the worker's session-ending Error (rid 0); then the link must close."""
    while True:
        r, _ = await reply(c)
        for msg in r.messages:
            if type(msg) is m.Error and msg.rid == 0:
                assert await asyncio.wait_for(c.ended(), TIMEOUT)
                return msg


async def stalled_client(worker: InProcessWorker, capacity: int = 1) -> WireClient:
    """A session over a memory pair whose worker-to-client direction holds only `capacity` unread
    blobs, so the worker's sends block as soon as this client stops reading (as a TCP window does)."""
    client_end, worker_end = memory.pair(capacity=capacity, name="stalled")

    async def serve() -> None:  # what a listener does: the link closes when its session ends
        try:
            await worker.worker.handle(worker_end)
        finally:
            await worker_end.close()

    asyncio.get_running_loop().create_task(serve())
    who = worker.new_client()
    hs = ClientHandshake(who, worker.node_id, os.urandom)
    await client_end.send(hs.hello())
    auth, channel, _ = hs.receive_welcome(bytes(await client_end.recv()))
    await client_end.send(auth)
    return WireClient(client_end, channel)


def the_session(worker: InProcessWorker) -> Session:
    (session,) = worker.worker.sessions
    return session


async def wait_for(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def no_sessions(worker: InProcessWorker) -> None:
    await wait_for(lambda: not worker.worker.sessions)


def in_use(worker: InProcessWorker) -> int:
    return worker.worker.device.backend.memory_stats()["in_use_bytes"]


# -- sessions that never end ----------------------------------------------------------------------


def test_an_upload_of_zero_elements_with_huge_dims_ends_the_session_with_an_error(
    worker: InProcessWorker,
) -> None:
    async def go() -> m.Error:
        c = await WireClient.connect(worker)
        await c.send(1, [m.Upload(1, F32, (0, 1 << 40, 1 << 40, 1 << 40), 0), m.Sync(1)])
        error = await final_error(c)
        await no_sessions(worker)
        return error

    error = run(worker, go())
    assert error.code == "refused" and "shape" in error.message


def _a_bug_ends_the_session(
    worker: InProcessWorker, caplog: pytest.LogCaptureFixture, rid: int = 1
) -> tuple[m.Error, list[logging.LogRecord]]:
    """A client sends one Sync; the worker, with a bug planted by the caller, must end the session
    with an error the client receives, logged once with the client's NodeId."""
    who = worker.new_client()

    async def go() -> m.Error:
        c = await WireClient.connect(worker, who)
        await c.send(1, [m.Sync(rid)])
        error = await final_error(c)
        await no_sessions(worker)
        return error

    with caplog.at_level(logging.INFO, logger="emberlink.server"):
        error = run(worker, go())
    failures = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(failures) == 1 and who.node_id in failures[0].getMessage()
    return error, failures


def test_an_exception_in_a_sessions_receive_task_ends_it_with_an_error_logged_once(
    worker: InProcessWorker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("a bug in the worker")

    monkeypatch.setattr(m, "decode_batch_prefix", broken)
    error, failures = _a_bug_ends_the_session(worker, caplog)
    assert error.code == "remote" and "RuntimeError" in error.message
    assert failures[0].exc_info is not None


def test_an_exception_applying_a_batch_ends_the_session_with_an_error_logged_once(
    worker: InProcessWorker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from emberlink.server.runner import BatchRunner

    def broken(self: BatchRunner, msg: m.Sync, out: object) -> None:
        raise KeyError("a bug in the worker")

    monkeypatch.setattr(BatchRunner, "_sync", broken)
    error, _ = _a_bug_ends_the_session(worker, caplog)
    assert error.code == "remote" and "KeyError" in error.message


def test_an_exception_in_a_sessions_send_task_ends_it_with_an_error_logged_once(
    worker: InProcessWorker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real, real_inline = m.encode_reply, m.encode_reply_inline

    def broken(reply: m.Reply) -> bytes:
        if m.Done(7) in reply.messages:
            raise ValueError("a bug in the worker")
        return real(reply)

    def broken_inline(ack: int, messages: tuple[m.WorkerMessage, ...], inline: Iterable[int]) -> bytes:
        if m.Done(7) in messages:
            raise ValueError("a bug in the worker")
        return real_inline(ack, messages, inline)

    monkeypatch.setattr(m, "encode_reply", broken)
    monkeypatch.setattr(m, "encode_reply_inline", broken_inline)  # (small replies: see _reply_layout)
    error, _ = _a_bug_ends_the_session(worker, caplog, rid=7)
    assert error.code == "remote" and "ValueError" in error.message


# -- replies nobody reads -------------------------------------------------------------------------


def test_a_client_past_the_unacknowledged_batch_limit_is_refused(worker: InProcessWorker) -> None:
    async def go() -> m.Error:
        c = await stalled_client(worker)
        for seq in range(1, 200):  # never reads a reply
            try:
                await asyncio.wait_for(c.send(seq, [m.Sync(seq)]), 2)
            except (TimeoutError, TransportError):
                break  # the worker stopped reading
        error = await final_error(c)
        await no_sessions(worker)
        return error

    error = run(worker, go())
    assert error.code == "refused" and "acknowledge" in error.message


def test_replies_waiting_to_be_sent_count_against_the_session_quota(make_worker) -> None:
    quota = 4 << 20
    worker = make_worker(max_session_bytes=quota)
    n = 1 << 18  # 1 MiB of float32
    x = np.ones(n, np.float32)
    gid, body = scale_graph(n)

    async def go() -> tuple[int, list[m.WorkerMessage]]:
        c = await stalled_client(worker)
        await c.send(1, [upload(1, x), m.Register(gid, body)], [x])
        for seq in range(2, 12):  # each batch leaves a fresh 1 MiB result in a reply nobody reads
            tid = 100 + seq
            await c.send(seq, [m.Execute(gid, (1,), (2.0,), tid), m.Read(seq, tid), m.Drop((tid,))])
        session = the_session(worker)
        await wait_for(lambda: session.applied >= 11)
        held = in_use(worker)
        got = await until_ack(c, 11)
        await c.close()
        return held, got

    held, got = run(worker, go())
    assert held <= quota
    codes = [msg.code for msg in got if type(msg) is m.Error]
    assert codes and set(codes) == {"quota"}
    assert any(type(msg) is m.Result for msg in got)


def test_a_client_that_stops_reading_is_paused_then_ended(make_worker) -> None:
    worker = make_worker(limits=Limits(max_reply_bytes=1 << 20, reply_timeout=0.5))
    x = np.ones(1 << 19, np.float32)  # 2 MiB: one read of it is over the 1 MiB of queued replies

    async def go() -> tuple[int, m.Error]:
        c = await stalled_client(worker)
        await c.send(1, [upload(1, x), m.Read(1, 1)], [x])
        session = the_session(worker)
        await wait_for(lambda: session.paused)
        await c.send(2, [m.Sync(2)])  # not read while paused: never applied
        await wait_for(lambda: session.ending)  # the reply timeout ran out
        applied = session.applied
        error = await final_error(c)  # a client that reads again in time still hears why
        await no_sessions(worker)
        return applied, error

    applied, error = run(worker, go())
    assert applied == 1
    assert error.code == "refused" and "reading" in error.message
    assert in_use(worker) == 0


# -- memory counted: intermediates, reads of views -------------------------------------------------


def test_an_execute_whose_peak_passes_the_quota_answers_quota_exceeded_and_the_session_goes_on(
    make_worker,
) -> None:
    worker = make_worker(max_session_bytes=1 << 20)
    gid, body = broadcast_sum_graph(1 << 19)  # outputs 4 bytes, materializes 2 MiB on the way
    one = np.ones(1, np.float32)
    small_gid, small_body = broadcast_sum_graph(1 << 10)

    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(
            1,
            [upload(1, one), m.Register(gid, body), m.Execute(gid, (1,), (2.0,), 2), m.Read(1, 2)],
            [one],
        )
        await c.send(
            2, [m.Register(small_gid, small_body), m.Execute(small_gid, (1,), (2.0,), 3), m.Read(2, 3)]
        )
        got = await until_ack(c, 2)
        await c.close()
        return got

    refused, fine = run(worker, go())
    assert type(refused) is m.Error and refused.code == "quota" and "peak" in refused.message
    assert type(fine) is m.Result
    assert worker.worker.device.backend.memory_stats()["peak_bytes"] < 1 << 20


def test_tensors_of_zero_bytes_are_not_free(make_worker) -> None:
    worker = make_worker(max_session_bytes=64 << 10)
    count = 300  # ids of nothing: each costs the worker its objects, ID_BYTES counted (256 fit)

    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        uploads: list[m.ClientMessage] = [m.Upload(tid, F32, (0,), 0, True) for tid in range(1, count + 1)]
        await c.send(1, [*uploads, m.Sync(1)])
        got = await until_ack(c, 1)
        await c.close()
        return got

    (sync,) = run(worker, go())
    assert type(sync) is m.Error and sync.code == "quota"


def test_reading_a_non_contiguous_result_counts_its_copy_once(worker: InProcessWorker) -> None:
    n = 256
    size = n * n * 4
    a = np.arange(n * n, dtype=np.float32).reshape(n, n)
    gid, body = transpose_graph(n)

    async def go() -> tuple[list[m.WorkerMessage], list[np.ndarray]]:
        c = await WireClient.connect(worker)
        reads = [m.Read(i, 2) for i in range(1, 21)]
        await c.send(1, [upload(1, a), m.Register(gid, body), m.Execute(gid, (1,), (), 2), *reads], [a])
        messages: list[m.WorkerMessage] = []
        arrays: list[np.ndarray] = []
        while len(arrays) < 20:
            r, got = await reply(c)
            messages.extend(r.messages)
            arrays.extend(got)
        await c.send(2, [m.Stats(21)])
        (stats,) = await until_ack(c, 2)
        await c.close()
        return [stats], arrays

    (stats,), arrays = run(worker, go())
    for array in arrays:
        np.testing.assert_array_equal(array, a.T)
    peak = stats.stats["session_peak_bytes"]
    assert 2 * size < peak < 4 * size  # the copy counted once (uncounted: 2 sizes; each read: 22)


# -- replies larger than the transport allows -------------------------------------------------------


def test_many_replies_in_one_batch_go_in_frames_under_the_transport_limit(worker: InProcessWorker) -> None:
    count = MAX_BATCH_MESSAGES  # StatsReplies of about 500 bytes each: about 500 KB together

    async def go() -> tuple[int, int, int]:
        c = await WireClient.connect(worker)
        await c.send(1, [m.Stats(i) for i in range(1, count + 1)])
        largest_blob = largest_frame = answered = 0
        while answered < count:
            blob = await asyncio.wait_for(c.link.recv(), TIMEOUT)
            largest_blob = max(largest_blob, len(blob))
            for frame in split_frames(blob):
                _, plain = c.channel.open(frame)
                largest_frame = max(largest_frame, len(plain))
                answered += sum(1 for msg in m.decode_reply(plain).messages if type(msg) is m.StatsReply)
        await c.close()
        return largest_blob, largest_frame, answered

    largest_blob, largest_frame, answered = run(worker, go())
    assert answered == count
    assert largest_blob <= MAX_BLOB and largest_frame <= MAX_REPLY_FRAME_BYTES


def test_a_batch_of_more_messages_than_the_limit_is_refused_with_an_error(worker: InProcessWorker) -> None:
    async def go() -> m.Error:
        c = await WireClient.connect(worker)
        await c.send(1, [m.Sync(i) for i in range(1, MAX_BATCH_MESSAGES + 2)])
        return await final_error(c)

    error = run(worker, go())
    assert error.code == "refused" and str(MAX_BATCH_MESSAGES) in error.message


def test_a_batch_whose_replies_would_pass_the_transport_limit_is_refused_with_an_error(
    worker: InProcessWorker,
) -> None:
    # The input: 65,536 Stats in one batch, about 16 MB of replies. The client must hear
    # why (before, the reply blob passed MAX_BLOB and the session died as "link lost", unexplained).
    count = 1 << 16

    async def go() -> m.Error:
        c = await WireClient.connect(worker)
        await c.send(1, [m.Stats(i) for i in range(1, count + 1)])
        return await final_error(c)

    error = run(worker, go())
    assert error.code == "refused" and str(MAX_BATCH_MESSAGES) in error.message


# -- internal errors from valid-looking input ---------------------------------------------------------


def test_a_graph_whose_shapes_overflow_is_refused_as_a_shape_error(worker: InProcessWorker) -> None:
    extremes: dict[str, AttrValue] = {"start": -(1 << 63), "stop": (1 << 63) - 1, "step": 1, "dtype": "int64"}
    attrs = check_attrs("arange", extremes)
    gid, body = registered(Graph((), (), (Node("arange", (), attrs),), (0,)))

    async def go() -> m.Error:
        c = await WireClient.connect(worker)
        await c.send(1, [m.Register(gid, body), m.Execute(gid, (), (), 1), m.Sync(1)])
        return await final_error(c)

    error = run(worker, go())
    assert error.code == "refused" and "arange" in error.message and "internal" not in error.message


def test_execute_outputs_past_the_id_space_are_refused(worker: InProcessWorker) -> None:
    gid, body = two_outputs_graph()
    x = np.ones(3, np.float32)

    async def go() -> m.Error:
        c = await WireClient.connect(worker)
        await c.send(
            1, [upload(1, x), m.Register(gid, body), m.Execute(gid, (1,), (), m.MAX_ID), m.Sync(1)], [x]
        )
        return await final_error(c)

    error = run(worker, go())
    assert error.code == "refused" and "id" in error.message


# -- one client stalls everyone -------------------------------------------------------------------------


def _execute_and_read(
    gid: bytes, body: bytes, inputs: tuple[int, ...], bindings: tuple[float, ...]
) -> list[m.ClientMessage]:
    return [m.Register(gid, body), m.Execute(gid, inputs, bindings, 50), m.Read(1, 50)]


def test_a_sum_over_a_broadcast_past_the_element_limit_is_refused_before_it_runs(
    worker: InProcessWorker,
) -> None:
    gid, body = lazy_broadcast_sum_graph(1 << 33)
    one = np.ones(1, np.float32)

    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(1, [upload(1, one), *_execute_and_read(gid, body, (1,), ()), m.Read(2, 1)], [one])
        got = await until_ack(c, 1)
        await c.close()
        return got

    refused, fine = run(worker, go())
    assert type(refused) is m.Error and refused.code == "limit" and "elements" in refused.message
    assert type(fine) is m.Result


def test_a_large_matmul_is_refused_before_it_runs(worker: InProcessWorker) -> None:
    gid, body = matmul_graph(4096)  # float64: seconds of one core, at the default limits

    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(1, [*_execute_and_read(gid, body, (), ()), m.Sync(2)])
        got = await until_ack(c, 1)
        await c.close()
        return got

    refused, sync = run(worker, go())
    assert type(refused) is m.Error and refused.code == "limit"
    assert type(sync) is m.Error and sync.code == "limit"


def test_limits_are_set_per_worker(make_worker) -> None:
    worker = make_worker(limits=Limits(max_plan_elements=1 << 12, max_plan_flops=1 << 15))
    gid, body = lazy_broadcast_sum_graph(1 << 13)
    ok_gid, ok_body = lazy_broadcast_sum_graph(1 << 10)
    mm_gid, mm_body = matmul_graph(28)  # 3,920 elements touched, about 45,000 FLOPs
    one = np.ones(1, np.float32)

    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(1, [upload(1, one), *_execute_and_read(gid, body, (1,), ())], [one])
        await c.send(2, [m.Register(ok_gid, ok_body), m.Execute(ok_gid, (1,), (), 60), m.Read(2, 60)])
        await c.send(3, [m.Register(mm_gid, mm_body), m.Execute(mm_gid, (), (), 61), m.Read(3, 61)])
        got = await until_ack(c, 3)
        await c.close()
        return got

    elements, fine, flops = run(worker, go())
    assert type(elements) is m.Error and elements.code == "limit" and str(1 << 12) in elements.message
    assert type(fine) is m.Result
    assert type(flops) is m.Error and flops.code == "limit" and "FLOPs" in flops.message


def test_a_graph_over_the_node_limit_is_refused_and_the_session_goes_on(make_worker) -> None:
    worker = make_worker(limits=Limits(max_graph_nodes=100))
    gid, body = chain_graph(101)
    ok_gid, ok_body = chain_graph(100)
    x = np.ones(4, np.float32)

    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(1, [upload(1, x), *_execute_and_read(gid, body, (1,), ())], [x])
        await c.send(2, [m.Register(ok_gid, ok_body), m.Execute(ok_gid, (1,), (), 60), m.Read(2, 60)])
        got = await until_ack(c, 2)
        await c.close()
        return got

    refused, fine = run(worker, go())
    assert type(refused) is m.Error and refused.code == "limit" and "100 nodes" in refused.message
    assert type(fine) is m.Result


def test_a_graph_refused_once_is_refused_again_without_being_read_again(
    make_worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from emberlink.graph_replay import canonical

    worker = make_worker(limits=Limits(max_graph_nodes=10))
    gid, body = chain_graph(11)
    reads: list[bytes] = []
    real = canonical.graph_size

    def counted(raw: bytes) -> tuple[int, int]:
        reads.append(raw)
        return real(raw)

    monkeypatch.setattr(canonical, "graph_size", counted)
    x = np.ones(4, np.float32)

    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(1, [upload(1, x), *_execute_and_read(gid, body, (1,), ())], [x])
        await c.send(2, [m.Register(gid, body), m.Execute(gid, (1,), (), 60), m.Read(2, 60)])
        got = await until_ack(c, 2)
        await c.close()
        return got

    first, again = run(worker, go())
    assert type(first) is m.Error and type(again) is m.Error and again.code == "limit"
    assert len(reads) == 1


def test_compiling_a_graph_never_blocks_other_sessions_device_work(
    worker: InProcessWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from emberlink.graph_replay import plan as plan_module
    from emberlink.server import graphs as graphs_module

    release = threading.Event()
    compiling = threading.Event()
    compiled = threading.Event()
    real = plan_module.compile_plan

    def slow_compile(graph: Graph, **kwargs: Any) -> Any:
        if len(graph.nodes) != 7:
            return real(graph, **kwargs)
        compiling.set()  # only the slow client's graph waits
        release.wait(15)
        try:
            return real(graph, **kwargs)
        finally:
            compiled.set()

    monkeypatch.setattr(graphs_module, "compile_plan", slow_compile)
    slow_gid, slow_body = chain_graph(7)
    gid, body = scale_graph(3)
    x = np.ones(3, np.float32)

    async def go() -> bool:
        honest = await WireClient.connect(worker)
        await honest.send(1, [m.Register(gid, body), m.Sync(1)])
        await until_ack(honest, 1)
        slow = await WireClient.connect(worker)
        await slow.send(1, [m.Register(slow_gid, slow_body), m.Sync(1)])
        await asyncio.get_running_loop().run_in_executor(None, compiling.wait, 10)
        await honest.send(2, [upload(1, x), m.Execute(gid, (1,), (2.0,), 2), m.Read(2, 2)], [x])
        got = await until_ack(honest, 2)
        still_compiling = not compiled.is_set()
        release.set()
        await until_ack(slow, 1)
        await slow.close()
        await honest.close()
        return still_compiling and type(got[0]) is m.Result

    try:
        assert run(worker, go())
    finally:
        release.set()


def test_one_sessions_long_queue_does_not_starve_another(worker: InProcessWorker) -> None:
    batches = 12

    async def go() -> tuple[int, bool]:
        busy = await WireClient.connect(worker)
        busy_session = the_session(worker)
        honest = await WireClient.connect(worker)
        for seq in range(1, batches + 1):  # a quarter second of device work, ahead of the honest Sync
            await busy.send(seq, [m.Stats(seq * 10_000 + i) for i in range(1, MAX_BATCH_MESSAGES)])
        await honest.send(1, [m.Sync(1)])
        await until_ack(honest, 1)
        applied, refused = busy_session.applied, busy_session.ending
        await busy.close()
        await honest.close()
        return applied, refused

    applied, refused = run(worker, go())
    assert applied < batches and not refused


# -- a worker-wide memory budget ------------------------------------------------------------------------


def test_the_worker_memory_budget_refuses_an_upload_with_a_clear_error(make_worker) -> None:
    worker = make_worker(limits=Limits(max_worker_bytes=48 << 20, max_session_bytes=32 << 20))
    big = np.ones(7 << 20, np.float32)  # 28 MiB: fits a session quota, not twice in the worker

    async def go() -> list[m.WorkerMessage]:
        a = await WireClient.connect(worker)
        b = await WireClient.connect(worker)
        await a.send(1, [upload(1, big), m.Sync(1)], [big])
        first = await until_ack(a, 1)
        await b.send(1, [upload(1, big), m.Read(1, 1), m.Sync(2)], [big])
        got = await until_ack(b, 1)
        await a.close()
        await b.close()
        return first + got

    done, refused, sync = run(worker, go())
    assert type(done) is m.Done
    assert (
        type(refused) is m.Error
        and refused.code == "out_of_memory"
        and "--max-worker-bytes" in refused.message
    )
    assert type(sync) is m.Error


def test_the_worker_memory_budget_refuses_a_plan_with_a_clear_error(make_worker) -> None:
    worker = make_worker(limits=Limits(max_worker_bytes=24 << 20))
    gid, body = broadcast_sum_graph(4 << 20)  # 16 MiB on the way
    one = np.ones(1, np.float32)
    pad = np.ones(3 << 20, np.float32)  # 12 MiB held by another session

    async def go() -> list[m.WorkerMessage]:
        other = await WireClient.connect(worker)
        await other.send(1, [upload(1, pad), m.Sync(1)], [pad])
        await until_ack(other, 1)
        c = await WireClient.connect(worker)
        await c.send(
            1, [upload(1, one), m.Register(gid, body), m.Execute(gid, (1,), (2.0,), 2), m.Read(1, 2)], [one]
        )
        got = await until_ack(c, 1)
        await other.close()
        await c.close()
        return got

    (refused,) = run(worker, go())
    assert (
        type(refused) is m.Error
        and refused.code == "out_of_memory"
        and "--max-worker-bytes" in refused.message
    )


def test_the_worker_memory_budget_refuses_a_new_session_when_full(make_worker) -> None:
    budget = 32 << 20
    worker = make_worker(limits=Limits(max_worker_bytes=budget))
    pad = np.ones((budget - SESSION_BYTES - ID_BYTES) // 4, np.float32)  # with its session: all of it

    async def go() -> m.Error:
        a = await WireClient.connect(worker)
        await a.send(1, [upload(1, pad), m.Sync(1)], [pad])
        await until_ack(a, 1)
        b = await WireClient.connect(worker)
        error = await final_error(b)
        await a.close()
        return error

    error = run(worker, go())
    assert error.code == "out_of_memory" and "--max-worker-bytes" in error.message


# -- one client's sessions ------------------------------------------------------------------------------


def test_a_clients_detached_sessions_past_its_cap_end_oldest_first_and_free_what_they_held(
    make_worker: Callable[..., InProcessWorker],
) -> None:
    worker = make_worker(limits=Limits(max_client_detached=2), resume_window=60.0)
    who = worker.new_client()
    x = np.ones(1 << 18, np.float32)  # 1 MiB each
    held_before = worker.worker.held.used

    async def hang_up_one(tid: int) -> Session:
        c = await WireClient.connect(worker, who)
        await c.send(1, [upload(tid, x), m.Sync(1)], [x])
        await until_ack(c, 1)
        (session,) = [s for s in worker.worker.sessions if s.state is State.OPEN]
        await c.close()
        await wait_for(lambda: session.state is not State.OPEN)
        return session

    async def go() -> list[Session]:
        sessions = [await hang_up_one(1)]
        sessions.append(await hang_up_one(2))
        held_by_two = worker.worker.held.used
        sessions.append(await hang_up_one(3))
        await wait_for(lambda: sessions[0] not in worker.worker.sessions)
        assert worker.worker.held.used == held_by_two  # the first one's memory went with it
        return sessions

    first, second, third = run(worker, go())
    assert [s.state for s in (second, third)] == [State.DETACHED, State.DETACHED]
    assert first.state is State.CLOSED
    assert worker.worker.resumes.sessions_of(who.node_id) == (2, 2)
    assert worker.worker.held.used > held_before


def test_a_client_at_its_session_cap_is_told_why_it_may_not_open_another() -> None:
    registry = ResumeRegistry(1.0, max_open=2)

    async def go() -> tuple[str | None, str | None, str | None]:
        first = registry.open("client-a", b"\x01" * 32, lambda: None)
        registry.open("client-a", b"\x02" * 32, lambda: None)
        full, other = registry.refusal("client-a"), registry.refusal("client-b")
        first.close()
        return full, other, registry.refusal("client-a")

    full, other, after_close = asyncio.run(go())
    assert full is not None and "--max-client-sessions 2" in full and "client-a" in full
    assert other is None and after_close is None


def test_a_worker_refuses_a_clients_session_past_its_cap_and_serves_other_clients(
    make_worker: Callable[..., InProcessWorker],
) -> None:
    worker = make_worker(limits=Limits(max_client_sessions=2))
    who = worker.new_client()

    async def go() -> tuple[m.Error, int]:
        first = await WireClient.connect(worker, who)
        second = await WireClient.connect(worker, who)
        for c in (first, second):
            await c.send(1, [m.Sync(1)])
            await until_ack(c, 1)
        third = await WireClient.connect(worker, who)
        error = await final_error(third)
        other = await WireClient.connect(worker)  # another client is not counted against this one
        await other.send(1, [m.Sync(1)])
        await until_ack(other, 1)
        await first.send(2, [m.Close("bye")])  # room again: a new session of this client is served
        await wait_for(lambda: worker.worker.resumes.sessions_of(who.node_id)[0] == 1)
        fourth = await WireClient.connect(worker, who)
        await fourth.send(1, [m.Sync(1)])
        await until_ack(fourth, 1)
        served = worker.worker.resumes.sessions_of(who.node_id)[0]
        for c in (second, other, fourth):
            await c.close()
        return error, served

    error, served = run(worker, go())
    assert error.code == "refused" and "--max-client-sessions 2" in error.message
    assert who.node_id in error.message
    assert served == 2


def test_a_session_past_its_tensor_id_limit_ends_with_an_error_naming_the_flag_and_frees_all(
    make_worker: Callable[..., InProcessWorker],
) -> None:
    worker = make_worker(limits=Limits(max_session_tensors=8))
    x = np.ones(4, np.float32)
    held_before = worker.worker.held.used

    async def go() -> tuple[m.Error, m.Error]:
        honest = await WireClient.connect(worker)
        # Eight ids, dropped and stored again, stay within the limit however often they are reused.
        await honest.send(1, [upload(t, x) for t in range(1, 9)] + [m.Sync(1)], [x] * 8)
        await until_ack(honest, 1)
        await honest.send(2, [m.Drop((1, 2)), upload(9, x), upload(10, x), m.Sync(2)], [x, x])
        await until_ack(honest, 2)
        # A ninth id held at once (here a failed one: reading nothing into it) ends the session.
        hoarder = await WireClient.connect(worker)
        await hoarder.send(1, [upload(t, x) for t in range(1, 9)] + [m.Sync(1)], [x] * 8)
        await until_ack(hoarder, 1)
        await hoarder.send(2, [upload(9, x)], [x])
        error = await final_error(hoarder)
        await honest.send(3, [m.Close("bye")])
        await no_sessions(worker)
        return error, error

    error, _ = run(worker, go())
    assert error.code == "refused" and "--max-session-tensors" in error.message
    assert "9 tensor ids" in error.message and "8" in error.message
    assert worker.worker.held.used == held_before


def test_client_caps_default_to_sane_values_and_must_be_positive() -> None:
    device = DeviceCapacity("cpu", 8 << 30, 2)
    limits = Limits().resolve(device)
    assert limits.max_client_sessions == 16 and limits.max_client_detached == 4
    assert limits.max_session_tensors == 16_384
    with pytest.raises(ConfigError, match="max_client_detached"):
        Limits(max_client_detached=0).resolve(device)


# -- nothing outlives a session ------------------------------------------------------------------------


@pytest.fixture
def no_cycle_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _hostile_endings() -> dict[str, Callable[[WireClient, np.ndarray, bytes, bytes], Any]]:
    async def close(c: WireClient, x: np.ndarray, gid: bytes, body: bytes) -> None:
        await c.send(2, [m.Close("bye")])
        await asyncio.wait_for(c.ended(), TIMEOUT)

    async def hang_up(c: WireClient, x: np.ndarray, gid: bytes, body: bytes) -> None:
        await c.close()

    async def malformed(c: WireClient, x: np.ndarray, gid: bytes, body: bytes) -> None:
        await c.link.send(b"\x01\x01" + b"\xff" * 40)
        await asyncio.wait_for(c.ended(), TIMEOUT)

    async def out_of_order(c: WireClient, x: np.ndarray, gid: bytes, body: bytes) -> None:
        await c.send(7, [m.Sync(9)])
        await asyncio.wait_for(c.ended(), TIMEOUT)

    async def hang_up_mid_upload(c: WireClient, x: np.ndarray, gid: bytes, body: bytes) -> None:
        msg = upload(5, x)
        await c.link.send(c.channel.seal(m.encode_batch(m.Batch(2, (msg,))), MESSAGE))
        await c.close()

    return {
        "close": close,
        "hang_up": hang_up,
        "malformed": malformed,
        "out_of_order": out_of_order,
        "hang_up_mid_upload": hang_up_mid_upload,
    }


@pytest.mark.parametrize("ending", sorted(_hostile_endings()))
def test_nothing_a_session_held_outlives_it_without_the_cycle_collector(
    make_worker: Callable[..., InProcessWorker], no_cycle_collector: None, ending: str
) -> None:
    # A hang-up detaches the session for the resume window (server/detached.py): a short one, so
    # the session ends when it passes, and what it held must be freed then as at any other end.
    worker = make_worker(resume_window=0.3)
    x = np.ones(1 << 18, np.float32)
    gid, body = scale_graph(1 << 18)
    baseline = in_use(worker)
    held_before = worker.worker.held.used
    end = _hostile_endings()[ending]

    async def go() -> weakref.ref[Session]:
        c = await WireClient.connect(worker)
        await c.send(
            1,
            [upload(1, x), m.Register(gid, body), m.Execute(gid, (1,), (2.0,), 2), m.Read(1, 2), m.Sync(2)],
            [x],
        )
        await until_ack(c, 1)
        session = weakref.ref(the_session(worker))
        await end(c, x, gid, body)
        await no_sessions(worker)
        return session

    session = run(worker, go())
    run(worker, asyncio.sleep(0.05))
    assert in_use(worker) == baseline
    assert worker.worker.held.used == held_before
    assert session() is None


def test_a_client_that_never_confirms_its_replies_does_not_make_the_worker_keep_them_all(
    worker: InProcessWorker,
) -> None:
    batches = MAX_KEPT_REPLIES + 40

    async def go() -> tuple[int, int, bool]:
        c = await WireClient.connect(worker)  # its batches say received=0: nothing is ever confirmed
        for seq in range(1, batches + 1):
            await c.send(seq, [m.Sync(seq)])
            await until_ack(c, seq)
        session = the_session(worker)
        assert session._conn is not None
        replies = session._conn.replies
        kept, forgotten = len(replies), replies.forgotten
        await c.close()
        return kept, forgotten, replies.covers(batches - MAX_KEPT_REPLIES)

    kept, forgotten, covers_the_kept = run(worker, go())
    assert kept == MAX_KEPT_REPLIES and forgotten == batches - MAX_KEPT_REPLIES and covers_the_kept


def test_a_resume_that_needs_replies_the_worker_forgot_ends_the_session_with_worker_lost(
    make_worker: Callable[..., InProcessWorker],
) -> None:
    worker = make_worker(resume_window=30.0)
    who = worker.new_client()
    batches = MAX_KEPT_REPLIES + 3
    held_before = worker.worker.held.used

    async def go() -> m.Reply:
        c = await WireClient.connect(worker, who)  # its batches say received=0
        for seq in range(1, batches + 1):
            await c.send(seq, [m.Sync(seq)])
            await until_ack(c, seq)
        session = the_session(worker)
        await c.close()
        await wait_for(lambda: session.state is State.DETACHED)
        # A resume from reply 0: replies 1..3 were forgotten, so it cannot be made whole.
        link = await worker.open_link()
        credential = Credential(c.resume_secret)
        hs = ClientHandshake(who, worker.node_id, os.urandom, token_for=lambda th2: credential.token(th2, 0))
        await link.send(hs.hello())
        auth, channel, _ = hs.receive_welcome(bytes(await link.recv()))
        await link.send(auth)
        (frame,) = split_frames(await asyncio.wait_for(link.recv(), TIMEOUT))
        _, plaintext = channel.open(frame)
        await link.close()
        await no_sessions(worker)
        return m.decode_reply(plaintext)

    reply = run(worker, go())
    (error,) = [x for x in reply.messages if type(x) is m.Error and x.rid == 0]
    assert error.code == "worker_lost" and "were not kept" in error.message
    assert worker.worker.held.used == held_before  # the session ended and freed what it held


def test_a_reply_forgotten_while_detached_releases_what_it_kept_charged() -> None:
    released: list[int] = []

    class Held:
        def __init__(self, ack: int) -> None:
            self.ack = ack

        def release(self) -> None:
            released.append(self.ack)

    log: ReplyLog[Outgoing] = ReplyLog()
    for ack in range(1, MAX_KEPT_REPLIES + 3):
        out = Outgoing(ack, [m.Done(ack)])
        out.holds = [Held(ack)]  # type: ignore[list-item]
        log.keep(out)
    assert released == [1, 2] and len(log) == MAX_KEPT_REPLIES
    assert not log.covers(1) and log.covers(2)
