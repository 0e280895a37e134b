"""Helpers for the relay tests: worker and client processes, in-process relay workers, keys, and an
eavesdropper on the NATS server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from emberlink.client.trust import KNOWN_WORKERS_ENV
from emberlink.protocol.cluster import Certificate
from emberlink.protocol.identity import AllowPolicy, Identity
from emberlink.protocol.ticket import Ticket
from emberlink.server.background import BackgroundWorker
from emberlink.server.relay import RelayService
from emberlink.transport.nats_access import RelayAccess

from ..process_harness import Process

ROOT = Path(__file__).parents[2]
"""The repository root: `python -m tests.relay.relay_client` needs it on the path."""


def new_key(folder: Path, name: str) -> tuple[Identity, Path]:
    identity = Identity.generate(os.urandom)
    path = folder / f"{name}.key"
    identity.save(path)
    return identity, path


def allow_file(folder: Path, name: str, *node_ids: str) -> Path:
    path = folder / name
    path.write_text("".join(f"{n}\n" for n in node_ids))
    return path


def worker_process(
    folder: Path, name: str, *args: str, key: Path, prefix: list[str] | None = None
) -> tuple[Process, Ticket]:
    """`emberlink worker` (through `python -m emberlink`) and the ticket it printed."""
    argv = [*(prefix or []), sys.executable, "-m", "emberlink", "worker", "--key", str(key), *args]
    proc = Process(argv, folder / f"{name}.log")
    try:
        ticket = Ticket.parse(proc.next_line(30))
    except BaseException:
        proc.close()
        raise
    return proc, ticket


def relay_worker_process(folder: Path, url: str, key: Path) -> tuple[Process, Ticket]:
    """`worker_process` on 127.0.0.1:0 admitting any client and serving through the relay at `url`."""
    return worker_process(folder, "worker", "--listen", "127.0.0.1:0", "--allow-any", "--relay", url, key=key)


def client_process(folder: Path, name: str, *args: str, prefix: list[str] | None = None) -> Process:
    """tests/relay/relay_client.py in its own process (stdin open for commands)."""
    argv = [*(prefix or []), sys.executable, "-m", "tests.relay.relay_client", *args]
    return Process(argv, folder / f"{name}.log", stdin=True, env=_with_tests_importable())


def _with_tests_importable() -> dict[str, str]:
    """os.environ with the repository root first on PYTHONPATH, so `-m tests.relay...` resolves."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *([path] if path else [])]))


@contextlib.contextmanager
def relay_worker(
    url: str,
    allow: AllowPolicy | None = None,
    *,
    grpc: bool = True,
    identity: Identity | None = None,
    certificate: Certificate | None = None,
    access: RelayAccess | None = None,
) -> Iterator[BackgroundWorker]:
    """An in-process worker serving through the relay at `url` (and on loopback gRPC)."""
    worker = BackgroundWorker(identity, allow=allow, grpc=grpc)
    ticket = Ticket(worker.node_id, ((worker.host, worker.port),) if worker.port else (), url)
    service = RelayService(worker.worker, url, ticket, certificate=certificate, access=access)
    try:
        worker.call(service.start())
        # start() returns before the beacon has subscribed to queries (it attaches in the
        # background), and a survey published before then goes unheard: wait for it here.
        worker.call(asyncio.wait_for(service.beacon.attached.wait(), 10))
        worker.relay = service  # type: ignore[attr-defined]
        yield worker
    finally:
        with contextlib.suppress(Exception):
            worker.call(service.stop(1.0))
        worker.stop()


def trust_workers(*node_ids: str, clusters: tuple[str, ...] = ()) -> Path:
    """Write this client's known-workers file (the path tests/relay/conftest.py put in the environment)."""
    path = Path(os.environ[KNOWN_WORKERS_ENV])
    lines = [*node_ids, *(f"@cluster {c}" for c in clusters)]
    path.write_text("# written by the test\n" + "".join(f"{line}\n" for line in lines))
    return path


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


