"""The ONNX graph under construction: unique value names, nodes, deduplicated constants, casts and
shape tensors (static, or computed from the batch size); no knowledge of emberlink's ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from emberlink.graph_replay.ir import Scalar
from emberlink.graph_replay.numpy_backend import host_scalar
from emberlink.onnx.batch import Affine, Dim

INT64_MAX = 2**63 - 1
"""A Slice end meaning "to the end of the axis"."""

_SMALL = 1 << 16
"""Constants up to this many bytes are shared by content (an index list used twice is stored once)."""


def onnx_dtype(dtype: str) -> int:
    """The ONNX element type (`onnx.TensorProto.FLOAT`, ...) of a NumPy dtype name."""
    return int(helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))


class Builder:
    """Collects nodes and initializers; every value name it hands out is unique in the graph."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()
        self._shared: dict[tuple[str, tuple[int, ...], bytes], str] = {}
        self._sizes: dict[Affine, str] = {}
        self.batch_source: str | None = None
        """A graph input whose axis 0 is the batch (set when the batch is dynamic)."""

    def fresh(self, hint: str) -> str:
        """A new value name: `hint`, else `hint_1`, `hint_2`, ..."""
        name, k = hint, 0
        while name in self._names:
            k += 1
            name = f"{hint}_{k}"
        self._names.add(name)
        return name

    def node(self, op_type: str, inputs: Sequence[str], hint: str, **attrs: Any) -> str:
        """Append one node with one output; returns the output's name."""
        out = self.fresh(hint)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def initializer(self, array: np.ndarray, name: str) -> str:
        """Store `array` under `name` (a parameter's dotted name; made unique if taken)."""
        out = self.fresh(name)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), out))
        return out

    def const(self, array: np.ndarray, hint: str = "const") -> str:
        """A constant: an initializer, shared with an equal small constant made before."""
        array = np.ascontiguousarray(array)
        if array.nbytes > _SMALL:
            return self.initializer(array, hint)
        key = (array.dtype.name, array.shape, array.tobytes())
        name = self._shared.get(key)
        if name is None:
            name = self._shared[key] = self.initializer(array, hint)
        return name

    def scalar(self, value: Scalar, dtype: str) -> str:
        """A 0-d constant: a binding's value brought to `dtype` as the NumPy backend brings it."""
        return self.const(np.asarray(host_scalar(value, dtype)), "scalar")

    def cast(self, name: str, src: str, dst: str) -> str:
        return name if src == dst else self.node("Cast", [name], f"{name}_{dst}", to=onnx_dtype(dst))

    def ints(self, dims: Sequence[Dim], hint: str = "shape") -> str:
        """A 1-D int64 tensor of `dims`: a constant, or computed from the batch size where a dim is
        Affine."""
        if all(type(d) is int for d in dims):
            return self.const(np.array(dims, dtype=np.int64), hint)
        parts: list[str] = []
        run: list[int] = []
        for d in dims:
            if isinstance(d, Affine):
                if run:
                    parts.append(self.const(np.array(run, dtype=np.int64), hint))
                    run = []
                parts.append(self.size(d))
            else:
                run.append(d)
        if run:
            parts.append(self.const(np.array(run, dtype=np.int64), hint))
        return parts[0] if len(parts) == 1 else self.node("Concat", parts, hint, axis=0)

    def size(self, d: Affine) -> str:
        """`d` at the run's batch size, as a 1-D int64 tensor of one element."""
        name = self._sizes.get(d)
        if name is None:
            if self.batch_source is None:  # pragma: no cover - compare() makes Affine sizes only with a batch
                raise AssertionError("an Affine size without a dynamic batch")
            name = self._sizes.get(Affine(1, 0))
            if name is None:
                name = self.node("Shape", [self.batch_source], "batch", start=0, end=1)
                self._sizes[Affine(1, 0)] = name
            if d.scale != 1:
                name = self.node("Mul", [name, self.const(np.array([d.scale], np.int64))], "size")
            if d.offset:
                name = self.node("Add", [name, self.const(np.array([d.offset], np.int64))], "size")
            self._sizes[d] = name
        return name


__all__ = ["INT64_MAX", "Builder", "onnx_dtype"]
