"""A remote device on loopback against the bare transport and against local execution.

    .venv/bin/python bench/remote_step.py [--quick] [--worker process|thread] [--tiny N] [--cpus split|same|any]
    .venv/bin/python bench/remote_step.py --upload N [--quick] [--device cuda:0]   # only the host-batch rows
    .venv/bin/python bench/remote_step.py --loader N [--loader-sizes 784-64-10] [--device cuda:0] [--loader-from OTHER/emberlink/data.py]
    .venv/bin/python bench/remote_step.py --loader-client N [--loader-sizes 784-64-10]
    EMBERLINK_UVLOOP=0 .venv/bin/python bench/remote_step.py   # asyncio's loop even where uvloop is installed

Rows, each a median over interleaved repeats so machine noise hits both sides alike:
- tiny step: one 64-byte input upload, one op (`sum`), one scalar read, against a bare grpc.aio
  bidirectional-stream ping-pong of 64 bytes (bench/bare.py), twice: client and server in this
  process on one event loop (the old floor), and the server in its own process (the topology of an
  `emberlink worker`: two processes, each with its own loop and gRPC poller). Goal: at most 1.5x.
- jitted tiny step: the same step compiled with `emberlink.jit` (a replay: no recording, no
  segment, one Execute sent as a Repeat of the step before), against the same bare ping-pong with
  its server in another process. Goal: at most 1.5x.
- MLP training step: batch 128, 784-512-512-10, SGD (bench/local_step.py's model), remote against
  the same step on Device.cpu(); and the same step jitted (bench/local_step.py's JitMLP), remote
  against jitted on Device.cpu().
- the same tiny, jitted tiny and MLP steps over the raw TCP transport (`--tcp-listen`, transport/tcp.py)
  against the same bare grpc.aio ping-pong (server in another process), and a bare asyncio TCP
  ping-pong (streams, 4-byte length, server in another process; bench/bare.py) for scale.
- 64 MiB upload (`dev.tensor(a)` then `sync()`) and download (`t.numpy()`), against bare
  grpc.aio streaming of the same bytes in 1 MiB messages, the server in this process and in
  another one. Goal: at least 0.7x the bare rate.
- `--upload N` only: the jitted step with a 401 KB host batch (128x784 float32, a small op, a
  scalar read) and the jitted MLP step over tcp, the upload pipelined in 64 KiB BULK frames
  (client/session.py, `Pipelined`) against the layout before (EMBERLINK_PIPELINE_CHUNK=0), each
  in its own session, interleaved; then 64 MiB each way over tcp both ways and over gRPC.
- what bounds the tiny step: the bare ping-pong (server in another process) plus only the work a
  tiny step cannot skip, in three steps (see `floor_rows`).
- `--loader N` (alone): a small jitted MLP step (batch 128, 784-64-10 or `--loader-sizes`, SGD;
  NumPy's compute small enough not to hide the feed; `--device cuda:0` for a GPU worker) over
  tcp, fed by `DataLoader(resident=True)`, against the same step written by hand on the data set
  uploaded once (`X.take(idx, axis=0)` inside the jitted function, the index uploaded each step:
  what the loader's folded gather should cost no more than) and on batches uploaded beforehand, N
  interleaved repeats, every row's losses checked equal, with the Executes sent per step (the
  resident loader's gather is folded into the jitted step's graph: one, as with uploaded
  batches) and the CPU a step of the client's main thread, the client and the worker process
  (the client's includes its spin while it waits for an answer, up to EMBERLINK_SPIN_US; run
  with EMBERLINK_SPIN_US=0 for its work alone); `--loader-from` adds the resident row through
  the DataLoader of another tree's data.py (an A/B of the loader in one run; that tree's loader
  runs with this tree's jit). `--loader-client N`: the same three rows' client work alone, over an
  executor that runs nothing (CPU time of this thread a step).

Both sides run on the event loop emberlink picks (transport/loop.py: uvloop where installed, unless
EMBERLINK_UVLOOP=0); the bare servers in other processes too. The worker runs as an `emberlink worker` process (default; as a user would run it) or in this
process on the client's I/O loop (`--worker thread`). The first bare gRPC ping-pong row is one
process, one event loop, no encryption and no thread hand-offs: a floor, not a peer; the second
(server in another process) is the honest peer of `--worker process`.

Placement (`--cpus`): by default this process runs on CPU 0 and every server it starts (the worker,
the bare servers) on CPU 1, as a client and a worker on two machines would; `--cpus same` puts them
all on CPU 0 and `--cpus any` leaves it to the kernel. Left to the kernel on a 2-core machine the
bare gRPC ping-pong is bimodal (~100-140 or ~190-230 µs from run to run, as its threads migrate),
so a ratio against it said more about the scheduler than about emberlink.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bare
import local_step

import emberlink as el
from emberlink.protocol.identity import AllowPolicy, Identity
from emberlink.protocol.ticket import Ticket
from emberlink.transport.loop import io_loop

MiB = 1 << 20


def split_ticket(text: str) -> tuple[str, str]:
    """(a ticket with only the gRPC address, one with only the tcp address) of a worker that has both."""
    ticket = Ticket.parse(text)
    return str(Ticket(ticket.node_id, ticket.addrs)), str(Ticket(ticket.node_id, (), tcp=ticket.tcp))


@contextmanager
def worker_process(client: Identity, device: str = "cpu", pids: list[int] | None = None) -> Any:
    """An `emberlink worker` process on `device`, 127.0.0.1:0 (gRPC) and 127.0.0.1:0 (raw TCP),
    admitting `client`; yields its ticket (and appends its pid to `pids`)."""
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "worker.key"
        Identity.generate(os.urandom).save(key)
        allow = Path(tmp) / "allow"
        allow.write_text(client.node_id + "\n")
        proc = subprocess.Popen(
            [sys.executable, "-m", "emberlink", "worker", "--listen", "127.0.0.1:0", "--key", str(key)]
            + ["--allow", str(allow), "--tcp-listen", "127.0.0.1:0", "--device", device],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        bare.place_server(proc.pid)
        if pids is not None:
            pids.append(proc.pid)
        try:
            assert proc.stdout is not None
            yield proc.stdout.readline().strip()
        finally:
            proc.terminate()
            proc.wait(30)
            proc.stdout.close()  # type: ignore[union-attr]


@contextmanager
def worker_thread(client: Identity) -> Any:
    from emberlink.server.background import BackgroundWorker

    with BackgroundWorker(allow=AllowPolicy.of([client.node_id]), tcp=True) as worker:
        yield worker.ticket


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) process `pid` has used, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_us(fn: Callable[[], object], n: int) -> float:
    for _ in range(min(n, 200)):
        fn()
    samples = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t)
    return statistics.median(samples) / 1e3


def tiny_step(dev: el.Device) -> Callable[[], float]:
    x = np.arange(16, dtype=np.float32)  # 64 bytes

    def step() -> float:
        return float(dev.tensor(x).sum())

    return step


def jit_tiny_step(dev: el.Device) -> Callable[[], float]:
    x = np.arange(16, dtype=np.float32)
    total = el.jit(lambda t: t.sum())

    def step() -> float:
        return float(total(dev.tensor(x)))

    return step


def jit_upload_step(dev: el.Device) -> Callable[[], float]:
    """The small MLP's host batch alone: a 401 KB upload (128x784 float32), a small op, a scalar
    read, jitted (bench/gpu_step.py's host-batch step without the model)."""
    x = np.random.default_rng(0).standard_normal((128, 784)).astype(np.float32)
    total = el.jit(lambda t: (t * 2.0).sum())

    def step() -> float:
        return float(total(dev.tensor(x)))

    want = float((x.astype(np.float64) * 2.0).sum())
    got = step()
    assert abs(got - want) <= 1e-3 * abs(want) + 1e-2, (got, want)
    return step


def transfer_gbps(dev: el.Device, total: int) -> tuple[float, float]:
    a = np.random.default_rng(0).standard_normal(total // 4).astype(np.float32)
    t0 = time.perf_counter()
    t = dev.tensor(a)
    dev.sync()
    up = total / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    b = t.numpy()
    down = total / (time.perf_counter() - t0) / 1e9
    assert b.shape == a.shape and b[-1] == a[-1]
    return up, down


def mlp_ms(cpu: el.Device, devs: dict[str, el.Device], steps: int) -> dict[str, float]:
    """Median ms of the MLP step, eager and jitted, on Device.cpu() and remote over gRPC and tcp
    (eager and jit each in its own session, so each step can go as a Repeat of its own previous
    one); the sides take turns every few steps, so the machine's load hits them alike."""
    sides = {
        "mlp_cpu": local_step.EmberlinkMLP(cpu),
        "mlp": local_step.EmberlinkMLP(devs["grpc"]),
        "mlp_jit_cpu": local_step.JitMLP(cpu),
        "mlp_jit": local_step.JitMLP(devs["grpc_jit"]),
        "mlp_tcp": local_step.EmberlinkMLP(devs["tcp"]),
        "mlp_jit_tcp": local_step.JitMLP(devs["tcp_jit"]),
    }
    batches = local_step._batches(4)
    times: dict[str, list[float]] = {k: [] for k in sides}
    for model in sides.values():  # warm-up: graphs built and registered, jit traced
        local_step._time(model.step, batches, 5, [])
    block = 5
    for _ in range(max(1, steps // block)):
        for k, model in sides.items():
            local_step._time(model.step, batches, block, times[k])
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


# -- what bounds the tiny step ------------------------------------------------------------------------


def floor_rows(n: int, cpu: el.Device) -> dict[str, float]:
    """The bare ping-pong with a server in another process (emberlink's topology), plus the work a tiny
    step cannot skip, each measured as it runs there, between round trips (bench/bare.py,
    `floor_pingpong_process`). Parts measured alone in a hot loop (~25 µs for the step on
    Device.cpu()) cost several times that here, with the caches cold after every round trip."""
    loop = io_loop()
    step = tiny_step(cpu)
    return {
        "floor_step": loop.call(bare.floor_pingpong_process(n, step, False)),
        "floor_proto": loop.call(bare.floor_pingpong_process(n, None, True)),
        "floor_both": loop.call(bare.floor_pingpong_process(n, step, True)),
    }


def tiny_only(repeats: int, n: int, worker: str) -> None:
    """The jitted tiny step over gRPC and tcp against both bare ping-pongs (server in another
    process), `repeats` interleaved repeats of `n` samples each: quick to compare two trees."""
    loop = io_loop()
    client = Identity.generate(os.urandom)
    rows: dict[str, list[float]] = {
        k: [] for k in ("bare_pp_proc", "bare_tcp_proc", "tiny_jit", "tiny_jit_tcp")
    }
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "client.key"
        client.save(key)
        with (worker_process if worker == "process" else worker_thread)(client) as ticket:
            grpc_ticket, tcp_ticket = split_ticket(ticket)
            dev = el.Device.remote(grpc_ticket, key=str(key))
            dev_tcp = el.Device.remote(tcp_ticket, key=str(key))
            steps = {"tiny_jit": jit_tiny_step(dev), "tiny_jit_tcp": jit_tiny_step(dev_tcp)}
            for _ in range(repeats):
                rows["bare_pp_proc"].append(loop.call(bare.grpc_bare_pingpong_process(n)))
                rows["bare_tcp_proc"].append(loop.call(bare.tcp_bare_pingpong_process(n)))
                for k, step in steps.items():
                    rows[k].append(median_us(step, n))
            dev.close()
            dev_tcp.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    bp = med["bare_pp_proc"]
    print(f"{repeats} interleaved repeat(s) of {n}, {type(loop.loop).__module__.split('.')[0]} event loop")
    print("| row | median µs | vs bare gRPC (proc) |")
    print("|---|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.0f} | {v / bp:.2f}x |")


def upload_only(repeats: int, n: int, worker: str, device: str) -> None:
    """The jitted 401 KB host-batch step (`jit_upload_step`) and the jitted MLP step over tcp, with
    uploads pipelined (client/session.py, `Pipelined`) and not (`PIPELINE_ENV`=0: the layout
    before, the host batch inline in the step's one MESSAGE frame), each in its own session,
    `repeats` interleaved repeats of `n` samples each; then 64 MiB up and down over tcp both ways
    and over gRPC (whose 1 MiB chunks pipelining must leave alone). The worker runs on `device`
    (a process only: `--worker thread` serves the cpu)."""
    from emberlink.client.session import PIPELINE_ENV

    loop = io_loop()
    client = Identity.generate(os.urandom)
    rows: dict[str, list[float]] = {}
    settings = {"not pipelined": "0", "pipelined": None}
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "client.key"
        client.save(key)
        serving = worker_process(client, device) if worker == "process" else worker_thread(client)
        with serving as ticket:
            grpc_ticket, tcp_ticket = split_ticket(ticket)
            devs: dict[str, el.Device] = {}
            for name, chunk in settings.items():
                os.environ.pop(PIPELINE_ENV, None)
                if chunk is not None:
                    os.environ[PIPELINE_ENV] = chunk  # read as each session starts
                devs[name] = el.Device.remote(tcp_ticket, key=str(key))
                devs[name + " mlp"] = el.Device.remote(tcp_ticket, key=str(key))
            os.environ.pop(PIPELINE_ENV, None)
            grpc = el.Device.remote(grpc_ticket, key=str(key))
            steps = {f"upload step, {name}": jit_upload_step(devs[name]) for name in settings}
            mlps = {f"MLP jit step, {name}": local_step.JitMLP(devs[name + " mlp"]) for name in settings}
            batches = local_step._batches(4)
            for model in mlps.values():
                local_step._time(model.step, batches, 20, [])
            for _ in range(repeats):
                for k, step in steps.items():
                    rows.setdefault(k, []).append(median_us(step, n))
                for k, model in mlps.items():
                    times: list[float] = []
                    local_step._time(model.step, batches, max(20, n // 10), times)
                    rows.setdefault(k, []).append(statistics.median(times) * 1e6)
            transfers = {f"tcp, {name}": devs[name] for name in settings} | {"gRPC": grpc}
            for dev in transfers.values():  # a process's first 64 MiB page-faults its heap (main())
                transfer_gbps(dev, 64 * MiB)
            for _ in range(repeats):
                for k, dev in transfers.items():
                    up, down = transfer_gbps(dev, 64 * MiB)
                    rows.setdefault(f"64 MiB upload, {k}", []).append(up)
                    rows.setdefault(f"64 MiB download, {k}", []).append(down)
            for dev in [*devs.values(), grpc]:
                dev.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{repeats} interleaved repeat(s) of {n}, {type(loop.loop).__module__.split('.')[0]} event loop")
    print("| row | median | vs not pipelined |")
    print("|---|---:|---:|")
    firsts: dict[str, float] = {}
    for k, v in med.items():
        first = firsts.setdefault(k.split(",")[0], v)
        shown = f"{v:.2f} GB/s" if k.startswith("64 MiB") else f"{v:.0f} µs"
        print(f"| {k} | {shown} | {v / first:.2f}x |")


def _loader_step(fn: Callable[..., el.Tensor], batches: Iterator[Any]) -> float:
    return float(fn(*next(batches)))


def _take_step(
    fn: Callable[..., el.Tensor], data: tuple[el.Tensor, el.Tensor], rows: Iterator[np.ndarray]
) -> float:
    """The hand-written resident step: this batch's row indices uploaded, the take inside the jit."""
    return float(fn(*data, data[0].device.tensor(next(rows))))


MANUAL = "hand-written take in the jit, index uploaded"


class _Answered:
    """A read's answer from `_NullExecutor`: zeros of the read's shape (a scalar here)."""

    def result(self, timeout: float | None = None) -> np.ndarray:
        return np.zeros((), np.float32)

    def done(self) -> bool:
        return True


class _NullExecutor:
    """An executor that runs and stores nothing: what a Device costs its caller alone."""

    def upload(self, buf: int, array: np.ndarray) -> None:
        pass

    def execute(self, graph: Any, gid: bytes, call: Any) -> None:
        pass

    def read(self, buf: int, wait: bool = False, after_sent: Callable[[], None] | None = None) -> _Answered:
        if after_sent is not None:
            after_sent()
        return _Answered()

    def drop(self, bufs: Any) -> None:
        pass

    def send(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}

    def memory_stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def _loader_train(dev: el.Device, sizes: Sequence[int]) -> Callable[[el.Tensor, el.Tensor], el.Tensor]:
    """The loader rows' training step on `dev`: a 2-layer ReLU MLP (seeds 0 and 1), SGD lr=0.01."""
    nn = el.nn
    model = nn.Sequential(
        nn.Linear(sizes[0], sizes[1], seed=0), nn.ReLU(), nn.Linear(sizes[1], sizes[2], seed=1)
    )
    model = model.to(dev)
    opt = el.optim.SGD(model.parameters(), lr=0.01)

    def train(x: el.Tensor, y: el.Tensor) -> el.Tensor:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return train


def loader_client_only(repeats: int, steps: int, sizes: tuple[int, ...]) -> None:
    """The `--loader` rows' client work alone: each step's CPU time on this thread over an
    executor that runs nothing (no worker, no link), medians of interleaved blocks of steps."""
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((16 * 128, sizes[0]), dtype=np.float32)
    ys = rng.integers(0, sizes[-1], 16 * 128)
    index = [np.arange(k, k + 128, dtype=np.int32) for k in range(0, len(xs), 128)]
    steps_of: dict[str, Callable[[], float]] = {}
    for name in ("uploaded beforehand", MANUAL, "resident loader"):
        dev = el.Device(_NullExecutor(), "null")  # type: ignore[arg-type]
        train = _loader_train(dev, sizes)

        if name == MANUAL:

            def train_take(xd: el.Tensor, yd: el.Tensor, idx: el.Tensor, train: Any = train) -> el.Tensor:
                return train(xd.take(idx, axis=0), yd.take(idx, axis=0))  # type: ignore[no-any-return]

            data = (dev.tensor(xs), dev.tensor(ys))
            steps_of[name] = functools.partial(_take_step, el.jit(train_take), data, itertools.cycle(index))
            continue
        batches: Iterator[Any]
        if name == "resident loader":
            loader = el.data.DataLoader((xs, ys), batch_size=128, device=dev, resident=True)
            batches = itertools.chain.from_iterable(itertools.repeat(loader))
        else:
            batches = itertools.cycle(
                [(dev.tensor(xs[k : k + 128]), dev.tensor(ys[k : k + 128])) for k in range(0, len(xs), 128)]
            )
        steps_of[name] = functools.partial(_loader_step, el.jit(train), batches)
    for step in steps_of.values():
        for _ in range(100):
            step()
    times: dict[str, list[float]] = {k: [] for k in steps_of}
    for _ in range(repeats):
        for k, step in steps_of.items():
            start = time.thread_time()
            for _ in range(steps):
                step()
            times[k].append((time.thread_time() - start) / steps * 1e6)
    print(
        f"{repeats} interleaved repeat(s) of {steps} steps, jitted MLP 128x{'-'.join(map(str, sizes))}, client alone"
    )
    print("| feed | client CPU µs a step |")
    print("|---|---:|")
    for k, v in times.items():
        print(f"| {k} | {statistics.median(v):.1f} |")


def loader_only(
    repeats: int, steps: int, worker: str, others: list[str], sizes: tuple[int, ...], device: str = "cpu"
) -> None:
    """The jitted small MLP over tcp, batches from a resident DataLoader (this tree's, and
    `others`' if given) against batches uploaded beforehand, each in its own session; medians of
    interleaved blocks of steps. Every row's losses are checked against the uploaded row's."""
    import importlib.util

    loaders: dict[str, Any] = {"resident loader": el.data.DataLoader}
    for n, other in enumerate(others):
        spec = importlib.util.spec_from_file_location(f"other_data{n}", other)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        loaders[f"resident loader of {other}"] = mod.DataLoader
    n_batches = 16
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((n_batches * 128, sizes[0]), dtype=np.float32)
    ys = rng.integers(0, sizes[-1], n_batches * 128)
    client = Identity.generate(os.urandom)
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "client.key"
        client.save(key)
        pids: list[int] = []
        started = worker_process(client, device, pids) if worker == "process" else worker_thread(client)
        with started as ticket:
            _, tcp_ticket = split_ticket(ticket)
            names = ["uploaded beforehand", MANUAL, *loaders]
            devs = {k: el.Device.remote(tcp_ticket, key=str(key)) for k in names}
            steps_of: dict[str, Callable[[], float]] = {}
            for name, dev in devs.items():
                train = _loader_train(dev, sizes)

                fn = el.jit(train)
                batches: Iterator[Any]
                if name == MANUAL:

                    def train_take(
                        xd: el.Tensor, yd: el.Tensor, idx: el.Tensor, train: Any = train
                    ) -> el.Tensor:
                        return train(xd.take(idx, axis=0), yd.take(idx, axis=0))  # type: ignore[no-any-return]

                    data = (dev.tensor(xs), dev.tensor(ys))
                    rows = itertools.cycle(
                        [np.arange(k, k + 128, dtype=np.int32) for k in range(0, len(xs), 128)]
                    )
                    steps_of[name] = functools.partial(_take_step, el.jit(train_take), data, rows)
                    continue
                if name in loaders:
                    loader = loaders[name]((xs, ys), batch_size=128, device=dev, resident=True)
                    batches = itertools.chain.from_iterable(itertools.repeat(loader))
                else:
                    cut = [
                        (dev.tensor(xs[k : k + 128]), dev.tensor(ys[k : k + 128]))
                        for k in range(0, len(xs), 128)
                    ]
                    batches = itertools.cycle(cut)
                steps_of[name] = functools.partial(_loader_step, fn, batches)
            losses = {k: [step() for _ in range(3 * n_batches)] for k, step in steps_of.items()}
            for k, got in losses.items():  # the same batches in the same order: the same losses
                want = losses["uploaded beforehand"]
                if device == "cpu":
                    assert got == want, f"{k}: losses differ"
                else:  # (a GPU's kernels may sum in another order in another plan)
                    np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=f"{k}: losses differ")
            times: dict[str, list[float]] = {k: [] for k in steps_of}
            # CPU a step over each block (its warm-up included): this process's main thread, this
            # whole process, the worker process (its clock ticks are 10 ms: blocks of >= 300 steps)
            cpu: dict[str, list[tuple[float, float, float]]] = {k: [] for k in steps_of}
            for _ in range(repeats):
                for k, step in steps_of.items():
                    t0, p0 = time.thread_time(), time.process_time()
                    w0 = process_cpu_s(pids[0]) if pids else 0.0
                    times[k].append(median_us(step, steps))
                    count = steps + min(steps, 200)
                    w1 = process_cpu_s(pids[0]) if pids else 0.0
                    cpu[k].append(
                        (
                            (time.thread_time() - t0) / count * 1e6,
                            (time.process_time() - p0) / count * 1e6,
                            (w1 - w0) / count * 1e6,
                        )
                    )
            stats = {k: dev.stats() for k, dev in devs.items()}
            repeated = {k: st["batches_repeated"] / st["round_trips"] for k, st in stats.items()}
            # Executes sent (a registration or a replay each) per read, i.e. per step: the folded
            # gather makes the resident row's 1, as the uploaded row's.
            graphs = {
                k: (st["graphs_registered"] + st["graph_replays"]) / st["round_trips"]
                for k, st in stats.items()
            }
            for dev in devs.values():
                dev.close()
    base = statistics.median(times["uploaded beforehand"])
    print(
        f"{repeats} interleaved repeat(s) of {steps} steps, jitted MLP 128x{'-'.join(map(str, sizes))} over tcp"
    )
    print(
        "| feed | median µs | vs uploaded beforehand | minus uploaded, µs "
        "| CPU µs a step: client main thread / client / worker "
        "| batches sent as a Repeat, per step | graphs run per step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for k, v in times.items():
        med = statistics.median(v)
        main, proc, work = (statistics.median(c[i] for c in cpu[k]) for i in range(3))
        shown = f"{main:.0f} / {proc:.0f} / {work:.0f}" if pids else f"{main:.0f} / {proc:.0f} / -"
        print(
            f"| {k} | {med:.0f} | {med / base:.2f}x | {med - base:+.0f} | {shown} "
            f"| {repeated[k]:.3f} | {graphs[k]:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, one repeat")
    parser.add_argument("--worker", choices=("process", "thread"), default="process")
    parser.add_argument(
        "--tiny",
        type=int,
        metavar="REPEATS",
        help="only the jitted tiny step against the bare ping-pongs, interleaved",
    )
    parser.add_argument(
        "--cpus",
        choices=("split", "same", "any"),
        default="split",
        help="split (default): this process on CPU 0, the worker and bare servers on CPU 1; "
        "same: all on CPU 0; any: left to the kernel (see bench/bare.py's `place`)",
    )
    parser.add_argument(
        "--upload",
        type=int,
        metavar="REPEATS",
        help="only the jitted 401 KB host-batch step and the jitted MLP step over tcp, uploads "
        "pipelined and not, interleaved, and 64 MiB transfers",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="with --upload or --loader: the worker's device, e.g. cuda:0 (default: cpu)",
    )
    parser.add_argument(
        "--loader",
        type=int,
        metavar="REPEATS",
        help="only the jitted small MLP fed by a resident DataLoader against batches uploaded beforehand",
    )
    parser.add_argument(
        "--loader-from",
        metavar="DATA_PY",
        action="append",
        default=[],
        help="with --loader: another data.py too",
    )
    parser.add_argument("--loader-sizes", default="784-64-10", help="with --loader: the MLP's layer sizes")
    parser.add_argument(
        "--loader-client",
        type=int,
        metavar="REPEATS",
        help="only the --loader rows' client work, over an executor that runs nothing",
    )
    args = parser.parse_args()
    print(bare.place(args.cpus))
    if args.upload:
        upload_only(args.upload, 200 if args.quick else 500, args.worker, args.device)
        return
    if args.loader_client:
        sizes = tuple(int(d) for d in args.loader_sizes.split("-"))
        loader_client_only(args.loader_client, 300 if args.quick else 2000, sizes)
        return
    if args.loader:
        sizes = tuple(int(d) for d in args.loader_sizes.split("-"))
        loader_only(
            args.loader, 300 if args.quick else 1000, args.worker, args.loader_from, sizes, args.device
        )
        return
    if args.tiny:
        tiny_only(args.tiny, 500 if args.quick else 1000, args.worker)
        return
    n, steps, repeats, total = (500, 20, 1, 64 * MiB) if args.quick else (2000, 60, 5, 64 * MiB)
    loop = io_loop()
    client = Identity.generate(os.urandom)
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "client.key"
        client.save(key)
        with (worker_process if args.worker == "process" else worker_thread)(client) as ticket:
            grpc_ticket, tcp_ticket = split_ticket(ticket)
            devs = {
                "grpc": el.Device.remote(grpc_ticket, key=str(key)),
                "grpc_jit": el.Device.remote(grpc_ticket, key=str(key)),
                "tcp": el.Device.remote(tcp_ticket, key=str(key)),
                "tcp_jit": el.Device.remote(tcp_ticket, key=str(key)),
            }
            dev, dev_tcp = devs["grpc"], devs["tcp"]
            cpu = el.Device.cpu()
            rows: dict[str, list[float]] = {
                k: []
                for k in (
                    "bare_pp",
                    "bare_pp_proc",
                    "bare_tcp_proc",
                    "floor_step",
                    "floor_proto",
                    "floor_both",
                    "tiny",
                    "tiny_jit",
                    "mlp_cpu",
                    "mlp",
                    "mlp_jit_cpu",
                    "mlp_jit",
                    "tiny_tcp",
                    "tiny_jit_tcp",
                    "mlp_tcp",
                    "mlp_jit_tcp",
                    "up",
                    "down",
                    "up_tcp",
                    "down_tcp",
                )
            }
            bare_up: list[float] = []
            bare_down: list[float] = []
            proc_up: list[float] = []
            proc_down: list[float] = []
            # One untimed transfer each way first: a process's first 64 MiB page-faults its heap
            # into existence (seen here: 0.3 GB/s cold, 1.2-1.6 GB/s after), on both sides alike.
            loop.call(bare.grpc_bare_stream(total))
            transfer_gbps(dev, total)
            transfer_gbps(dev_tcp, total)
            for _ in range(repeats):  # interleaved
                rows["bare_pp"].append(loop.call(bare.grpc_bare_pingpong(n)))
                rows["bare_pp_proc"].append(loop.call(bare.grpc_bare_pingpong_process(n)))
                rows["bare_tcp_proc"].append(loop.call(bare.tcp_bare_pingpong_process(n)))
                for row, us in floor_rows(n, cpu).items():
                    rows[row].append(us)
                rows["tiny"].append(median_us(tiny_step(dev), n))
                rows["tiny_jit"].append(median_us(jit_tiny_step(dev), n))
                rows["tiny_tcp"].append(median_us(tiny_step(dev_tcp), n))
                rows["tiny_jit_tcp"].append(median_us(jit_tiny_step(dev_tcp), n))
                for row, ms in mlp_ms(cpu, devs, steps).items():
                    rows[row].append(ms)
                up, down = loop.call(bare.grpc_bare_stream(total))
                bare_up.append(up)
                bare_down.append(down)
                up, down = loop.call(bare.grpc_bare_stream_process(total))
                proc_up.append(up)
                proc_down.append(down)
                up, down = transfer_gbps(dev, total)
                rows["up"].append(up)
                rows["down"].append(down)
                up, down = transfer_gbps(dev_tcp, total)
                rows["up_tcp"].append(up)
                rows["down_tcp"].append(down)
            paths = f"{dev.stats()['path']} and {dev_tcp.stats()['path']}"
            for d in devs.values():
                d.close()
            cpu.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    b_up, b_down = statistics.median(bare_up), statistics.median(bare_down)
    p_up, p_down = statistics.median(proc_up), statistics.median(proc_down)
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, loopback, worker as a {args.worker}, "
        f"{repeats} interleaved repeat(s), paths {paths}, {type(loop.loop).__module__.split('.')[0]} event loop"
    )
    print()
    print("| measurement | emberlink remote | baseline | ratio | goal |")
    print("|---|---:|---:|---:|---|")
    print(
        f"| tiny step (64 B upload, sum, scalar read) vs bare grpc.aio 64 B ping-pong, one process, "
        f"median µs | {med['tiny']:.0f} | {med['bare_pp']:.0f} | {med['tiny'] / med['bare_pp']:.2f}x | ≤ 1.5x |"
    )
    print(
        f"| tiny step vs bare grpc.aio 64 B ping-pong, server in another process, median µs "
        f"| {med['tiny']:.0f} | {med['bare_pp_proc']:.0f} | {med['tiny'] / med['bare_pp_proc']:.2f}x | ≤ 1.5x |"
    )
    print(
        f"| jitted tiny step vs bare grpc.aio 64 B ping-pong, server in another process, median µs "
        f"| {med['tiny_jit']:.0f} | {med['bare_pp_proc']:.0f} | {med['tiny_jit'] / med['bare_pp_proc']:.2f}x "
        "| ≤ 1.5x |"
    )
    print(
        f"| MLP step 128×784-512-512-10 SGD vs Device.cpu(), median ms "
        f"| {med['mlp']:.2f} | {med['mlp_cpu']:.2f} | {med['mlp'] / med['mlp_cpu']:.2f}x | – |"
    )
    print(
        f"| MLP step jit vs the same jitted on Device.cpu(), median ms "
        f"| {med['mlp_jit']:.2f} | {med['mlp_jit_cpu']:.2f} | {med['mlp_jit'] / med['mlp_jit_cpu']:.2f}x | – |"
    )
    print(
        f"| MLP step jit vs the same eager, both remote, median ms "
        f"| {med['mlp_jit']:.2f} | {med['mlp']:.2f} | {med['mlp_jit'] / med['mlp']:.2f}x | – |"
    )
    bp = med["bare_pp_proc"]
    for what, row in (
        ("tiny step over tcp", "tiny_tcp"),
        ("jitted tiny step over tcp", "tiny_jit_tcp"),
        (
            "bare asyncio TCP 64 B ping-pong (streams, 4-byte length), server in another process",
            "bare_tcp_proc",
        ),
    ):
        print(
            f"| {what} vs bare grpc.aio 64 B ping-pong, server in another process, median µs "
            f"| {med[row]:.0f} | {bp:.0f} | {med[row] / bp:.2f}x | {'≤ 1.5x' if 'step' in what else '–'} |"
        )
    print(
        f"| jitted tiny step over tcp vs bare asyncio TCP ping-pong, server in another process, median µs "
        f"| {med['tiny_jit_tcp']:.0f} | {med['bare_tcp_proc']:.0f} "
        f"| {med['tiny_jit_tcp'] / med['bare_tcp_proc']:.2f}x | – |"
    )
    print(
        f"| MLP step over tcp vs the same over gRPC, median ms "
        f"| {med['mlp_tcp']:.2f} | {med['mlp']:.2f} | {med['mlp_tcp'] / med['mlp']:.2f}x | – |"
    )
    print(
        f"| MLP step jit over tcp vs the same over gRPC, median ms "
        f"| {med['mlp_jit_tcp']:.2f} | {med['mlp_jit']:.2f} | {med['mlp_jit_tcp'] / med['mlp_jit']:.2f}x | – |"
    )
    print(
        f"| MLP step jit over tcp vs the same jitted on Device.cpu(), median ms "
        f"| {med['mlp_jit_tcp']:.2f} | {med['mlp_jit_cpu']:.2f} | {med['mlp_jit_tcp'] / med['mlp_jit_cpu']:.2f}x | – |"
    )
    for what, ours, one, two in (
        ("upload", med["up"], b_up, p_up),
        ("download", med["down"], b_down, p_down),
        ("upload over tcp", med["up_tcp"], b_up, p_up),
        ("download over tcp", med["down_tcp"], b_down, p_down),
    ):
        print(
            f"| {total // MiB} MiB {what} vs bare grpc.aio 1 MiB messages, one process, GB/s "
            f"| {ours:.2f} | {one:.2f} | {ours / one:.2f}x | ≥ 0.7x |"
        )
        print(
            f"| {total // MiB} MiB {what} vs the same, server in another process, GB/s "
            f"| {ours:.2f} | {two:.2f} | {ours / two:.2f}x | ≥ 0.7x |"
        )
    bare_us = med["bare_pp_proc"]
    print()
    print(
        "What bounds the tiny step: the bare ping-pong with its server in another process, plus only "
        "the work no design can skip, measured between round trips as it runs here (median µs):"
    )
    print()
    print("| round trip | µs | vs bare |")
    print("|---|---:|---:|")
    for what, row in (
        ("bare grpc.aio 64 B ping-pong, server in another process", "bare_pp_proc"),
        (
            "+ the step's own work on the client: the same step on Device.cpu() (record, run, read)",
            "floor_step",
        ),
        (
            (
                "+ the protocol at its barest: a sealed batch with the input inline, opened and decoded; "
                "the server sums and seals the answer"
            ),
            "floor_proto",
        ),
        ("+ both: a floor for any design in Python on grpc.aio", "floor_both"),
        ("emberlink tiny step (sessions, store, quotas, flow control, replay)", "tiny"),
        ("emberlink jitted tiny step (the same, without recording)", "tiny_jit"),
        ("bare asyncio TCP ping-pong, server in another process (for scale)", "bare_tcp_proc"),
        ("emberlink tiny step over tcp", "tiny_tcp"),
        ("emberlink jitted tiny step over tcp", "tiny_jit_tcp"),
    ):
        print(f"| {what} | {med[row]:.0f} | {med[row] / bare_us:.2f}x |")


if __name__ == "__main__":
    main()