class Eavesdropper:
    """Everything published on a NATS server (`>`), subjects, reply subjects and payloads, captured
    by a plain nats-py client on its own thread."""

    def __init__(self, url: str, *, creds: Path | None = None) -> None:
        self.url = url
        self.creds = creds
        self.messages: list[tuple[str, str, bytes]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._nc = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    async def _start(self) -> Client:
        seed = str(self.creds) if self.creds is not None else None
        nc = await nats.connect(self.url, allow_reconnect=False, nkeys_seed=seed)

        async def keep(msg: Msg) -> None:
            self.messages.append((msg.subject, msg.reply, bytes(msg.data)))

        await nc.subscribe(">", cb=keep)
        await nc.flush()
        return nc

    def everything(self) -> bytes:
        """All captured subjects, reply subjects and payloads, concatenated."""
        return b"\n".join(s.encode() + b" " + r.encode() + b" " + d for s, r, d in self.messages)

    def close(self) -> None:
        async def stop() -> None:
            await self._nc.flush()
            await self._nc.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


_NOT_SESSIONS = ("emberlink.node.", "emberlink.presence.", "emberlink.discover", "emberlink.i.", "_INBOX.")
_FRAGMENT = struct.Struct(">BI")  # a relayed message starts with kind and sequence number
_BEAT, _CLOSE, _MORE, _LAST = 2, 3, 0, 1


class Attacker:
    """Someone who can reach the relay (no credentials asked, or stolen ones with `>`): it sees every
    session's subjects and messages, and publishes what it likes on them, over and over, while on.

    Modes: "beat" (a heartbeat carrying the next sequence number), "close" (a close, likewise),
    "inject" (payload fragments with the next numbers), "replay" (the latest message again, and an
    older one: a duplicate and a reordering), "flood" (many messages of every size and shape).
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.mode: str | None = None
        self.published = 0
        self.subjects: set[str] = set()
        self._history: dict[str, list[bytes]] = {}
        self._rng = random.Random(7)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._nc = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self._task = asyncio.run_coroutine_threadsafe(self._attack(), self._loop)

    async def _start(self) -> Client:
        nc = await nats.connect(self.url, allow_reconnect=False)

        async def keep(msg: Msg) -> None:
            if msg.subject.startswith("emberlink.") and not msg.subject.startswith(_NOT_SESSIONS):
                history = self._history.setdefault(msg.subject, [])
                history.append(bytes(msg.data))
                del history[:-50]

        await nc.subscribe(">", cb=keep)
        await nc.flush()
        return nc

    def _forgeries(self, history: list[bytes]) -> list[bytes]:
        last = history[-1]
        if len(last) < _FRAGMENT.size:
            return []
        seq = _FRAGMENT.unpack_from(last)[1]
        nxt = [(seq + i) & 0xFFFFFFFF for i in (1, 2, 3)]
        rand = self._rng.randbytes
        if self.mode == "beat":
            return [_FRAGMENT.pack(_BEAT, s) for s in nxt]
        if self.mode == "close":
            return [_FRAGMENT.pack(_CLOSE, s) for s in nxt]
        if self.mode == "inject":
            return [_FRAGMENT.pack(_MORE, nxt[0]) + rand(100), _FRAGMENT.pack(_LAST, nxt[1]) + rand(300)]
        if self.mode == "replay":
            return [last, history[self._rng.randrange(len(history))]]
        if self.mode == "flood":
            shapes = [
                lambda: rand(self._rng.randrange(0, 64)),
                lambda: _FRAGMENT.pack(self._rng.randrange(256), self._rng.choice(nxt)) + rand(40),
                lambda: _FRAGMENT.pack(_LAST, self._rng.choice(nxt)) + rand(self._rng.randrange(20_000)),
                lambda: self._rng.choice(history),
            ]
            return [self._rng.choice(shapes)() for _ in range(50)]
        return []

    async def _attack(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            if self.mode is None:
                continue
            for subject, history in list(self._history.items()):
                forged = self._forgeries(history)
                for data in forged:
                    await self._nc.publish(subject, data)
                if forged:
                    self.published += len(forged)
                    self.subjects.add(subject)

    def close(self) -> None:
        self._task.cancel()

        async def stop() -> None:
            await self._nc.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
