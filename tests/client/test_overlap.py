"""Overlap: reads that return a future at once, and a loader that sends batches ahead or keeps the
data set on the device (gathering each batch there, so only its indices travel)."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import emberlink as el
from emberlink import Device, ExecutionError, ShapeError, WorkerLost
from emberlink.client.remote import connect_link, connect_ticket
from emberlink.data import DataLoader
from emberlink.protocol.identity import Identity
from emberlink.protocol.ticket import Ticket
from emberlink.server.background import BackgroundWorker
from emberlink.transport import memory
from emberlink.transport.loop import io_loop

from ..process_harness import Process

F = el.nn.functional
ROWS, FEATURES, CLASSES = 10, 3, 4


@pytest.fixture
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.standard_normal((ROWS, FEATURES), dtype=np.float32), rng.integers(0, CLASSES, ROWS)


def uploaded(dev: Device) -> int:
    return int(dev.stats()["bytes_uploaded"])


# -- read_async ---------------------------------------------------------------------------------------


def test_read_async_gives_what_the_blocking_reads_give(dev: Device) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = dev.tensor(a)
    futures = [(x * 2.0).read_async(), x.sum().read_async(), (x > 5.0).read_async()]
    np.testing.assert_array_equal(futures[0].result(timeout=30), a * 2.0)
    assert futures[1].item(timeout=30) == float(x.sum()) == 66.0
    np.testing.assert_array_equal(futures[2].result(), a > 5.0)
    assert all(f.done() for f in futures)
    assert futures[0].result() is futures[0].result()  # one array, kept by the future


def test_read_async_item_needs_one_element(dev: Device) -> None:
    fut = dev.tensor(np.ones(3, np.float32)).read_async()
    with pytest.raises(ValueError, match=r"one element.*\(3,\)"):
        fut.item()


def test_execution_failure_is_raised_by_result_with_the_type_of_a_blocking_read(dev: Device) -> None:
    x = dev.tensor(np.arange(3, dtype=np.float32))
    bad = x.take(dev.tensor(np.array([7])))  # only the run can see the index is out of range
    fut = bad.read_async()  # nothing is raised here
    with pytest.raises(ExecutionError):
        fut.result(timeout=30)
    with pytest.raises(ExecutionError):
        bad.numpy()
    assert float((x + 1.0).sum()) == 6.0  # the device goes on


def test_a_parameter_not_yet_on_a_device_reads_async_too() -> None:
    layer = el.nn.Linear(2, 3, seed=0)
    fut = layer.weight.read_async()
    assert fut.done()
    np.testing.assert_array_equal(fut.result(), layer.weight.numpy())


# A worker of our own whose device thread a test can hold: the read must come back as a future
# while the worker cannot possibly have answered.


@pytest.fixture(scope="module")
def own_worker() -> Iterator[BackgroundWorker]:
    worker = BackgroundWorker(grpc=True, memory=True, loop_thread=io_loop())
    yield worker
    worker.stop()


def memory_device(worker: BackgroundWorker) -> Device:
    executor = connect_link(
        lambda: memory.connect(worker.memory_name, hub=worker.hub),  # type: ignore[arg-type]
        worker.node_id,
        Identity.generate(os.urandom),
        path="memory",
        loop_thread=worker.loop_thread,
        timeout=10,
    )
    return Device(executor, "remote-memory")


def grpc_device(worker: BackgroundWorker) -> Device:
    grpc_only = Ticket(worker.node_id, Ticket.parse(worker.ticket).addrs)
    executor = connect_ticket(grpc_only, Identity.generate(os.urandom), timeout=10)
    return Device(executor, "remote-grpc")


def tcp_device(worker: BackgroundWorker) -> Device:
    executor = connect_ticket(Ticket.parse(worker.ticket), Identity.generate(os.urandom), timeout=10)
    return Device(executor, "remote-tcp")  # the whole ticket: tcp, which the worker serves by default


@pytest.mark.parametrize("connect", [memory_device, grpc_device, tcp_device], ids=["memory", "grpc", "tcp"])
def test_read_async_returns_while_the_worker_is_busy(
    own_worker: BackgroundWorker, connect: Callable[[BackgroundWorker], Device]
) -> None:
    with connect(own_worker) as dev:
        x = dev.tensor(np.arange(4, dtype=np.float32))
        dev.sync()
        gate = threading.Event()
        own_worker.worker.device.submit(gate.wait, 30)  # hold the worker's device thread
        try:
            fut = (x * 2.0).sum().read_async()
            assert not fut.done()
            with pytest.raises(TimeoutError):
                fut.result(timeout=0.05)  # a timeout leaves the read in flight
        finally:
            gate.set()
        assert fut.item(timeout=30) == 12.0
        assert fut.done()


def test_a_lost_worker_is_raised_by_result_as_by_a_blocking_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBERLINK_RESUME_WINDOW", "1")  # resuming a killed worker fails after 1 s
    worker_key, client_key = tmp_path / "worker.key", tmp_path / "client.key"
    Identity.generate(os.urandom).save(worker_key)
    Identity.generate(os.urandom).save(client_key)
    argv = [sys.executable, "-m", "emberlink", "worker", "--listen", "127.0.0.1:0"]
    worker = Process([*argv, "--key", str(worker_key), "--allow-any"], tmp_path / "worker.log")
    try:
        ticket = worker.next_line(60)
        with Device.remote(ticket, key=str(client_key), timeout=30) as dev:
            x = dev.tensor(np.arange(4, dtype=np.float32))
            assert float(x.sum()) == 6.0
            worker.signal(signal.SIGSTOP)  # a frozen worker: it cannot answer
            fut = (x * 2.0).read_async()
            assert not fut.done()
            worker.kill()
            with pytest.raises(WorkerLost):
                fut.result(timeout=60)
            with pytest.raises(WorkerLost):
                (x * 3.0).numpy()
            later = (x * 4.0).read_async()  # the session is over: the future says so, not the call
            with pytest.raises(WorkerLost):
                later.result(timeout=60)
    finally:
        worker.close()


# -- the loader: batches ----------------------------------------------------------------------------


def expected_batches(
    data: tuple[np.ndarray, np.ndarray], batch: int, seed: int, epochs: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """What the loader documents: epoch e uses the e-th permutation of default_rng(seed)."""
    rng = np.random.default_rng(seed)
    rows_in = len(data[0])
    out = []
    for _ in range(epochs):
        order = rng.permutation(rows_in)
        for start in range(0, rows_in, batch):
            rows = order[start : start + batch]
            out.append((data[0][rows], data[1][rows]))
    return out


@pytest.mark.parametrize("resident", [False, True], ids=["host", "resident"])
def test_shuffled_batches_are_the_host_batches_in_the_seeds_order(
    dev: Device, data: tuple[np.ndarray, np.ndarray], resident: bool
) -> None:
    loader = DataLoader(data, batch_size=4, shuffle=True, seed=7, device=dev, resident=resident)
    assert len(loader) == 3  # 4 + 4 + 2
    got = [(x.numpy(), y.numpy()) for _ in range(2) for x, y in loader]
    want = expected_batches(data, 4, 7, 2)
    assert len(got) == len(want) == 6
    for (gx, gy), (wx, wy) in zip(got, want, strict=True):
        np.testing.assert_array_equal(gx, wx)
        np.testing.assert_array_equal(gy, wy)
    assert not np.array_equal(got[0][0], got[3][0])  # each epoch is shuffled anew


@pytest.mark.parametrize("resident", [False, True], ids=["host", "resident"])
def test_unshuffled_batches_keep_the_order_and_drop_last_drops_the_short_one(
    dev: Device, data: tuple[np.ndarray, np.ndarray], resident: bool
) -> None:
    x = data[0]
    loader = DataLoader(x, batch_size=4, device=dev, resident=resident, drop_last=True)
    batches = [b.numpy() for b in loader]  # one array in: Tensors out, not tuples
    assert len(loader) == len(batches) == 2
    np.testing.assert_array_equal(np.concatenate(batches), x[:8])


def test_loader_refuses_what_it_cannot_batch(dev: Device, data: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = data
    with pytest.raises(ShapeError, match=r"first dimensions differ: \[10, 9\]"):
        DataLoader((x, y[:9]), batch_size=2, device=dev)
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(x, batch_size=0, device=dev)
    with pytest.raises(TypeError, match="array 1 is a list"):
        DataLoader((x, [1, 2]), batch_size=2, device=dev)  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match="0-d"):
        DataLoader(np.zeros(()), batch_size=1, device=dev)


# -- the loader: what travels, and when ---------------------------------------------------------------


def spy_on(
    dev: Device,
    monkeypatch: pytest.MonkeyPatch,
    names: tuple[str, ...] = ("upload", "execute", "read", "send"),
) -> list[str]:
    """The executor calls the device makes from now on, in order: upload, execute, read, send (or `names`)."""
    calls: list[str] = []
    executor = dev._executor
    for name in names:
        method = getattr(executor, name)

        def logged(*args: Any, _name: str = name, _method: Any = method, **kwargs: Any) -> Any:
            calls.append(_name)
            return _method(*args, **kwargs)

        monkeypatch.setattr(executor, name, logged)
    return calls


def test_host_loader_sends_the_next_batch_right_after_the_steps_read_is_sent(
    dev: Device, data: tuple[np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    x, y = data
    per_batch = 4 * x.itemsize * FEATURES + 4 * y.itemsize
    start = uploaded(dev)
    sent = int(dev.stats()["bytes_sent"])
    it = iter(DataLoader(data, batch_size=4, device=dev))
    xb, _ = next(it)  # batch 0 handed out and sent; batch 1 waits for the step's read
    assert uploaded(dev) - start == per_batch
    if dev.name.startswith("remote"):  # batch 0 is on the wire though nothing has been read
        deadline = time.monotonic() + 30
        while int(dev.stats()["bytes_sent"]) - sent < per_batch and time.monotonic() < deadline:
            time.sleep(0.001)
        assert int(dev.stats()["bytes_sent"]) - sent >= per_batch
    calls = spy_on(dev, monkeypatch)
    assert float((xb * 2.0).sum()) == pytest.approx(2.0 * float(x[:4].sum()), rel=1e-5)
    # The step and its read first, then batch 1's two arrays, sent before the read waited.
    assert calls == ["execute", "read", "upload", "upload", "send"]
    assert uploaded(dev) - start == 2 * per_batch
    xb1, yb1 = next(it)  # already there: nothing more is uploaded for it
    assert calls[5:] == []
    np.testing.assert_array_equal(xb1.numpy(), x[4:8])
    np.testing.assert_array_equal(yb1.numpy(), y[4:8])


def test_host_loader_uploads_the_next_batch_after_a_step_that_reads_nothing(
    dev: Device, data: tuple[np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    x, _ = data
    it = iter(DataLoader(data, batch_size=4, device=dev))
    xb, _ = next(it)
    calls = spy_on(dev, monkeypatch)
    a = xb * 2.0  # the user's step, never read
    xb1, _ = next(it)  # the step flushed as its own graph, then batch 1 uploaded after it
    assert calls == ["execute", "upload", "upload", "send"]
    assert dev.stats()["pending_nodes"] == 0
    np.testing.assert_array_equal(a.numpy(), x[:4] * 2.0)
    np.testing.assert_array_equal(xb1.numpy(), x[4:8])


def test_a_loop_that_leaves_the_loader_early_uploads_nothing_more(
    dev: Device, data: tuple[np.ndarray, np.ndarray]
) -> None:
    x, _ = data
    per_batch = 4 * x.itemsize * FEATURES + 4 * data[1].itemsize
    start = uploaded(dev)
    for xb, _ in DataLoader(data, batch_size=4, device=dev):
        break  # the generator is closed here: its upload ahead with it
    assert float(xb.sum()) == pytest.approx(float(x[:4].sum()), rel=1e-5)
    assert uploaded(dev) - start == per_batch


def test_a_batch_that_cannot_be_made_ahead_fails_where_it_is_asked_for_not_in_the_read(
    dev: Device, data: tuple[np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    x, _ = data
    loader = DataLoader(data, batch_size=4, device=dev)
    it = iter(loader)
    xb, _ = next(it)

    def broken(order: np.ndarray | None, bound: tuple[int, int]) -> Any:
        raise el.DeviceError("no room for the next batch")

    monkeypatch.setattr(loader, "_upload", broken)
    assert float(xb.sum()) == pytest.approx(float(x[:4].sum()), rel=1e-5)  # step 0's read still answers
    with pytest.raises(el.DeviceError, match="no room for the next batch"):
        next(it)


def small_model(dev: Device, features: int = FEATURES) -> tuple[el.nn.Module, el.optim.SGD]:
    nn = el.nn
    model = nn.Sequential(nn.Linear(features, 8, seed=1), nn.ReLU(), nn.Linear(8, CLASSES, seed=2)).to(dev)
    return model, el.optim.SGD(model.parameters(), lr=0.1)


def train(model: el.nn.Module, opt: el.optim.SGD, x: el.Tensor, y: el.Tensor) -> el.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_resident_batches_upload_only_their_indices(dev: Device) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256), dtype=np.float32)  # a batch of data: 16 KiB
    y = rng.integers(0, CLASSES, 64)
    model, opt = small_model(dev, 256)
    dev.sync()
    start = uploaded(dev)
    loader = DataLoader((x, y), batch_size=16, shuffle=True, seed=1, device=dev, resident=True)
    assert uploaded(dev) - start == x.nbytes + y.nbytes  # the data set, once
    futures = []
    for _ in range(2):
        for xb, yb in loader:
            before = uploaded(dev)
            futures.append(train(model, opt, xb, yb).read_async())
            assert uploaded(dev) - before == 0  # an eager step uploads nothing (its take was recorded)
            if len(futures) == 1:  # the first step registers its graph: count from the second
                futures[0].result(timeout=30)
                dev.sync()
                sent = int(dev.stats()["bytes_sent"])
    dev.sync()
    # Seven steps on the wire (each with its indices) and a sync: fewer bytes than one batch of data.
    if dev.name.startswith("remote"):
        assert int(dev.stats()["bytes_sent"]) - sent < x[:16].nbytes + y[:16].nbytes
    # 8 batches: the indices, 16 int32 each, are all that was uploaded after the data set
    assert uploaded(dev) - start == x.nbytes + y.nbytes + 8 * 16 * 4
    assert all(np.isfinite(f.item(timeout=30)) for f in futures)


def test_resident_steps_replay_one_graph_where_slices_would_make_one_per_batch(dev: Device) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, FEATURES), dtype=np.float32)
    y = rng.integers(0, CLASSES, 40)
    model, opt = small_model(dev)
    loader = DataLoader((x, y), batch_size=8, shuffle=True, seed=2, device=dev, resident=True)
    built = []
    for xb, yb in loader:
        float(train(model, opt, xb, yb))
        built.append(int(dev.stats()["graphs_built"]))
    assert built[1:] == [built[1]] * 4  # after the first step, no new graph
    xs, ys = dev.tensor(x), dev.tensor(y)
    sliced = []
    for start in range(0, 40, 8):  # the same batches by slicing: the bounds are attrs
        float(train(model, opt, xs[start : start + 8], ys[start : start + 8]))
        sliced.append(int(dev.stats()["graphs_built"]))
    assert sliced == list(range(sliced[0], sliced[0] + 5))  # one new graph per batch


def doubled_sum() -> Callable[[el.Tensor], el.Tensor]:
    """A jitted step: its first call runs eagerly, its second traces (with the batch's gather
    folded in), the next ones replay that trace."""
    return el.jit(lambda t: (t * 2.0).sum())


def test_a_jitted_step_on_a_resident_batch_runs_its_gather_in_its_own_graph(
    dev: Device, data: tuple[np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    x, y = data
    total = doubled_sum()
    it = iter(DataLoader(data, batch_size=1, device=dev, resident=True))
    for _ in range(3):  # eager, traced with the gather folded in, replayed
        float(total(next(it)[0]))
    calls = spy_on(dev, monkeypatch)
    for k in range(3, 6):
        xb, yb = next(it)  # its indices go; its take is recorded, not run
        assert calls == ["upload"]
        assert dev.stats()["pending_nodes"] == 2  # (x's take and y's)
        assert float(total(xb)) == pytest.approx(2.0 * float(x[k].sum()), rel=1e-5)
        assert calls == ["upload", "execute", "read"]  # the gather and the step: one graph
        assert dev.stats()["pending_nodes"] == 0
        np.testing.assert_array_equal(xb.numpy(), x[k : k + 1])  # the batch came out of it too
        np.testing.assert_array_equal(yb.numpy(), y[k : k + 1])
        calls.clear()


def test_a_resident_jitted_loop_drops_what_a_step_let_go_after_the_next_steps_work_not_before_its_batch(
    dev: Device, data: tuple[np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The buffers let go between steps (the last loss, batch and indices) are not sent on their
    own when the next batch is asked for: they follow that step's work, so every step, an epoch's
    first included, is the same four calls (on a remote device, one batch a Repeat of the last)."""
    x, _ = data
    total = doubled_sum()
    loader = DataLoader(data, batch_size=2, device=dev, resident=True)  # 5 batches an epoch
    batches = itertools.chain.from_iterable(itertools.repeat(loader))
    for _ in range(3):  # eager, traced with the gather folded in, replayed
        xb, _ = next(batches)
        float(total(xb))
    calls = spy_on(dev, monkeypatch, ("upload", "execute", "drop", "read", "send"))
    for k in range(3, 13):  # across two epochs' ends
        xb, _ = next(batches)
        assert calls == ["upload"], k
        assert float(total(xb)) == pytest.approx(
            2.0 * float(x[2 * (k % 5) : 2 * (k % 5) + 2].sum()), rel=1e-5
        )
        assert calls == ["upload", "execute", "drop", "read"], k
        calls.clear()


