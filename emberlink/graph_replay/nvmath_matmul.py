"""The IR's float `matmul` through cuBLAS from nvmath-python, which CUDA graphs can capture; no op table.

CuPy refuses every cuBLAS call while a stream captures (its own matmul included); the same cuBLAS
routines called through nvmath-python's bindings capture and replay correctly. `Gemm` owns one
cuBLAS handle and one workspace per device, set up before any capture ("planned": cuBLAS then
allocates nothing while capturing), and computes what `numpy_backend._matmul` computes: operands
widened to the accumulation dtype (float16 to float32), NumPy's matmul rules (1-D operands,
broadcast batch dims), the result cast back. It calls `cublasGemmEx` and
`cublasGemmStridedBatchedEx` with the compute type and algorithm CuPy's own matmul picks
(`CUBLAS_COMPUTE_32F`/`64F`, no TF32), so results agree with the eager path to cuBLAS's rounding.

Row-major arrays are column-major transposes, so `C = A @ B` is computed as `C^T = B^T A^T`. An
operand is read where it lies whenever cuBLAS can address it: each matrix row-major or
column-major (a transposed view, as the backward pass makes them: `x.mT` of a contiguous `x`)
with a leading dimension of at least its width, and, for a batch, one stride from matrix to
matrix. So the backward pass of a convolution (`g @ cols.mT`), of attention (`q.mT @ g`) and of
a Linear layer on 3-D input read their big operands in place, where a copy would move them
twice more. Anything else (a batch broadcast along some axes only, matrices of one row or column,
negative strides) is copied into a contiguous array first, as `strided=False` does for all.
Integer matmuls are not cuBLAS's: the caller runs them with CuPy's own kernels.
"""

from __future__ import annotations

import itertools
import math
import weakref
from typing import Any

import numpy as np

WORKSPACE_BYTES = 32 << 20
"""cuBLAS's recommended workspace on Hopper; set explicitly so that a capture allocates nothing."""

FLOAT_DTYPES = ("float16", "float32", "float64")


def load() -> Any:
    """The `nvmath.bindings.cublas` module; ImportError (or what loading cuBLAS raises) if missing."""
    from nvmath.bindings import cublas

    return cublas


