"""The `dev` fixture: every tensor test runs once per device kind in DEVICE_FACTORIES.

Other suites append their kinds (e.g. "remote-memory", "remote-grpc") to DEVICE_FACTORIES; the
list is read when tests are collected, so appending at import time of any conftest works. A
tensor test must take `dev` rather than call `Device.cpu()` itself; only tests about the local
device as such make their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from emberlink import Device

DEVICE_FACTORIES: list[tuple[str, Callable[[], Device]]] = [("cpu", Device.cpu)]
"""(name, factory) pairs; a factory returns a fresh, open Device, which the fixture closes."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Tests that need a fresh device of the same kind (a second one, or one they close
    # themselves) take `device_factory` directly.
    if "device_factory" in metafunc.fixturenames:
        metafunc.parametrize(
            "device_factory", [f for _, f in DEVICE_FACTORIES], ids=[n for n, _ in DEVICE_FACTORIES]
        )


@pytest.fixture
def dev(device_factory: Callable[[], Device]) -> Iterator[Device]:
    device = device_factory()
    try:
        yield device
    finally:
        device.close()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# -- remote devices (appended by the server suite) -----------------------------------------------------
# Every tensor test also runs against a worker in this process: over the in-memory transport (the
# memory Link is single-loop, so the worker serves on the client's I/O loop) and over gRPC on
# loopback. One worker serves the whole test run; each device is its own session.

import atexit
import os

from emberlink.client.loop import io_loop
from emberlink.client.remote import connect_link, connect_ticket
from emberlink.protocol.identity import Identity
from emberlink.protocol.ticket import Ticket
from emberlink.server.background import BackgroundWorker
from emberlink.transport import memory

_REMOTE: dict[str, object] = {}


def _remote_worker() -> tuple[BackgroundWorker, Identity]:
    if "worker" not in _REMOTE:
        worker = BackgroundWorker(grpc=True, memory=True, loop_thread=io_loop())
        atexit.register(worker.stop)
        _REMOTE["worker"], _REMOTE["identity"] = worker, Identity.generate(os.urandom)
    return _REMOTE["worker"], _REMOTE["identity"]  # type: ignore[return-value]


def _remote_memory() -> Device:
    worker, identity = _remote_worker()
    executor = connect_link(
        lambda: memory.connect(worker.memory_name, hub=worker.hub),  # type: ignore[arg-type]
        worker.node_id,
        identity,
        path="memory",
        loop_thread=worker.loop_thread,
    )
    return Device(executor, "remote-memory")


def _remote_grpc() -> Device:
    worker, identity = _remote_worker()
    return Device(connect_ticket(Ticket.parse(worker.ticket), identity), "remote-grpc")


DEVICE_FACTORIES += [("remote-memory", _remote_memory), ("remote-grpc", _remote_grpc)]
