"""The ONNX form of every op of emberlink's op table: one lowering per op, in the op table's order;
no tracing, no file I/O.

Rules of this file:
- A lowering gets a `Site` (the op, its arguments, attrs, output spec and dims) and returns the
  name of the ONNX value that holds the op's result, of exactly the output's dtype and shape. It
  may return an argument's own name (a cast to the same dtype, floor of an int).
- Meanings are the NumPy backend's (graph_replay/numpy_backend.py), dtype for dtype: operands are
  brought to the op's `operand_dtype` first, bindings become constants of that dtype by the same
  `host_scalar`, float16 work runs in float32 (as the reference does for reductions, softmaxes and
  matmul, and as NumPy's float16 loops do for the rest), and small ints (int8, int16, uint8) in
  int32 where ONNX Runtime has no kernel for them; the cast back wraps, as NumPy's arithmetic does.
- `LOWERINGS` has an entry for every op a forward pass may record; `REFUSED` names the rest, with
  the reason the error gives (random numbers, backward-only ops). A test checks that together they
  cover `ops.OPS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import numpy as np

from emberlink.errors import ExportError
from emberlink.graph_replay import ops
from emberlink.graph_replay.ir import Scalar, TensorSpec
from emberlink.graph_replay.promotion import float_dtype_for
from emberlink.onnx.batch import Affine, Dim, Sym, is_static
from emberlink.onnx.builder import INT64_MAX, Builder
from emberlink.onnx.trace import Program


@dataclass(frozen=True, slots=True)
class Arg:
    """An op's argument: an ONNX value (`name`) or a binding (`value`, a Python number, or a size
    that follows the batch)."""

    name: str | None
    value: Scalar | Affine | None
    spec: TensorSpec
    dims: tuple[Dim, ...]


@dataclass(frozen=True, slots=True)
class Site:
    """One op application as a lowering sees it."""

    op: str
    args: tuple[Arg, ...]
    attrs: Mapping[str, Sym]
    spec: TensorSpec
    dims: tuple[Dim, ...]

    @property
    def x(self) -> Arg:
        return self.args[0]

    @property
    def name(self) -> str:
        """The first argument's ONNX value (ops whose first input is a tensor)."""
        return cast(str, self.args[0].name)


Lowering = Callable[[Builder, Site], str]

_WIDE = {"float16": "float32", "int8": "int32", "int16": "int32", "uint8": "int32"}


def wide(dtype: str) -> str:
    """The dtype an op computes in: float16 in float32, small ints in int32, the rest as they are."""
    return _WIDE.get(dtype, dtype)


def operand(b: Builder, arg: Arg, dtype: str) -> str:
    """`arg` as an ONNX value of `dtype`: a tensor cast, or a binding as a 0-d constant."""
    if arg.name is not None:
        return b.cast(arg.name, arg.spec.dtype, dtype)
    return _number(b, arg.value, dtype)


def _operand_dtype(s: Site) -> str:
    return ops.operand_dtype(s.op, [a.spec for a in s.args]) or s.x.spec.dtype


def _norm(axis: Sym, ndim: int) -> int:
    a = cast(int, axis)
    return a + ndim if a < 0 else a


def _axes(s: Site) -> tuple[int, ...] | None:
    """A reduction's axes, normalized; None: all of them."""
    axis = s.attrs["axis"]
    if axis is None:
        return None
    raw = (axis,) if isinstance(axis, int) else cast(tuple[int, ...], axis)
    return tuple(_norm(a, s.x.spec.ndim) for a in raw)


# -- elementwise -----------------------------------------------------------------------------------

_UNARY = {
    "negative": "Neg", "abs": "Abs", "sign": "Sign", "relu": "Relu", "floor": "Floor", "ceil": "Ceil",
    "round": "Round", "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "tanh": "Tanh", "sigmoid": "Sigmoid",
    "sin": "Sin", "cos": "Cos", "sinh": "Sinh", "cosh": "Cosh", "arctan": "Atan", "logical_not": "Not",
}  # fmt: skip

