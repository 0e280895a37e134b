"""Shape and dtype inference, one function per op family; no arrays, no I/O.

Each function takes `(op, input specs, attrs)` with attrs already checked by `ops.check_attrs`
(the casts only tell mypy) and input kinds already checked by `ops.infer`; it returns the output
spec or raises ShapeError/DTypeError naming the op and every operand's shape or dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import cast

from emberlink.errors import DTypeError, ShapeError
from emberlink.graph_replay.ir import MAX_RANK, AttrValue, Key, TensorSpec
from emberlink.graph_replay.promotion import broadcast_shapes, float_dtype_for, promote, promote_all


def _dt(spec: TensorSpec) -> str:
    return f"{spec.dtype} scalar" if spec.weak else spec.dtype


def _norm_axis(op: str, axis: int, ndim: int, *, extra: int = 0) -> int:
    """Normalize a possibly negative axis into `[0, ndim + extra)`."""
    n = ndim + extra
    if not -n <= axis < n:
        raise ShapeError(f"{op}: axis {axis} is out of range for rank {ndim}")
    return axis + n if axis < 0 else axis


def _norm_axes(op: str, axis: AttrValue, spec: TensorSpec) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(spec.ndim))
    raw = (axis,) if isinstance(axis, int) else cast(tuple[int, ...], axis)
    axes = tuple(_norm_axis(op, a, spec.ndim) for a in raw)
    if len(set(axes)) != len(axes):
        raise ShapeError(f"{op}: repeated axis in {axis!r} for shape {spec.shape}")
    return axes


# Inference functions, one per family. Attrs arrive validated by check_attrs; casts only tell mypy.


def creation(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    return TensorSpec(cast(str, a["dtype"]), cast(tuple[int, ...], a["shape"]))


def arange(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    start, stop, step = (cast(int | float, a[k]) for k in ("start", "stop", "step"))
    dtype = cast(str, a["dtype"])
    if dtype == "bool":
        raise DTypeError(f"{op}: dtype bool is not allowed")
    if step == 0:
        raise ShapeError(f"{op}: step must not be 0")
    if isinstance(start, int) and isinstance(stop, int) and isinstance(step, int):
        n = _range_len(start, stop, step)
    else:
        q = (stop - start) / step
        if not math.isfinite(q):
            raise ShapeError(f"{op}: ({start}, {stop}, {step}) gives too many elements")
        n = max(0, math.ceil(q))
    if n > MAX_DIM:
        raise ShapeError(f"{op}: ({start}, {stop}, {step}) gives {n} elements, more than an array can hold")
    return TensorSpec(dtype, (n,))


MAX_DIM = (1 << 63) - 1
"""The longest axis an array can have (NumPy's index type): a longer one is a ShapeError, never an
OverflowError."""


def _range_len(start: int, stop: int, step: int) -> int:
    """len(range(start, stop, step)) for any ints (`len` raises OverflowError past sys.maxsize)."""
    return max(0, -((start - stop) // step))


def eye(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    return TensorSpec(cast(str, a["dtype"]), (cast(int, a["n"]), cast(int, a["m"])))


def unary_same(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    """A numeric operand; the result has its dtype (negative, abs, floor, ...)."""
    x = ins[0]
    if x.kind == "bool":
        raise DTypeError(f"{op}: needs a numeric operand, got {x.dtype}")
    return x


def unary_float(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    """Any operand; the result is float (exp, log, ...: ints and bools compute in float32)."""
    x = ins[0]
    return TensorSpec(float_dtype_for(x), x.shape)


def unary_predicate(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    """A numeric operand; the result is bool (isnan, isinf, isfinite)."""
    x = ins[0]
    if x.kind == "bool":
        raise DTypeError(f"{op}: needs a numeric operand, got {x.dtype}")
    return TensorSpec("bool", x.shape)


def logical_not(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x = ins[0]
    if x.kind != "bool":
        raise DTypeError(f"{op}: needs a bool operand, got {x.dtype}")
    return x


def _binary_shape(op: str, x: TensorSpec, y: TensorSpec) -> tuple[int, ...]:
    if x.weak and y.weak:
        raise DTypeError(f"{op}: needs at least one tensor, got {_dt(x)} and {_dt(y)}")
    return broadcast_shapes(op, x, y)


def arithmetic(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    """Numeric operands, promoted (add, subtract, multiply, pow)."""
    x, y = ins
    shape = _binary_shape(op, x, y)
    dtype = promote(x, y)
    if dtype == "bool":
        raise DTypeError(f"{op}: needs numeric operands, got {_dt(x)} and {_dt(y)}")
    return TensorSpec(dtype, shape)


def divide(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    """Numeric operands; the result is the float dtype of their promotion."""
    out = arithmetic(op, ins, a)
    return TensorSpec(float_dtype_for(TensorSpec(out.dtype, ())), out.shape)


def extremum(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    """Any operands, promoted; bools allowed (maximum, minimum)."""
    x, y = ins
    shape = _binary_shape(op, x, y)
    return TensorSpec(promote(x, y), shape)


def compare(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    """Any operands (compared in their promoted dtype); the result is bool."""
    x, y = ins
    return TensorSpec("bool", _binary_shape(op, x, y))


def logical(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    """Bool operands; the result is bool (logical_and, logical_or)."""
    x, y = ins
    shape = _binary_shape(op, x, y)
    if x.kind != "bool" or y.kind != "bool":
        raise DTypeError(f"{op}: needs bool operands, got {_dt(x)} and {_dt(y)}")
    return TensorSpec("bool", shape)


def where(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    cond, x, y = ins
    if cond.dtype != "bool":
        raise DTypeError(f"{op}: condition must be bool, got {cond.dtype}")
    return TensorSpec(promote(x, y), broadcast_shapes(op, cond, x, y))


def astype(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    return TensorSpec(cast(str, a["dtype"]), ins[0].shape)


def _reduced_shape(x: TensorSpec, axes: tuple[int, ...], keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    return tuple(d for i, d in enumerate(x.shape) if i not in axes)


def reduce(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x = ins[0]
    axes = _norm_axes(op, a["axis"], x)
    if op in ("max", "min", "argmax", "argmin") and any(x.shape[i] == 0 for i in axes):
        raise ShapeError(f"{op}: cannot reduce shape {x.shape} over an empty axis (axis={a['axis']!r})")
    shape = _reduced_shape(x, axes, cast(bool, a["keepdims"]))
    if op in ("argmax", "argmin"):
        dtype = "int64"
    elif op in ("sum", "prod"):
        dtype = "int64" if x.kind != "float" else x.dtype
    elif op == "mean":
        dtype = float_dtype_for(x)
    else:
        dtype = x.dtype
    return TensorSpec(dtype, shape)


def matmul(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x, y = ins
    if x.ndim == 0 or y.ndim == 0:
        raise ShapeError(f"{op}: operands must be at least 1-D, got shapes {x.shape} and {y.shape}")
    dtype = promote(x, y)
    if dtype == "bool":
        raise DTypeError(f"{op}: needs numeric operands, got {x.dtype} and {y.dtype}")
    xs = (1, *x.shape) if x.ndim == 1 else x.shape
    ys = (*y.shape, 1) if y.ndim == 1 else y.shape
    if xs[-1] != ys[-2]:
        raise ShapeError(f"{op}: shapes {x.shape} and {y.shape} do not align: {xs[-1]} != {ys[-2]}")
    try:
        batch = broadcast_shapes(op, TensorSpec("bool", xs[:-2]), TensorSpec("bool", ys[:-2]))
    except ShapeError:
        raise ShapeError(f"{op}: batch dims of shapes {x.shape} and {y.shape} do not broadcast") from None
    shape = batch + ((xs[-2],) if x.ndim > 1 else ()) + ((ys[-1],) if y.ndim > 1 else ())
    return TensorSpec(dtype, shape)


def reshape(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x, shape = ins[0], cast(tuple[int, ...], a["shape"])
    if math.prod(shape) != x.size:
        raise ShapeError(f"{op}: cannot reshape {x.shape} ({x.size} elements) to {shape}")
    return TensorSpec(x.dtype, shape)


def permute_dims(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x, axes = ins[0], cast(tuple[int, ...], a["axes"])
    norm = tuple(_norm_axis(op, ax, x.ndim) for ax in axes) if len(axes) == x.ndim else ()
    if sorted(norm) != list(range(x.ndim)) or len(axes) != x.ndim:
        raise ShapeError(f"{op}: axes {axes} are not a permutation of the axes of shape {x.shape}")
    return TensorSpec(x.dtype, tuple(x.shape[i] for i in norm))


def broadcast_to(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x, shape = ins[0], cast(tuple[int, ...], a["shape"])
    ok = len(shape) >= x.ndim and all(d in (1, t) for d, t in zip(reversed(x.shape), reversed(shape)))
    if not ok:
        raise ShapeError(f"{op}: cannot broadcast shape {x.shape} to {shape}")
    return TensorSpec(x.dtype, shape)


def expand_dims(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x = ins[0]
    axis = _norm_axis(op, cast(int, a["axis"]), x.ndim, extra=1)
    return TensorSpec(x.dtype, x.shape[:axis] + (1,) + x.shape[axis:])


def squeeze(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x = ins[0]
    axes = _norm_axes(op, a["axis"], x)
    if any(x.shape[i] != 1 for i in axes):
        raise ShapeError(f"{op}: cannot squeeze axes {a['axis']!r} of shape {x.shape}: size is not 1")
    return TensorSpec(x.dtype, tuple(d for i, d in enumerate(x.shape) if i not in axes))


def concat(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    first, shapes = ins[0], [s.shape for s in ins]
    dtype = promote_all(ins)
    if op == "stack":
        if any(s != first.shape for s in shapes):
            raise ShapeError(f"{op}: shapes {', '.join(map(str, shapes))} are not all equal")
        axis = _norm_axis(op, cast(int, a["axis"]), first.ndim, extra=1)
        return TensorSpec(dtype, first.shape[:axis] + (len(ins),) + first.shape[axis:])
    if first.ndim == 0:
        raise ShapeError(f"{op}: cannot concatenate 0-d operands")
    axis = _norm_axis(op, cast(int, a["axis"]), first.ndim)
    for s in shapes:
        if len(s) != first.ndim or any(d != f for i, (d, f) in enumerate(zip(s, first.shape)) if i != axis):
            raise ShapeError(f"{op}: shapes {', '.join(map(str, shapes))} differ off axis {axis}")
    total = sum(s[axis] for s in shapes)
    return TensorSpec(dtype, first.shape[:axis] + (total,) + first.shape[axis + 1 :])


def _getitem_shape(op: str, shape: tuple[int, ...], key: Key) -> tuple[int, ...]:
    out: list[int] = []
    d = 0
    for item in key:
        if item[0] == "n":
            out.append(1)
            continue
        if d >= len(shape):
            raise ShapeError(f"{op}: key {key!r} indexes more axes than shape {shape} has")
        dim = shape[d]
        if item[0] == "i":
            index = cast(tuple[str, int], item)[1]
            if index >= dim:
                raise ShapeError(f"{op}: index {index} is out of range for axis {d} of shape {shape}")
        else:
            _, start, stop, step = cast(tuple[str, int, int, int], item)
            if start > dim or stop > dim:
                raise ShapeError(f"{op}: slice {start}:{stop} is out of range for axis {d} of shape {shape}")
            out.append(_range_len(start, stop, step))
        d += 1
    return (*out, *shape[d:])


def getitem(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x = ins[0]
    return TensorSpec(x.dtype, _getitem_shape(op, x.shape, cast(Key, a["key"])))


def getitem_grad(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    g, shape = ins[0], cast(tuple[int, ...], a["shape"])
    want = _getitem_shape(op, shape, cast(Key, a["key"]))
    if want != g.shape:
        raise ShapeError(f"{op}: gradient shape {g.shape} != {want}, the shape of the key into {shape}")
    return TensorSpec(g.dtype, shape)


def _check_indices(op: str, ind: TensorSpec) -> None:
    if ind.kind != "int":
        raise DTypeError(f"{op}: indices must be int32 or int64, got {ind.dtype}")


def take(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x, ind = ins
    _check_indices(op, ind)
    if a["axis"] is None:
        if x.size == 0 and ind.size > 0:
            raise ShapeError(f"{op}: cannot take {ind.shape} indices from empty shape {x.shape}")
        return TensorSpec(x.dtype, ind.shape)
    axis = _norm_axis(op, cast(int, a["axis"]), x.ndim)
    if x.shape[axis] == 0 and ind.size > 0:
        raise ShapeError(f"{op}: cannot take {ind.shape} indices from empty axis {axis} of {x.shape}")
    return TensorSpec(x.dtype, x.shape[:axis] + ind.shape + x.shape[axis + 1 :])


def scatter_add(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    g, ind = ins
    _check_indices(op, ind)
    if g.kind == "bool":
        raise DTypeError(f"{op}: needs a numeric gradient, got {g.dtype}")
    size = cast(int, a["size"])
    if a["axis"] is None:
        if g.shape != ind.shape:
            raise ShapeError(f"{op}: gradient shape {g.shape} != indices shape {ind.shape} (axis=None)")
        return TensorSpec(g.dtype, (size,))
    out_ndim = g.ndim - ind.ndim + 1
    if out_ndim < 1:
        raise ShapeError(f"{op}: gradient shape {g.shape} is too small for indices shape {ind.shape}")
    axis = _norm_axis(op, cast(int, a["axis"]), out_ndim)
    if g.shape[axis : axis + ind.ndim] != ind.shape:
        raise ShapeError(f"{op}: gradient shape {g.shape} does not hold indices shape {ind.shape} at {axis}")
    return TensorSpec(g.dtype, g.shape[:axis] + (size,) + g.shape[axis + ind.ndim :])


def softmax(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x = ins[0]
    _norm_axis(op, cast(int, a["axis"]), x.ndim)
    return TensorSpec(float_dtype_for(x), x.shape)


def cross_entropy(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    logits, labels = ins
    if logits.kind != "float":
        raise DTypeError(f"{op}: logits must be float, got {logits.dtype} (labels {labels.dtype})")
    _check_indices(op, labels)
    if logits.ndim != 2 or labels.ndim != 1 or logits.shape[0] != labels.shape[0] or logits.shape[1] == 0:
        raise ShapeError(f"{op}: needs logits [N, C>0] and labels [N], got {logits.shape} and {labels.shape}")
    shape = labels.shape if a["reduction"] == "none" else ()
    return TensorSpec(logits.dtype, shape)


def one_hot(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    labels = ins[0]
    _check_indices(op, labels)
    if labels.ndim >= MAX_RANK:
        raise ShapeError(f"{op}: labels of shape {labels.shape} leave no room for the class axis")
    return TensorSpec(cast(str, a["dtype"]), (*labels.shape, cast(int, a["num_classes"])))


def rand(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    return creation(op, ins, a)


# -- sliding windows (unfold, fold) ----------------------------------------------------------------

Pair = tuple[int, int]


def window_counts(op: str, size: Pair, a: Mapping[str, AttrValue]) -> Pair:
    """How many windows `unfold` takes along each spatial axis of an input of `size` (H, W):
    `(size + 2 padding - dilation (kernel - 1) - 1) // stride + 1`, as torch's unfold and fold.
    ShapeError when an axis gets none."""
    k, d, p, s = (cast(Pair, a[name]) for name in ("kernel_size", "dilation", "padding", "stride"))
    counts = tuple((size[i] + 2 * p[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(2))
    if min(counts) < 1:
        raise ShapeError(
            f"{op}: spatial size {size} with padding {p} is smaller than the dilated kernel "
            f"(kernel_size {k}, dilation {d}): no window fits"
        )
    return cast(Pair, counts)


def _numeric(op: str, x: TensorSpec) -> None:
    if x.kind == "bool":
        raise DTypeError(f"{op}: needs a numeric operand, got {x.dtype}")


def unfold(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    """(N, C, H, W) -> (N, C kh kw, L): every window as a column, channel-major (torch's unfold)."""
    x = ins[0]
    _numeric(op, x)
    if x.ndim != 4:
        raise ShapeError(f"{op}: needs a 4-D input (N, C, H, W), got shape {x.shape}")
    n, c, h, w = x.shape
    oh, ow = window_counts(op, (h, w), a)
    kh, kw = cast(Pair, a["kernel_size"])
    return TensorSpec(x.dtype, (n, c * kh * kw, oh * ow))


def fold(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    """(N, C kh kw, L) -> (N, C, H, W) with (H, W) = output_size, overlaps summed (torch's fold)."""
    x = ins[0]
    _numeric(op, x)
    kh, kw = cast(Pair, a["kernel_size"])
    if x.ndim != 3 or x.shape[1] % (kh * kw):
        raise ShapeError(
            f"{op}: needs a 3-D input (N, C * {kh} * {kw}, L) for kernel_size ({kh}, {kw}), got shape {x.shape}"
        )
    out_h, out_w = cast(Pair, a["output_size"])
    oh, ow = window_counts(op, (out_h, out_w), a)
    if x.shape[2] != oh * ow:
        raise ShapeError(
            f"{op}: input shape {x.shape} has {x.shape[2]} blocks, but output_size ({out_h}, {out_w}) "
            f"gives {oh} x {ow} = {oh * ow}"
        )
    return TensorSpec(x.dtype, (x.shape[0], x.shape[1] // (kh * kw), out_h, out_w))
