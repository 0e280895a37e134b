"""The backend registry: device strings, registration, and a third backend that works by registration alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

import emberlink.testing
from emberlink import Device
from emberlink.client.remote import RemoteExecutor
from emberlink.errors import ConfigError, DeviceError
from emberlink.graph_replay.backend import Array
from emberlink.graph_replay.backends import (
    DeviceSpec,
    create_backend,
    device_kinds,
    parse_device,
    register,
    unregister,
)
from emberlink.graph_replay.ir import Scalar
from emberlink.graph_replay.numpy_backend import NumpyBackend
from emberlink.graph_replay.plan import Plan
from emberlink.server.presence import free_memory

from ..training import mlp_losses
from .cases import CASE_IDS, CASES, Case, assert_close, run_case


class ReferenceBackend(NumpyBackend):
    """The NumPy reference under another name: the third backend."""

    name = "reference"


class IndexedReference(NumpyBackend):
    """The NumPy reference as an indexed kind (`multi:N`), remembering its index."""

    name = "multi"

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index


class DeviceThreadOnly(NumpyBackend):
    """Answers that no work may run inline, and records the threads that bind it and run on it."""

    name = "device-thread-only"
    runs_inline = False

    def __init__(self) -> None:
        super().__init__()
        self.bound: list[str] = []
        self.ran: list[str] = []

    def bind_thread(self) -> None:
        self.bound.append(threading.current_thread().name)

    def run(self, plan: Plan, inputs: Sequence[Array], bindings: Sequence[Scalar]) -> list[Array]:
        self.ran.append(threading.current_thread().name)
        return super().run(plan, inputs, bindings)


@pytest.fixture(scope="module")
def reference() -> Iterator[str]:
    register("reference", ReferenceBackend)
    try:
        yield "reference"
    finally:
        unregister("reference")


# -- device strings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "spec"),
    [("cpu", DeviceSpec("cpu")), ("cuda", DeviceSpec("cuda", 0)), ("cuda:0", DeviceSpec("cuda", 0))]
    + [("cuda:12", DeviceSpec("cuda", 12))],
)
def test_device_strings_parse_to_kind_and_index(text: str, spec: DeviceSpec) -> None:
    assert parse_device(text) == spec
    assert str(parse_device(str(spec))) == str(spec)


@pytest.mark.parametrize("text", ["tpu:0", "cpu:0", "cuda:", "CPU", "cuda:1234", "cuda:-1", "", " cpu"])
def test_an_unknown_or_malformed_device_string_is_a_config_error_naming_the_kinds(text: str) -> None:
    with pytest.raises(ConfigError, match=r"device must be cpu or cuda:N, got"):
        parse_device(text)


def test_the_built_in_kinds_create_their_backends() -> None:
    assert type(create_backend("cpu")) is NumpyBackend
    assert str(DeviceSpec("cuda", 1)) == "cuda:1" and device_kinds() == "cpu or cuda:N"


def test_a_kind_is_registered_once_and_must_be_well_formed() -> None:
    with pytest.raises(ConfigError, match="already registered"):
        register("cpu", NumpyBackend)
    with pytest.raises(ConfigError, match="lowercase"):
        register("Big-Kind", NumpyBackend)
    with pytest.raises(ConfigError, match="package.module:Class"):
        register("lazy", "emberlink.graph_replay.numpy_backend.NumpyBackend")
    assert device_kinds() == "cpu or cuda:N"


def test_an_indexed_kind_calls_its_class_with_the_index() -> None:
    register("multi", IndexedReference, indexed=True)
    try:
        assert device_kinds() == "cpu, cuda:N or multi:N"
        backend = create_backend("multi:3")
        assert isinstance(backend, IndexedReference) and backend.index == 3
        assert create_backend(parse_device("multi")).index == 0  # type: ignore[attr-defined]
    finally:
        unregister("multi")
    with pytest.raises(ConfigError, match="cpu or cuda:N"):
        parse_device("multi:3")


def test_a_device_the_backend_cannot_use_is_a_device_error_naming_the_device() -> None:
    class Missing(NumpyBackend):
        def __init__(self, index: int) -> None:
            raise DeviceError(f"no such unit {index}")

    register("missing", Missing, indexed=True)
    try:
        with pytest.raises(DeviceError, match=r"^device missing:2: no such unit 2$"):
            create_backend("missing:2")
    finally:
        unregister("missing")


# -- a third backend, by registration alone --------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_registered_backend_runs_every_op_case(reference: str, case: Case) -> None:
    backend = create_backend(reference)
    assert type(backend) is ReferenceBackend
    assert case.expect is not None
    assert_close(run_case(backend, case), case.expect(*case.args), case.id)


def test_a_registered_backend_is_a_local_device(reference: str) -> None:
    with Device.cpu() as cpu:
        expected = mlp_losses(cpu, 4)
    with Device.local(reference) as dev:
        assert str(dev) == "reference" and dev.stats()["backend"] == "reference"
        assert mlp_losses(dev, 4) == expected


def test_a_registered_backend_serves_a_worker(reference: str) -> None:
    with Device.cpu() as cpu:
        expected = mlp_losses(cpu, 4)
    with emberlink.testing.worker(device=reference) as w, w.device() as dev:
        assert mlp_losses(dev, 4) == expected
        executor = dev._executor
        assert isinstance(executor, RemoteExecutor)
        stats = executor.worker_stats()
        assert (stats["device"], stats["backend"]) == ("reference", "reference")


# -- questions the worker asks its backend -----------------------------------------------------------------


def test_a_backend_that_may_not_run_inline_gets_every_batch_on_its_bound_device_thread() -> None:
    backend = DeviceThreadOnly()
    with emberlink.testing.worker(backend=backend) as w, w.device() as dev:
        x = dev.tensor(np.ones(4, np.float32))
        for _ in range(10):  # light, repeated batches: NumPy's would run on the event loop
            x = x * 1.0
            assert float(x.sum()) == 4.0
    assert backend.bound == ["emberlink-cpu"]
    assert len(backend.ran) >= 10 and set(backend.ran) == {"emberlink-cpu"}


def test_free_memory_is_the_backends_figure_or_the_hosts() -> None:
    class Reports(NumpyBackend):
        def free_bytes(self) -> int:
            return 12345

    class Fails(NumpyBackend):
        def free_bytes(self) -> int:
            raise RuntimeError("no driver")

    assert free_memory(Reports()) == 12345
    assert free_memory(Fails()) == 0
    assert free_memory(NumpyBackend()) > 0  # the host's available memory


@pytest.mark.gpu
def test_an_in_process_worker_serves_a_gpu() -> None:
    pytest.importorskip("cupy")
    with Device.cpu() as cpu:
        expected = mlp_losses(cpu, 4)
    with emberlink.testing.worker(device="cuda") as w, w.device() as dev:
        np.testing.assert_allclose(mlp_losses(dev, 4), expected, rtol=1e-4)
        executor = dev._executor
        assert isinstance(executor, RemoteExecutor)
        stats = executor.worker_stats()
        assert (stats["device"], stats["backend"]) == ("cuda:0", "cupy")
        assert 0 < free_memory(w.worker.device.backend)