_ROUNDING = ("floor", "ceil", "round", "trunc")


def _unary(b: Builder, s: Site) -> str:
    if s.op in _ROUNDING and s.x.spec.kind != "float":
        return s.name  # integers keep their values (Array API)
    cd = wide(_operand_dtype(s))
    x = operand(b, s.x, cd)
    if s.op == "square":
        y = b.node("Mul", [x, x], s.op)
    elif s.op == "trunc":
        negative = b.node("Less", [x, b.scalar(0, cd)], "negative")
        y = b.node("Where", [negative, b.node("Ceil", [x], "ceil"), b.node("Floor", [x], "floor")], s.op)
    else:
        y = b.node(_UNARY[s.op], [x], s.op)
    return b.cast(y, cd, s.spec.dtype)


_SMALL_X = 1e-5
"""Below this |x|, expm1 and log1p use three terms of their series (error under 1e-16 relative)."""


def _near_zero(b: Builder, s: Site) -> str:
    """expm1 and log1p, which ONNX lacks: in float64, the series near 0 and the plain formula
    elsewhere (1e-11 relative at worst, at |x| = 1e-5), so float32 results are exact to rounding."""
    x = operand(b, s.x, "float64")
    small = b.node("Less", [b.node("Abs", [x], "abs"), b.scalar(_SMALL_X, "float64")], "small")
    one, third = b.scalar(1.0, "float64"), b.scalar(1 / 3 if s.op == "log1p" else 1 / 6, "float64")
    half = b.scalar(0.5, "float64")
    if s.op == "expm1":  # x (1 + x (1/2 + x / 6))
        inner = b.node("Add", [half, b.node("Mul", [x, third], "t")], "t")
        series = b.node("Mul", [x, b.node("Add", [one, b.node("Mul", [x, inner], "t")], "t")], "series")
        direct = b.node("Sub", [b.node("Exp", [x], "exp"), one], "direct")
    else:  # x (1 - x (1/2 - x / 3))
        inner = b.node("Sub", [half, b.node("Mul", [x, third], "t")], "t")
        series = b.node("Mul", [x, b.node("Sub", [one, b.node("Mul", [x, inner], "t")], "t")], "series")
        direct = b.node("Log", [b.node("Add", [one, x], "t")], "direct")
    y = b.node("Where", [small, series, direct], s.op)
    return b.cast(y, "float64", s.spec.dtype)


def _fill_like(b: Builder, s: Site, value: bool) -> str:
    return b.node("Expand", [b.const(np.array(value)), b.node("Shape", [s.name], "shape")], s.op)


def _predicate(b: Builder, s: Site) -> str:
    if s.x.spec.kind != "float":
        return _fill_like(b, s, s.op == "isfinite")  # an integer is never NaN or infinite
    x = operand(b, s.x, wide(s.x.spec.dtype))
    if s.op == "isnan":
        return b.node("IsNaN", [x], s.op)
    if s.op == "isinf":
        return b.node("IsInf", [x], s.op)
    special = b.node("Or", [b.node("IsNaN", [x], "isnan"), b.node("IsInf", [x], "isinf")], "special")
    return b.node("Not", [special], s.op)


_BINARY = {
    "add": "Add", "subtract": "Sub", "multiply": "Mul", "divide": "Div", "pow": "Pow",
    "maximum": "Max", "minimum": "Min", "equal": "Equal", "not_equal": "Equal", "less": "Less",
    "less_equal": "LessOrEqual", "greater": "Greater", "greater_equal": "GreaterOrEqual",
    "logical_and": "And", "logical_or": "Or",
}  # fmt: skip
_BOOL_NATIVE = ("equal", "not_equal", "logical_and", "logical_or")


