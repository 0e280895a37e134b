"""Remote sessions over the raw TCP transport whose blocking reads are done by the reading thread
(client/session.py's `request_direct`): the values, the loop taking over whenever it must, a read
that does not wait, and a link cut under the thread that owns it, resumed."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import emberlink as el
import emberlink.testing
from emberlink.client.device import Device
from emberlink.client.remote import RemoteExecutor, connect_ticket
from emberlink.client.session import ClientSession
from emberlink.data import DataLoader
from emberlink.protocol.ticket import Ticket

from ..training import mlp_losses


class Counted:
    """Wraps a ClientSession method: how often it was called, and how often it returned True."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.calls = self.true = 0
        inner = getattr(ClientSession, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            out = inner(*args, **kwargs)
            self.true += out is True
            return out

        monkeypatch.setattr(ClientSession, name, counted)


def jit_sum() -> Callable[[Device, np.ndarray], float]:
    total = el.jit(lambda t: t.sum())
    return lambda dev, x: float(total(dev.tensor(x)))


def test_blocking_reads_over_tcp_are_sent_and_read_by_the_waiting_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    direct = Counted(monkeypatch, "request_direct")
    via_loop = Counted(monkeypatch, "submit")
    step = jit_sum()
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        for i in range(40):
            x = np.arange(16, dtype=np.float32) + i
            assert step(dev, x) == float(x.sum())
        dev.sync()
        assert dev.stats()["path"] == "tcp"
    # The first step goes through the loop (nothing is parked before a reply); after it, the
    # reading thread sends and reads (the loop takes the link back only when it has been quiet).
    assert direct.true > 30
    assert via_loop.calls < 10


def test_a_read_that_does_not_wait_is_answered_by_the_loop_while_the_thread_does_other_work() -> None:
    step = jit_sum()
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        x = np.arange(8, dtype=np.float32)
        assert step(dev, x) == 28.0  # parks the link: the next read could be the thread's own
        future = (dev.tensor(x) * 2.0).sum().read_async()
        deadline = time.monotonic() + 10
        while not future.done() and time.monotonic() < deadline:
            time.sleep(0.005)  # the user's thread never waits on the future itself
        assert future.done() and future.item() == 56.0
        assert step(dev, x + 1) == 36.0


def on_threads(n: int, run: Callable[[Device, int], None], timeout: float) -> None:
    """`run(device, k)` on n threads at once, each with its own tcp device of one worker; the
    first failure of any of them is raised here."""
    errors: list[BaseException] = []

    def guarded(dev: Device, k: int) -> None:
        try:
            run(dev, k)
        except BaseException as e:  # noqa: BLE001 (the main thread raises it)
            errors.append(e)

    with emberlink.testing.worker(tcp=True) as w:
        devices = [w.device(transport="tcp") for _ in range(n)]
        threads = [threading.Thread(target=guarded, args=(d, k)) for k, d in enumerate(devices)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        for d in devices:
            d.close()
    assert not errors, errors


def test_devices_on_several_threads_each_get_their_own_values() -> None:
    step = jit_sum()

    def run(dev: Device, k: int) -> None:
        offset = 100 * k
        for i in range(30):
            x = np.full(4, offset + i, np.float32)
            assert step(dev, x) == float(x.sum())
            if i % 7 == 0:
                assert (dev.tensor(x) + 1.0).read_async().result(timeout=10).tolist() == [offset + i + 1] * 4

    on_threads(3, run, 60)


class CuttableProxy:
    """A TCP proxy in front of the worker's tcp listener whose connections a test can cut."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._open: list[socket.socket] = []
        self._all: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            worker = socket.create_connection(self._target)
            with self._lock:
                self._open += [client, worker]
                self._all += [client, worker]
            for a, b in ((client, worker), (worker, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        """Drop every connection now (both ends see the link end)."""
        with self._lock:
            cut, self._open = self._open, []
        for s in cut:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._server.close()
        self.cut()
        with self._lock:
            for s in self._all:
                s.close()


@contextmanager
def proxied_tcp_device(w: emberlink.testing.InProcessWorker) -> Iterator[tuple[Device, CuttableProxy]]:
    ticket = Ticket.parse(w.ticket)
    proxy = CuttableProxy(ticket.tcp[0])
    through = Ticket(ticket.node_id, (), tcp=(("127.0.0.1", proxy.port),))
    dev = Device(connect_ticket(through, w.client, timeout=10, resume_window=20), "remote(proxied tcp)")
    try:
        yield dev, proxy
    finally:
        dev.close()
        proxy.close()


def test_a_tcp_link_cut_between_blocking_reads_is_resumed_with_every_value_right() -> None:
    step = jit_sum()
    with emberlink.testing.worker(tcp=True) as w, proxied_tcp_device(w) as (dev, proxy):
        for i in range(30):
            if i in (5, 6, 17):  # parked by the read before: the reading thread meets the cut
                proxy.cut()
            x = np.arange(16, dtype=np.float32) * i
            assert step(dev, x) == float(x.sum())
        assert dev.stats()["resumes"] == 3


def test_a_tcp_link_cut_while_the_thread_waits_for_its_answer_is_resumed() -> None:
    with emberlink.testing.worker(tcp=True) as w, proxied_tcp_device(w) as (dev, proxy):
        x = dev.tensor(np.ones((256, 256), np.float32))
        assert float(x.sum()) == 65536.0  # parks the link
        cutter = threading.Timer(0.05, proxy.cut)
        cutter.start()
        y = x
        for _ in range(100):  # long enough a step that the cut comes while this thread reads
            y = (y @ x) * (1.0 / 256)
        assert float(y.sum()) == 65536.0
        cutter.join()
        assert float(x.sum()) == 65536.0  # (had the cut come after the read, this one meets it)
        assert dev.stats()["resumes"] == 1


def test_a_graph_the_worker_lacks_is_sent_again_when_the_reading_thread_hears_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    direct = Counted(monkeypatch, "request_direct")
    with el.Device.cpu() as cpu:
        expected = mlp_losses(cpu, 6)
    # A graph cache smaller than one graph: every Execute meets GraphUnknown, and the batch goes
    # again (through the loop) with its graph.
    with emberlink.testing.worker(tcp=True, graph_cache_bytes=64) as w, w.device(transport="tcp") as dev:
        assert mlp_losses(dev, 6) == expected
        assert dev.stats()["graph_cache_misses"] > 0
    assert direct.true > 0


def test_host_batches_keep_the_values_they_had_when_made_whatever_follows() -> None:
    # A host batch large enough to be staged for sealing in place (RemoteExecutor.host_array),
    # with a small upload after it, one before it, and one of another dtype: each tensor keeps
    # its source's values at dev.tensor, however the source changes before the batch is sent.
    step = el.jit(lambda x, y: (x * 2).sum() + y.sum())
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        for i in range(6):
            x = np.arange(128 * 784, dtype=np.float32).reshape(128, 784) % 97 + i
            y = np.arange(128, dtype=np.int64) + i
            before = dev.tensor(np.float32(i)) if i % 2 else None
            tx, ty = dev.tensor(x), dev.tensor(y.astype(np.float32))
            big16 = dev.tensor(x.astype(np.float16)) if i == 3 else None
            want_x, want_y = x.copy(), y.astype(np.float32)
            x += 1000  # the sources change before anything is sent
            y += 1000
            got = float(step(tx, ty))
            assert got == float((want_x * 2).sum(dtype=np.float32) + want_y.sum(dtype=np.float32))
            np.testing.assert_array_equal(tx.numpy(), want_x)
            np.testing.assert_array_equal(ty.numpy(), want_y)
            if before is not None:
                assert float(before) == i
            if big16 is not None:
                np.testing.assert_array_equal(big16.numpy(), want_x.astype(np.float16))


def test_host_batches_of_steps_still_in_flight_arrive_each_with_its_own_values() -> None:
    # Reads that do not wait leave several steps' batches unsent or unacknowledged at once; the
    # staging buffer of each is reused only after its batch is acknowledged.
    total = el.jit(lambda x: x.sum())
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        for _ in range(3):
            xs = [np.full((128, 784), k, np.float32) for k in range(8)]
            futures = [total(dev.tensor(x)).read_async() for x in xs]
            assert [float(f.result()) for f in futures] == [128 * 784 * k for k in range(8)]
            for k in range(0, 8, 2):  # and steps that wait, reusing buffers in between
                assert float(total(dev.tensor(xs[k]))) == 128 * 784 * k


def test_a_step_reuses_the_staging_buffer_of_an_acknowledged_one_and_frees_it_with_the_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handed: list[np.ndarray] = []  # where each host batch was staged (kept: no address is reused)
    host_array = RemoteExecutor.host_array

    def recorded(executor: RemoteExecutor, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
        out = host_array(executor, shape, dtype)
        if out is not None:
            handed.append(out)
        return out

    monkeypatch.setattr(RemoteExecutor, "host_array", recorded)
    total = el.jit(lambda x, y: x.sum() + y.sum())
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        for i in range(6):
            x = np.full((128, 784), i, np.float32)
            y = np.arange(128, dtype=np.int64) + i
            assert float(total(dev.tensor(x), dev.tensor(y.astype(np.float32)))) == float(x.sum() + y.sum())
        executor = dev._executor
        assert isinstance(executor, RemoteExecutor)
        staged_x = handed[::2]
        assert len(staged_x) == 6 and len({a.__array_interface__["data"][0] for a in staged_x}) < 6
    assert executor._spares == [] and executor._lent == {}


# -- the host DataLoader: the next batch goes from the thread that owns the link ---------------------


def loader_data(rows: int, features: int = 20) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return rng.standard_normal((rows, features), dtype=np.float32), rng.integers(0, 5, rows)


def jitted_training(dev: Device, features: int = 20) -> Callable[[el.Tensor, el.Tensor], el.Tensor]:
    nn = el.nn
    model = nn.Sequential(nn.Linear(features, 16, seed=3), nn.ReLU(), nn.Linear(16, 5, seed=4)).to(dev)
    opt = el.optim.SGD(model.parameters(), lr=0.1)

    @el.jit
    def step(x: el.Tensor, y: el.Tensor) -> el.Tensor:
        loss = el.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def plain_losses(data: tuple[np.ndarray, np.ndarray], batch: int) -> list[float]:
    """The losses of the same training with each batch made by `dev.tensor`, on this CPU."""
    x, y = data
    with el.Device.cpu() as cpu:
        step = jitted_training(cpu, x.shape[1])
        return [
            float(step(cpu.tensor(x[k : k + batch]), cpu.tensor(y[k : k + batch])))
            for k in range(0, len(x), batch)
        ]


def test_a_loader_loop_over_tcp_sends_the_next_batch_from_the_reading_thread_with_the_same_losses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    direct = Counted(monkeypatch, "request_direct")
    owned = Counted(monkeypatch, "send_owned")
    via_loop = Counted(monkeypatch, "submit")
    data = loader_data(8 * 4)
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        step = jitted_training(dev)
        loader = DataLoader(data, 8, device=dev)
        losses = [float(step(xb, yb)) for _ in range(12) for xb, yb in loader]
    assert losses == plain_losses((np.tile(data[0], (12, 1)), np.tile(data[1], 12)), 8)
    # After the first steps, each step's read and the next batch's upload (an epoch's first batch
    # too) are written by the reading thread, which then reads the answer itself: nothing goes
    # through the loop.
    assert direct.true > 40
    assert owned.true > 40
    assert via_loop.calls < 10  # (the first steps, the Close)


def test_a_next_batch_that_fails_while_the_thread_owns_the_link_fails_next_not_the_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    owned = Counted(monkeypatch, "send_owned")
    data = loader_data(8 * 12)
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        step = jitted_training(dev)
        loader = DataLoader(data, 8, device=dev)
        it = iter(loader)
        losses = [float(step(*next(it))) for _ in range(6)]  # the link is the reading thread's by now
        assert owned.true > 0
        xb, yb = next(it)
        make = loader._upload

        def broken(order: np.ndarray | None, bound: tuple[int, int]) -> Any:
            raise el.DeviceError("no room for the next batch")

        monkeypatch.setattr(loader, "_upload", broken)
        losses.append(float(step(xb, yb)))  # the read is answered; the failure waits for next()
        with pytest.raises(el.DeviceError, match="no room for the next batch"):
            next(it)
        monkeypatch.setattr(loader, "_upload", make)
        # The session carries on: a new epoch gives the losses of a fresh run's steps after these.
        losses += [float(step(xb, yb)) for xb, yb in loader]
    want = plain_losses(data, 8)
    assert losses == want[:7] + plain_losses_continued(data, 8, 7)


def plain_losses_continued(data: tuple[np.ndarray, np.ndarray], batch: int, done: int) -> list[float]:
    """The losses of a whole epoch after `done` steps of the first one, on this CPU."""
    x, y = data
    with el.Device.cpu() as cpu:
        step = jitted_training(cpu, x.shape[1])
        for k in range(0, done * batch, batch):
            float(step(cpu.tensor(x[k : k + batch]), cpu.tensor(y[k : k + batch])))
        return [
            float(step(cpu.tensor(x[k : k + batch]), cpu.tensor(y[k : k + batch])))
            for k in range(0, len(x), batch)
        ]


def test_a_loader_loop_left_early_over_tcp_uploads_nothing_more() -> None:
    data = loader_data(8 * 20)
    per_batch = data[0][:8].nbytes + data[1][:8].nbytes
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        step = jitted_training(dev)
        dev.sync()
        start = int(dev.stats()["bytes_uploaded"])
        for i, (xb, yb) in enumerate(DataLoader(data, 8, device=dev)):
            float(step(xb, yb))  # uploads batch i + 1 while step i runs
            if i == 9:
                break
        uploaded = int(dev.stats()["bytes_uploaded"]) - start
        assert float(step(dev.tensor(data[0][:8]), dev.tensor(data[1][:8]))) > 0  # the session carries on
        assert int(dev.stats()["bytes_uploaded"]) - start == uploaded + per_batch
    assert uploaded == 11 * per_batch  # batches 0..10: the one made ahead of the last step, no more


def test_a_next_batch_too_large_to_write_from_the_reading_thread_goes_through_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    owned = Counted(monkeypatch, "send_owned")
    data = loader_data(2 * 6, 160_000)  # 1.28 MB a batch: more than one thread writes itself
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        total = el.jit(lambda x: x.sum())
        warm = np.ones(16, np.float32)
        for _ in range(3):
            assert float(total(dev.tensor(warm))) == 16.0  # parks the link
        sums = [float(total(xb)) for xb, _ in DataLoader(data, 2, device=dev)]
        assert float(total(dev.tensor(warm))) == 16.0
    assert sums == [float(data[0][k : k + 2].sum(dtype=np.float32)) for k in range(0, 12, 2)]
    assert owned.calls > 0 and owned.true == 0


def test_a_next_batch_held_back_by_flow_control_lets_the_link_go_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = Counted(monkeypatch, "read_acks")
    data = loader_data(8 * 16)
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        step = jitted_training(dev)
        # Two batches unacknowledged at most: the step's and the next batch's, made while the step
        # runs, may not both go while the batch before is unacknowledged (its ack comes up to 1 ms
        # after its step's answer, and the link parks before it). Owning the link, the reading
        # thread cannot wait for that ack: nobody else would read it.
        dev._executor._max_batches = 2  # type: ignore[attr-defined]
        losses = [float(step(xb, yb)) for xb, yb in DataLoader(data, 8, device=dev)]
    assert losses == plain_losses(data, 8)
    assert release.calls > 0


def test_loader_loops_on_several_threads_each_get_their_own_losses() -> None:
    datas = [loader_data(8 * 24 + k) for k in range(3)]
    wants = [plain_losses((x[: 8 * 24], y[: 8 * 24]), 8) for x, y in datas]
    got: list[list[float]] = [[] for _ in datas]

    def run(dev: Device, k: int) -> None:
        step = jitted_training(dev)
        got[k] = [float(step(xb, yb)) for xb, yb in DataLoader(datas[k], 8, device=dev, drop_last=True)]

    on_threads(len(datas), run, 120)
    assert got == wants


def test_a_tcp_link_cut_under_a_loader_loop_is_resumed_with_the_same_losses() -> None:
    data = loader_data(8 * 30)
    with emberlink.testing.worker(tcp=True) as w, proxied_tcp_device(w) as (dev, proxy):
        step = jitted_training(dev)
        losses = []
        for i, (xb, yb) in enumerate(DataLoader(data, 8, device=dev)):
            if i in (
                6,
                7,
                19,
            ):  # the link parked, the next batch unacknowledged: the reading thread meets the cut
                proxy.cut()
            losses.append(float(step(xb, yb)))
        assert dev.stats()["resumes"] == 3
    assert losses == plain_losses(data, 8)


def test_a_read_inside_the_work_run_after_a_read_is_sent_is_answered_too() -> None:
    # The owning thread cannot wait for an answer only it would read: it lets the link go first.
    total = el.jit(lambda x: x.sum())
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        x = np.arange(16, dtype=np.float32)
        for _ in range(3):
            assert float(total(dev.tensor(x))) == 120.0  # parks the link
        inner: list[float] = []
        dev._after_read_sent.append(lambda: inner.append(float(total(dev.tensor(x * 2)))))
        assert float(total(dev.tensor(x + 1))) == 136.0
        assert inner == [240.0]
        assert float(total(dev.tensor(x))) == 120.0
