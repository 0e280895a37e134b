"""uint8, int8 and int16 end to end on every device kind: upload, promotion, casts, reductions, indices."""

from __future__ import annotations

import numpy as np
import pytest

import emberlink as el
from emberlink import Device
from emberlink.errors import ExecutionError

F = el.nn.functional
SMALL_INTS = ("uint8", "int8", "int16")


@pytest.mark.parametrize("dtype", SMALL_INTS)
def test_small_int_tensor_keeps_its_dtype_and_bytes_through_the_device(dev: Device, dtype: str) -> None:
    info = np.iinfo(dtype)
    a = np.array([[info.min, 0, 1], [info.max, info.max - 1, 7]], dtype)
    t = dev.tensor(a)
    assert t.dtype == dtype
    got = (t + 0).numpy()  # through a graph, not only the upload
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, a)


def test_uint8_image_batch_becomes_float32_in_zero_one(dev: Device) -> None:
    imgs = np.random.default_rng(0).integers(0, 256, (4, 8, 8), dtype=np.uint8)
    x = dev.tensor(imgs).astype("float32") / 255
    assert x.dtype == "float32"
    np.testing.assert_allclose(x.numpy(), imgs.astype(np.float32) / np.float32(255), rtol=1e-7)


def test_uint8_with_a_signed_int_promotes_to_one_holding_both_ranges(dev: Device) -> None:
    u = dev.tensor(np.array([200, 0, 255], np.uint8))
    s8 = dev.tensor(np.array([-100, -1, 127], np.int8))
    s16 = dev.tensor(np.array([-300, 1, 1000], np.int16))
    total = u + s8
    assert total.dtype == "int16"
    np.testing.assert_array_equal(total.numpy(), [100, -1, 382])
    assert (u * s16).dtype == "int16"
    assert (s8 + s16).dtype == "int16"
    assert (u + dev.tensor(np.array([1, 2, 3], np.int32))).dtype == "int32"
    assert (u + 1).dtype == "uint8" and (u * 0.5).dtype == "float32"


def test_comparing_uint8_with_int8_compares_values_not_bits(dev: Device) -> None:
    u = dev.tensor(np.array([200, 0, 127], np.uint8))
    s = dev.tensor(np.array([-56, 0, 127], np.int8))  # -56 has the bits of 200
    np.testing.assert_array_equal((u > s).numpy(), [True, False, False])
    np.testing.assert_array_equal((u == s).numpy(), [False, True, True])


@pytest.mark.parametrize("dtype", SMALL_INTS)
def test_sum_of_small_ints_is_int64_and_does_not_overflow(dev: Device, dtype: str) -> None:
    a = np.full((1000,), np.iinfo(dtype).max, dtype)
    s = dev.tensor(a).sum()
    assert s.dtype == "int64"
    assert int(s) == 1000 * int(np.iinfo(dtype).max)
    m = dev.tensor(a).mean()
    assert m.dtype == "float32" and float(m) == pytest.approx(float(np.iinfo(dtype).max))


def test_max_and_argmax_of_small_ints_keep_dtype_and_give_int64(dev: Device) -> None:
    a = np.array([[3, -7, 12], [-128, 127, 0]], np.int8)
    x = dev.tensor(a)
    assert x.max(axis=1).dtype == "int8"
    np.testing.assert_array_equal(x.max(axis=1).numpy(), [12, 127])
    assert x.argmin(axis=1).dtype == "int64"
    np.testing.assert_array_equal(x.argmin(axis=1).numpy(), [1, 0])


def test_astype_to_and_from_small_ints_follows_numpy(dev: Device) -> None:
    f = np.array([-3.7, 0.2, 100.9, 250.0], np.float32)
    x = dev.tensor(f)
    for dtype in ("int8", "int16"):
        np.testing.assert_array_equal(x.astype(dtype).numpy(), f.astype(dtype))
    big = np.array([-300, 255, 256, 1000], np.int16)
    np.testing.assert_array_equal(dev.tensor(big).astype("uint8").numpy(), big.astype(np.uint8))
    np.testing.assert_array_equal(dev.tensor(big).astype("float16").numpy(), big.astype(np.float16))


def test_creation_functions_make_small_int_tensors(dev: Device) -> None:
    np.testing.assert_array_equal(dev.zeros((2, 2), dtype="int8").numpy(), np.zeros((2, 2), np.int8))
    np.testing.assert_array_equal(dev.full((3,), 255, dtype="uint8").numpy(), np.full(3, 255, np.uint8))
    np.testing.assert_array_equal(
        dev.arange(0, 10, 3, dtype="int16").numpy(), np.arange(0, 10, 3, dtype=np.int16)
    )


@pytest.mark.parametrize("dtype", SMALL_INTS)
def test_small_int_indices_and_labels_work_like_int64(dev: Device, dtype: str) -> None:
    table = np.arange(300 * 2, dtype=np.float32).reshape(300, 2)
    k = np.array([min(int(np.iinfo(dtype).max), 299), 0, 3], dtype)  # 299 for int16, 255, 127
    np.testing.assert_array_equal(dev.tensor(table).take(dev.tensor(k), axis=0).numpy(), table[k])
    # 255 classes and more: the labels are compared in int64, so nothing wraps at 256.
    np.testing.assert_array_equal(
        F.one_hot(dev.tensor(k), 300).numpy(), np.eye(300, dtype=np.float32)[k.astype(np.int64)]
    )
    logits = np.random.default_rng(1).standard_normal((3, 300)).astype(np.float32)
    want = F.cross_entropy(dev.tensor(logits), dev.tensor(k.astype(np.int64)))
    got = F.cross_entropy(dev.tensor(logits), dev.tensor(k))
    assert float(got) == pytest.approx(float(want), rel=1e-6)


def test_a_float_model_trains_on_uint8_input(dev: Device) -> None:
    imgs = np.random.default_rng(2).integers(0, 256, (8, 16), dtype=np.uint8)
    labels = np.arange(8) % 3
    model = el.nn.Linear(16, 3, seed=0, device=dev)
    loss = F.cross_entropy(model(dev.tensor(imgs).astype("float32") / 255), dev.tensor(labels))
    loss.backward()
    assert model.weight.grad is not None and model.weight.grad.dtype == "float32"
    assert np.isfinite(model.weight.grad.numpy()).all()


def test_an_int_scalar_outside_a_uint8_range_fails_when_the_step_runs(dev: Device) -> None:
    u = dev.tensor(np.array([1, 2], np.uint8))
    with pytest.raises(ExecutionError, match="300"):
        (u + 300).numpy()


@pytest.mark.gpu
def test_small_ints_on_cuda_match_the_cpu() -> None:
    pytest.importorskip("cupy")
    imgs = np.random.default_rng(0).integers(0, 256, (8, 64), dtype=np.uint8)
    labels = np.array([255, 0, 17], np.uint8)
    got = []
    for make in (Device.cpu, lambda: Device.cuda(0)):
        with make() as dev:
            x, u = dev.tensor(imgs), dev.tensor(imgs[0])
            s = dev.tensor(imgs[1].astype(np.int8))
            got.append(
                [
                    (x.astype("float32") / 255).numpy(),
                    (u + s).numpy(),
                    (u > s).numpy(),
                    x.sum(axis=1).numpy(),
                    F.one_hot(dev.tensor(labels), 300).numpy(),
                ]
            )
    for a, b in zip(got[0], got[1], strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(b, a, rtol=1e-6)
