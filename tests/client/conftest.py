"""The `dev` fixture: every tensor test runs once per device kind in DEVICE_KINDS.

"cpu" is this process's CPU; "remote-memory", "remote-grpc" and "remote-tcp" are sessions with a
worker in this process (`emberlink.testing`), over the in-memory transport, gRPC and the raw TCP
transport on loopback (over tcp, a read waited for at once is done by the reading thread). Each test
module gets its own worker (`remote_worker`, started on first use); each device is its own
session. A tensor test must take `dev` rather than call `Device.cpu()` itself; only tests about
the local device as such make their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

import emberlink.testing
from emberlink import Device

DEVICE_KINDS = ["cpu", "remote-memory", "remote-grpc", "remote-tcp"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Tests that need a fresh device of the same kind (a second one, or one they close
    # themselves) take `device_factory` directly.
    if "device_factory" in metafunc.fixturenames:
        metafunc.parametrize("device_factory", DEVICE_KINDS, indirect=True)


@pytest.fixture(scope="module")
def remote_worker() -> Iterator[emberlink.testing.InProcessWorker]:
    """The worker of this module's remote devices (memory, gRPC and raw TCP listeners)."""
    with emberlink.testing.worker(grpc=True, tcp=True) as worker:
        yield worker


@pytest.fixture
def device_factory(request: pytest.FixtureRequest) -> Callable[[], Device]:
    """Returns a fresh, open Device of the test's kind on each call."""
    kind: str = request.param
    if kind == "cpu":
        return Device.cpu
    worker: emberlink.testing.InProcessWorker = request.getfixturevalue("remote_worker")
    transports: dict[str, emberlink.testing.Transport] = {"remote-grpc": "grpc", "remote-tcp": "tcp"}
    transport = transports.get(kind, "memory")
    return lambda: worker.device(transport=transport)


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