def _binary(b: Builder, s: Site) -> str:
    od = _operand_dtype(s)
    cd = "int32" if od == "bool" and s.op not in _BOOL_NATIVE else wide(od)  # bools ordered as 0 < 1
    y = b.node(_BINARY[s.op], [operand(b, a, cd) for a in s.args], s.op)
    if s.op == "not_equal":
        y = b.node("Not", [y], s.op)
    return b.cast(y, "bool" if s.op in _BOOL_RESULT else cd, s.spec.dtype)


_BOOL_RESULT = frozenset(("equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
                          "logical_and", "logical_or"))  # fmt: skip


def _where(b: Builder, s: Site) -> str:
    od = _operand_dtype(s)
    cd = "uint8" if od == "bool" else wide(od)
    a, c = (operand(b, arg, cd) for arg in s.args[1:])
    return b.cast(b.node("Where", [s.name, a, c], s.op), cd, s.spec.dtype)


def _astype(b: Builder, s: Site) -> str:
    return b.cast(s.name, s.x.spec.dtype, s.spec.dtype)


# -- reductions and matmul -------------------------------------------------------------------------

_REDUCE = {
    "sum": "ReduceSum",
    "prod": "ReduceProd",
    "mean": "ReduceMean",
    "max": "ReduceMax",
    "min": "ReduceMin",
}


def _reduce(b: Builder, s: Site) -> str:
    axes, keep = _axes(s), int(cast(bool, s.attrs["keepdims"]))
    if axes == ():
        return b.cast(s.name, s.x.spec.dtype, s.spec.dtype)  # nothing reduced (NumPy's axis=())
    if s.op in ("sum", "prod"):
        acc = wide(s.spec.dtype)
    elif s.op == "mean":
        acc = "float64" if s.x.spec.kind != "float" else wide(s.spec.dtype)
    else:
        acc = "int32" if s.x.spec.dtype == "bool" else wide(s.x.spec.dtype)
    inputs = [operand(b, s.x, acc)]
    if axes is not None:
        inputs.append(b.const(np.array(axes, np.int64), "axes"))
    y = b.node(_REDUCE[s.op], inputs, s.op, keepdims=keep)
    return b.cast(y, acc, s.spec.dtype)


def _arg_reduce(b: Builder, s: Site) -> str:
    x = operand(b, s.x, "int32" if s.x.spec.dtype == "bool" else wide(s.x.spec.dtype))
    onnx_op = "ArgMax" if s.op == "argmax" else "ArgMin"
    axis, keep = s.attrs["axis"], bool(s.attrs["keepdims"])
    if axis is not None:
        return b.node(onnx_op, [x], s.op, axis=_norm(axis, s.x.spec.ndim), keepdims=int(keep))
    flat = b.node("Reshape", [x, b.ints((-1,))], "flat")
    y = b.node(onnx_op, [flat], s.op, axis=0, keepdims=0)
    return b.node("Reshape", [y, b.ints(s.dims)], s.op) if keep else y


def _matmul(b: Builder, s: Site) -> str:
    cd = wide(_operand_dtype(s))
    y = b.node("MatMul", [operand(b, a, cd) for a in s.args], s.op)
    return b.cast(y, cd, s.spec.dtype)


# -- shapes and indexing ---------------------------------------------------------------------------


def _reshape(b: Builder, s: Site) -> str:
    dims = s.dims
    dynamic = [i for i, d in enumerate(dims) if isinstance(d, Affine)]
    if 0 in dims:  # a zero-size dim: ONNX's 0 would mean "copy this dim" without allowzero
        return b.node("Reshape", [s.name, b.ints(dims)], s.op, allowzero=1)
    if len(dynamic) == 1:  # the one size that follows the batch is what is left: -1
        dims = tuple(-1 if i == dynamic[0] else d for i, d in enumerate(dims))
    return b.node("Reshape", [s.name, b.ints(dims)], s.op)


