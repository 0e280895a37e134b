"""The NATS relay against direct gRPC and bare nats-py, on loopback, with a worker process.

    python bench/relay.py [--quick]

prints a markdown table: a tiny step's round trip (record, Execute, Read of one float) through
the relay and over direct gRPC (medians, ratio), and a 64 MiB upload (`dev.tensor(a)` then
`dev.sync()`: sealed, fragmented, relayed, decrypted into the worker's array) through the relay,
against bench/bare.py's bare nats-py publishing of the same number of bytes in chunks under the
server's max_payload (goal: at least 0.7x). Runs of the things compared are interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import bare  # bench/bare.py, beside this file
import numpy as np

import emberlink as el
from emberlink.protocol.identity import Identity
from emberlink.protocol.ticket import Ticket
from emberlink.transport.fragment import TAGGED_HEADER

MiB = 1 << 20
FRAGMENT_HEADER = TAGGED_HEADER.size  # a session's relayed messages carry it: bare chunks leave that room


def start_nats(folder: Path, max_payload: int | None) -> tuple[subprocess.Popen[bytes], str]:
    beside = Path(sys.executable).parent / "nats-server"
    binary = beside if beside.exists() else Path(shutil.which("nats-server") or beside)
    log = folder / "nats.log"
    cmd = [str(binary), "-a", "127.0.0.1", "-p", "-1", "-l", str(log)]
    if max_payload is not None:
        (folder / "nats.conf").write_text(f"max_payload: {max_payload}\n")
        cmd += ["-c", str(folder / "nats.conf")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    for _ in range(1000):
        text = log.read_text() if log.exists() else ""
        if "Server is ready" in text:
            line = next(x for x in text.splitlines() if "Listening for client connections on" in x)
            return proc, f"nats://127.0.0.1:{line.rsplit(':', 1)[1]}"
        time.sleep(0.01)
    proc.kill()
    raise SystemExit(f"nats-server did not start: {log.read_text() if log.exists() else ''}")


def start_worker(folder: Path, url: str) -> tuple[subprocess.Popen[bytes], Ticket]:
    key = folder / "worker.key"
    Identity.generate(os.urandom).save(key)
    proc = subprocess.Popen(
        [sys.executable, "-m", "emberlink", "worker", "--listen", "127.0.0.1:0", "--key", str(key)]
        + ["--allow-any", "--relay", url],
        stdout=subprocess.PIPE,
        stderr=(folder / "worker.log").open("wb"),
    )
    assert proc.stdout is not None
    return proc, Ticket.parse(proc.stdout.readline().decode())


def tiny_step_us(dev: el.Device, n: int) -> list[float]:
    """Per-step µs of n tiny steps: `float((x * 2 + 1).sum())` on a 16-element tensor, one round trip each."""
    x = dev.tensor(np.arange(16, dtype=np.float32))
    for _ in range(20):  # warm-up: the graph is registered once, then replayed
        float((x * 2 + 1).sum())
    samples = []
    for _ in range(n):
        t = time.perf_counter_ns()
        float((x * 2 + 1).sum())
        samples.append((time.perf_counter_ns() - t) / 1000)
    return samples


def upload_gbps(dev: el.Device, array: np.ndarray) -> float:
    t = time.perf_counter()
    tensor = dev.tensor(array)
    dev.sync()
    seconds = time.perf_counter() - t
    del tensor
    dev.sync()
    return array.nbytes / seconds / 1e9


def interleaved(makers: list[Callable[[], float]], repeats: int) -> list[float]:
    runs: list[list[float]] = [[] for _ in makers]
    for _ in range(repeats):
        for i, make in enumerate(makers):
            runs[i].append(make())
    return [statistics.median(r) for r in runs]


def measure(n: int, total: int, repeats: int, max_payload: int | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        nats, url = start_nats(folder, max_payload)
        worker, ticket = start_worker(folder, url)
        client_key = folder / "client.key"
        Identity.generate(os.urandom).save(client_key)
        try:
            relayed = el.Device.remote(str(Ticket(ticket.node_id, (), url)), key=str(client_key))
            direct = el.Device.remote(str(Ticket(ticket.node_id, ticket.addrs)), key=str(client_key))
            assert (relayed.stats()["path"], direct.stats()["path"]) == ("relay", "grpc")
            payload = max_payload or 1 * MiB
            chunk = payload - FRAGMENT_HEADER
            array = np.random.default_rng(0).standard_normal(total // 4).astype(np.float32)
            step_relay, step_direct = interleaved(
                [
                    lambda: statistics.median(tiny_step_us(relayed, n)),
                    lambda: statistics.median(tiny_step_us(direct, n)),
                ],
                repeats,
            )
            up_relay, up_bare, up_direct = interleaved(
                [
                    lambda: upload_gbps(relayed, array),
                    lambda: asyncio.run(bare.nats_bare_publish(url, total, chunk)),
                    lambda: upload_gbps(direct, array),
                ],
                repeats,
            )
            relayed.close()
            direct.close()
        finally:
            worker.terminate()
            worker.wait(30)
            nats.terminate()
            nats.wait(10)
    return {
        "step_relay": step_relay,
        "step_direct": step_direct,
        "up_relay": up_relay,
        "up_bare": up_bare,
        "up_direct": up_direct,
        "chunk": chunk,
    }


def markdown(r: dict[str, float], n: int, total: int, repeats: int) -> str:
    mib = total // MiB
    goal = "met" if r["up_relay"] >= 0.7 * r["up_bare"] else "MISSED"
    rows = [
        ("measure", "through the relay", "compared with", "ratio"),
        ("---", "---:", "---:", "---"),
        (
            f"tiny step round trip, median µs (n={n} x {repeats})",
            f"{r['step_relay']:.0f}",
            f"{r['step_direct']:.0f} (direct gRPC)",
            f"relay / direct = {r['step_relay'] / r['step_direct']:.2f}x",
        ),
        (
            f"{mib} MiB upload, GB/s (median of {repeats})",
            f"{r['up_relay']:.2f}",
            f"{r['up_bare']:.2f} (bare nats-py, {int(r['chunk'])} B chunks)",
            f"relay / bare = {r['up_relay'] / r['up_bare']:.2f}x (goal >= 0.7x: {goal})",
        ),
        (
            f"{mib} MiB upload, GB/s, direct gRPC for reference",
            "–",
            f"{r['up_direct']:.2f}",
            f"relay / direct = {r['up_relay'] / r['up_direct']:.2f}x",
        ),
    ]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, 16 MiB, one repeat")
    parser.add_argument(
        "--max-payload", type=int, default=None, help="the NATS server's max_payload (default: its 1 MiB)"
    )
    args = parser.parse_args()
    n, total, repeats = (200, 16 * MiB, 1) if args.quick else (500, 64 * MiB, 5)
    r = measure(n, total, repeats, args.max_payload)
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, loopback; worker and nats-server are processes"
    )
    print()
    print(markdown(r, n, total, repeats))


if __name__ == "__main__":
    main()
