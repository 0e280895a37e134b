"""The op table: every op's inputs, attrs and shape/dtype inference; no arrays, no I/O.

Rules of this file (everything that decides whether a node is well formed lives here):
- `OPS` is the whole op vocabulary. A name not in it is refused everywhere (here, by the decoder,
  by the backends' tables); nothing ever looks an op up with `getattr`.
- Every op has exactly one output, whose spec `infer` computes from the input specs and the attrs
  alone. The client calls it when recording, the worker over a whole graph when decoding.
- Input kinds: `x` a tensor, `xb` a tensor or a binding, `b` a binding of any kind, `b_int` an int
  binding. Binary ops need at least one tensor.
- Attr values have exact Python types (`int` never accepts `bool`, tuples are tuples) and ints fit
  in int64. `check_attrs` returns them as the sorted `(name, value)` tuple a `Node` holds, with
  defaults filled in, so that one meaning has one canonical form.
- Errors: `DTypeError` for dtypes (operands, `dtype` attrs) and attr values of the wrong Python
  type; `ShapeError` for everything else (shapes, axes, arity, unknown ops or attrs). Messages
  name the op and every operand's shape or dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from emberlink.errors import DTypeError, ShapeError
from emberlink.graph_replay.ir import (
    DTYPES,
    MAX_RANK,
    AttrValue,
    Graph,
    Key,
    TensorSpec,
    binding_spec,
)
from emberlink.graph_replay.promotion import broadcast_shapes, float_dtype_for, promote, promote_all

InferFn = Callable[[str, Sequence[TensorSpec], Mapping[str, AttrValue]], TensorSpec]
Attrs = Mapping[str, AttrValue] | Iterable[tuple[str, AttrValue]]

MAX_VARIADIC = 64
"""Most inputs of `concat` and `stack`."""

FLOAT_DTYPES: tuple[str, ...] = ("float16", "float32", "float64")
REDUCTIONS: tuple[str, ...] = ("mean", "none", "sum")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

ATTR_KINDS: dict[str, tuple[str, ...]] = {
    "shape": ("shape",),
    "axis": ("axis", "axis_int", "axis_opt", "axis_tuple"),
    "axes": ("axes",),
    "keepdims": ("bool",),
    "dtype": ("dtype", "float_dtype"),
    "key": ("key",),
    "start": ("number",),
    "stop": ("number",),
    "step": ("number",),
    "n": ("count",),
    "m": ("count",),
    "k": ("int",),
    "num_classes": ("count",),
    "reduction": ("reduction",),
    "size": ("count",),
}
"""The attr allow-list: each name and the value kinds ops may declare it with."""


@dataclass(frozen=True)
class OpDef:
    """One entry of the op table."""

    name: str
    inputs: tuple[str, ...]
    attrs: Mapping[str, str]
    infer: InferFn
    defaults: Mapping[str, AttrValue] = field(default_factory=dict)
    variadic: bool = False

    @property
    def arity(self) -> tuple[int, int]:
        """Least and most inputs."""
        return (1, MAX_VARIADIC) if self.variadic else (len(self.inputs), len(self.inputs))

    def input_kind(self, i: int) -> str:
        return self.inputs[0] if self.variadic else self.inputs[i]


# -- attr checking ---------------------------------------------------------------------------------


def _is_int(v: object) -> bool:
    return type(v) is int and _INT64_MIN <= v <= _INT64_MAX


def _is_int_tuple(v: object) -> bool:
    return type(v) is tuple and len(v) <= MAX_RANK and all(_is_int(d) for d in v)


def _check_key(op: str, v: object) -> Key:
    if type(v) is not tuple or len(v) > MAX_RANK:
        raise DTypeError(f"{op}: key must be a tuple of at most {MAX_RANK} items, got {v!r}")
    for item in v:
        if type(item) is not tuple or not item or type(item[0]) is not str:
            raise DTypeError(f"{op}: key item must be a tuple starting with 's', 'i' or 'n', got {item!r}")
        tag, args = item[0], item[1:]
        want = {"s": 3, "i": 1, "n": 0}.get(tag)
        if want is None or len(args) != want or not all(_is_int(x) for x in args):
            raise DTypeError(f"{op}: malformed key item {item!r}")
        if any(x < 0 for x in args) or (tag == "s" and args[2] < 1):
            raise ShapeError(f"{op}: key item {item!r} is not normalized (bounds >= 0, step >= 1)")
    return cast(Key, v)


def _check_attr_value(op: str, name: str, kind: str, v: object) -> AttrValue:
    bad = f"{op}: attr {name!r} must be"
    if kind == "shape":
        if not _is_int_tuple(v) or any(d < 0 for d in cast(tuple[int, ...], v)):
            raise DTypeError(f"{bad} a tuple of at most {MAX_RANK} non-negative ints, got {v!r}")
    elif kind in ("axis_tuple", "axes"):
        if not _is_int_tuple(v):
            raise DTypeError(f"{bad} a tuple of ints, got {v!r}")
    elif kind == "axis":
        if not (v is None or _is_int(v) or _is_int_tuple(v)):
            raise DTypeError(f"{bad} an int, a tuple of ints or None, got {v!r}")
    elif kind == "axis_opt":
        if not (v is None or _is_int(v)):
            raise DTypeError(f"{bad} an int or None, got {v!r}")
    elif kind in ("axis_int", "int"):
        if not _is_int(v):
            raise DTypeError(f"{bad} an int, got {v!r}")
    elif kind == "count":
        if not _is_int(v) or cast(int, v) < 0:
            raise DTypeError(f"{bad} a non-negative int, got {v!r}")
    elif kind == "bool":
        if type(v) is not bool:
            raise DTypeError(f"{bad} a bool, got {v!r}")
    elif kind in ("dtype", "float_dtype"):
        allowed = DTYPES if kind == "dtype" else FLOAT_DTYPES
        if type(v) is not str or v not in allowed:
            raise DTypeError(f"{bad} one of {allowed}, got {v!r}")
    elif kind == "number":
        if not (_is_int(v) or (type(v) is float and math.isfinite(v))):
            raise DTypeError(f"{bad} an int or a finite float, got {v!r}")
    elif kind == "reduction":
        if type(v) is not str or v not in REDUCTIONS:
            raise DTypeError(f"{bad} one of {REDUCTIONS}, got {v!r}")
    elif kind == "key":
        return _check_key(op, v)
    else:  # pragma: no cover - the table below uses only the kinds above
        raise AssertionError(kind)
    return cast(AttrValue, v)


def get_op(op: object) -> OpDef:
    """The table entry for `op`; ShapeError when there is none."""
    opdef = OPS.get(op) if type(op) is str else None
    if opdef is None:
        raise ShapeError(f"unknown op {op!r}")
    return opdef


def check_attrs(
    op: str, attrs: Attrs = (), *, fill_defaults: bool = True
) -> tuple[tuple[str, AttrValue], ...]:
    """Validate `attrs` for `op` and return them as a Node holds them: sorted, defaults filled.

    With `fill_defaults=False` every attr must be given (the decoder's canonical check).
    """
    opdef = get_op(op)
    pairs = list(attrs.items()) if isinstance(attrs, Mapping) else list(attrs)
    given: dict[str, AttrValue] = {}
    for name, value in pairs:
        if name in given:
            raise ShapeError(f"{op}: attr {name!r} given twice")
        if name not in opdef.attrs:
            raise ShapeError(f"{op}: unknown attr {name!r}; it takes {sorted(opdef.attrs)}")
        given[name] = _check_attr_value(op, name, opdef.attrs[name], value)
    for name in opdef.attrs:
        if name not in given:
            if not fill_defaults or name not in opdef.defaults:
                raise ShapeError(f"{op}: missing attr {name!r}")
            given[name] = opdef.defaults[name]
    return tuple(sorted(given.items()))


# -- inference -------------------------------------------------------------------------------------


def infer(op: str, in_specs: Sequence[TensorSpec], attrs: Attrs = ()) -> TensorSpec:
    """The spec of `op`'s output; ShapeError or DTypeError naming the op and the operands."""
    opdef = get_op(op)
    amap = dict(check_attrs(op, attrs))
    lo, hi = opdef.arity
    if not lo <= len(in_specs) <= hi:
        want = f"{lo}" if lo == hi else f"{lo} to {hi}"
        raise ShapeError(f"{op}: takes {want} inputs, got {len(in_specs)}")
    for i, spec in enumerate(in_specs):
        kind = opdef.input_kind(i)
        if kind == "x" and spec.weak:
            raise DTypeError(f"{op}: input {i} must be a tensor, got a {spec.describe()}")
        if kind in ("b", "b_int") and not spec.weak:
            raise DTypeError(f"{op}: input {i} must be a binding (scalar), got a tensor {spec.describe()}")
        if kind == "b_int" and spec.dtype != "int":
            raise DTypeError(f"{op}: input {i} must be an int binding, got a {spec.describe()}")
    return opdef.infer(op, in_specs, amap)


def operand_dtype(op: str, in_specs: Sequence[TensorSpec]) -> str | None:
    """The dtype a backend brings the operands to before computing, where the op has one.

    Binary ops, `where`, `concat`, `stack`, `matmul` and the float-only ops; None for the rest.
    Weak scalars are cast to it too (docs/internals.md: "backends cast the scalar first").
    """
    if op in _LOGICAL:
        return "bool"
    if op == "divide":
        return float_dtype_for(TensorSpec(promote(in_specs[0], in_specs[1]), ()))
    if op in _BINARY or op == "matmul":
        return promote(in_specs[0], in_specs[1])
    if op == "where":
        return promote(in_specs[1], in_specs[2])
    if op in ("concat", "stack"):
        return promote_all(in_specs)
    if op in _UNARY_FLOAT or op in ("softmax", "log_softmax", "mean"):
        return float_dtype_for(in_specs[0])
    return None


def graph_specs(graph: Graph) -> tuple[TensorSpec, ...]:
    """The spec of every value of `graph`, inferring each node in order.

    References must be in range and earlier than their use; ShapeError/DTypeError otherwise.
    """
    specs: list[TensorSpec] = list(graph.inputs)
    specs.extend(binding_spec(k) for k in graph.bindings)
    for i, node in enumerate(graph.nodes):
        here = len(specs)
        for v in node.inputs:
            if type(v) is not int or not 0 <= v < here:
                raise ShapeError(f"node {i} ({node.op}): input {v!r} is not an earlier value (< {here})")
        specs.append(infer(node.op, [specs[v] for v in node.inputs], node.attrs))
    for v in graph.outputs:
        if type(v) is not int or not 0 <= v < len(specs):
            raise ShapeError(f"output {v!r} is not a value of the graph (< {len(specs)})")
        if specs[v].weak:
            raise ShapeError(f"output {v} is a binding; outputs are tensors")
    return tuple(specs)


def op_names() -> tuple[str, ...]:
    """Every op name, sorted."""
    return tuple(sorted(OPS))


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


def _creation(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    return TensorSpec(cast(str, a["dtype"]), cast(tuple[int, ...], a["shape"]))


def _arange(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    start, stop, step = (cast(int | float, a[k]) for k in ("start", "stop", "step"))
    dtype = cast(str, a["dtype"])
    if dtype == "bool":
        raise DTypeError(f"{op}: dtype bool is not allowed")
    if step == 0:
        raise ShapeError(f"{op}: step must not be 0")
    if isinstance(start, int) and isinstance(stop, int) and isinstance(step, int):
        n = len(range(start, stop, step))
    else:
        q = (stop - start) / step
        if not math.isfinite(q):
            raise ShapeError(f"{op}: ({start}, {stop}, {step}) gives too many elements")
        n = max(0, math.ceil(q))
    return TensorSpec(dtype, (n,))


def _eye(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    return TensorSpec(cast(str, a["dtype"]), (cast(int, a["n"]), cast(int, a["m"])))


def _unary(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x = ins[0]
    if op == "logical_not":
        if x.kind != "bool":
            raise DTypeError(f"{op}: needs a bool operand, got {x.dtype}")
        return x
    if op in _UNARY_FLOAT:
        return TensorSpec(float_dtype_for(x), x.shape)
    if x.kind == "bool":
        raise DTypeError(f"{op}: needs a numeric operand, got {x.dtype}")
    return x


def _binary(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x, y = ins
    if x.weak and y.weak:
        raise DTypeError(f"{op}: needs at least one tensor, got {_dt(x)} and {_dt(y)}")
    shape = broadcast_shapes(op, x, y)
    if op in _LOGICAL:
        if x.kind != "bool" or y.kind != "bool":
            raise DTypeError(f"{op}: needs bool operands, got {_dt(x)} and {_dt(y)}")
        return TensorSpec("bool", shape)
    dtype = promote(x, y)
    if op in _COMPARE:
        return TensorSpec("bool", shape)
    if op in ("maximum", "minimum"):
        return TensorSpec(dtype, shape)
    if dtype == "bool":
        raise DTypeError(f"{op}: needs numeric operands, got {_dt(x)} and {_dt(y)}")
    if op == "divide":
        dtype = float_dtype_for(TensorSpec(dtype, ()))
    return TensorSpec(dtype, shape)


def _where(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    cond, x, y = ins
    if cond.dtype != "bool":
        raise DTypeError(f"{op}: condition must be bool, got {cond.dtype}")
    return TensorSpec(promote(x, y), broadcast_shapes(op, cond, x, y))


def _astype(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    return TensorSpec(cast(str, a["dtype"]), ins[0].shape)


def _reduced_shape(x: TensorSpec, axes: tuple[int, ...], keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    return tuple(d for i, d in enumerate(x.shape) if i not in axes)


def _reduce(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
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


def _matmul(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
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


def _reshape(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x, shape = ins[0], cast(tuple[int, ...], a["shape"])
    if math.prod(shape) != x.size:
        raise ShapeError(f"{op}: cannot reshape {x.shape} ({x.size} elements) to {shape}")
    return TensorSpec(x.dtype, shape)


def _permute_dims(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x, axes = ins[0], cast(tuple[int, ...], a["axes"])
    norm = tuple(_norm_axis(op, ax, x.ndim) for ax in axes) if len(axes) == x.ndim else ()
    if sorted(norm) != list(range(x.ndim)) or len(axes) != x.ndim:
        raise ShapeError(f"{op}: axes {axes} are not a permutation of the axes of shape {x.shape}")
    return TensorSpec(x.dtype, tuple(x.shape[i] for i in norm))


def _broadcast_to(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x, shape = ins[0], cast(tuple[int, ...], a["shape"])
    ok = len(shape) >= x.ndim and all(d in (1, t) for d, t in zip(reversed(x.shape), reversed(shape)))
    if not ok:
        raise ShapeError(f"{op}: cannot broadcast shape {x.shape} to {shape}")
    return TensorSpec(x.dtype, shape)


def _expand_dims(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x = ins[0]
    axis = _norm_axis(op, cast(int, a["axis"]), x.ndim, extra=1)
    return TensorSpec(x.dtype, x.shape[:axis] + (1,) + x.shape[axis:])


def _squeeze(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x = ins[0]
    axes = _norm_axes(op, a["axis"], x)
    if any(x.shape[i] != 1 for i in axes):
        raise ShapeError(f"{op}: cannot squeeze axes {a['axis']!r} of shape {x.shape}: size is not 1")
    return TensorSpec(x.dtype, tuple(d for i, d in enumerate(x.shape) if i not in axes))


def _concat(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
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
            out.append(len(range(start, stop, step)))
        d += 1
    return (*out, *shape[d:])


def _getitem(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x = ins[0]
    return TensorSpec(x.dtype, _getitem_shape(op, x.shape, cast(Key, a["key"])))


def _getitem_grad(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    g, shape = ins[0], cast(tuple[int, ...], a["shape"])
    want = _getitem_shape(op, shape, cast(Key, a["key"]))
    if want != g.shape:
        raise ShapeError(f"{op}: gradient shape {g.shape} != {want}, the shape of the key into {shape}")
    return TensorSpec(g.dtype, shape)


def _check_indices(op: str, ind: TensorSpec) -> None:
    if ind.kind != "int":
        raise DTypeError(f"{op}: indices must be int32 or int64, got {ind.dtype}")


def _take(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
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


def _scatter_add(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
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


def _softmax(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    x = ins[0]
    _norm_axis(op, cast(int, a["axis"]), x.ndim)
    return TensorSpec(float_dtype_for(x), x.shape)


def _cross_entropy(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    logits, labels = ins
    if logits.kind != "float":
        raise DTypeError(f"{op}: logits must be float, got {logits.dtype} (labels {labels.dtype})")
    _check_indices(op, labels)
    if logits.ndim != 2 or labels.ndim != 1 or logits.shape[0] != labels.shape[0] or logits.shape[1] == 0:
        raise ShapeError(f"{op}: needs logits [N, C>0] and labels [N], got {logits.shape} and {labels.shape}")
    shape = labels.shape if a["reduction"] == "none" else ()
    return TensorSpec(logits.dtype, shape)


def _one_hot(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    labels = ins[0]
    _check_indices(op, labels)
    if labels.ndim >= MAX_RANK:
        raise ShapeError(f"{op}: labels of shape {labels.shape} leave no room for the class axis")
    return TensorSpec(cast(str, a["dtype"]), (*labels.shape, cast(int, a["num_classes"])))


def _rand(op: str, ins: Sequence[TensorSpec], a: Mapping[str, AttrValue]) -> TensorSpec:
    return _creation(op, ins, a)


_UNARY_SAME = ("negative", "abs", "square", "sign", "relu")
_UNARY_FLOAT = ("exp", "log", "sqrt", "tanh", "sigmoid", "sin", "cos")
_ARITH = ("add", "subtract", "multiply", "divide", "pow", "maximum", "minimum")
_COMPARE = ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")
_LOGICAL = ("logical_and", "logical_or")
_BINARY = _ARITH + _COMPARE + _LOGICAL

_SHAPE_DTYPE = {"shape": "shape", "dtype": "dtype"}
_REDUCE_ATTRS = {"axis": "axis", "keepdims": "bool"}
_ARG_ATTRS = {"axis": "axis_opt", "keepdims": "bool"}
_NO_AXIS_KEEP: dict[str, AttrValue] = {"axis": None, "keepdims": False}


def _table() -> dict[str, OpDef]:
    defs = [
        OpDef("zeros", (), _SHAPE_DTYPE, _creation),
        OpDef("ones", (), _SHAPE_DTYPE, _creation),
        OpDef("full", ("b",), _SHAPE_DTYPE, _creation),
        OpDef(
            "arange", (), {"start": "number", "stop": "number", "step": "number", "dtype": "dtype"}, _arange
        ),
        OpDef("eye", (), {"n": "count", "m": "count", "k": "int", "dtype": "dtype"}, _eye, {"k": 0}),
        OpDef("rand", ("b_int",), {"shape": "shape", "dtype": "float_dtype"}, _rand),
        OpDef("randn", ("b_int",), {"shape": "shape", "dtype": "float_dtype"}, _rand),
        *(OpDef(name, ("x",), {}, _unary) for name in (*_UNARY_SAME, *_UNARY_FLOAT, "logical_not")),
        *(OpDef(name, ("xb", "xb"), {}, _binary) for name in _BINARY),
        OpDef("where", ("x", "xb", "xb"), {}, _where),
        OpDef("astype", ("x",), {"dtype": "dtype"}, _astype),
        *(
            OpDef(name, ("x",), _REDUCE_ATTRS, _reduce, _NO_AXIS_KEEP)
            for name in ("sum", "mean", "max", "min", "prod")
        ),
        *(OpDef(name, ("x",), _ARG_ATTRS, _reduce, _NO_AXIS_KEEP) for name in ("argmax", "argmin")),
        OpDef("matmul", ("x", "x"), {}, _matmul),
        OpDef("reshape", ("x",), {"shape": "shape"}, _reshape),
        OpDef("permute_dims", ("x",), {"axes": "axes"}, _permute_dims),
        OpDef("broadcast_to", ("x",), {"shape": "shape"}, _broadcast_to),
        OpDef("expand_dims", ("x",), {"axis": "axis_int"}, _expand_dims),
        OpDef("squeeze", ("x",), {"axis": "axis_tuple"}, _squeeze),
        OpDef("concat", ("x",), {"axis": "axis_int"}, _concat, {"axis": 0}, variadic=True),
        OpDef("stack", ("x",), {"axis": "axis_int"}, _concat, {"axis": 0}, variadic=True),
        OpDef("getitem", ("x",), {"key": "key"}, _getitem),
        OpDef("take", ("x", "x"), {"axis": "axis_opt"}, _take, {"axis": None}),
        OpDef("softmax", ("x",), {"axis": "axis_int"}, _softmax, {"axis": -1}),
        OpDef("log_softmax", ("x",), {"axis": "axis_int"}, _softmax, {"axis": -1}),
        OpDef("cross_entropy", ("x", "x"), {"reduction": "reduction"}, _cross_entropy, {"reduction": "mean"}),
        OpDef("one_hot", ("x",), {"num_classes": "count", "dtype": "dtype"}, _one_hot),
        OpDef("getitem_grad", ("x",), {"key": "key", "shape": "shape"}, _getitem_grad),
        OpDef("scatter_add", ("x", "x"), {"axis": "axis_opt", "size": "count"}, _scatter_add),
    ]
    return {d.name: d for d in defs}


OPS: Mapping[str, OpDef] = _table()
"""The op vocabulary: name -> OpDef. Backends' tables must have exactly these keys."""

__all__ = [
    "ATTR_KINDS",
    "FLOAT_DTYPES",
    "MAX_VARIADIC",
    "OPS",
    "REDUCTIONS",
    "OpDef",
    "check_attrs",
    "get_op",
    "graph_specs",
    "infer",
    "op_names",
    "operand_dtype",
]