def _permute_dims(b: Builder, s: Site) -> str:
    axes = cast(tuple[int, ...], s.attrs["axes"])
    return b.node("Transpose", [s.name], s.op, perm=[_norm(a, s.x.spec.ndim) for a in axes])


def _broadcast_to(b: Builder, s: Site) -> str:
    return b.node("Expand", [s.name, b.ints(s.dims)], s.op)


def _expand_dims(b: Builder, s: Site) -> str:
    axis = _norm(s.attrs["axis"], s.x.spec.ndim + 1)
    return b.node("Unsqueeze", [s.name, b.ints((axis,), "axes")], s.op)


def _squeeze(b: Builder, s: Site) -> str:
    axes = _axes(s)
    if not axes:  # ONNX's Squeeze without axes would squeeze every size-1 axis
        return s.name
    return b.node("Squeeze", [s.name, b.ints(axes, "axes")], s.op)


def _concat(b: Builder, s: Site) -> str:
    od = _operand_dtype(s)
    inputs = [operand(b, a, od) for a in s.args]
    if s.op == "stack":
        axis = _norm(s.attrs["axis"], s.x.spec.ndim + 1)
        inputs = [b.node("Unsqueeze", [x, b.ints((axis,), "axes")], "unsqueeze") for x in inputs]
    else:
        axis = _norm(s.attrs["axis"], s.x.spec.ndim)
    return b.node("Concat", inputs, s.op, axis=axis)


def _getitem(b: Builder, s: Site) -> str:
    """A normalized key (see client/indexing.py): one Slice for its slices and indices (an index i
    as i:i+1), then Squeeze the indexed axes and Unsqueeze the new ones."""
    key = cast(tuple[tuple[Sym, ...], ...], s.attrs["key"])
    starts: list[Dim] = []
    ends: list[Dim] = []
    axes: list[int] = []
    steps: list[int] = []
    dropped: list[int] = []
    new: list[int] = []
    axis = out_axis = 0
    for item in key:
        if item[0] == "n":
            new.append(out_axis)
            out_axis += 1
            continue
        dim = s.x.dims[axis]
        if item[0] == "i":
            start = cast(Dim, item[1])
            stop: Dim = start + 1 if isinstance(start, int) else Affine(start.scale, start.offset + 1)
            step = 1
            dropped.append(axis)
        else:
            start, stop, step = cast(tuple[Dim, Dim, int], item[1:])
            out_axis += 1
            if (start, stop, step) == (0, dim, 1):
                axis += 1
                continue  # the whole axis
        starts.append(start)
        ends.append(INT64_MAX if stop == dim else stop)
        axes.append(axis)
        steps.append(step)
        axis += 1
    y = s.name
    if axes:
        inputs = [
            b.ints(starts, "starts"),
            b.ints(ends, "ends"),
            b.ints(axes, "axes"),
            b.ints(steps, "steps"),
        ]
        y = b.node("Slice", [y, *inputs], "slice")
    if dropped:
        y = b.node("Squeeze", [y, b.ints(dropped, "axes")], "squeeze")
    if new:
        y = b.node("Unsqueeze", [y, b.ints(new, "axes")], "unsqueeze")
    return y


def _indices(b: Builder, arg: Arg) -> str:
    """Indices for Gather: int32 and int64 as they are, smaller ints widened (as the reference does)."""
    name = cast(str, arg.name)
    return name if arg.spec.dtype in ("int32", "int64") else b.cast(name, arg.spec.dtype, "int64")


def _take(b: Builder, s: Site) -> str:
    x, indices = s.name, _indices(b, s.args[1])
    axis = s.attrs["axis"]
    if axis is None:
        x = b.node("Reshape", [x, b.ints((-1,))], "flat")
        return b.node("Gather", [x, indices], s.op, axis=0)
    return b.node("Gather", [x, indices], s.op, axis=_norm(axis, s.x.spec.ndim))


