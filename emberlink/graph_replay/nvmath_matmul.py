"""The IR's float `matmul` through cuBLAS from nvmath-python, which CUDA graphs can capture; no op table.

CuPy refuses every cuBLAS call while a stream captures (its own matmul included); the same cuBLAS
routines called through nvmath-python's bindings capture and replay correctly. `Gemm` owns one
cuBLAS handle and one workspace per device, set up before any capture ("planned": cuBLAS then
allocates nothing while capturing), and computes what `numpy_backend._matmul` computes: operands
widened to the accumulation dtype (float16 to float32), NumPy's matmul rules (1-D operands,
broadcast batch dims), the result cast back. It calls `cublasGemmEx` and
`cublasGemmStridedBatchedEx` with the compute type and algorithm CuPy's own matmul picks
(`CUBLAS_COMPUTE_32F`/`64F`, no TF32), so results agree with the eager path to cuBLAS's rounding.

Row-major arrays are column-major transposes, so `C = A @ B` is computed as `C^T = B^T A^T`. A
2-D operand that is a transposed contiguous array (as the backward pass makes them) is read
through cuBLAS's transpose flag, without a copy; anything else not contiguous is copied first.
Integer matmuls are not cuBLAS's: the caller runs them with CuPy's own kernels.
"""

from __future__ import annotations

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

    def __init__(self, xp: Any, cublas: Any) -> None:
        from nvmath import CudaDataType

        self._xp = xp
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
        """`(op, leading dim, batch stride, array)` of a `(..., rows, cols)` row-major operand.

        One matrix for the whole batch (its batch dims all 1) has batch stride 0; a batched one is
        broadcast to `batch` and made contiguous, with stride rows*cols.
        """
        xp = self._xp
        rows, cols = x.shape[-2:]
        if math.prod(x.shape[:-2]) == 1:
            mat = x.reshape(rows, cols)
            item = mat.itemsize
            if mat.flags.c_contiguous:
                return self._n, max(1, cols), 0, mat
            if mat.strides[0] == item and mat.strides[1] == rows * item:  # a transposed contiguous array
                return self._t, max(1, rows), 0, mat
            return self._n, max(1, cols), 0, xp.ascontiguousarray(mat)
        full = xp.ascontiguousarray(xp.broadcast_to(x, batch + (rows, cols)))
        return self._n, max(1, cols), rows * cols, full


__all__ = ["FLOAT_DTYPES", "WORKSPACE_BYTES", "Gemm", "load"]
