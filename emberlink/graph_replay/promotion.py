"""Dtype promotion (tensor/tensor and weak scalar) and shape broadcasting; pure functions, no arrays.

The rules (docs/internals.md section 2), written once here so that inference and every backend
agree:
- Two tensors: same kind -> the wider dtype; bool with int/float -> the other; int with float ->
  the float operand's dtype (so `int64 + float16` is `float16`, unlike NumPy).
- uint8 with a signed int: the smallest signed int holding both ranges, the Array API's (and
  NumPy's, PyTorch's) lattice: `uint8 + int8` and `uint8 + int16` are `int16`, `uint8 + int32`
  is `int32`. uint8 is the only unsigned dtype, so no pair needs more than int64.
- A weak scalar (a binding) with a tensor: the tensor's dtype wins when the scalar's kind is not
  higher (bool < int < float); otherwise `int64` (int scalar, bool tensor) or `float32` (float
  scalar, bool/int tensor).
- Two weak scalars (only `where` allows it): the default dtype of the higher kind.
"""

from __future__ import annotations

from collections.abc import Sequence

from emberlink.errors import ShapeError
from emberlink.graph_replay.ir import DEFAULT_DTYPE_OF_KIND, ITEMSIZE, KIND_RANK, TensorSpec


def promote(a: TensorSpec, b: TensorSpec) -> str:
    """The dtype two operands are brought to before a binary op."""
    if a.weak and b.weak:
        return DEFAULT_DTYPE_OF_KIND[max(a.kind, b.kind, key=KIND_RANK.__getitem__)]
    if a.weak or b.weak:
        scalar, tensor = (a, b) if a.weak else (b, a)
        if KIND_RANK[scalar.kind] <= KIND_RANK[tensor.kind]:
            return tensor.dtype
        return DEFAULT_DTYPE_OF_KIND[scalar.kind]
    if a.kind == b.kind:
        if a.kind == "int" and (a.dtype == "uint8") != (b.dtype == "uint8"):
            signed = b.dtype if a.dtype == "uint8" else a.dtype
            return signed if ITEMSIZE[signed] > 1 else "int16"
        return a.dtype if ITEMSIZE[a.dtype] >= ITEMSIZE[b.dtype] else b.dtype
    if a.kind == "bool":
        return b.dtype
    if b.kind == "bool":
        return a.dtype
    return a.dtype if a.kind == "float" else b.dtype


def promote_all(specs: Sequence[TensorSpec]) -> str:
    """Fold `promote` over one or more tensor operands (concat, stack)."""
    dtype = specs[0].dtype
    for s in specs[1:]:
        dtype = promote(TensorSpec(dtype, ()), s)
    return dtype


def float_dtype_for(spec: TensorSpec) -> str:
    """The dtype a float-only op (exp, divide, mean, ...) computes in: floats keep theirs, others float32."""
    if spec.weak:
        return "float32"
    return spec.dtype if spec.kind == "float" else "float32"


def broadcast_shapes(op: str, *specs: TensorSpec) -> tuple[int, ...]:
    """NumPy broadcasting of the operands' shapes; ShapeError naming the op and every shape."""
    ndim = max(s.ndim for s in specs)
    out: list[int] = []
    for i in range(-ndim, 0):
        dim = 1
        for s in specs:
            d = s.shape[i] if -i <= s.ndim else 1
            if d != 1 and dim != 1 and d != dim:
                shapes = " and ".join(str(t.shape) for t in specs)
                raise ShapeError(f"{op}: shapes {shapes} do not broadcast: {dim} != {d} at axis {i}")
            if d != 1:
                dim = d
        out.append(dim)
    return tuple(out)


__all__ = ["broadcast_shapes", "float_dtype_for", "promote", "promote_all"]
