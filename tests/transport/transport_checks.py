"""Checks every transport must pass, written once against the Link interface; no transport specifics."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Self, TypeVar

import pytest

from emberlink.errors import TransportError
from emberlink.transport.base import Link

T = TypeVar("T")


async def echo(link: Link) -> None:
    """A worker handler that sends every blob straight back until the client goes away."""
    while True:
        await link.send(await link.recv())


def blobs(sizes: list[int]) -> list[bytes]:
    return [os.urandom(n) for n in sizes]


async def ping_pong(link: Link, sent: list[bytes]) -> list[bytes | memoryview]:
    got = []
    for blob in sent:
        await link.send(blob)
        got.append(await link.recv())
    return got


async def pipelined(link: Link, sent: list[bytes]) -> list[bytes | memoryview]:
    """Send everything while receiving concurrently: order and wholeness under load."""

    async def sender() -> None:
        for blob in sent:
            await link.send(blob)

    task = asyncio.create_task(sender())
    got = [await link.recv() for _ in sent]
    await task
    return got


REPO = Path(__file__).resolve().parents[2]


def echo_worker_script(module: str, listener: str) -> str:
    """A worker process on 127.0.0.1:0 over `emberlink.transport.<module>` that echoes every blob and
    prints its port (for `Child`)."""
    return f"""
    import asyncio
    from emberlink.transport import {module}

    async def echo(link):
        while True:
            await link.send(await link.recv())

    async def main():
        listener = {module}.{listener}("127.0.0.1", 0, echo)
        print(await listener.start(), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
"""


def client_script(module: str) -> str:
    """A client process that connects over `emberlink.transport.<module>` to the port in argv[1],
    sends one blob, says "connected" and waits (for `Child`)."""
    return f"""
    import asyncio, sys
    from emberlink.transport import {module}

    async def main():
        link = await {module}.connect("127.0.0.1", int(sys.argv[1]), timeout=10)
        await link.send(b"hello")
        print("connected", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
"""


class Child:
    """A Python subprocess that prints one line when ready; killed and reaped on exit."""

    def __init__(self, code: str, *args: str) -> None:
        self.code = code
        self.args = args
        self.proc: asyncio.subprocess.Process | None = None
        self.ready_line = ""

    async def __aenter__(self) -> Self:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            textwrap.dedent(self.code),
            *self.args,
            cwd=REPO,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 30)
        if not line:
            raise RuntimeError(f"child exited before it was ready (rc={await self.proc.wait()})")
        self.ready_line = line.decode().strip()
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        await self.proc.wait()


async def within(seconds: float, awaitable: Awaitable[T]) -> T:
    """Await with a generous bound: a hang is a failure, a slow machine is not."""
    return await asyncio.wait_for(awaitable, seconds)


class Recorder:
    """A worker handler that keeps what its sessions received and the error that ended the first."""

    def __init__(self) -> None:
        self.received: list[bytes | memoryview] = []
        self.ended: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    async def __call__(self, link: Link) -> None:
        try:
            while True:
                self.received.append(await link.recv())
        except BaseException as e:
            if not self.ended.done():
                self.ended.set_result(e)
            raise


async def echo_once(link: Link) -> None:
    """A worker handler that answers one blob and returns (which ends the session)."""
    await link.send(await link.recv())


async def check_sessions_are_isolated(links: Sequence[Link], per_link: list[list[bytes]]) -> None:
    """Links to an `echo` worker: pipelined traffic stays on its own link, and closing one spares
    the others. Closes every link."""
    assert (
        await asyncio.gather(*(pipelined(lk, s) for lk, s in zip(links, per_link, strict=True))) == per_link
    )
    await links[0].close()
    assert await ping_pong(links[1], [b"others live on"]) == [b"others live on"]
    for link in links[1:]:
        await link.close()


async def check_client_close_reaches_the_worker_after_its_last_blob(link: Link, recorder: Recorder) -> None:
    """A link to a `Recorder` worker: the worker reads the last blob, then a TransportError
    saying the session is closed; the closed link's own recv raises too."""
    await link.send(b"last words")
    await link.close()
    error = await within(5, recorder.ended)
    assert isinstance(error, TransportError) and "closed" in str(error)
    assert recorder.received == [b"last words"]
    with pytest.raises(TransportError, match="closed"):
        await link.recv()


async def check_handler_return_closes_the_client(link: Link) -> None:
    """A link to an `echo_once` worker: after its answer, the client's recv raises "closed". Closes the link."""
    assert await ping_pong(link, [b"1"]) == [b"1"]
    with pytest.raises(TransportError, match="closed"):
        await within(5, link.recv())
    await link.close()


async def check_sigkilled_worker_makes_client_recv_raise(
    echo_worker: str, connect: Callable[[int], Awaitable[Link]]
) -> None:
    """An `echo_worker_script` process SIGKILLed while the client waits in recv: the recv raises
    TransportError within seconds."""
    async with Child(echo_worker) as worker:
        link = await connect(int(worker.ready_line))
        assert await ping_pong(link, [b"alive"]) == [b"alive"]
        pending = asyncio.create_task(link.recv())
        worker.signal(signal.SIGKILL)
        with pytest.raises(TransportError):
            await within(5, pending)
        await link.close()


async def check_sigkilled_client_makes_worker_recv_raise(client: str, port: int, recorder: Recorder) -> None:
    """A `client_script` process, having sent "hello" to a `Recorder` worker on `port`, SIGKILLed:
    the worker's recv raises TransportError within seconds."""
    async with Child(client, str(port)) as child:
        child.signal(signal.SIGKILL)
        error = await within(5, recorder.ended)
    assert isinstance(error, TransportError)
    assert recorder.received == [b"hello"]