class Gemm:
    """cuBLAS matmuls for one device: a handle and a workspace, bound to a stream per run."""

    def __init__(self, xp: Any, cublas: Any, *, strided: bool = True) -> None:
        from nvmath import CudaDataType

        self._xp = xp
        self._strided = strided
        self._cublas = cublas
        self._handle = cublas.create()
        # Destroyed with this object, not at interpreter exit (the CUDA context may be gone by then).
        weakref.finalize(self, cublas.destroy, self._handle).atexit = False
        self._workspace = xp.empty(WORKSPACE_BYTES, dtype=np.uint8)
        self._n, self._t = int(cublas.Operation.N), int(cublas.Operation.T)
        self._algo = int(cublas.GemmAlgo.DEFAULT_TENSOR_OP)
        self._kinds = {
            "float32": (int(CudaDataType.CUDA_R_32F), int(cublas.ComputeType.COMPUTE_32F)),
            "float64": (int(CudaDataType.CUDA_R_64F), int(cublas.ComputeType.COMPUTE_64F)),
        }
        # alpha = 1, beta = 0 in host memory (cuBLAS's default pointer mode): read when a call is
        # made or captured, so they stay alive as long as this object.
        self._scalars = {d: (np.ones(1, d), np.zeros(1, d)) for d in ("float32", "float64")}

    @property
    def nbytes(self) -> int:
        return WORKSPACE_BYTES

    def bind(self, stream_ptr: int) -> None:
        """Make later calls run on (or be captured from) `stream_ptr`. Setting a stream resets
        cuBLAS's workspace to its default pool, so the workspace is set again after it."""
        self._cublas.set_stream(self._handle, stream_ptr)
        self._cublas.set_workspace(self._handle, self._workspace.data.ptr, WORKSPACE_BYTES)

    def matmul(self, a: Any, b: Any, out_dtype: str) -> Any:
        """`a @ b` as the reference computes it, for a float `out_dtype`."""
        xp = self._xp
        wide = "float32" if out_dtype == "float16" else out_dtype
        a = a.astype(wide, copy=False)
        b = b.astype(wide, copy=False)
        a2 = a[None, :] if a.ndim == 1 else a
        b2 = b[:, None] if b.ndim == 1 else b
        m, k = a2.shape[-2:]
        n = b2.shape[-1]
        batch = tuple(np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]))
        count = math.prod(batch)
        shape = batch + (m, n)
        if count == 0 or m == 0 or n == 0 or k == 0:
            c = xp.zeros(shape, dtype=wide)
        else:
            c = xp.empty(shape, dtype=wide)
            self._gemm(a2, b2, c, batch, m, n, k, wide)
        if a.ndim == 1:
            c = c.reshape(c.shape[:-2] + (n,))
        if b.ndim == 1:
            c = c.reshape(c.shape[:-1])
        return c.astype(out_dtype, copy=False)

    def _gemm(
        self, a: Any, b: Any, c: Any, batch: tuple[int, ...], m: int, n: int, k: int, dtype: str
    ) -> None:
        a_op, a_ld, a_stride, a = self._operand(a, batch)
        b_op, b_ld, b_stride, b = self._operand(b, batch)
        cuda_dtype, compute = self._kinds[dtype]
        one, zero = (s.ctypes.data for s in self._scalars[dtype])
        count = math.prod(batch)
        # C^T (n x m) = B^T (n x k) A^T (k x m), all column-major views of the row-major arrays.
        common = (self._handle, b_op, a_op, n, m, k, one)
        if count == 1:
            self._cublas.gemm_ex(
                *common,
                b.data.ptr, cuda_dtype, b_ld,
                a.data.ptr, cuda_dtype, a_ld,
                zero, c.data.ptr, cuda_dtype, n,
                compute, self._algo,
            )  # fmt: skip
        else:
            self._cublas.gemm_strided_batched_ex(
                *common,
                b.data.ptr, cuda_dtype, b_ld, b_stride,
                a.data.ptr, cuda_dtype, a_ld, a_stride,
                zero, c.data.ptr, cuda_dtype, n, m * n,
                count, compute, self._algo,
            )  # fmt: skip

    def _operand(self, x: Any, batch: tuple[int, ...]) -> tuple[int, int, int, Any]:
        """`(op, leading dim, batch stride, array)` of a `(..., rows, cols)` operand.

        One matrix for the whole batch (its batch dims all 1) has batch stride 0. An operand
        cuBLAS can address where it lies (`addressing`) is passed as it is; any other is broadcast
        to `batch` and made contiguous, with stride rows*cols.
        """
        xp = self._xp
        rows, cols = x.shape[-2:]
        single = math.prod(x.shape[:-2]) == 1
        if single:
            x = x.reshape(rows, cols)
        if self._strided:
            found = addressing(x.shape, x.strides, x.itemsize, () if single else batch)
            if found is not None:
                transposed, ld, stride = found
                return (self._t if transposed else self._n), ld, stride, x
        if single:
            return self._n, max(1, cols), 0, xp.ascontiguousarray(x)
        full = xp.ascontiguousarray(xp.broadcast_to(x, batch + (rows, cols)))
        return self._n, max(1, cols), rows * cols, full


def addressing(
    shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, batch: tuple[int, ...]
) -> tuple[bool, int, int] | None:
    """How cuBLAS reads an operand of `shape` and byte `strides` in place, for a batch of shape
    `batch` (`()`: one matrix, `shape` 2-D): `(transposed, leading dim, batch stride)` in
    elements, or None when it cannot (then the operand is copied).

    A matrix is row-major (unit column stride; op N, leading dim = row stride) or column-major
    (unit row stride; op T, leading dim = column stride), the leading dim at least its width
    (cols, or rows if transposed). Matrices of one row or one column are left to the copy (their
    unit stride is ambiguous). A batch must have the operand's own batch shape and collapse to one
    positive stride; a lone matrix gets stride 0.
    """
    rows, cols = shape[-2:]
    row_stride, col_stride = strides[-2:]
    if rows < 2 or cols < 2 or row_stride % itemsize or col_stride % itemsize:
        return None
    if col_stride == itemsize and row_stride >= cols * itemsize:
        transposed, ld = False, row_stride // itemsize
    elif row_stride == itemsize and col_stride >= rows * itemsize:
        transposed, ld = True, col_stride // itemsize
    else:
        return None
    if not batch:
        return transposed, ld, 0
    if tuple(shape[:-2]) != batch:
        return None
    dims = [(d, s) for d, s in zip(shape[:-2], strides[:-2]) if d != 1]
    if not dims:
        return transposed, ld, 0
    for (_, outer), (inner_dim, inner) in itertools.pairwise(dims):
        if outer != inner * inner_dim:
            return None
    stride = dims[-1][1]
    if stride <= 0 or stride % itemsize:
        return None
    return transposed, ld, stride // itemsize


__all__ = ["FLOAT_DTYPES", "WORKSPACE_BYTES", "Gemm", "addressing", "load"]
