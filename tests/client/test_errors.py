"""Bad input fails at the line that recorded it with a clear error; failed runs poison their results."""

from __future__ import annotations

import numpy as np
import pytest

import emberlink as el
from emberlink import Device, DeviceError, DTypeError, ExecutionError, ShapeError

F = el.nn.functional


def ones(dev: Device, *shape: int, dtype: str = "float32") -> el.Tensor:
    return dev.tensor(np.ones(shape, dtype=dtype))


# -- shapes, at the recording line ------------------------------------------------------------------


def test_broadcast_mismatch_names_both_shapes_before_anything_runs(dev: Device) -> None:
    a, b = ones(dev, 2, 3), ones(dev, 4)
    with pytest.raises(ShapeError, match=r"\(2, 3\).*\(4,\)"):
        a + b
    assert dev.stats()["pending_nodes"] == 0


def test_matmul_mismatch_names_both_shapes(dev: Device) -> None:
    with pytest.raises(ShapeError, match=r"\(2, 3\).*\(4, 5\)"):
        ones(dev, 2, 3) @ ones(dev, 4, 5)
    with pytest.raises(ShapeError):
        ones(dev, 3) @ ones(dev)


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda x: x.reshape(4, 4), r"cannot reshape \(2, 3\)"),
        (lambda x: x.reshape(-1, -1), "one -1"),
        (lambda x: x.reshape(5, -1), r"cannot reshape \(2, 3\)"),
        (lambda x: x.sum(axis=2), "out of range"),
        (lambda x: x.permute(0, 0), "not a permutation"),
        (lambda x: x.broadcast_to(4, 3, 2), r"cannot broadcast shape \(2, 3\)"),
        (lambda x: x.squeeze(0), "size is not 1"),
        (lambda x: x.expand_dims(4), "out of range"),
        (lambda x: el.concat([x, x.T], axis=0), "differ"),
        (lambda x: el.stack([x, x.T]), "not all equal"),
    ],
)
def test_shape_errors_are_raised_when_recording(dev: Device, fn, match: str) -> None:
    with pytest.raises(ShapeError, match=match):
        fn(ones(dev, 2, 3))


def test_cross_entropy_checks_shapes_and_label_dtype(dev: Device) -> None:
    with pytest.raises(ShapeError, match=r"\(4, 3\).*\(5,\)"):
        F.cross_entropy(ones(dev, 4, 3), dev.tensor(np.zeros(5, "int64")))
    with pytest.raises(DTypeError, match="int"):
        F.cross_entropy(ones(dev, 4, 3), ones(dev, 4))
    with pytest.raises(ValueError, match="reduction"):
        F.cross_entropy(ones(dev, 4, 3), dev.tensor(np.zeros(4, "int64")), reduction="avg")


# -- dtypes -----------------------------------------------------------------------------------------


def test_dtype_errors(dev: Device) -> None:
    x = ones(dev, 3)
    with pytest.raises(DTypeError, match="bool"):
        el.logical_and(x, x)
    with pytest.raises(DTypeError, match="logical_not"):
        _ = ~x
    with pytest.raises(DTypeError, match="complex64"):
        x.astype("complex64")
    with pytest.raises(DTypeError, match="indices"):
        x.take(ones(dev, 2))
    with pytest.raises(DTypeError):
        dev.zeros(3, dtype="float8")
    with pytest.raises(DTypeError, match="uint16"):
        dev.tensor(np.zeros(3, dtype="uint16"))
    with pytest.raises(DTypeError):
        dev.tensor(np.array(["a", "b"]))
    assert dev.tensor(np.zeros(3, dtype="uint16"), dtype="int32").dtype == "int32"


def test_unsupported_operands_are_type_errors(dev: Device) -> None:
    x = ones(dev, 3)
    with pytest.raises(TypeError, match=r"dev\.tensor"):
        x + np.ones(3)
    with pytest.raises(TypeError, match=r"dev\.tensor"):
        np.ones(3) * x
    with pytest.raises(TypeError):
        x + "a"
    with pytest.raises(TypeError):
        x @ 2.0
    assert (x == None) is False  # comparing with a non-operand falls back to identity
    with pytest.raises(TypeError, match="immutable"):
        x[0] = 1.0
    with pytest.raises(TypeError, match="where"):
        x[dev.tensor([True, False, True])]
    with pytest.raises(TypeError, match="integer Tensor"):
        x[[0, 1]]
    with pytest.raises(DTypeError, match="int64"):
        x * (2**70)
    with pytest.raises(TypeError, match="Device"):
        x.to("cpu")  # type: ignore[arg-type]


# -- devices ----------------------------------------------------------------------------------------


def test_operands_on_two_devices_need_an_explicit_move(dev: Device, device_factory) -> None:
    other = device_factory()
    try:
        with pytest.raises(DeviceError, match=r"t\.to\(device\)"):
            ones(dev, 2) + ones(other, 2)
    finally:
        other.close()


def test_every_op_on_a_closed_device_raises_device_error(device_factory) -> None:
    dev = device_factory()
    x = ones(dev, 2)
    y = x + 1.0
    dev.close()
    dev.close()  # idempotent
    assert dev.closed
    for fn in (
        lambda: x + 1.0,
        lambda: y.numpy(),
        lambda: float(x.sum()),
        lambda: dev.tensor([1.0]),
        lambda: dev.zeros(2),
        lambda: dev.sync(),
        lambda: dev.memory_stats(),
    ):
        with pytest.raises(DeviceError, match="closed"):
            fn()


def test_a_device_is_a_context_manager(device_factory) -> None:
    with device_factory() as dev:
        assert float(ones(dev, 2).sum()) == 2.0
    assert dev.closed
    with pytest.raises(DeviceError, match="closed"):
        dev.tensor([1.0])


def test_an_unplaced_parameter_asks_for_module_to(dev: Device) -> None:
    layer = el.nn.Linear(3, 2, seed=0)
    with pytest.raises(DeviceError, match=r"module\.to\(device\)"):
        layer(ones(dev, 1, 3))
    with pytest.raises(DeviceError, match=r"module\.to\(device\)"):
        layer.weight * 2.0


# -- failed computations ----------------------------------------------------------------------------


def test_reading_a_failed_result_raises_the_failure_with_the_op(dev: Device) -> None:
    x = dev.tensor([1.0, 2.0])
    bad = x[dev.tensor([5])]  # out of range: found only when it runs
    later = bad * 2.0
    with pytest.raises(ExecutionError, match="take"):
        bad.numpy()
    with pytest.raises(ExecutionError, match="take"):
        later.numpy()
    with pytest.raises(ExecutionError, match="take"):
        float((later + 1.0).sum())  # a graph reading a poisoned buffer passes the failure on
    assert float(x.sum()) == 3.0  # the device lives on


def test_sync_raises_the_first_failure_once(dev: Device) -> None:
    x = dev.tensor([1.0, 2.0])
    bad = x[dev.tensor([9])]
    with pytest.raises(ExecutionError, match="take"):
        dev.sync()
    dev.sync()
    with pytest.raises(ExecutionError):
        bad.numpy()


def test_other_results_of_a_failed_graph_are_poisoned_too(dev: Device) -> None:
    x = dev.tensor([1.0, 2.0])
    good = x * 3.0
    bad = x[dev.tensor([9])]
    with pytest.raises(ExecutionError):
        bad.numpy()
    with pytest.raises(ExecutionError):
        good.numpy()  # one graph, one failure: all of its outputs are lost
    np.testing.assert_array_equal((x * 3.0).numpy(), [3.0, 6.0])
