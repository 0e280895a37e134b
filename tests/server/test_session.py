"""The worker's side of the session protocol, frame by frame (docs/internals.md section 6)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest

from emberlink.graph_replay.canonical import encode_graph, graph_id
from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.protocol import messages as m
from emberlink.server.store import ID_BYTES
from emberlink.testing import InProcessWorker

from .server_harness import WireClient, memory_device, worker_stats


def scale_graph(n: int = 3) -> tuple[bytes, bytes]:
    """(gid, body) of `x * s` for a float32 vector of n and a float binding."""
    graph = Graph(
        inputs=(TensorSpec("float32", (n,)),),
        bindings=("float",),
        nodes=(Node("multiply", (0, 1)),),
        outputs=(2,),
    )
    body = encode_graph(graph)
    return graph_id(body), body


def upload(tid: int, array: np.ndarray) -> m.Upload:
    return m.Upload(tid, array.dtype.name, array.shape, array.nbytes)


X = np.array([1.0, 2.0, 3.0], np.float32)


T = TypeVar("T")


def run(worker: InProcessWorker, coro: Coroutine[Any, Any, T]) -> T:
    return worker.call(coro, 20)


def test_one_batch_uploads_executes_and_reads(worker: InProcessWorker) -> None:
    gid, body = scale_graph()

    async def go() -> tuple[m.Reply, list[np.ndarray]]:
        c = await WireClient.connect(worker)
        await c.send(
            1, [upload(1, X), m.Register(gid, body), m.Execute(gid, (1,), (2.0,), 2), m.Read(1, 2)], [X]
        )
        out = await c.reply()
        await c.close()
        return out

    reply, arrays = run(worker, go())
    assert reply.ack == 1
    assert reply.messages == (m.Result(1, "float32", (3,), 12, inline=True),)  # in the reply's own frame
    np.testing.assert_array_equal(arrays[0], X * 2)


def test_results_that_fit_in_a_chunk_travel_in_the_reply_frame_and_larger_ones_in_bulk_frames(
    worker: InProcessWorker,
) -> None:
    big = np.arange(worker.worker.chunk_size // 4 + 1, dtype=np.float32)  # one chunk and 4 bytes

    async def go() -> tuple[m.Reply, list[np.ndarray]]:
        c = await WireClient.connect(worker)
        await c.send(1, [upload(1, X), upload(2, big)], [X, big])
        await c.reply()
        await c.send(2, [m.Read(1, 1), m.Read(2, 2), m.Read(3, 1)])
        out = await c.reply()
        await c.close()
        return out

    reply, arrays = run(worker, go())
    assert [type(msg) is m.Result and msg.inline for msg in reply.messages] == [True, False, True]
    for got, want in zip(arrays, [X, big, X], strict=True):
        np.testing.assert_array_equal(got, want)


def test_forged_register_is_refused_and_ends_only_that_session(worker: InProcessWorker) -> None:
    gid, _ = scale_graph()
    _, other_body = scale_graph(4)
    bystander = memory_device(worker)

    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(1, [m.Register(gid, other_body)])
        got = (await c.reply())[0].messages
        assert await c.ended()
        return list(got)

    (error,) = run(worker, go())
    assert type(error) is m.Error and error.rid == 0 and error.code == "refused"
    assert "does not match" in error.message or "mismatch" in error.message
    assert float((bystander.tensor(X) * 3.0).sum()) == 18.0
    bystander.close()


@pytest.mark.parametrize("garbage", [b"\x00" * 64, bytes(range(256)) * 3, b"\x01\x01" + b"\xff" * 40])
def test_malformed_frame_after_handshake_ends_only_that_session(
    worker: InProcessWorker, garbage: bytes
) -> None:
    bystander = memory_device(worker)
    x = bystander.tensor(X)

    async def go() -> bool:
        c = await WireClient.connect(worker)
        await c.link.send(garbage)
        return await c.ended()

    assert run(worker, go())
    np.testing.assert_array_equal((x + 1.0).numpy(), X + 1)
    assert worker_stats(bystander)["sessions_open"] == 1
    bystander.close()


def test_frame_sealed_for_another_session_is_refused(worker: InProcessWorker) -> None:
    async def go() -> bool:
        a = await WireClient.connect(worker)
        b = await WireClient.connect(worker)
        frame = a.channel.seal(m.encode_batch(m.Batch(1, (m.Sync(1),))))
        await b.link.send(frame)
        ended = await b.ended()
        await a.close()
        return ended

    assert run(worker, go())


def test_batches_out_of_order_are_refused(worker: InProcessWorker) -> None:
    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(2, [m.Sync(1)])
        got = list((await c.reply())[0].messages)
        assert await c.ended()
        return got

    (error,) = run(worker, go())
    assert type(error) is m.Error and error.code == "refused" and "order" in error.message


def test_unknown_graph_applies_nothing_of_its_batch_and_discards_later_batches(
    worker: InProcessWorker,
) -> None:
    gid, body = scale_graph()

    async def go() -> tuple[list[m.WorkerMessage], list[m.WorkerMessage], list[np.ndarray]]:
        c = await WireClient.connect(worker)
        # Batch 1 uploads and executes a graph the worker has never seen: nothing of it applies.
        await c.send(1, [upload(1, X), m.Execute(gid, (1,), (2.0,), 2), m.Read(1, 2)], [X])
        # Batch 2 was already on its way; it must be discarded, not applied out of turn.
        await c.send(2, [m.Read(2, 1)])
        first = list((await c.reply())[0].messages)
        # The resend: batch 1 again with the Register first, then batch 2.
        await c.send(
            1, [m.Register(gid, body), upload(1, X), m.Execute(gid, (1,), (2.0,), 2), m.Read(1, 2)], [X]
        )
        await c.send(2, [m.Read(2, 1)])
        second: list[m.WorkerMessage] = []
        arrays: list[np.ndarray] = []
        while True:
            reply, got = await c.reply()
            second.extend(reply.messages)
            arrays.extend(got)
            if reply.ack == 2:
                break
        await c.close()
        return first, second, arrays

    first, second, arrays = run(worker, go())
    assert first == [m.GraphUnknown(1, gid)]
    assert second == [m.Result(1, "float32", (3,), 12, True), m.Result(2, "float32", (3,), 12, True)]
    np.testing.assert_array_equal(arrays[0], X * 2)
    np.testing.assert_array_equal(arrays[1], X)


def test_graph_cache_survives_a_reconnect_of_the_same_client(worker: InProcessWorker) -> None:
    gid, body = scale_graph()
    me = worker.new_client()

    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker, me)
        await c.send(1, [m.Register(gid, body), m.Sync(1)])
        await c.reply_until(1)
        await c.close()
        again = await WireClient.connect(worker, me)
        await again.send(1, [upload(1, X), m.Execute(gid, (1,), (3.0,), 2), m.Read(1, 2)], [X])
        got = await again.reply_until(1)
        await again.close()
        return got

    (result,) = run(worker, go())
    assert type(result) is m.Result


def test_clients_see_neither_each_others_graphs_nor_their_cache_figures(worker: InProcessWorker) -> None:
    gid, body = scale_graph()

    async def go() -> tuple[list[m.WorkerMessage], dict[str, m.StatValue], dict[str, m.StatValue]]:
        a = await WireClient.connect(worker)
        b = await WireClient.connect(worker)
        await b.send(1, [m.Stats(1)])
        (before,) = await b.reply_until(1)
        await a.send(
            1, [m.Register(gid, body), upload(1, X), m.Execute(gid, (1,), (2.0,), 2), m.Sync(1)], [X]
        )
        await a.reply_until(1)
        await a.send(2, [m.Execute(gid, (1,), (2.0,), 3), m.Sync(2)])
        await a.reply_until(2)
        # b names a's graph without registering it: for b it does not exist.
        await b.send(2, [upload(1, X), m.Execute(gid, (1,), (2.0,), 2), m.Read(2, 2)], [X])
        unknown = await b.reply_until(1)
        await b.send(2, [m.Stats(3)])
        (after,) = await b.reply_until(2)
        await a.close()
        await b.close()
        assert type(before) is m.StatsReply and type(after) is m.StatsReply
        return unknown, before.stats, after.stats

    unknown, before, after = run(worker, go())
    assert unknown == [m.GraphUnknown(2, gid)]
    cache_before = {k: v for k, v in before.items() if k.startswith("cache_") and k != "cache_misses"}
    cache_after = {k: v for k, v in after.items() if k.startswith("cache_") and k != "cache_misses"}
    assert cache_before == cache_after  # a's register and hit changed nothing b can see
    misses_before = before["cache_misses"]
    assert type(misses_before) is int and after["cache_misses"] == misses_before + 1  # b's own miss only


def test_another_clients_registrations_never_evict_my_graphs(make_worker) -> None:
    gid, body = scale_graph(3)
    worker = make_worker(graph_cache_bytes=2 * len(body) + 4096)  # room for a couple of graphs each

    async def go() -> list[m.WorkerMessage]:
        a = await WireClient.connect(worker)
        b = await WireClient.connect(worker)
        await a.send(1, [m.Register(gid, body), m.Sync(1)])
        await a.reply_until(1)
        for k in range(20):  # b floods the worker with graphs of its own
            other_gid, other_body = scale_graph(4 + k)
            await b.send(k + 1, [m.Register(other_gid, other_body), m.Sync(k + 1)])
            await b.reply_until(1)
        await a.send(2, [upload(1, X), m.Execute(gid, (1,), (2.0,), 2), m.Read(2, 2)], [X])
        got = await a.reply_until(1)
        await a.close()
        await b.close()
        return got

    (result,) = run(worker, go())
    assert result == m.Result(2, "float32", (3,), 12, True)  # not GraphUnknown: a's graph is still cached


def test_execution_error_poisons_only_its_outputs_and_the_session_lives(worker: InProcessWorker) -> None:
    gid, body = scale_graph(3)
    wrong = np.arange(4, dtype=np.float32)  # the graph wants 3 elements

    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(
            1,
            [
                upload(1, wrong),
                upload(5, X),
                m.Register(gid, body),
                m.Execute(gid, (1,), (2.0,), 2),  # fails: poisons 2
                m.Execute(gid, (2,), (2.0,), 3),  # reads poisoned 2: poisons 3 with the same error
                m.Execute(gid, (5,), (2.0,), 4),  # fine
                m.Read(1, 3),
                m.Read(2, 4),
                m.Sync(3),
                m.Sync(4),
            ],
            [wrong, X],
        )
        got = await c.reply_until(1)
        await c.close()
        return got

    err3, ok4, sync_err, sync_done = run(worker, go())
    assert type(err3) is m.Error and err3.rid == 1 and err3.code == "execution" and "input 0" in err3.message
    assert type(ok4) is m.Result and ok4.rid == 2
    assert type(sync_err) is m.Error and sync_err.rid == 3 and sync_err.message == err3.message
    assert sync_done == m.Done(4)  # a sync reports each failure once


def test_reading_an_unknown_or_dropped_tensor_answers_unknown_tensor(worker: InProcessWorker) -> None:
    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(1, [upload(1, X), m.Drop((1, 99)), m.Read(1, 1), m.Read(2, 7)], [X])
        got = await c.reply_until(1)
        await c.close()
        return got

    a, b = run(worker, go())
    assert type(a) is m.Error and type(b) is m.Error
    assert (a.code, b.code) == ("unknown_tensor", "unknown_tensor")


def test_upload_over_the_session_quota_is_poisoned_and_its_bytes_are_skipped(make_worker) -> None:
    worker = make_worker(max_session_bytes=1000)
    big = np.ones(400, np.float32)  # 1600 bytes

    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(1, [upload(1, big), upload(2, X), m.Read(1, 1), m.Read(2, 2)], [big, X])
        got = await c.reply_until(1)
        await c.close()
        return got

    refused, fine = run(worker, go())
    assert type(refused) is m.Error and refused.code == "quota"
    assert type(fine) is m.Result


def test_execute_whose_outputs_would_pass_the_quota_is_poisoned_and_later_work_fits(make_worker) -> None:
    quota = 1000 + ID_BYTES  # every stored id costs ID_BYTES besides its bytes
    worker = make_worker(max_session_bytes=quota)
    gid, body = scale_graph(200)
    x = np.ones(200, np.float32)  # 800 bytes: the upload fits, its doubled copy does not

    async def go() -> tuple[list[m.WorkerMessage], int]:
        c = await WireClient.connect(worker)
        await c.send(
            1,
            [upload(1, x), m.Register(gid, body), m.Execute(gid, (1,), (2.0,), 2), m.Read(1, 2), m.Sync(2)],
            [x],
        )
        await c.send(2, [m.Drop((1,))])
        await c.send(3, [upload(3, x[:100]), m.Read(3, 3)], [x[:100]])
        got = await c.reply_until(3)
        (session,) = worker.worker.sessions  # (a StatsReply itself would not fit this quota)
        held = session.quota.used
        await c.close()
        return got, held

    (refused, sync_error, later), held = run(worker, go())
    assert type(refused) is m.Error and refused.code == "quota"
    assert f"quota of {quota} bytes ({800 + ID_BYTES} in use)" in refused.message
    assert type(sync_error) is m.Error and sync_error.code == "quota"
    assert type(later) is m.Result and later.nbytes == 400
    assert held == 400 + 2 * ID_BYTES  # tensor 3, and the poisoned id 2 until it is dropped


def test_a_client_that_ignores_flow_control_is_cut_off(
    worker: InProcessWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from emberlink.protocol import session as session_module

    monkeypatch.setattr(session_module, "MAX_UNACKED_BYTES", 1000)
    x = np.ones(200, np.float32)  # 800 bytes a batch
    gate = threading.Event()
    worker.worker.device.post(gate.wait, 10)  # nothing is applied (or acknowledged) meanwhile

    async def refused() -> tuple[WireClient, list[m.WorkerMessage]]:
        c = await WireClient.connect(worker)
        await c.send(1, [upload(1, x)], [x])
        await c.send(2, [upload(2, x)], [x])  # 1600 bytes unacknowledged: over the bound
        reply, _ = await c.reply()
        return c, list(reply.messages)

    try:
        client, messages = run(worker, refused())
    finally:
        gate.set()  # the session frees its memory on the device thread before it closes
    last = messages[-1]
    assert type(last) is m.Error and last.code == "refused" and "without waiting for acks" in last.message
    assert run(worker, client.ended())


def test_an_empty_result_before_another_in_one_reply_leaves_each_its_own_bytes(
    worker: InProcessWorker,
) -> None:
    empty = np.zeros((0, 3), np.float32)

    async def go() -> list[np.ndarray]:
        c = await WireClient.connect(worker)
        await c.send(1, [upload(1, empty), upload(2, X), m.Read(1, 1), m.Read(2, 2)], [X])
        reply, arrays = await c.reply()
        await c.close()
        assert [type(x) for x in reply.messages] == [m.Result, m.Result]
        return arrays

    got_empty, got_x = run(worker, go())
    assert got_empty.shape == (0, 3)
    np.testing.assert_array_equal(got_x, X)


def test_an_ack_alone_rides_on_the_next_reply(
    worker: InProcessWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of uploads only (a DataLoader's next batch) is not answered by a reply of its own
    when the next batch's reply follows: one frame less each way a step."""
    from emberlink.server import session as worker_session

    monkeypatch.setattr(worker_session, "ACK_DELAY", 60.0)  # only the next reply can carry it

    async def go() -> list[m.Reply]:
        c = await WireClient.connect(worker)
        await c.send(1, [upload(1, X)], [X])
        (session,) = worker.worker.sessions
        while session.applied < 1:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # time enough for a reply of its own to go out (none should)
        await c.send(2, [m.Read(1, 1)])
        reply, arrays = await c.reply()
        await c.close()
        np.testing.assert_array_equal(arrays[0], X)
        return [reply]

    (reply,) = run(worker, go())
    assert reply.ack == 2 and [type(x) for x in reply.messages] == [m.Result]


def test_an_ack_alone_is_sent_when_no_reply_follows(worker: InProcessWorker) -> None:
    """A client that uploads and then waits for its acks (for window space, or to let go of what
    it keeps for a resume) gets them without sending anything else."""

    async def go() -> int:
        c = await WireClient.connect(worker)
        await c.send(1, [upload(1, X)], [X])
        reply, _ = await c.reply()
        await c.close()
        return reply.ack

    assert run(worker, go()) == 1


def test_acks_are_not_held_back_once_a_quarter_of_the_window_is_used(
    worker: InProcessWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An honest client never stalls on a deferred ack: past a quarter of its window of unacked
    batches the worker acks at once, whatever the delay."""
    from emberlink.protocol.limits import MAX_UNACKED_BATCHES
    from emberlink.server import session as worker_session

    monkeypatch.setattr(worker_session, "ACK_DELAY", 60.0)
    n = MAX_UNACKED_BATCHES // 4 + 2

    async def go() -> int:
        c = await WireClient.connect(worker)
        for seq in range(1, n + 1):
            await c.send(seq, [upload(seq, X)], [X])
        reply, _ = await c.reply()
        await c.close()
        return reply.ack

    ack = run(worker, go())
    assert 1 <= ack <= n
