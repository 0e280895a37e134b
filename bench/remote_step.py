"""A remote device on loopback against the bare transport and against local execution.

    .venv/bin/python bench/remote_step.py [--quick] [--worker process|thread]

Rows, each a median over interleaved repeats so machine noise hits both sides alike:
- tiny step: one 64-byte input upload, one op (`sum`), one scalar read, against a bare grpc.aio
  bidirectional-stream ping-pong of 64 bytes (bench/bare.py), twice: client and server in this
  process on one event loop (the old floor), and the server in its own process (the topology of an
  `emberlink worker`: two processes, each with its own loop and gRPC poller). Goal: at most 1.5x.
- MLP training step: batch 128, 784-512-512-10, SGD (bench/local_step.py's model), remote against
  the same step on Device.cpu().
- 64 MiB upload (`dev.tensor(a)` then `sync()`) and download (`t.numpy()`), against bare
  grpc.aio streaming of the same bytes in 1 MiB messages. Goal: at least 0.7x the bare rate.

The worker runs as an `emberlink worker` process (default; as a user would run it) or in this
process on the client's I/O loop (`--worker thread`). The first bare gRPC ping-pong row is one
process, one event loop, no encryption and no thread hand-offs: a floor, not a peer; the second
(server in another process) is the honest peer of `--worker process`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bare
import local_step

import emberlink as el
from emberlink.client.loop import io_loop
from emberlink.protocol.identity import AllowPolicy, Identity

MiB = 1 << 20


@contextmanager
def worker_process(client: Identity) -> Any:
    """An `emberlink worker` process on 127.0.0.1:0 admitting `client`; yields its ticket."""
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "worker.key"
        Identity.generate(os.urandom).save(key)
        allow = Path(tmp) / "allow"
        allow.write_text(client.node_id + "\n")
        proc = subprocess.Popen(
            [sys.executable, "-m", "emberlink", "worker", "--listen", "127.0.0.1:0", "--key", str(key)]
            + ["--allow", str(allow)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
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

    with BackgroundWorker(allow=AllowPolicy.of([client.node_id])) as worker:
        yield worker.ticket


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


def mlp_ms(dev: el.Device, steps: int) -> float:
    model = local_step.EmberlinkMLP(dev)
    batches = local_step._batches(4)
    times: list[float] = []
    local_step._time(model.step, batches, 5, [])  # warm-up: graphs built and registered
    local_step._time(model.step, batches, steps, times)
    return statistics.median(times) * 1e3


# -- what bounds the tiny step: its parts, each measured alone ------------------------------------------


def floor_parts(n: int) -> list[tuple[str, float]]:
    """Median µs of each piece a tiny remote step pays on top of the transport's round trip."""
    import asyncio
    from concurrent.futures import Future

    from emberlink.graph_replay.cache import GraphCache
    from emberlink.graph_replay.canonical import encode_graph, graph_id
    from emberlink.graph_replay.ir import Graph, Node, TensorSpec
    from emberlink.graph_replay.numpy_backend import NumpyBackend
    from emberlink.protocol import messages as m
    from emberlink.protocol.channel import BULK, Channel
    from emberlink.server.device import DeviceThread
    from emberlink.server.graphs import GraphView
    from emberlink.server.runner import BatchRunner, Incoming
    from emberlink.server.store import Quota, TensorStore

    loop = io_loop().loop
    device = DeviceThread("cpu")

    def user_loop_user() -> None:
        fut: Future[int] = Future()
        loop.call_soon_threadsafe(fut.set_result, 1)
        fut.result()

    def loop_device_loop() -> None:
        # measured from the user thread, minus user_loop_user below
        io_loop().call(device.run(int))

    x = np.arange(16, dtype=np.float32)
    graph = Graph(
        (TensorSpec("float32", (16,)),), (), (Node("sum", (0,), (("axis", None), ("keepdims", False))),), (1,)
    )
    body = encode_graph(graph)
    gid = graph_id(body)
    client, worker = Channel.pair(b"benchsid", os.urandom(32), os.urandom(32))
    batch = m.Batch(
        1, (m.Upload(1, "float32", (16,), 64), m.Execute(gid, (1,), (), 2), m.Read(1, 2), m.Drop((1, 2)))
    )
    reply = m.Reply(1, (m.Result(1, "float32", (), 4),))

    def batch_both_ways() -> None:  # client seals, worker opens and decodes (and the same for the reply)
        f1 = client.seal(m.encode_batch(batch))
        f2 = next(iter(client.seal_chunks(x.data.cast("B"))))
        m.decode_batch(worker.open(f1)[1])
        out = np.empty(16, np.float32)
        assert worker.open_into(f2, out.data.cast("B"))[0] is BULK
        g1 = worker.seal(m.encode_reply(reply))
        g2 = next(iter(worker.seal_chunks(np.float32(1).reshape(()).data.cast("B"))))
        m.decode_reply(client.open(g1)[1])
        client.open_into(g2, np.empty((), np.float32).data.cast("B"))

    runner = BatchRunner(
        NumpyBackend(), TensorStore(Quota(None)), GraphView(GraphCache(1 << 20), "me"), dict, Quota(None)
    )
    seq = iter(range(1, 1 << 30))
    runner.apply(Incoming(m.Batch(next(seq), (m.Register(gid, body),)), [], 0))

    def apply() -> None:
        runner.apply(Incoming(m.Batch(next(seq), batch.messages), [x.copy()], 0))

    cpu = el.Device.cpu()
    parts = [
        ("hand-off user → I/O loop → user", median_us(user_loop_user, n)),
        ("hand-off I/O loop → device thread → I/O loop (incl. one user hop)", median_us(loop_device_loop, n)),
        (
            "seal + open + encode + decode: the batch, its bulk, the reply, its bulk",
            median_us(batch_both_ways, n),
        ),
        ("worker applies the batch (NumPy: upload, sum, read, drop)", median_us(apply, n)),
        ("the same step on Device.cpu() (recording, memo, run, read)", median_us(tiny_step(cpu), n)),
    ]
    cpu.close()
    device.shutdown()
    asyncio.set_event_loop(None)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, one repeat")
    parser.add_argument("--worker", choices=("process", "thread"), default="process")
    args = parser.parse_args()
    n, steps, repeats, total = (500, 20, 1, 64 * MiB) if args.quick else (2000, 60, 5, 64 * MiB)
    loop = io_loop()
    client = Identity.generate(os.urandom)
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "client.key"
        client.save(key)
        with (worker_process if args.worker == "process" else worker_thread)(client) as ticket:
            dev = el.Device.remote(ticket, key=str(key))
            cpu = el.Device.cpu()
            rows: dict[str, list[float]] = {
                k: [] for k in ("bare_pp", "bare_pp_proc", "tiny", "mlp_cpu", "mlp", "up", "down")
            }
            bare_up: list[float] = []
            bare_down: list[float] = []
            # One untimed transfer each way first: a process's first 64 MiB page-faults its heap
            # into existence (seen here: 0.3 GB/s cold, 1.2-1.6 GB/s after), on both sides alike.
            loop.call(bare.grpc_bare_stream(total))
            transfer_gbps(dev, total)
            for _ in range(repeats):  # interleaved
                rows["bare_pp"].append(loop.call(bare.grpc_bare_pingpong(n)))
                rows["bare_pp_proc"].append(loop.call(bare.grpc_bare_pingpong_process(n)))
                rows["tiny"].append(median_us(tiny_step(dev), n))
                rows["mlp_cpu"].append(mlp_ms(cpu, steps))
                rows["mlp"].append(mlp_ms(dev, steps))
                up, down = loop.call(bare.grpc_bare_stream(total))
                bare_up.append(up)
                bare_down.append(down)
                up, down = transfer_gbps(dev, total)
                rows["up"].append(up)
                rows["down"].append(down)
            stats = dev.stats()
            dev.close()
            cpu.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    b_up, b_down = statistics.median(bare_up), statistics.median(bare_down)
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, loopback, worker as a {args.worker}, "
        f"{repeats} interleaved repeat(s), path {stats['path']}"
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
        f"| MLP step 128×784-512-512-10 SGD vs Device.cpu(), median ms "
        f"| {med['mlp']:.2f} | {med['mlp_cpu']:.2f} | {med['mlp'] / med['mlp_cpu']:.2f}x | – |"
    )
    print(
        f"| {total // MiB} MiB upload vs bare grpc.aio 1 MiB messages, GB/s "
        f"| {med['up']:.2f} | {b_up:.2f} | {med['up'] / b_up:.2f}x | ≥ 0.7x |"
    )
    print(
        f"| {total // MiB} MiB download vs bare grpc.aio 1 MiB messages, GB/s "
        f"| {med['down']:.2f} | {b_down:.2f} | {med['down'] / b_down:.2f}x | ≥ 0.7x |"
    )
    parts = floor_parts(n)
    print()
    print("What a tiny step pays besides the transport's round trip (each part alone, median µs):")
    print()
    print("| part | µs |")
    print("|---|---:|")
    for what, us in parts:
        print(f"| {what} | {us:.0f} |")
    hops = 2 * parts[0][1] + (parts[1][1] - parts[0][1])
    floor = med["bare_pp"] + hops + parts[2][1] + parts[3][1] + parts[4][1]
    print(
        f"| sum: bare round trip + 4 hand-offs + protocol + apply + client recording "
        f"(a floor for this design, all on one core) | {floor:.0f} |"
    )


if __name__ == "__main__":
    main()
