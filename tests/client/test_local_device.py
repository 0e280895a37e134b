"""The local device itself: constructors, what Device.remote hands its address to, stats, and LocalExecutor."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest

import emberlink as el
from emberlink import Device, DeviceError, ExecutionError, UnknownTensor
from emberlink.client import address as address_module
from emberlink.client.executor import Call
from emberlink.client.local import LocalExecutor
from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.graph_replay.numpy_backend import NumpyBackend


def test_cpu_device_names_itself() -> None:
    with Device.cpu() as dev:
        assert str(dev) == "cpu" and "cpu" in repr(dev)
        assert dev.stats()["backend"] == "numpy"


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_cuda_without_cupy_says_what_to_install() -> None:
    with pytest.raises(DeviceError, match=r"emberlink\[cuda13\].*emberlink\[cuda12\]"):
        Device.cuda(0)


@pytest.mark.gpu
def test_cuda_device_runs_a_step() -> None:
    pytest.importorskip("cupy")
    a = np.arange(6, dtype="float32").reshape(2, 3)
    with Device.cuda(0) as dev:
        x = dev.tensor(a)
        np.testing.assert_allclose((x @ x.T).numpy(), a @ a.T)
        assert dev.memory_stats()["pool_bytes"] > 0


def test_remote_opens_its_address_through_open_remote(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def open_remote(
        address: str, *, key: str | None, timeout: float, resume_window: float | None
    ) -> LocalExecutor:
        calls.append((address, key, timeout, resume_window))
        return LocalExecutor(NumpyBackend())

    monkeypatch.setattr(address_module, "open_remote", open_remote)
    with Device.remote("emberlink://abc@host:1", key="/tmp/k", timeout=5.0, resume_window=3.0) as dev:
        assert float(dev.tensor([1.0, 2.0]).sum()) == 3.0
        assert "emberlink://abc@host:1" in str(dev)
    assert calls == [("emberlink://abc@host:1", "/tmp/k", 5.0, 3.0)]


def test_local_stats_have_the_public_keys_and_count_plan_reuse() -> None:
    with Device.cpu() as dev:
        x = dev.tensor([1.0, 2.0])
        for _ in range(3):
            float((x * 2.0).sum())
        stats = dev.stats()
        assert stats["bytes_sent"] == stats["bytes_received"] == stats["round_trips"] == 0
        assert stats["graphs_registered"] == 1 and stats["graph_replays"] == 2
        mem = dev.memory_stats()
        assert set(mem) >= {"in_use_bytes", "peak_bytes", "pool_bytes"}
        assert mem["in_use_bytes"] >= 8


def _double_graph() -> Graph:
    return Graph(
        inputs=(TensorSpec("float32", (2,)),),
        bindings=("float",),
        nodes=(Node("multiply", (0, 1)),),
        outputs=(2,),
    )


def test_local_executor_runs_reads_and_drops() -> None:
    ex = LocalExecutor(NumpyBackend())
    ex.upload(1, np.array([1.0, 2.0], dtype="float32"))
    ex.execute(_double_graph(), b"g" * 16, Call((1,), (3.0,), (2,)))
    out = ex.read(2).result()
    np.testing.assert_array_equal(out, [3.0, 6.0])
    out[0] = 99.0  # the caller's copy
    np.testing.assert_array_equal(ex.read(2).result(), [3.0, 6.0])
    ex.drop([1, 2, 12345])
    with pytest.raises(UnknownTensor):
        ex.read(2).result()
    ex.sync()
    ex.close()
    ex.close()


def test_local_executor_poisons_outputs_and_passes_poison_on() -> None:
    ex = LocalExecutor(NumpyBackend())
    ex.upload(1, np.array([1.0, 2.0], dtype="float32"))
    take = Graph(
        inputs=(TensorSpec("float32", (2,)), TensorSpec("int64", (1,))),
        bindings=(),
        nodes=(Node("take", (0, 1), (("axis", 0),)),),
        outputs=(2,),
    )
    ex.upload(2, np.array([7]))
    ex.execute(take, b"t" * 16, Call((1, 2), (), (3,)))
    with pytest.raises(ExecutionError, match="take"):
        ex.read(3).result()
    ex.execute(_double_graph(), b"g" * 16, Call((3,), (2.0,), (4,)))
    with pytest.raises(ExecutionError, match="take"):
        ex.read(4).result()
    with pytest.raises(ExecutionError, match="take"):
        ex.sync()
    ex.sync()
    ex.upload(3, np.zeros(2, dtype="float32"))  # a new upload replaces the poison
    np.testing.assert_array_equal(ex.read(3).result(), [0.0, 0.0])


def test_public_namespace_exports_the_api() -> None:
    for name in ("Device", "Tensor", "nn", "optim", "no_grad", "errors", "ShapeError", "ExecutionError"):
        assert hasattr(el, name)
    assert el.errors.DeviceError is DeviceError


class _StagingExecutor(LocalExecutor):
    """A LocalExecutor that offers host memory for uploads, as Device.cuda's does (page-locked)."""

    def __init__(self) -> None:
        super().__init__(NumpyBackend())
        self.offered: list[np.ndarray] = []

    def host_array(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray | None:
        out = np.empty(shape, dtype)
        self.offered.append(out)
        return out


def test_a_batch_goes_into_the_host_memory_its_executor_offers_as_a_copy() -> None:
    ex = _StagingExecutor()
    data = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]  # not contiguous: copyto handles it
    want = data.copy()
    with Device(ex, "staging") as dev:
        x = dev.tensor(data)
        data[...] = -1  # the tensor holds a copy, made when it was created
        assert [a.shape for a in ex.offered] == [(3, 2)]
        np.testing.assert_array_equal(ex.offered[0], want)
        np.testing.assert_array_equal((x * 2.0).numpy(), want * 2)


def test_local_executors_offer_no_host_memory_without_captured_graphs() -> None:
    assert LocalExecutor(NumpyBackend()).host_array((1024, 1024), np.dtype(np.float32)) is None
