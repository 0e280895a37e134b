"""The CuPy backend: the reference op table run on a CUDA GPU; imports CuPy only when constructed.

It reuses numpy_backend's definitions with `xp = cupy` and replaces only what CuPy lacks
(`scatter_add` works around the dtypes CUDA atomics lack). The CuPy tests compare it op by op with the NumPy
reference on the same case table.

Where fused elementwise chains will plug in: a fusion pass would turn runs of elementwise
`Step`s of a compiled `Plan` into one step whose function is a `cupy.ElementwiseKernel` (or
`cupy.fuse`) built once per plan and kept beside it (e.g. in `self._fused`, keyed by plan
identity). `run_plan` only looks a step's function up in the table it is given, so that lookup
is the single seam; nothing else needs to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from emberlink.errors import DeviceError, DTypeError
from emberlink.graph_replay.backend import Array, OpFn, run_plan
from emberlink.graph_replay.ir import DTYPES, Scalar
from emberlink.graph_replay.numpy_backend import OP_TABLE, scatter_index
from emberlink.graph_replay.plan import Plan, Step

_INSTALL_HINT = "pip install 'emberlink[cuda13]' (CUDA 13) or 'emberlink[cuda12]' (CUDA 12)"


def _import_cupy() -> Any:
    """The cupy module, or DeviceError saying what is missing."""
    try:
        import cupy
    except ImportError as e:
        raise DeviceError(f"CuPy is not installed or failed to import ({e}); {_INSTALL_HINT}") from e
    return cupy


def _scatter_add(xp: Any, args: Sequence[Any], step: Step) -> Array:
    """`cupy.add.at` on CUDA atomics: float16 accumulates in float32, int64 adds as uint64 (same bits)."""
    g, indices = args
    dtype = step.out_spec.dtype
    index = scatter_index(step, indices)
    if dtype == "int64":
        out = xp.zeros(step.out_spec.shape, dtype=np.uint64)
        xp.add.at(out, index, g.view(np.uint64))
        return out.view(np.int64)
    acc = "float32" if dtype == "float16" else dtype
    out = xp.zeros(step.out_spec.shape, dtype=acc)
    xp.add.at(out, index, g.astype(acc, copy=False))
    return out.astype(dtype, copy=False)


class CupyBackend:
    """Runs plans on one CUDA GPU. Memory figures come from CuPy's default memory pool."""

    name = "cupy"

    def __init__(self, device: int = 0) -> None:
        cupy = _import_cupy()
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # CUDARuntimeError: no driver, no device
            raise DeviceError(f"CuPy is installed but no CUDA GPU or driver is usable: {e}") from e
        if count == 0:
            raise DeviceError("CuPy is installed but no CUDA GPU is visible (CUDA_VISIBLE_DEVICES?)")
        if not 0 <= device < count:
            raise DeviceError(f"no CUDA device {device}: this machine has {count}")
        self._cp = cupy
        self._device = cupy.cuda.Device(device)
        self._pool = cupy.get_default_memory_pool()
        self._peak = 0
        self._table: dict[str, OpFn] = {**OP_TABLE, "scatter_add": _scatter_add}
        self._oom: tuple[type[BaseException], ...] = (MemoryError, cupy.cuda.memory.OutOfMemoryError)

    def _sample(self) -> None:
        self._peak = max(self._peak, int(self._pool.used_bytes()))

    def from_numpy(self, a: Any) -> Array:
        if str(a.dtype) not in DTYPES:
            raise DTypeError(f"dtype {a.dtype} is not one of {DTYPES}")
        with self._device:
            out = self._cp.asarray(a)
        self._sample()
        return out

    def to_numpy(self, a: Array) -> Any:
        with self._device:
            return self._cp.asnumpy(a)

    def run(self, plan: Plan, inputs: Sequence[Array], bindings: Sequence[Scalar]) -> list[Array]:
        with self._device:
            return run_plan(
                plan,
                inputs,
                bindings,
                xp=self._cp,
                table=self._table,
                oom_errors=self._oom,
                after_step=self._sample,
            )

    def nbytes(self, a: Array) -> int:
        return int(a.nbytes)

    def memory_stats(self) -> dict[str, int]:
        self._sample()
        return {
            "in_use_bytes": int(self._pool.used_bytes()),
            "peak_bytes": self._peak,
            "pool_bytes": int(self._pool.total_bytes()),
        }

    def synchronize(self) -> None:
        self._device.synchronize()


__all__ = ["CupyBackend"]
