"""A remote device on loopback against the bare transport and against local execution.

    .venv/bin/python bench/remote_step.py [--quick] [--worker process|thread]

Rows, each a median over interleaved repeats so machine noise hits both sides alike:
- tiny step: one 64-byte input upload, one op (`sum`), one scalar read, against a bare grpc.aio
  bidirectional-stream ping-pong of 64 bytes (bench/bare.py). Goal: at most 1.5x.
- MLP training step: batch 128, 784-512-512-10, SGD (bench/local_step.py's model), remote against
  the same step on Device.cpu().
- 64 MiB upload (`dev.tensor(a)` then `sync()`) and download (`t.numpy()`), against bare
  grpc.aio streaming of the same bytes in 1 MiB messages. Goal: at least 0.7x the bare rate.

The worker runs as an `emberlink worker` process (default; as a user would run it) or in this
process on the client's I/O loop (`--worker thread`). The bare gRPC figures come from one
process, one event loop, no encryption and no thread hand-offs: the floor, not a peer.
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

import bare  # noqa: E402 - bench/bare.py, the transport engineer's bare measurements
import local_step  # noqa: E402 - bench/local_step.py, the model and its batches

import emberlink as el  # noqa: E402
from emberlink.client.loop import io_loop  # noqa: E402
from emberlink.protocol.identity import AllowPolicy, Identity  # noqa: E402
from emberlink.server.malloc import tune_malloc  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, one repeat")
    parser.add_argument("--worker", choices=("process", "thread"), default="process")
    args = parser.parse_args()
    n, steps, repeats, total = (500, 20, 1, 64 * MiB) if args.quick else (2000, 60, 3, 64 * MiB)
    tune_malloc()
    loop = io_loop()
    client = Identity.generate(os.urandom)
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "client.key"
        client.save(key)
        with (worker_process if args.worker == "process" else worker_thread)(client) as ticket:
            dev = el.Device.remote(ticket, key=str(key))
            cpu = el.Device.cpu()
            rows: dict[str, list[float]] = {k: [] for k in ("bare_pp", "tiny", "mlp_cpu", "mlp", "up", "down")}
            bare_up: list[float] = []
            bare_down: list[float] = []
            for _ in range(repeats):  # interleaved
                rows["bare_pp"].append(loop.call(bare.grpc_bare_pingpong(n)))
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
        f"| tiny step (64 B upload, sum, scalar read) vs bare grpc.aio 64 B ping-pong, median µs "
        f"| {med['tiny']:.0f} | {med['bare_pp']:.0f} | {med['tiny'] / med['bare_pp']:.2f}x | ≤ 1.5x |"
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


if __name__ == "__main__":
    main()