# -- training-family ops ---------------------------------------------------------------------------


def _softmax(b: Builder, s: Site) -> str:
    cd = wide(float_dtype_for(s.x.spec))
    onnx_op = "Softmax" if s.op == "softmax" else "LogSoftmax"
    y = b.node(onnx_op, [operand(b, s.x, cd)], s.op, axis=_norm(s.attrs["axis"], s.x.spec.ndim))
    return b.cast(y, cd, s.spec.dtype)


def _cross_entropy(b: Builder, s: Site) -> str:
    """-log_softmax(logits)[i, labels[i]], NaN where a label is outside [0, C); mean, sum or none."""
    logits, labels = s.args
    cd = wide(logits.spec.dtype)
    lsm = b.node("LogSoftmax", [operand(b, logits, cd)], "log_softmax", axis=1)
    label = b.cast(cast(str, labels.name), labels.spec.dtype, "int64")
    classes = b.const(np.array(logits.spec.shape[1], np.int64))
    zero = b.scalar(0, "int64")
    valid = b.node(
        "And",
        [b.node("GreaterOrEqual", [label, zero], "nonnegative"), b.node("Less", [label, classes], "below")],
        "valid",
    )
    safe = b.node("Where", [valid, label, zero], "label")
    column = b.node("Unsqueeze", [safe, b.ints((1,), "axes")], "label")
    picked = b.node("GatherElements", [lsm, column], "picked", axis=1)
    picked = b.node("Squeeze", [picked, b.ints((1,), "axes")], "picked")
    nll = b.node("Where", [valid, b.node("Neg", [picked], "nll"), b.scalar(float("nan"), cd)], "nll")
    reduction = s.attrs["reduction"]
    if reduction != "none":
        nll = b.node("ReduceSum" if reduction == "sum" else "ReduceMean", [nll], s.op, keepdims=0)
    return b.cast(nll, cd, s.spec.dtype)


def _one_hot(b: Builder, s: Site) -> str:
    """labels[..., None] == arange(C), as the reference: a label outside [0, C) gives a zero row
    (ONNX's OneHot would count a negative label from the end)."""
    label = b.cast(s.name, s.x.spec.dtype, "int64")
    column = b.node("Unsqueeze", [label, b.ints((-1,), "axes")], "label")
    classes = b.const(np.arange(cast(int, s.attrs["num_classes"]), dtype=np.int64), "classes")
    return b.cast(b.node("Equal", [column, classes], s.op), "bool", s.spec.dtype)


# -- creation --------------------------------------------------------------------------------------


def _filled(b: Builder, s: Site) -> str:
    dtype = s.spec.dtype
    if s.op == "full":
        value = operand(b, s.x, dtype)
    else:
        value = b.const(np.array(1 if s.op == "ones" else 0, dtype=dtype))
    return b.node("Expand", [value, b.ints(s.dims)], s.op)


def _arange(b: Builder, s: Site) -> str:
    """The reference's `arange(n) * step + start` (in int64 for int arguments, else float64); a
    constant, or a Range where the length or the start follows the batch (`x[::-1]` on axis 0)."""
    start, step, stop = (s.attrs[k] for k in ("start", "step", "stop"))
    exact = all(type(v) is int or isinstance(v, Affine) for v in (start, stop, step))
    acc = "int64" if exact else "float64"
    n = s.dims[0]
    if isinstance(n, int) and not isinstance(start, Affine) and not isinstance(step, Affine):
        values = np.arange(n, dtype=acc) * cast(int | float, step) + cast(int | float, start)
        return b.const(values.astype(s.spec.dtype), s.op)
    count = b.node("Reshape", [b.ints((n,)), b.ints(())], "count")
    base = b.cast(b.node("Range", [b.scalar(0, "int64"), count, b.scalar(1, "int64")], "range"), "int64", acc)
    scaled = b.node("Mul", [base, _number(b, step, acc)], "scaled")
    return b.cast(b.node("Add", [scaled, _number(b, start, acc)], s.op), acc, s.spec.dtype)


