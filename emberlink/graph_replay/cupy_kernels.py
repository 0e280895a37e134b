"""CUDA kernels the CuPy backend runs for `unfold`, `fold` and `softmax`/`log_softmax` in place of
the reference's compositions of array ops; no op meanings of their own, no policy.

Each entry has the reference's signature `(xp, args, step)` and gives the reference's values
(numpy_backend.py), which it also runs for what its kernel does not cover: dtypes other than
float32 and float64, counts past int32, softmax over an axis other than the last or over rows
longer than `MAX_ROW`. Why each exists (bytes moved for one conv or attention step on a GPU,
where these ops are bound by memory, not arithmetic):

- `unfold`: one kernel writes each column entry once, reading the image where the window lands
  (zero in the padding). The reference zeroes a padded copy, fills it, then copies one strided
  slice per kernel offset: for a 3x3 kernel, 11 launches and about twice the traffic.
- `fold`: one kernel computes each pixel as the sum of the column entries that read it (a
  gather: no atomics, and the reference's order of additions, so the same float results). The
  reference zeroes a padded image, adds one strided slice per kernel offset and crops.
- `softmax`, `log_softmax` over the last axis: one warp a row finds the max, sums exp(x - max)
  and writes (x - max) - log(sum) (or its exp), as the reference computes them: one read of
  the row from memory and one write, where the reference makes about ten full-size passes.

All are plain launches on the current stream, so a CUDA graph captures them (capture.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from emberlink.graph_replay.backend import Array, OpFn
from emberlink.graph_replay.numpy_backend import OP_TABLE, window
from emberlink.graph_replay.plan import Step

log = logging.getLogger(__name__)

_SOURCE = r"""
template<typename T>
__global__ void emberlink_unfold(const T* __restrict__ x, T* __restrict__ y,
                                 int H, int W, int KH, int KW, int DH, int DW,
                                 int PH, int PW, int SH, int SW, int OH, int OW) {
    // One block per row (n, c, i, j) of the columns, laid out (N, C, KH, KW, OH, OW).
    const long long row = blockIdx.x;
    const int j = (int)(row % KW);
    const int i = (int)((row / KW) % KH);
    const long long plane = row / ((long long)KH * KW);
    const T* src = x + plane * H * W;
    T* dst = y + row * OH * OW;
    for (int oh = threadIdx.y; oh < OH; oh += blockDim.y) {
        const int h = oh * SH - PH + i * DH;
        const bool row_inside = h >= 0 && h < H;
        for (int ow = threadIdx.x; ow < OW; ow += blockDim.x) {
            const int w = ow * SW - PW + j * DW;
            dst[(long long)oh * OW + ow] =
                (row_inside && w >= 0 && w < W) ? src[(long long)h * W + w] : T(0);
        }
    }
}

template<typename T>
__global__ void emberlink_fold(const T* __restrict__ cols, T* __restrict__ out,
                               int H, int W, int KH, int KW, int DH, int DW,
                               int PH, int PW, int SH, int SW, int OH, int OW) {
    // One block per image plane (n, c). A pixel sums the entries of the windows that cover it,
    // kernel offsets in the reference's order (i, then j), starting from zero.
    const long long plane = blockIdx.x;
    const T* src = cols + plane * KH * KW * OH * OW;
    T* dst = out + plane * H * W;
    for (int h = threadIdx.y; h < H; h += blockDim.y) {
        for (int w = threadIdx.x; w < W; w += blockDim.x) {
            T acc = T(0);
            for (int i = 0; i < KH; ++i) {
                const int th = h + PH - i * DH;
                if (th < 0 || th % SH != 0 || th / SH >= OH) continue;
                const int oh = th / SH;
                for (int j = 0; j < KW; ++j) {
                    const int tw = w + PW - j * DW;
                    if (tw < 0 || tw % SW != 0 || tw / SW >= OW) continue;
                    acc += src[((long long)(i * KW + j) * OH + oh) * OW + tw / SW];
                }
            }
            dst[(long long)h * W + w] = acc;
        }
    }
}

