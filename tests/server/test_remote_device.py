"""Remote devices end to end against in-process workers: real executor, real worker, memory and gRPC."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import typing
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import emberlink as el
from emberlink.client import remote
from emberlink.client.executor import Call, DeviceStats
from emberlink.errors import AuthError, ExecutionError, GoingAway, QuotaExceeded, WorkerLost
from emberlink.graph_replay.canonical import encode_graph, graph_id
from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.protocol.limits import MAX_UNACKED_BATCHES
from emberlink.protocol.ticket import Ticket
from emberlink.testing import InProcessWorker
from emberlink.transport.base import Blob, Link

from .server_harness import executor_of, grpc_device, memory_device, new_identity

DeviceMaker = Callable[[InProcessWorker], el.Device]
TRANSPORTS = [pytest.param(memory_device, id="memory"), pytest.param(grpc_device, id="grpc")]


def buffer_of(t: el.Tensor) -> int:
    """The buffer id of a flushed tensor (a pending one has none yet)."""
    buf = t._v.buf
    assert buf is not None, "the tensor is not flushed"
    return buf


def mlp_losses(dev: el.Device, steps: int, seed: int = 0) -> list[float]:
    """A small MLP trained with Adam on fixed random data; the loss of every step."""
    nn = el.nn
    model = nn.Sequential(nn.Linear(20, 32, seed=seed), nn.ReLU(), nn.Linear(32, 5, seed=seed + 1)).to(dev)
    opt = el.optim.Adam(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 20), dtype=np.float32)
    y = rng.integers(0, 5, 64)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(dev.tensor(x)), dev.tensor(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("make_device", TRANSPORTS)
def test_training_gives_the_same_losses_as_the_local_cpu(
    worker: InProcessWorker, make_device: DeviceMaker
) -> None:
    with el.Device.cpu() as cpu:
        expected = mlp_losses(cpu, 8)
    with make_device(worker) as dev:
        got = mlp_losses(dev, 8)
        stats = dev.stats()
    assert got == expected
    assert stats["graphs_registered"] >= 1 and stats["graph_replays"] >= 5
    assert stats["round_trips"] >= 8 and stats["bytes_sent"] > 0 and stats["bytes_received"] > 0


def test_a_graph_cache_smaller_than_one_graph_still_trains_identically(make_worker) -> None:
    worker = make_worker(graph_cache_bytes=64)
    with el.Device.cpu() as cpu:
        expected = mlp_losses(cpu, 6)
    with memory_device(worker) as dev:
        got = mlp_losses(dev, 6)
        stats = dev.stats()
    assert got == expected
    assert stats["graph_cache_misses"] >= 3  # replays missed and were recovered by re-registering


@pytest.mark.parametrize("make", TRANSPORTS)
def test_a_result_dropped_after_its_read_leaves_the_workers_memory_at_once(
    worker: InProcessWorker, make: DeviceMaker
) -> None:
    """The reply that carried a read's bytes must not keep them held on the worker: the Drop right
    after (here in the same batch as the Stats request, no reply in between) frees them."""
    with make(worker) as dev:
        before = dev.memory_stats()["in_use_bytes"]
        x = dev.tensor(np.ones((256, 256), np.float32))
        assert x.numpy().sum() == 256 * 256
        del x
        assert dev.memory_stats()["in_use_bytes"] == before


def test_stats_report_the_path_and_the_worker_answers_memory_stats(worker: InProcessWorker) -> None:
    with grpc_device(worker) as dev:
        before = dev.memory_stats()
        x = dev.tensor(np.ones((256, 256), np.float32))
        held = dev.memory_stats()
        assert held["in_use_bytes"] >= before["in_use_bytes"] + x.numpy().nbytes
        assert {"in_use_bytes", "peak_bytes", "pool_bytes"} <= held.keys()
        del x
        dev.sync()
        assert dev.memory_stats()["in_use_bytes"] == before["in_use_bytes"]
        stats = dev.stats()
        assert stats["path"] == "grpc"
        for key in (
            "bytes_sent",
            "bytes_received",
            "round_trips",
            "graphs_registered",
            "graph_replays",
            "graph_cache_misses",
        ):
            assert key in stats


def test_device_stats_hold_only_the_declared_keys_with_their_declared_types(
    worker: InProcessWorker,
) -> None:
    declared = typing.get_type_hints(DeviceStats)
    for dev in (el.Device.cpu(), memory_device(worker)):
        with dev:
            float(dev.tensor([1.0, 2.0]).sum())
            stats = dev.stats()
        assert DeviceStats.__required_keys__ <= stats.keys() <= declared.keys(), (dev, stats)
        assert all(isinstance(v, declared[k]) for k, v in stats.items()), (dev, stats)


@pytest.mark.parametrize("make_device", TRANSPORTS)
def test_every_dtype_and_odd_shape_survives_the_round_trip(
    worker: InProcessWorker, make_device: DeviceMaker
) -> None:
    rng = np.random.default_rng(3)
    arrays = [
        np.array(True),
        np.array(7, np.int64),
        np.zeros((0, 3), np.float32),
        rng.standard_normal((3, 5)).astype(np.float16),
        rng.integers(-5, 5, (2, 3, 4)).astype(np.int32),
        rng.standard_normal(17).astype(np.float64),
        rng.integers(0, 2, (4, 4)).astype(bool),
        np.asfortranarray(rng.standard_normal((6, 7)).astype(np.float32)),
        rng.standard_normal(5).astype(">f8"),  # big-endian: sent as native bytes, same values
    ]
    with make_device(worker) as dev:
        for a in arrays:
            out = dev.tensor(a).numpy()
            assert out.dtype == a.dtype.newbyteorder("=") and out.shape == a.shape
            np.testing.assert_array_equal(out, a)


@pytest.mark.parametrize("make_device", TRANSPORTS)
def test_transfers_larger_than_a_chunk_arrive_whole(
    worker: InProcessWorker, make_device: DeviceMaker
) -> None:
    a = np.random.default_rng(5).standard_normal(5 * 1024 * 1024 // 8 + 3)  # 5 MiB and a bit, float64
    with make_device(worker) as dev:
        t = dev.tensor(a)
        np.testing.assert_array_equal((t + 1.0).numpy(), a + 1.0)


def test_async_reads_overlap_and_resolve_in_any_order(worker: InProcessWorker) -> None:
    with grpc_device(worker) as dev:
        xs = [dev.tensor(np.full(4, i, np.float32)) * 2.0 for i in range(10)]
        dev.flush()
        futures = [executor_of(dev).read(buffer_of(x)) for x in xs]
        for i, f in reversed(list(enumerate(futures))):
            np.testing.assert_array_equal(f.result(timeout=10), np.full(4, 2 * i, np.float32))


def test_execution_failure_raises_at_the_read_and_once_at_sync(worker: InProcessWorker) -> None:
    graph = Graph((TensorSpec("float32", (3,)),), ("float",), (Node("multiply", (0, 1)),), (2,))
    gid = graph_id(encode_graph(graph))
    with memory_device(worker) as dev:
        ex = executor_of(dev)
        ex.upload(1, np.zeros(4, np.float32))  # the graph wants 3 elements: the run fails
        ex.execute(graph, gid, Call((1,), (2.0,), (2,)))
        ex.upload(3, np.ones(3, np.float32))
        ex.execute(graph, gid, Call((3,), (2.0,), (4,)))
        with pytest.raises(ExecutionError, match="input 0"):
            ex.read(2).result(timeout=10)
        np.testing.assert_array_equal(ex.read(4).result(timeout=10), np.full(3, 2, np.float32))
        with pytest.raises(ExecutionError):
            ex.sync()
        ex.sync()  # the failure was reported once; the session goes on
        assert float(dev.tensor(np.float32(2)) * 3.0) == 6.0


def test_quota_exceeded_fails_that_session_only(make_worker) -> None:
    worker = make_worker(max_session_bytes=1 << 20)
    with memory_device(worker) as greedy, memory_device(worker) as modest:
        small = modest.tensor(np.ones(1000, np.float32))
        big = greedy.tensor(np.ones(1 << 19, np.float32))  # 2 MiB
        with pytest.raises(QuotaExceeded):
            big.numpy()
        assert float((greedy.tensor(np.ones(10, np.float32)) * 2.0).sum()) == 20.0  # greedy lives on
        assert float(small.sum()) == 1000.0


def test_flow_control_bounds_unacknowledged_batches(
    worker: InProcessWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "FLUSH_MESSAGES", 1)  # every message its own batch
    with memory_device(worker) as dev:
        ex = executor_of(dev)
        x = dev.tensor(np.zeros(8, np.float32))
        seen = 0
        for _ in range(300):
            x = x + 1.0
            dev.flush()
            seen = max(seen, ex._unacked_batches)
        assert seen <= MAX_UNACKED_BATCHES
        np.testing.assert_array_equal(x.numpy(), np.full(8, 300, np.float32))


CLIENT_SCRIPT = """
import json, sys
import emberlink as el
from tests.server.test_remote_device import mlp_losses
with el.Device.remote(sys.argv[1], timeout=30) as dev:
    print(json.dumps(mlp_losses(dev, int(sys.argv[2]), seed=int(sys.argv[3]))))