def _number(b: Builder, value: Sym, dtype: str) -> str:
    """An attr's number as a 0-d constant of `dtype`, or computed from the batch where it follows it."""
    if isinstance(value, Affine):
        return b.cast(b.node("Reshape", [b.size(value), b.ints(())], "size"), "int64", dtype)
    return b.scalar(cast(Scalar, value), dtype)


def _eye(b: Builder, s: Site) -> str:
    if not is_static(s.dims):
        raise ExportError("eye: a size that follows the batch size has no export; use dynamic_batch=False")
    n, m = cast(tuple[int, int], s.dims)
    return b.const(np.eye(n, m, k=cast(int, s.attrs["k"]), dtype=s.spec.dtype), s.op)


# -- unfold and fold (im2col and col2im) -----------------------------------------------------------


def _pair(value: Sym) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    a, c = cast(tuple[int, int], value)
    return a, c


@dataclass(frozen=True, slots=True)
class _Window:
    """The sliding window of unfold/fold over a padded (Hp, Wp) image: which pixel (as an index
    into the flattened padded image) each (kernel offset, output position) reads."""

    padding: tuple[int, int]
    padded: tuple[int, int]
    index: np.ndarray  # (kh * kw, L) int64

    @classmethod
    def of(cls, op: str, attrs: Mapping[str, Sym], image: tuple[Dim, Dim]) -> _Window:
        if not is_static(image):
            raise ExportError(f"{op}: an image size that follows the batch size has no export")
        h, w = cast(tuple[int, int], image)
        (kh, kw), (dh, dw) = _pair(attrs["kernel_size"]), _pair(attrs["dilation"])
        (ph, pw), (sh, sw) = _pair(attrs["padding"]), _pair(attrs["stride"])
        hp, wp = h + 2 * ph, w + 2 * pw
        oh, ow = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
        rows = np.arange(kh)[:, None, None, None] * dh + np.arange(oh)[None, None, :, None] * sh
        cols = np.arange(kw)[None, :, None, None] * dw + np.arange(ow)[None, None, None, :] * sw
        return cls((ph, pw), (hp, wp), (rows * wp + cols).reshape(kh * kw, oh * ow).astype(np.int64))


def _unfold(b: Builder, s: Site) -> str:
    """im2col, (N, C, H, W) -> (N, C * kh * kw, L) (or without N): pad, flatten the image, Gather
    every window's pixels with a constant index. Exact for every dtype and value (a Conv with a
    one-hot kernel would turn an inf among the zeros into NaN)."""
    lead = s.x.dims[:-2]
    window = _Window.of(s.op, s.attrs, cast(tuple[Dim, Dim], s.x.dims[-2:]))
    (ph, pw), (hp, wp) = window.padding, window.padded
    x = s.name
    if ph or pw:
        zeros = (0,) * len(lead)
        x = b.node("Pad", [x, b.ints((*zeros, ph, pw, *zeros, ph, pw), "pads")], "pad")
    flat = b.node("Reshape", [x, b.ints((*lead, hp * wp))], "flat")
    windows = b.node("Gather", [flat, b.const(window.index, "im2col_index")], "windows", axis=len(lead))
    return b.node("Reshape", [windows, b.ints(s.dims)], s.op)