template<typename T>
__global__ void emberlink_softmax(const T* __restrict__ x, T* __restrict__ y,
                                  long long rows, int cols, int log_out) {
    // One warp per row (whole warps leave together, so the shuffles see all 32 lanes).
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x % 32;
    const T* xr = x + row * cols;
    T* yr = y + row * cols;
    // The max by comparisons: a NaN anywhere in the row makes every result NaN all the same.
    T m = xr[lane < cols ? lane : 0];
    for (int k = lane + 32; k < cols; k += 32) m = xr[k] > m ? xr[k] : m;
    for (int o = 16; o > 0; o /= 2) {
        const T other = __shfl_xor_sync(0xffffffffu, m, o);
        m = other > m ? other : m;
    }
    T s = T(0);
    for (int k = lane; k < cols; k += 32) s += exp(xr[k] - m);
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
    const T log_s = log(s);
    for (int k = lane; k < cols; k += 32) {
        const T v = (xr[k] - m) - log_s;
        yr[k] = log_out ? v : exp(v);
    }
}
"""

_C_TYPES = {"float32": "float", "float64": "double"}
_NAMES = ("emberlink_unfold", "emberlink_fold", "emberlink_softmax")
INT32_MAX = 2**31 - 1
MAX_ROW = 4096
"""Longest softmax row a warp takes; longer rows (a large vocabulary) run the reference, whose
passes use the whole GPU where one warp a row would use too few threads."""

_WINDOW_BLOCK = (32, 8)
_SOFTMAX_ROWS_PER_BLOCK = 8


class Kernels:
    """The three kernels of `_SOURCE` for one array module, compiled together on first use.

    `table()` gives the op-table entries (`unfold`, `fold`, `softmax`, `log_softmax`). Should
    CUDA refuse to compile them (`compile_error`, CuPy's exception for that), every entry runs
    the reference from then on, a warning is logged, and `broken` holds the error (the GPU tests
    check that it stays None).
    """

    def __init__(self, xp: Any, compile_error: type[BaseException]) -> None:
        self._xp = xp
        self._compile_error = compile_error
        self._module: Any = None
        self.broken: BaseException | None = None

    def _function(self, name: str, dtype: str) -> Any:
        """The compiled kernel `name` for `dtype`, or None if the module does not compile."""
        if self.broken is not None:
            return None
        try:
            if self._module is None:
                expressions = [f"{n}<{t}>" for n in _NAMES for t in _C_TYPES.values()]
                self._module = self._xp.RawModule(code=_SOURCE, name_expressions=expressions)
            return self._module.get_function(f"{name}<{_C_TYPES[dtype]}>")
        except self._compile_error as e:
            self.broken = e
            log.warning(
                "CUDA did not compile emberlink's window and softmax kernels; running the reference: %s", e
            )
            return None

    def table(self) -> dict[str, OpFn]:
        return {
            "unfold": self.unfold,
            "fold": self.fold,
            "softmax": self.softmax,
            "log_softmax": self.softmax,
        }

    def unfold(self, xp: Any, args: Sequence[Any], step: Step) -> Array:
        x = args[0]
        n, c, h, w = x.shape
        kernel, dilation, padding, stride, counts = window(step, (h, w))
        rows = n * c * kernel[0] * kernel[1]
        if str(x.dtype) not in _C_TYPES or not _fits(rows, h * w, counts[0] * counts[1]):
            return OP_TABLE["unfold"](xp, args, step)
        launch = self._function("emberlink_unfold", str(x.dtype))
        if launch is None:
            return OP_TABLE["unfold"](xp, args, step)
        x = xp.ascontiguousarray(x)
        out = xp.empty(step.out_spec.shape, dtype=x.dtype)
        dims = (h, w, *kernel, *dilation, *padding, *stride, *counts)
        launch((rows,), _WINDOW_BLOCK, (x, out, *_int32(dims)))
        return out

    def fold(self, xp: Any, args: Sequence[Any], step: Step) -> Array:
        cols = args[0]
        n, c, h, w = step.out_spec.shape
        kernel, dilation, padding, stride, counts = window(step, (h, w))
        dtype = step.out_spec.dtype
        per_plane = kernel[0] * kernel[1] * counts[0] * counts[1]
        if dtype not in _C_TYPES or str(cols.dtype) != dtype or not _fits(n * c, h * w, per_plane):
            return OP_TABLE["fold"](xp, args, step)
        launch = self._function("emberlink_fold", dtype)
        if launch is None:
            return OP_TABLE["fold"](xp, args, step)
        cols = xp.ascontiguousarray(cols)
        out = xp.empty(step.out_spec.shape, dtype=dtype)
        dims = (h, w, *kernel, *dilation, *padding, *stride, *counts)
        launch((n * c,), _WINDOW_BLOCK, (cols, out, *_int32(dims)))
        return out

    def softmax(self, xp: Any, args: Sequence[Any], step: Step) -> Array:
        x = args[0]
        dtype = step.out_spec.dtype
        axis = cast(int, step.attrs["axis"])
        length = x.shape[-1] if x.ndim else 0
        if (
            dtype not in _C_TYPES
            or str(x.dtype) != dtype
            or axis not in (-1, x.ndim - 1)
            or x.size == 0
            or not 0 < length <= MAX_ROW
        ):
            return OP_TABLE[step.op](xp, args, step)
        rows = x.size // length
        blocks = -(-rows // _SOFTMAX_ROWS_PER_BLOCK)
        launch = self._function("emberlink_softmax", dtype) if blocks <= INT32_MAX else None
        if launch is None:
            return OP_TABLE[step.op](xp, args, step)
        x = xp.ascontiguousarray(x)
        out = xp.empty(x.shape, dtype=dtype)
        launch((blocks,), (32 * _SOFTMAX_ROWS_PER_BLOCK,), (x, out, np.int64(rows), np.int32(length),
               np.int32(step.op == "log_softmax")))  # fmt: skip
        return out


def _fits(blocks: int, *counts: int) -> bool:
    """Whether a launch of `blocks` blocks over planes of `counts` elements each stays in int32."""
    return 0 < blocks <= INT32_MAX and all(0 < k <= INT32_MAX for k in counts)


def _int32(values: Sequence[int]) -> tuple[np.int32, ...]:
    return tuple(np.int32(v) for v in values)


__all__ = ["INT32_MAX", "MAX_ROW", "Kernels"]
