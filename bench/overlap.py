"""A training loop on plain loopback against the same loop through a 10 ms round trip.

    .venv/bin/python bench/overlap.py [--steps 60] [--async-steps 200] [--repeats 5] [--delay-ms 5]

The worker is an `emberlink worker` process on 127.0.0.1; the client (this process) reaches it
over the raw TCP transport (`--tcp-listen`) directly, or through a delaying TCP proxy of our own (`proxy` below, in a process of its own):
every chunk of bytes is held `--delay-ms` before it is passed on, each way, with no limit on
bandwidth, which is what `tc netem delay` would do (this kernel has none). The emulated round trip
is checked first: a bare 64-byte TCP ping-pong through the proxy, and `emberlink ping`. A third
path goes through a second proxy that adds no delay: on a small machine the proxy's own CPU use
weighs, and this column shows how much of a difference is the proxy rather than the delay.

The loop: an MLP (default batch 128, 784-512-512-10, ReLU, cross-entropy, SGD), its batches from
`emberlink.data.DataLoader`, host data (sent a batch ahead) or resident data (uploaded once,
gathered on the worker), read two ways:
  (a) waits for every loss: `float(loss)` each step, one round trip per step;
  (b) reads each loss without waiting: `loss.read_async()`, the futures resolved as they arrive
      (a step or more later), all of them before the clock stops.
In each round the paths run back to back; the table gives medians over the rounds, and ratios are
medians of the rounds' ratios. The issue's goal: (b) through the 10 ms round trip runs at >= 0.9x
its steps/s on loopback.

    .venv/bin/python bench/overlap.py proxy --upstream HOST:PORT --delay-ms 5   # the proxy alone
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from remote_step import worker_process

import emberlink as el
from emberlink.client.ping import ping
from emberlink.data import DataLoader
from emberlink.protocol.identity import Identity
from emberlink.protocol.ticket import Ticket

CHUNK = 1 << 16


# -- the delaying proxy ---------------------------------------------------------------------------------


async def _delay_line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Pass bytes from `reader` to `writer`, each chunk `delay` s after it arrived, in order.

    Reading never waits for writing, so the delay is latency only (as netem's): bytes in flight
    pile up in the queue, not in the sender's socket."""
    loop = asyncio.get_running_loop()
    line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def take_in() -> None:
        while data := await reader.read(CHUNK):
            line.put_nowait((loop.time() + delay, data))
        line.put_nowait((loop.time() + delay, b""))

    async def give_out() -> None:
        while True:
            due, data = await line.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    try:
        await asyncio.gather(take_in(), give_out())
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def serve_proxy(upstream: tuple[str, int], delay: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*upstream)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_delay_line(client_r, server_w, delay), _delay_line(server_r, client_w, delay))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def proxy_process(upstream: tuple[str, int], delay_ms: float) -> Iterator[int]:
    """This script's `proxy` command in a process of its own (so it never competes with the client
    for the GIL); yields the port it listens on."""
    host, port = upstream
    argv = [sys.executable, __file__, "proxy", "--upstream", f"{host}:{port}", "--delay-ms", str(delay_ms)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def via(ticket: str, port: int) -> str:
    """The same worker over the raw TCP transport, reached at 127.0.0.1:`port` (the proxy)."""
    return str(Ticket(Ticket.parse(ticket).node_id, (), tcp=(("127.0.0.1", port),)))


# -- checking the emulated round trip -------------------------------------------------------------------


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except asyncio.CancelledError:
        pass  # asyncio.run ending: the ping-pong is over
    finally:
        writer.close()


async def tcp_pingpong_ms(port: int, n: int) -> float:
    """Median ms of a 64-byte ping-pong over one TCP connection to 127.0.0.1:`port`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = os.urandom(64)
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        writer.write(payload)
        await writer.drain()
        await reader.readexactly(len(payload))
        samples.append(time.perf_counter() - t)
    writer.close()
    return statistics.median(samples) * 1e3


def bare_rtt_ms(delay_ms: float, n: int) -> tuple[float, float]:
    """The bare ping-pong's median round trip to an echo server: direct, and through a proxy."""

    async def run() -> tuple[float, float]:
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            direct = await tcp_pingpong_ms(port, n)
            with proxy_process(("127.0.0.1", port), delay_ms) as proxied:
                return direct, await tcp_pingpong_ms(proxied, n)

    return asyncio.run(run())


# -- the training loop -----------------------------------------------------------------------------------


class Trainer:
    """One model on one device and its two loaders (host data, resident data)."""

    def __init__(self, dev: el.Device, sizes: tuple[int, ...], x: np.ndarray, y: np.ndarray, batch: int):
        nn = el.nn
        layers: list[el.nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers += [nn.Linear(a, b, seed=i), nn.ReLU()]
        self.model = nn.Sequential(*layers[:-1]).to(dev)
        self.opt = el.optim.SGD(self.model.parameters(), lr=0.01)
        self.dev = dev
        self.batches = {
            resident: _forever(DataLoader((x, y), batch, shuffle=True, seed=0, device=dev, resident=resident))
            for resident in (False, True)
        }

    def step(self, resident: bool) -> el.Tensor:
        xb, yb = next(self.batches[resident])
        loss = el.nn.functional.cross_entropy(self.model(xb), yb)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss

    def waiting(self, resident: bool, steps: int) -> float:
        """(a): steps/s of a loop that reads every loss as a float."""
        t0 = time.perf_counter()
        for _ in range(steps):
            float(self.step(resident))
        return steps / (time.perf_counter() - t0)

    def not_waiting(self, resident: bool, steps: int) -> tuple[float, int]:
        """(b): steps/s of a loop that logs each loss when it has arrived; and the most steps whose
        loss was still on its way at once (the pipeline depth the loop reached)."""
        pending: deque[el.ArrayFuture] = deque()
        losses: list[float] = []
        deepest = 0
        t0 = time.perf_counter()
        for _ in range(steps):
            pending.append(self.step(resident).read_async())
            while pending and pending[0].done():
                losses.append(pending.popleft().item())
            deepest = max(deepest, len(pending))
        losses.extend(f.item() for f in pending)
        rate = steps / (time.perf_counter() - t0)
        if not all(np.isfinite(losses)):
            raise SystemExit(f"a loss is not finite: {losses}")
        return rate, deepest


def _forever(loader: DataLoader[tuple[el.Tensor, ...]]) -> Iterator[tuple[el.Tensor, ...]]:
    while True:
        yield from loader


# -- main -----------------------------------------------------------------------------------------------

Row = tuple[str, bool]  # (loop, resident)
PATHS = ("loopback", "proxy0", "10ms")  # direct; through the proxy with no delay; with the delay


def measure(
    trainers: dict[str, Trainer], steps: dict[str, int], repeats: int
) -> tuple[dict[Row, dict[str, float]], dict[Row, dict[str, float]], int]:
    """Per row: the median steps/s of each path, and the medians of the rounds' ratios of the
    10 ms path to each other path. In a round the paths run back to back (in an order that turns
    every round), so a burst of load from elsewhere on the machine tends to hit a ratio's sides alike."""
    rates: dict[Row, dict[str, list[float]]] = {}
    ratios: dict[Row, dict[str, list[float]]] = {}
    deepest = 0
    for i in range(repeats):
        order = PATHS[i % 3 :] + PATHS[: i % 3]
        for row in itertools.product(("a", "b"), (False, True)):
            loop, resident = row
            got: dict[str, float] = {}
            for path in order:
                if loop == "a":
                    got[path] = trainers[path].waiting(resident, steps[loop])
                else:
                    got[path], depth = trainers[path].not_waiting(resident, steps[loop])
                    deepest = max(deepest, depth)
                rates.setdefault(row, {}).setdefault(path, []).append(got[path])
            for path in PATHS[:2]:
                ratios.setdefault(row, {}).setdefault(path, []).append(got["10ms"] / got[path])
    med = statistics.median
    return (
        {row: {p: med(r) for p, r in by.items()} for row, by in rates.items()},
        {row: {p: med(r) for p, r in by.items()} for row, by in ratios.items()},
        deepest,
    )


def run_bench(args: argparse.Namespace) -> None:
    sizes = tuple(int(s) for s in args.sizes.split(","))
    rng = np.random.default_rng(0)
    rows = args.batch * 16
    x = rng.standard_normal((rows, sizes[0]), dtype=np.float32)
    y = rng.integers(0, sizes[-1], rows)
    # The worker computes on one core (set before it starts: it inherits this environment), so on
    # a small machine the client and the proxy have the other rather than fight spinning BLAS threads.
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(args.worker_threads)

    direct_rtt, proxied_rtt = bare_rtt_ms(args.delay_ms, 50)
    client = Identity.generate(os.urandom)
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "client.key"
        client.save(key)
        with (
            worker_process(client) as ticket,
            proxy_process(Ticket.parse(ticket).tcp[0], 0.0) as port0,
            proxy_process(Ticket.parse(ticket).tcp[0], args.delay_ms) as port10,
        ):
            # Every path over the raw TCP transport (a client prefers it when the ticket has it, as
            # this loopback one does): before, the proxied paths went over gRPC and the loopback one
            # over tcp, so the ratio weighed the transports as well as the delay.
            _, direct = Ticket.parse(ticket).tcp[0]
            tickets = {
                "loopback": via(ticket, direct),
                "proxy0": via(ticket, port0),
                "10ms": via(ticket, port10),
            }
            pings = {p: ping(t, key=str(key), count=30).median_s * 1e3 for p, t in tickets.items()}
            devices = {p: el.Device.remote(t, key=str(key)) for p, t in tickets.items()}
            try:
                trainers = {p: Trainer(d, sizes, x, y, args.batch) for p, d in devices.items()}
                for trainer in trainers.values():  # graphs registered, heaps grown
                    for resident in (False, True):
                        for _ in range(5):
                            float(trainer.step(resident))
                steps = {"a": args.steps, "b": args.async_steps}
                rates, ratios, deepest = measure(trainers, steps, args.repeats)
            finally:
                for d in devices.values():
                    d.close()

    print(
        f"MLP training step: batch {args.batch}, {'-'.join(map(str, sizes))}, SGD; {args.steps} steps "
        f"a round for (a), {args.async_steps} for (b); {args.repeats} rounds, medians; worker in "
        f"another process on 127.0.0.1 with {args.worker_threads} BLAS thread(s); {os.cpu_count()} CPUs"
    )
    print(
        f"emulated round trip (the proxy holds bytes {args.delay_ms:g} ms each way): bare 64 B TCP "
        f"ping-pong {direct_rtt:.2f} ms direct, {proxied_rtt:.2f} ms through the proxy; emberlink ping "
        f"{pings['loopback']:.2f} ms loopback, {pings['proxy0']:.2f} ms through the proxy with no "
        f"delay, {pings['10ms']:.2f} ms through the proxy with the delay"
    )
    print()
    print(
        "| loop | data | loopback steps/s | proxy, no delay | 10 ms RTT | 10 ms / loopback "
        "| 10 ms / proxy, no delay | goal (10 ms / loopback) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for row in itertools.product(("a", "b"), (False, True)):
        loop, resident = row
        what = "(a) waits for every loss" if loop == "a" else "(b) reads each loss without waiting"
        data = "resident" if resident else "host, loader"
        goal = "≥ 0.9x" if loop == "b" else "–"
        r, q = rates[row], ratios[row]
        print(
            f"| {what} | {data} | {r['loopback']:.1f} | {r['proxy0']:.1f} | {r['10ms']:.1f} "
            f"| {q['loopback']:.2f}x | {q['proxy0']:.2f}x | {goal} |"
        )
    print()
    print(
        f"ratios are medians of the rounds' ratios; deepest pipeline reached by (b): {deepest} steps "
        "with their loss still on its way (flow control allows 64 unacknowledged batches)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    proxy = sub.add_parser("proxy", help="run the delaying proxy alone; prints its port")
    proxy.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    proxy.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=60, help="timed steps a round, loop (a)")
    parser.add_argument("--async-steps", type=int, default=200, help="timed steps a round, loop (b)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--sizes", default="784,512,512,10", help="layer widths, input first")
    parser.add_argument("--delay-ms", type=float, default=5.0, help="proxy delay each way")
    parser.add_argument("--worker-threads", type=int, default=1, help="the worker's BLAS threads")
    args = parser.parse_args()
    if args.command == "proxy":
        host, port = args.upstream.rsplit(":", 1)
        asyncio.run(serve_proxy((host, int(port)), args.delay_ms / 1e3))
    else:
        run_bench(args)


if __name__ == "__main__":
    main()