"""


def test_sixteen_concurrent_clients_train_correctly(worker: InProcessWorker, tmp_path: Path) -> None:
    # Processes, not threads: each client is its own program, as it would be in use (and the
    # client's autograd mode is per process; see the report on `no_grad` and threads).
    steps = 200
    with el.Device.cpu() as cpu:
        expected = [mlp_losses(cpu, steps, seed=s) for s in (0, 1)]
    key = tmp_path / "client.key"
    worker.new_client().save(key)
    env = dict(os.environ, EMBERLINK_KEY=str(key), PYTHONPATH=str(Path(__file__).parents[2]))
    clients = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT_SCRIPT, worker.ticket, str(steps), str(i % 2)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(16)
    ]
    outputs = [c.communicate(timeout=300) for c in clients]
    for i, (client, (out, err)) in enumerate(zip(clients, outputs, strict=True)):
        assert client.returncode == 0, err
        assert json.loads(out) == expected[i % 2]


def test_unknown_client_key_is_refused_with_an_auth_error_naming_it(worker: InProcessWorker) -> None:
    stranger = new_identity()  # not on the worker's allow list
    with pytest.raises(AuthError, match=stranger.node_id):
        grpc_device(worker, stranger)
    with grpc_device(worker, worker.client) as dev:  # the allowed one gets in
        assert float(dev.tensor(np.float32(1.5))) == 1.5


def test_ticket_with_another_node_id_is_refused_before_any_data_is_sent(worker: InProcessWorker) -> None:
    from emberlink.transport import grpc

    impostor = new_identity().node_id  # the ticket names someone else than the worker at that address
    ((host, port),) = Ticket.parse(worker.ticket).addrs
    sent: list[Blob] = []

    class Recording:
        def __init__(self, link: Link) -> None:
            self.link, self.peer = link, link.peer

        async def send(self, blob: Blob) -> None:
            sent.append(blob)
            await self.link.send(blob)

        async def recv(self) -> bytes | memoryview:
            return await self.link.recv()

        async def close(self) -> None:
            await self.link.close()

    async def factory() -> Recording:
        return Recording(await grpc.connect(host, port, timeout=5))

    with pytest.raises(AuthError, match=impostor):
        remote.connect_link(factory, impostor, new_identity(), path="grpc", timeout=5)
    assert len(sent) == 1 and bytes(sent[0]).startswith(b"EMLH")  # the Hello, nothing else
    ticket = Ticket(impostor, ((host, port),))
    with pytest.raises(AuthError):
        remote.connect_ticket(ticket, new_identity(), timeout=5)


def test_draining_finishes_queued_work_then_ends_sessions_going_away(worker: InProcessWorker) -> None:
    with grpc_device(worker) as dev:
        x = dev.tensor(np.arange(4, dtype=np.float32))
        dev.sync()
        gate = threading.Event()
        worker.worker.device.submit(gate.wait, 10)  # hold the device thread
        (session,) = worker.worker.sessions
        received = session.bytes_in
        y = x * 2.0
        dev.flush()
        pending = executor_of(dev).read(buffer_of(y))
        # The batch is queued behind the held device thread when the drain starts.
        deadline = time.monotonic() + 10
        while session.bytes_in == received and time.monotonic() < deadline:
            time.sleep(0.001)
        drained = threading.Thread(target=worker.drain)
        drained.start()
        gate.set()
        np.testing.assert_array_equal(pending.result(timeout=10), np.arange(4, dtype=np.float32) * 2)
        drained.join(10)
        with pytest.raises(GoingAway):
            float(x.sum())
        with pytest.raises(WorkerLost):  # later calls keep failing
            dev.sync()


def test_a_device_dropped_without_close_ends_its_session(worker: InProcessWorker) -> None:
    import gc

    dev = memory_device(worker)
    x = dev.tensor(np.ones(1000, np.float32))
    assert float(x.sum()) == 1000.0
    del x, dev
    gc.collect()
    deadline = time.monotonic() + 10
    while worker.worker.sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.worker.sessions
    assert worker.worker.held.used == 0


def test_large_transfers_show_a_progress_bar_on_a_terminal(
    worker: InProcessWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from emberlink.client import session

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(session, "PROGRESS_BYTES", 1 << 16)
    monkeypatch.setattr("sys.stderr", terminal)
    a = np.arange(1 << 16, dtype=np.float32)  # 256 KiB each way
    with memory_device(worker) as dev:
        np.testing.assert_array_equal(dev.tensor(a).numpy(), a)
    assert "upload" in terminal.getvalue() and "download" in terminal.getvalue()