def _fold(b: Builder, s: Site) -> str:
    """col2im, (N, C * kh * kw, L) -> (N, C, H, W) (or without N): add every column into a padded
    zero image with ScatterElements(reduction="add") at unfold's indices, then crop the padding."""
    lead, (h, w) = s.dims[:-2], s.dims[-2:]
    window = _Window.of(s.op, s.attrs, (h, w))
    (ph, pw), (hp, wp) = window.padding, window.padded
    k, length = window.index.shape
    cd = wide(s.spec.dtype)
    columns = b.node("Reshape", [operand(b, s.x, cd), b.ints((*lead, k * length))], "columns")
    zeros = b.node("Expand", [b.const(np.zeros((), cd)), b.ints((*lead, hp * wp))], "zeros")
    flat_index = b.const(window.index.reshape(-1), "col2im_index")
    index = b.node("Expand", [flat_index, b.ints((*lead, k * length))], "index")
    image = b.node("ScatterElements", [zeros, index, columns], "image", axis=len(lead), reduction="add")
    image = b.node("Reshape", [image, b.ints((*lead, hp, wp))], "image")
    if ph or pw:
        h_, w_ = cast(tuple[int, int], (h, w))
        crop = [
            b.ints((ph, pw), "starts"),
            b.ints((ph + h_, pw + w_), "ends"),
            b.ints((len(lead), len(lead) + 1), "axes"),
        ]
        image = b.node("Slice", [image, *crop], "crop")
    return b.cast(image, cd, s.spec.dtype)


# -- the table -------------------------------------------------------------------------------------

REFUSED: dict[str, str] = {
    "rand": "random numbers in the forward pass (a Dropout layer in training mode? call model.eval() first)",
    "randn": "random numbers in the forward pass (a layer in training mode? call model.eval() first)",
    "getitem_grad": "a backward-pass op, which a forward pass under no_grad never records",
    "scatter_add": "a backward-pass op, which a forward pass under no_grad never records",
}
"""Ops with no export, and why (the ExportError says it)."""

LOWERINGS: dict[str, Lowering] = {
    "zeros": _filled,
    "ones": _filled,
    "full": _filled,
    "arange": _arange,
    "eye": _eye,
    **dict.fromkeys((*_UNARY, "square", "trunc"), _unary),
    "expm1": _near_zero,
    "log1p": _near_zero,
    **dict.fromkeys(("isnan", "isinf", "isfinite"), _predicate),
    **dict.fromkeys(_BINARY, _binary),
    "where": _where,
    "astype": _astype,
    **dict.fromkeys(("sum", "mean", "max", "min", "prod"), _reduce),
    "argmax": _arg_reduce,
    "argmin": _arg_reduce,
    "matmul": _matmul,
    "reshape": _reshape,
    "permute_dims": _permute_dims,
    "broadcast_to": _broadcast_to,
    "expand_dims": _expand_dims,
    "squeeze": _squeeze,
    "concat": _concat,
    "stack": _concat,
    "getitem": _getitem,
    "take": _take,
    "softmax": _softmax,
    "log_softmax": _softmax,
    "cross_entropy": _cross_entropy,
    "one_hot": _one_hot,
    # unfold/fold: PyTorch's nn.functional.unfold/fold (attrs kernel_size, dilation, padding, stride;
    # fold's output size is its output's spatial dims), which conv2d and pooling are built from.
    "unfold": _unfold,
    "fold": _fold,
}
"""Op name -> its lowering; with REFUSED, every op of `ops.OPS` (a test checks it)."""


def _lowering(op: str) -> Lowering:
    why = REFUSED.get(op)
    if why is not None:
        raise ExportError(f"{op}: cannot be exported: {why}")
    lowering = LOWERINGS.get(op)
    if lowering is None:
        raise ExportError(f"{op}: no ONNX form for this op (emberlink.onnx exports {len(LOWERINGS)} ops)")
    return lowering


def check_program(program: Program) -> None:
    """ExportError naming the first op of `program` that has no export."""
    for step in program.steps:
        _lowering(step.op)


def lower(b: Builder, s: Site) -> str:
    """The ONNX value holding `s.op`'s result; ExportError naming the op where it has no export."""
    return _lowering(s.op)(b, s)


__all__ = ["LOWERINGS", "REFUSED", "Arg", "Lowering", "Site", "check_program", "lower", "operand", "wide"]