def test_a_resident_loader_iterated_inside_a_jitted_function_is_refused_at_its_first_batch(
    dev: Device, data: tuple[np.ndarray, np.ndarray]
) -> None:
    """A replay runs no Python, so a loop over a loader inside would gather the traced batch on
    every replay: its first batch already raises, even with nothing else pending (a loop left
    after one batch never reaches a second batch's flush)."""
    loader = DataLoader(data, batch_size=2, device=dev, resident=True)

    @el.jit
    def first_batch_sum() -> el.Tensor:
        for xb, _ in loader:
            return xb.sum()
        raise AssertionError("an empty loader")

    for _ in range(3):  # the eager call, the tracing one, and any after
        with pytest.raises(el.JitError, match="flush or sync"):
            first_batch_sum()


def test_after_an_eager_step_the_next_batchs_take_joins_the_next_steps_graph(
    dev: Device, data: tuple[np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    x, _ = data
    it = iter(DataLoader(data, batch_size=4, device=dev, resident=True))
    xb, _ = next(it)
    calls = spy_on(dev, monkeypatch)
    float((xb * 2.0).sum())  # an eager step: nothing is gathered yet
    assert calls == ["execute", "read"]
    xb1, _ = next(it)  # batch 1's indices go, its take is recorded...
    assert calls[2:] == ["upload"]
    assert dev.stats()["pending_nodes"] == 2  # (x's take and y's)
    assert float((xb1 * 2.0).sum()) == pytest.approx(2.0 * float(x[4:8].sum()), rel=1e-5)
    assert calls[3:] == ["execute", "read"]  # ...and runs in the step's own graph


def test_resident_loader_flushes_a_step_that_reads_nothing_before_the_next_take(
    dev: Device, data: tuple[np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    x, _ = data
    it = iter(DataLoader(data, batch_size=4, device=dev, resident=True))
    xb, _ = next(it)
    calls = spy_on(dev, monkeypatch)
    a = xb * 2.0  # the user's step, never read
    xb1, _ = next(it)  # the step flushed as its own graph, then batch 1's take recorded after it
    assert calls == ["execute", "upload"]
    np.testing.assert_array_equal(a.numpy(), x[:4] * 2.0)
    np.testing.assert_array_equal(xb1.numpy(), x[4:8])


def test_a_resident_loop_left_early_holds_nothing_once_the_loader_is_dropped(
    dev: Device, data: tuple[np.ndarray, np.ndarray]
) -> None:
    total = doubled_sum()
    base = dev.memory_stats()["in_use_bytes"]
    loader = DataLoader(data, batch_size=4, shuffle=True, seed=3, device=dev, resident=True)
    for xb, yb in loader:
        float(total(xb))  # a whole epoch
    for xb, yb in loader:
        float(total(xb))  # one step, then the loop is left
        break
    assert dev.memory_stats()["in_use_bytes"] > base
    del loader, xb, yb
    assert dev.memory_stats()["in_use_bytes"] == base


def test_several_resident_loaders_at_once_each_give_their_own_batches(
    dev: Device, data: tuple[np.ndarray, np.ndarray]
) -> None:
    x, _ = data
    total = doubled_sum()
    shuffled = DataLoader(data, batch_size=4, shuffle=True, seed=7, device=dev, resident=True)
    plain = DataLoader(x * 10.0, batch_size=3, device=dev, resident=True)
    got = []
    for (a, _), b in zip(shuffled, plain, strict=False):
        float(total(a))  # (a replay from the third step on)
        got.append((a.numpy(), b.numpy()))
    want = expected_batches(data, 4, 7, 1)
    assert len(got) == 3
    for k, ((ga, gb), (wa, _)) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(ga, wa)
        np.testing.assert_array_equal(gb, x[3 * k : 3 * k + 3] * 10.0)


@pytest.mark.parametrize("resident", [False, True], ids=["host", "resident"])
def test_training_through_the_loader_gives_the_losses_of_a_plain_loop(
    dev: Device, data: tuple[np.ndarray, np.ndarray], resident: bool
) -> None:
    model, opt = small_model(dev)
    loader = DataLoader(data, 4, True, seed=5, device=dev, resident=resident)
    futures = [train(model, opt, xb, yb).read_async() for _ in range(3) for xb, yb in loader]
    got = [f.item(timeout=30) for f in futures]
    with Device.cpu() as cpu:
        model, opt = small_model(cpu)
        batches = expected_batches(data, 4, 5, 3)
        want = [float(train(model, opt, cpu.tensor(bx), cpu.tensor(by))) for bx, by in batches]
    assert got == want


# -- the resident loader and emberlink.jit: the gather folded into the step's graph --------------------


def executes(dev: Device) -> int:
    """Graphs the device's executor has run (a first run registers one, later ones replay)."""
    stats = dev.stats()
    return int(stats["graphs_registered"]) + int(stats["graph_replays"])


def jit_train(model: el.nn.Module, opt: el.optim.SGD) -> Callable[[el.Tensor, el.Tensor], el.Tensor]:
    return el.jit(lambda x, y: train(model, opt, x, y))


def momentum_model(dev: Device) -> tuple[el.nn.Module, el.optim.SGD]:
    nn = el.nn
    model = nn.Sequential(nn.Linear(FEATURES, 8, seed=1), nn.ReLU(), nn.Linear(8, CLASSES, seed=2)).to(dev)
    return model, el.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_a_jitted_step_on_resident_batches_trains_as_eager_and_as_uploaded_batches_in_one_graph(
    dev: Device, data: tuple[np.ndarray, np.ndarray]
) -> None:
    """Four shuffled epochs of 4 + 4 + 2 rows: the folded step (gather and step one graph, the
    short batch a signature of its own) gives the losses, parameters and momentum of eager steps on
    the same loader and of the jitted step on the same batches uploaded beforehand (a plain
    replay), bit for bit; from the third epoch on, every step is one graph run."""
    epochs = 4
    runs: dict[str, tuple[list[float], list[np.ndarray]]] = {}
    per_step: list[int] = []
    for feed in ("eager", "folded", "uploaded"):
        model, opt = momentum_model(dev)
        step = jit_train(model, opt)
        losses: list[float] = []
        if feed == "uploaded":
            for bx, by in expected_batches(data, 4, 11, epochs):
                losses.append(float(step(dev.tensor(bx), dev.tensor(by))))
        else:
            loader = DataLoader(data, batch_size=4, shuffle=True, seed=11, device=dev, resident=True)
            for epoch in range(epochs):
                for xb, yb in loader:
                    before = executes(dev)
                    if feed == "eager":
                        losses.append(float(train(model, opt, xb, yb)))
                        continue
                    losses.append(float(step(xb, yb)))
                    if epoch >= 2:
                        per_step.append(executes(dev) - before)
        state = [p.numpy() for p in model.parameters()]
        state += [opt.state[id(p)]["momentum"].numpy() for p in model.parameters()]
        runs[feed] = (losses, state)
    assert per_step == [1] * 6
    for feed in ("folded", "uploaded"):
        assert runs[feed][0] == runs["eager"][0], feed
        for got, want in zip(runs[feed][1], runs["eager"][1], strict=True):
            np.testing.assert_array_equal(got, want)


def warm_loader_step(
    dev: Device, data: tuple[np.ndarray, np.ndarray]
) -> tuple[Iterator[Any], Callable[[el.Tensor, el.Tensor], el.Tensor], el.nn.Module, el.optim.SGD]:
    """A resident loader (batches of 2, one epoch of 5) and a jitted step past its warm-up calls
    (eager, then traced with the gather folded in)."""
    model, opt = momentum_model(dev)
    step = jit_train(model, opt)
    it = iter(DataLoader(data, batch_size=2, device=dev, resident=True))
    for _ in range(2):
        float(step(*next(it)))
    return it, step, model, opt


def eager_losses(dev: Device, data: tuple[np.ndarray, np.ndarray], calls: list[int]) -> list[float]:
    """The losses eager steps give on the unshuffled batches of 2 rows: `calls[k]` steps on batch k."""
    model, opt = momentum_model(dev)
    x, y = data
    out = []
    for k, n in enumerate(calls):
        for _ in range(n):
            out.append(
                float(train(model, opt, dev.tensor(x[2 * k : 2 * k + 2]), dev.tensor(y[2 * k : 2 * k + 2])))
            )
    return out


def test_a_batch_read_before_the_jitted_step_is_gathered_on_its_own_then_the_step_replays(
    dev: Device, data: tuple[np.ndarray, np.ndarray]
) -> None:
    x, _ = data
    it, step, _, _ = warm_loader_step(dev, data)
    xb, yb = next(it)
    np.testing.assert_array_equal(xb.numpy(), x[4:6])  # the gather runs here, for this read
    before = executes(dev)
    loss = float(step(xb, yb))
    assert executes(dev) - before == 1  # the step alone
    assert [*eager_losses(dev, data, [1, 1]), loss] == eager_losses(dev, data, [1, 1, 1])


def test_a_batch_used_by_two_jitted_steps_is_folded_into_the_first_only(
    dev: Device, data: tuple[np.ndarray, np.ndarray]
) -> None:
    it, step, _, _ = warm_loader_step(dev, data)
    xb, yb = next(it)
    before = executes(dev)
    losses = [float(step(xb, yb)) for _ in range(2)]
    assert executes(dev) - before == 2  # the folded step, then a plain replay on the same batch
    assert eager_losses(dev, data, [1, 1]) + losses == eager_losses(dev, data, [1, 1, 2])


def test_a_folded_step_replays_the_trace_of_this_calls_pending_work_when_it_differs_from_the_last(
    dev: Device, data: tuple[np.ndarray, np.ndarray]
) -> None:
    """Seven forms of pending work at the call, in turn, each for two steps running (so each
    form's trace is looked up again right after the same form and right after another): the
    batch's labels let go first; the batch alone; the batch scaled two ways first, the first or
    the second passed (the same work, another argument); another op on the labels first (the same
    argument, more work); the batch times or plus a number (the same shape of work, another op).
    Every step gives the sum a plain step gives, and every tensor still held reads right after."""
    x, y = data
    total = doubled_sum()
    loader = DataLoader(data, batch_size=2, device=dev, resident=True)
    batches = itertools.chain.from_iterable(itertools.repeat(loader))
    for k in range(84):
        xb, yb = next(batches)
        rows, labels = x[2 * (k % 5) : 2 * (k % 5) + 2], y[2 * (k % 5) : 2 * (k % 5) + 2]
        form = (k // 2) % 7
        held = [(xb, rows)]
        if form == 0:
            del yb  # the labels' take is no longer live: another pending structure
        else:
            held.append((yb, labels))
        arg, scale = xb, 1.0
        if form in (2, 3):
            halved, doubled = xb * 0.5, xb * 2.0
            arg, scale = (halved, 0.5) if form == 2 else (doubled, 2.0)
            held += [(halved, rows * 0.5), (doubled, rows * 2.0)]
        if form == 4:
            held.append((yb + 1, labels + 1))
        want = 2.0 * scale * float(rows.sum())
        if form == 5:
            arg, want = xb * 0.5, float(rows.sum())
        if form == 6:
            arg, want = xb + 0.5, 2.0 * float((rows + 0.5).sum())
        assert float(total(arg)) == pytest.approx(want, rel=1e-5), k
        for t, expected in held:
            np.testing.assert_array_equal(t.numpy(), expected)


def test_eager_ops_on_the_batch_before_the_jitted_step_join_its_graph(
    dev: Device, data: tuple[np.ndarray, np.ndarray]
) -> None:
    x, y = data
    model, opt = momentum_model(dev)
    step = jit_train(model, opt)
    losses, runs = [], []
    for xb, yb in DataLoader(data, batch_size=2, device=dev, resident=True):
        scaled = xb * 0.5  # recorded after the gather: both are pending work of the step
        before = executes(dev)
        losses.append(float(step(scaled, yb)))
        runs.append(executes(dev) - before)
        np.testing.assert_array_equal(scaled.numpy(), xb.numpy() * 0.5)  # still held: valid
    assert runs[2:] == [1, 1, 1]
    model, opt = momentum_model(dev)
    want = [
        float(train(model, opt, dev.tensor(x[k : k + 2]) * 0.5, dev.tensor(y[k : k + 2])))
        for k in range(0, ROWS, 2)
    ]
    assert losses == want


def test_a_batch_pending_on_another_device_is_left_to_that_device(
    dev: Device, data: tuple[np.ndarray, np.ndarray]
) -> None:
    """Only the call's own device's pending work is folded in: a batch gathered on another device
    stays pending there, and a step on it fails as an eager step across devices does."""
    x, _ = data
    model, opt = momentum_model(dev)
    step = jit_train(model, opt)
    with Device.cpu() as other:
        elsewhere = iter(DataLoader(data, batch_size=2, device=other, resident=True))
        here = iter(DataLoader(data, batch_size=2, device=dev, resident=True))
        runs = []
        for _ in range(4):
            far, _ = next(elsewhere)  # pending on `other`
            xb, yb = next(here)
            before = executes(dev)
            float(step(xb, yb))
            runs.append(executes(dev) - before)
            assert other.stats()["pending_nodes"] == 2  # (its take of x and of y)
        assert runs[2:] == [1, 1]
        np.testing.assert_array_equal(far.numpy(), x[6:8])
        far, far_y = next(elsewhere)
        with pytest.raises(el.DeviceError, match="operands are on different devices"):
            step(far, far_y)  # the model is on `dev` (a new signature: run eagerly)


@pytest.mark.gpu
def test_on_a_gpu_the_folded_step_is_one_captured_graph_cut_after_its_loss() -> None:
    """Device.cuda: the resident loader's gather and the jitted step run as one captured plan a
    step, whose loss is readable early (the cut is after the loss, not after the labels' take),
    with the losses of the same jitted step on batches uploaded beforehand."""
    pytest.importorskip("cupy")
    pytest.importorskip("nvmath")
    from emberlink.graph_replay.capture import early_split

    rng = np.random.default_rng(4)
    data = rng.standard_normal((64, 20), dtype=np.float32), rng.integers(0, CLASSES, 64)
    with Device.cuda(0) as dev:
        runs: dict[str, list[float]] = {}
        for feed in ("folded", "uploaded"):
            nn = el.nn
            model = nn.Sequential(nn.Linear(20, 32, seed=1), nn.ReLU(), nn.Linear(32, CLASSES, seed=2)).to(
                dev
            )
            step = jit_train(model, el.optim.SGD(model.parameters(), lr=0.1))
            losses = runs.setdefault(feed, [])
            if feed == "uploaded":
                for bx, by in expected_batches(data, 16, 9, 4):
                    losses.append(float(step(dev.tensor(bx), dev.tensor(by))))
                continue
            loader = DataLoader(data, batch_size=16, shuffle=True, seed=9, device=dev, resident=True)
            for epoch in range(4):  # one loader: epoch e takes the e-th permutation of its seed
                for xb, yb in loader:
                    before = (executes(dev), int(dev.stats()["captured_replays"]))
                    losses.append(float(step(xb, yb)))
                    if epoch == 3:
                        assert (executes(dev), int(dev.stats()["captured_replays"])) == (
                            before[0] + 1,
                            before[1] + 1,
                        )
        np.testing.assert_allclose(runs["folded"], runs["uploaded"], rtol=1e-5)
        captures = dev._executor._captures  # type: ignore[attr-defined]
        plans = [e.captured.plan for e in captures._entries.values() if e.captured is not None]
        folded = [p for p in plans if p.steps[0].op == "take"]
        assert folded
        split = early_split(folded[0])
        assert split is not None and folded[0].steps[split.at - 1].op == "cross_entropy"
