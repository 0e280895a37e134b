"""cuBLAS matmuls through nvmath-python read strided operands in place (nvmath_matmul.py).

`addressing` is pure and checked here on any machine: whatever it lets cuBLAS read in place, read
back by its rules from the operand's first element, must be the operand. The GPU tests run the
same views through cuBLAS, in place and copied, against NumPy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from emberlink.graph_replay.nvmath_matmul import addressing

_SHAPE = (4, 5, 6, 7)
_BASE = np.arange(np.prod(_SHAPE), dtype=np.float32).reshape(_SHAPE)

VIEWS: dict[str, tuple[Callable[[Any], Any], bool]] = {
    # name: (the view of a base array of _SHAPE, NumPy's or CuPy's; whether cuBLAS reads it in place)
    "contiguous": (lambda b: b, True),
    "last-two-swapped": (lambda b: b.transpose(0, 1, 3, 2), True),  # x.mT: a backward pass's operand
    "column-slice": (lambda b: b[:, :, :, 1:5], True),  # rows longer than the matrix: a leading dim
    "transposed-column-slice": (lambda b: b[:, :, :, 1:5].transpose(0, 1, 3, 2), True),
    "batch-slice": (lambda b: b[1:3], True),
    "heads-swapped-with-length": (lambda b: b.transpose(0, 2, 1, 3), False),  # no one batch stride
    "every-other-row": (lambda b: b[:, :, ::2], True),
    "every-other-column": (lambda b: b[:, :, :, ::2], False),  # no unit stride
    "reversed-batch": (lambda b: b[::-1], False),
    "one-row": (lambda b: b[:, :, :1], False),  # left to the copy
}


def _read_back(x: np.ndarray, transposed: bool, ld: int, stride: int, batch: tuple[int, ...]) -> np.ndarray:
    """The operand as cuBLAS reads it by (op, leading dim, batch stride), from its first element."""
    rows, cols = x.shape[-2:]
    item = x.itemsize
    per_matrix = (item, ld * item) if transposed else (ld * item, item)
    count = int(np.prod(batch)) if batch else 1
    flat = np.lib.stride_tricks.as_strided(x, (count, rows, cols), (stride * item, *per_matrix))
    return flat.reshape(*batch, rows, cols)


@pytest.mark.parametrize("name", VIEWS)
def test_what_cublas_reads_in_place_is_the_operand(name: str) -> None:
    view, in_place = VIEWS[name]
    x = view(_BASE)
    batch = x.shape[:-2]
    found = addressing(x.shape, x.strides, x.itemsize, batch)
    assert (found is not None) == in_place, found
    if found is not None:
        np.testing.assert_array_equal(_read_back(x, *found, batch), x)


def test_a_lone_matrix_has_batch_stride_zero_and_may_be_transposed() -> None:
    w = _BASE[0, 0]
    assert addressing(w.shape, w.strides, w.itemsize, ()) == (False, 7, 0)
    assert addressing(w.T.shape, w.T.strides, w.itemsize, ()) == (True, 7, 0)


def test_an_operand_broadcast_along_some_batch_axes_is_copied() -> None:
    x = _BASE[:1]  # batch (1, 5) against (4, 5)
    assert addressing(x.shape, x.strides, x.itemsize, (4, 5)) is None


def test_a_batch_axis_of_size_one_does_not_break_the_stride() -> None:
    x = _BASE[:, 2:3]  # (4, 1, 6, 7): its size-1 axis has any stride
    found = addressing(x.shape, x.strides, x.itemsize, (4, 1))
    assert found == (False, 7, 5 * 6 * 7)
    np.testing.assert_array_equal(_read_back(x, *found, (4, 1)), x)


# -- on a GPU ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemms() -> Any:
    pytest.importorskip("nvmath")
    import cupy

    from emberlink.graph_replay.nvmath_matmul import Gemm, load

    cublas = load()
    pair = Gemm(cupy, cublas), Gemm(cupy, cublas, strided=False)
    for gemm in pair:
        gemm.bind(cupy.cuda.get_current_stream().ptr)
    return cupy, pair


@pytest.mark.gpu
@pytest.mark.parametrize("name", VIEWS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_strided_operand_in_place_gives_the_copied_values(gemms: Any, name: str, side: str) -> None:
    cupy, (strided, copying) = gemms
    rng = np.random.default_rng(0)
    base = rng.standard_normal(_SHAPE).astype(np.float32)
    view, _ = VIEWS[name]
    host = view(base)
    operand = view(cupy.asarray(base))
    assert operand.strides == host.strides
    rows, cols = host.shape[-2:]
    batch = host.shape[:-2]
    other = rng.standard_normal((*batch, cols, 3) if side == "left" else (*batch, 2, rows)).astype(np.float32)
    pair = (operand, cupy.asarray(other)) if side == "left" else (cupy.asarray(other), operand)
    want = np.matmul(host, other) if side == "left" else np.matmul(other, host)
    got_in_place = cupy.asnumpy(strided.matmul(*pair, "float32"))
    got_copied = cupy.asnumpy(copying.matmul(*pair, "float32"))
    np.testing.assert_allclose(got_in_place, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got_in_place, got_copied, rtol=1e-6, atol=1e-6)
