"""The op table: every fact about every op, one entry per op; no array work happens here.

Rules of this file (everything that decides what an op is and means lives here):
- `OPS` is the whole op vocabulary. A name not in it is refused everywhere (here, by the decoder,
  by the backends' tables); nothing ever looks an op up with `getattr`.
- An entry (`OpDef`) holds the op's family, its inputs and attrs, its shape/dtype inference
  (inference.py), the dtype its operands are brought to (`operands`), its gradient (`grad`, a
  rule of gradients.py, or None: not differentiable; every entry says which), what backward
  keeps alive (`grad.saves_inputs`/`saves_output`), whether its result may be a view of its
  first input (`view`); and for elementwise ops the reference meaning over an array module
  (`ref`, what numpy_backend.py and cupy_backend.py run), whether that honours `out=` (`into`,
  buffer reuse in plan.py) and its expression in a fused CUDA kernel (`expr`, fusion.py).
- Everything else is derived from the entries: the backends' elementwise tables, what fuses,
  what may reuse a buffer, what is differentiable and what it saves, the client's elementwise
  Tensor methods, functions and exports (a test checks each against this table).
- Every op has exactly one output, whose spec `infer` computes from the input specs and the attrs
  alone. The client calls it when recording, the worker over a whole graph when decoding.
- Input kinds: `x` a tensor, `xb` a tensor or a binding, `b` a binding of any kind, `b_int` an int
  binding. Binary ops need at least one tensor.
- Attr values (checked in attrs.py) have exact Python types (`int` never accepts `bool`, tuples
  are tuples) and ints fit in int64. `check_attrs` returns them as the sorted `(name, value)`
  tuple a `Node` holds, with defaults filled in, so that one meaning has one canonical form.
- Errors: `DTypeError` for dtypes (operands, `dtype` attrs) and attr values of the wrong Python
  type; `ShapeError` for everything else (shapes, axes, arity, unknown ops or attrs). Messages
  name the op and every operand's shape or dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from emberlink.errors import DTypeError, ShapeError
from emberlink.graph_replay import gradients as gr
from emberlink.graph_replay import inference as inf
from emberlink.graph_replay.attrs import ATTR_KINDS, REDUCTIONS, check_attr_value
from emberlink.graph_replay.gradients import Grad, unary
from emberlink.graph_replay.ir import AttrValue, Graph, TensorSpec, binding_spec
from emberlink.graph_replay.promotion import float_dtype_for, promote, promote_all

InferFn = Callable[[str, Sequence[TensorSpec], Mapping[str, AttrValue]], TensorSpec]
OperandFn = Callable[[Sequence[TensorSpec]], str]
Elementwise = Callable[..., Any]
"""`(xp, *operands, out=None) -> array`: an elementwise op's meaning over array module `xp`
(NumPy or CuPy), on operands already brought to the op's operand dtype."""
Attrs = Mapping[str, object] | Iterable[tuple[str, object]]
"""Attrs as a caller gives them, of any values: `check_attrs` checks each at run time (a DTypeError
naming the op and the attr), so a plain dict literal of mixed values is accepted as it is."""

MAX_VARIADIC = 64
"""Most inputs of `concat` and `stack`."""

FAMILIES = (
    "creation",
    "unary",
    "binary",
    "select",
    "cast",
    "reduction",
    "linalg",
    "shape",
    "index",
    "training",
    "window",
    "backward",
)
"""Op families; `unary` and `binary` are the elementwise ones (each has `ref`); `window` are the
sliding-window ops that convolution and pooling are composed of (nn/spatial.py)."""


@dataclass(frozen=True, kw_only=True)
class OpDef:
    """One entry of the op table (see the rules at the top of this file)."""

    name: str
    family: str
    inputs: tuple[str, ...]
    infer: InferFn
    grad: Grad | None
    """The gradient, or None: the op passes no gradient (required, so no entry forgets it)."""
    attrs: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, AttrValue] = field(default_factory=dict)
    variadic: bool = False
    operands: OperandFn | None = None
    """The dtype a backend brings the operands (weak scalars too) to before computing."""
    ref: Elementwise | None = None
    into: bool = False
    """Whether `ref` computes into a given `out=` buffer of the result's spec (buffer reuse)."""
    expr: str | None = None
    """The C expression of a fused kernel: `{0}`, `{1}`, ... the operands (already of the
    operand dtype), `{t}` their C type; None: the op never joins a fused chain."""
    view: bool = False
    """Whether the result may share memory with the first input."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"op {self.name}: unknown family {self.family!r}")
        if (self.ref is not None) != (self.family in ("unary", "binary")):
            raise ValueError(f"op {self.name}: exactly the elementwise ops have a reference `ref`")
        if self.into and self.ref is None:
            raise ValueError(f"op {self.name}: `into` needs a reference `ref`")

    @property
    def arity(self) -> tuple[int, int]:
        """Least and most inputs."""
        return (1, MAX_VARIADIC) if self.variadic else (len(self.inputs), len(self.inputs))

    def input_kind(self, i: int) -> str:
        return self.inputs[0] if self.variadic else self.inputs[i]


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
        given[name] = check_attr_value(op, name, opdef.attrs[name], value)
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
    """The dtype a backend brings the operands to before computing, where the op has one (its
    entry's `operands`); None for the rest. Weak scalars are cast to it too (docs/internals.md:
    "backends cast the scalar first")."""
    rule = get_op(op).operands
    return None if rule is None else rule(in_specs)


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


def binding_dtypes(graph: Graph) -> tuple[str | None, ...]:
    """For each binding, the one dtype every use of it casts it to, or None (uses differ, or none).

    A backend never computes with a binding's own value: ops taking a binding as an operand
    (inputs of kind `xb`) cast it to their `operand_dtype`, `full` to its output dtype. So a
    float binding whose only dtype is float32 may travel as a float32 without changing any
    result (the client's encoder uses this).
    """
    specs = graph_specs(graph)
    first_binding = len(graph.inputs)
    found: list[set[str | None]] = [set() for _ in graph.bindings]
    for i, node in enumerate(graph.nodes):
        in_specs = [specs[v] for v in node.inputs]
        if node.op == "full":
            cast: str | None = specs[graph.node_value(i)].dtype
        elif "xb" in OPS[node.op].inputs:
            cast = operand_dtype(node.op, in_specs)
        else:
            cast = None
        for v in node.inputs:
            if first_binding <= v < graph.first_node_value:
                found[v - first_binding].add(cast)
    return tuple(next(iter(d)) if len(d) == 1 else None for d in found)


def op_names() -> tuple[str, ...]:
    """Every op name, sorted."""
    return tuple(sorted(OPS))


def names(family: str) -> tuple[str, ...]:
    """The ops of one family, in table order."""
    return tuple(name for name, d in OPS.items() if d.family == family)


# -- operand dtypes --------------------------------------------------------------------------------


def _float_of_first(ins: Sequence[TensorSpec]) -> str:
    return float_dtype_for(ins[0])


def _promoted(ins: Sequence[TensorSpec]) -> str:
    return promote(ins[0], ins[1])


def _float_of_promoted(ins: Sequence[TensorSpec]) -> str:
    return float_dtype_for(TensorSpec(promote(ins[0], ins[1]), ()))


def _promoted_values(ins: Sequence[TensorSpec]) -> str:
    return promote(ins[1], ins[2])


def _bool(ins: Sequence[TensorSpec]) -> str:
    return "bool"


# -- elementwise references ------------------------------------------------------------------------
# Each computes into `out` when given one (the same ufunc loop runs either way), except where the
# entry says `into=False`.


def _relu(xp: Any, x: Any, out: Any = None) -> Any:
    return xp.maximum(x, x.dtype.type(0), out=out)


def _sigmoid(xp: Any, x: Any, out: Any = None) -> Any:
    # Several ufuncs in the wide dtype (float16 in float32): never written into a buffer.
    xf = x.astype("float32" if x.dtype == "float16" else x.dtype, copy=False)
    return (1 / (1 + xp.exp(-xf))).astype(x.dtype, copy=False)


def _rounding(fn: Callable[[Any], Any]) -> Elementwise:
    """A rounding op: floats through the ufunc `fn(xp)`; integers keep their values and dtype
    (Array API; NumPy before 2.1 would give float64)."""

    def ref(xp: Any, x: Any, out: Any = None) -> Any:
        if x.dtype.kind == "f":
            return fn(xp)(x, out=out)
        if out is None:
            return x.copy()
        xp.copyto(out, x)
        return out

    return ref


def _unary_same(name: str, ref: Elementwise, *, grad: Grad | None, expr: str | None) -> OpDef:
    return OpDef(name=name, family="unary", inputs=("x",), infer=inf.unary_same, ref=ref, into=True,
                 expr=expr, grad=grad)  # fmt: skip


def _unary_float(
    name: str, ref: Elementwise, *, grad: Grad | None, expr: str | None, into: bool = True
) -> OpDef:
    return OpDef(name=name, family="unary", inputs=("x",), infer=inf.unary_float,
                 operands=_float_of_first, ref=ref, into=into, expr=expr, grad=grad)  # fmt: skip


def _predicate(name: str, ref: Elementwise, *, expr: str) -> OpDef:
    return OpDef(name=name, family="unary", inputs=("x",), infer=inf.unary_predicate, ref=ref, into=True,
                 expr=expr, grad=None)  # fmt: skip


def _binary(
    name: str, infer: InferFn, operands: OperandFn, ref: Elementwise, *, grad: Grad | None, expr: str
) -> OpDef:
    return OpDef(name=name, family="binary", inputs=("xb", "xb"), infer=infer, operands=operands,
                 ref=ref, into=True, expr=expr, grad=grad)  # fmt: skip


# Piecewise-constant ops have a zero gradient (as in PyTorch); predicates, comparisons, sign and
# logical ops none. Derivatives read the input x or the output y, as `saves` says.
_ELEMENTWISE: tuple[OpDef, ...] = (
    _unary_same("negative", lambda xp, x, out=None: xp.negative(x, out=out), expr="(-{0})",
                grad=unary(lambda g, x, y: -g, saves="none")),
    _unary_same("abs", lambda xp, x, out=None: xp.abs(x, out=out), expr="fabs({0})",
                grad=unary(lambda g, x, y: g * x.sign(), saves="input")),
    _unary_same("square", lambda xp, x, out=None: xp.square(x, out=out), expr="({0} * {0})",
                grad=unary(lambda g, x, y: g * (x * 2.0), saves="input")),
    _unary_same("sign", lambda xp, x, out=None: xp.sign(x, out=out), expr=None, grad=None),
    _unary_same("relu", _relu, expr="(({0} > ({t})0 || {0} != {0}) ? {0} : ({t})0)",
                grad=unary(lambda g, x, y: g * (x > 0), saves="input")),
    _unary_same("floor", _rounding(lambda xp: xp.floor), expr="floor({0})", grad=gr.ZERO),
    _unary_same("ceil", _rounding(lambda xp: xp.ceil), expr="ceil({0})", grad=gr.ZERO),
    _unary_same("round", _rounding(lambda xp: xp.rint), expr="rint({0})", grad=gr.ZERO),
    _unary_same("trunc", _rounding(lambda xp: xp.trunc), expr="trunc({0})", grad=gr.ZERO),
    _unary_float("exp", lambda xp, x, out=None: xp.exp(x, out=out), expr="exp({0})",
                 grad=unary(lambda g, x, y: g * y, saves="output")),
    _unary_float("expm1", lambda xp, x, out=None: xp.expm1(x, out=out), expr="expm1({0})",
                 grad=unary(lambda g, x, y: g * (y + 1.0), saves="output")),
    _unary_float("log", lambda xp, x, out=None: xp.log(x, out=out), expr="log({0})",
                 grad=unary(lambda g, x, y: g / x, saves="input")),
    _unary_float("log1p", lambda xp, x, out=None: xp.log1p(x, out=out), expr="log1p({0})",
                 grad=unary(lambda g, x, y: g / (x + 1.0), saves="input")),
    _unary_float("sqrt", lambda xp, x, out=None: xp.sqrt(x, out=out), expr="sqrt({0})",
                 grad=unary(lambda g, x, y: (g / y) * 0.5, saves="output")),
    _unary_float("tanh", lambda xp, x, out=None: xp.tanh(x, out=out), expr="tanh({0})",
                 grad=unary(lambda g, x, y: g * (1.0 - y * y), saves="output")),
    _unary_float("sigmoid", _sigmoid, into=False, expr="(({t})1 / (({t})1 + exp(-{0})))",
                 grad=unary(lambda g, x, y: g * (y * (1.0 - y)), saves="output")),
    _unary_float("sin", lambda xp, x, out=None: xp.sin(x, out=out), expr="sin({0})",
                 grad=unary(lambda g, x, y: g * x.cos(), saves="input")),
    _unary_float("cos", lambda xp, x, out=None: xp.cos(x, out=out), expr="cos({0})",
                 grad=unary(lambda g, x, y: -(g * x.sin()), saves="input")),
    _unary_float("sinh", lambda xp, x, out=None: xp.sinh(x, out=out), expr="sinh({0})",
                 grad=unary(lambda g, x, y: g * x.cosh(), saves="input")),
    _unary_float("cosh", lambda xp, x, out=None: xp.cosh(x, out=out), expr="cosh({0})",
                 grad=unary(lambda g, x, y: g * x.sinh(), saves="input")),
    _unary_float("arctan", lambda xp, x, out=None: xp.arctan(x, out=out), expr="atan({0})",
                 grad=unary(lambda g, x, y: g / (x * x + 1.0), saves="input")),
    _predicate("isnan", lambda xp, x, out=None: xp.isnan(x, out=out), expr="isnan({0})"),
    _predicate("isinf", lambda xp, x, out=None: xp.isinf(x, out=out), expr="isinf({0})"),
    _predicate("isfinite", lambda xp, x, out=None: xp.isfinite(x, out=out), expr="isfinite({0})"),
    OpDef(name="logical_not", family="unary", inputs=("x",), infer=inf.logical_not,
          ref=lambda xp, x, out=None: xp.logical_not(x, out=out), into=True, expr="(!{0})", grad=None),
    _binary("add", inf.arithmetic, _promoted, lambda xp, a, b, out=None: xp.add(a, b, out=out),
            expr="({0} + {1})", grad=gr.BINARY["add"]),
    _binary("subtract", inf.arithmetic, _promoted, lambda xp, a, b, out=None: xp.subtract(a, b, out=out),
            expr="({0} - {1})", grad=gr.BINARY["subtract"]),
    _binary("multiply", inf.arithmetic, _promoted, lambda xp, a, b, out=None: xp.multiply(a, b, out=out),
            expr="({0} * {1})", grad=gr.BINARY["multiply"]),
    _binary("divide", inf.divide, _float_of_promoted,
            lambda xp, a, b, out=None: xp.true_divide(a, b, out=out),
            expr="({0} / {1})", grad=gr.BINARY["divide"]),
    _binary("pow", inf.arithmetic, _promoted, lambda xp, a, b, out=None: xp.power(a, b, out=out),
            expr="pow({0}, {1})", grad=gr.BINARY["pow"]),
    _binary("maximum", inf.extremum, _promoted, lambda xp, a, b, out=None: xp.maximum(a, b, out=out),
            expr="(({0} > {1} || {0} != {0}) ? {0} : {1})", grad=gr.BINARY["maximum"]),
    _binary("minimum", inf.extremum, _promoted, lambda xp, a, b, out=None: xp.minimum(a, b, out=out),
            expr="(({0} < {1} || {0} != {0}) ? {0} : {1})", grad=gr.BINARY["minimum"]),
    _binary("equal", inf.compare, _promoted, lambda xp, a, b, out=None: xp.equal(a, b, out=out),
            expr="({0} == {1})", grad=None),
    _binary("not_equal", inf.compare, _promoted, lambda xp, a, b, out=None: xp.not_equal(a, b, out=out),
            expr="({0} != {1})", grad=None),
    _binary("less", inf.compare, _promoted, lambda xp, a, b, out=None: xp.less(a, b, out=out),
            expr="({0} < {1})", grad=None),
    _binary("less_equal", inf.compare, _promoted, lambda xp, a, b, out=None: xp.less_equal(a, b, out=out),
            expr="({0} <= {1})", grad=None),
    _binary("greater", inf.compare, _promoted, lambda xp, a, b, out=None: xp.greater(a, b, out=out),
            expr="({0} > {1})", grad=None),
    _binary("greater_equal", inf.compare, _promoted,
            lambda xp, a, b, out=None: xp.greater_equal(a, b, out=out), expr="({0} >= {1})", grad=None),
    _binary("logical_and", inf.logical, _bool, lambda xp, a, b, out=None: xp.logical_and(a, b, out=out),
            expr="({0} && {1})", grad=None),
    _binary("logical_or", inf.logical, _bool, lambda xp, a, b, out=None: xp.logical_or(a, b, out=out),
            expr="({0} || {1})", grad=None),
)  # fmt: skip

_SHAPE_DTYPE = {"shape": "shape", "dtype": "dtype"}
_SHAPE_FLOAT_DTYPE = {"shape": "shape", "dtype": "float_dtype"}
_REDUCE_ATTRS = {"axis": "axis", "keepdims": "bool"}
_ARG_ATTRS = {"axis": "axis_opt", "keepdims": "bool"}
_NO_AXIS_KEEP: dict[str, AttrValue] = {"axis": None, "keepdims": False}
_AXIS_INT = {"axis": "axis_int"}
_WINDOW = {"kernel_size": "pos_pair", "dilation": "pos_pair", "padding": "pair", "stride": "pos_pair"}
_WINDOW_DEFAULTS: dict[str, AttrValue] = {"dilation": (1, 1), "padding": (0, 0), "stride": (1, 1)}


def _reduction(name: str, grad: Grad | None, operands: OperandFn | None = None) -> OpDef:
    attrs = _ARG_ATTRS if name.startswith("arg") else _REDUCE_ATTRS
    return OpDef(name=name, family="reduction", inputs=("x",), attrs=attrs, infer=inf.reduce,
                 defaults=_NO_AXIS_KEEP, operands=operands, grad=grad)  # fmt: skip


_STRUCTURAL: tuple[OpDef, ...] = (
    OpDef(name="zeros", family="creation", inputs=(), attrs=_SHAPE_DTYPE, infer=inf.creation, grad=None),
    OpDef(name="ones", family="creation", inputs=(), attrs=_SHAPE_DTYPE, infer=inf.creation, grad=None),
    OpDef(name="full", family="creation", inputs=("b",), attrs=_SHAPE_DTYPE, infer=inf.creation, grad=None),
    OpDef(name="arange", family="creation", inputs=(),
          attrs={"start": "number", "stop": "number", "step": "number", "dtype": "dtype"},
          infer=inf.arange, grad=None),
    OpDef(name="eye", family="creation", inputs=(),
          attrs={"n": "count", "m": "count", "k": "int", "dtype": "dtype"}, defaults={"k": 0},
          infer=inf.eye, grad=None),
    OpDef(name="rand", family="creation", inputs=("b_int",), attrs=_SHAPE_FLOAT_DTYPE, infer=inf.rand,
          grad=None),
    OpDef(name="randn", family="creation", inputs=("b_int",), attrs=_SHAPE_FLOAT_DTYPE, infer=inf.rand,
          grad=None),
    OpDef(name="where", family="select", inputs=("x", "xb", "xb"), infer=inf.where, operands=_promoted_values,
          expr="({0} ? {1} : {2})", grad=gr.WHERE),
    OpDef(name="astype", family="cast", inputs=("x",), attrs={"dtype": "dtype"}, infer=inf.astype,
          grad=gr.ASTYPE),
    _reduction("sum", gr.SUM),
    _reduction("mean", gr.MEAN, _float_of_first),
    _reduction("max", gr.EXTREME),
    _reduction("min", gr.EXTREME),
    _reduction("prod", gr.PROD),
    _reduction("argmax", None),
    _reduction("argmin", None),
    OpDef(name="matmul", family="linalg", inputs=("x", "x"), infer=inf.matmul, operands=_promoted,
          grad=gr.MATMUL),
    OpDef(name="reshape", family="shape", inputs=("x",), attrs={"shape": "shape"}, infer=inf.reshape,
          view=True, grad=gr.RESHAPE_BACK),
    OpDef(name="permute_dims", family="shape", inputs=("x",), attrs={"axes": "axes"}, infer=inf.permute_dims,
          view=True, grad=gr.PERMUTE_DIMS),
    OpDef(name="broadcast_to", family="shape", inputs=("x",), attrs={"shape": "shape"},
          infer=inf.broadcast_to, view=True, grad=gr.BROADCAST_TO),
    OpDef(name="expand_dims", family="shape", inputs=("x",), attrs=_AXIS_INT, infer=inf.expand_dims,
          view=True, grad=gr.RESHAPE_BACK),
    OpDef(name="squeeze", family="shape", inputs=("x",), attrs={"axis": "axis_tuple"}, infer=inf.squeeze,
          view=True, grad=gr.RESHAPE_BACK),
    OpDef(name="concat", family="shape", inputs=("x",), attrs=_AXIS_INT, defaults={"axis": 0},
          variadic=True, infer=inf.concat, operands=promote_all, grad=gr.CONCAT),
    OpDef(name="stack", family="shape", inputs=("x",), attrs=_AXIS_INT, defaults={"axis": 0},
          variadic=True, infer=inf.concat, operands=promote_all, grad=gr.STACK),
    OpDef(name="getitem", family="index", inputs=("x",), attrs={"key": "key"}, infer=inf.getitem,
          view=True, grad=gr.GETITEM),
    OpDef(name="take", family="index", inputs=("x", "x"), attrs={"axis": "axis_opt"}, defaults={"axis": None},
          infer=inf.take, grad=gr.TAKE),
    OpDef(name="softmax", family="training", inputs=("x",), attrs=_AXIS_INT, defaults={"axis": -1},
          infer=inf.softmax, operands=_float_of_first, grad=gr.SOFTMAX),
    OpDef(name="log_softmax", family="training", inputs=("x",), attrs=_AXIS_INT, defaults={"axis": -1},
          infer=inf.softmax, operands=_float_of_first, grad=gr.LOG_SOFTMAX),
    OpDef(name="cross_entropy", family="training", inputs=("x", "x"), attrs={"reduction": "reduction"},
          defaults={"reduction": "mean"}, infer=inf.cross_entropy, grad=gr.CROSS_ENTROPY),
    OpDef(name="one_hot", family="training", inputs=("x",), attrs={"num_classes": "count", "dtype": "dtype"},
          infer=inf.one_hot, grad=None),
    OpDef(name="unfold", family="window", inputs=("x",), attrs=_WINDOW, defaults=_WINDOW_DEFAULTS,
          infer=inf.unfold, grad=gr.UNFOLD),
    OpDef(name="fold", family="window", inputs=("x",), attrs={**_WINDOW, "output_size": "pair"},
          defaults=_WINDOW_DEFAULTS, infer=inf.fold, grad=gr.FOLD),
    OpDef(name="getitem_grad", family="backward", inputs=("x",), attrs={"key": "key", "shape": "shape"},
          infer=inf.getitem_grad, grad=None),
    OpDef(name="scatter_add", family="backward", inputs=("x", "x"),
          attrs={"axis": "axis_opt", "size": "count"}, infer=inf.scatter_add, grad=None),
)  # fmt: skip


def _table() -> dict[str, OpDef]:
    table: dict[str, OpDef] = {}
    for d in (*_STRUCTURAL[:7], *_ELEMENTWISE, *_STRUCTURAL[7:]):
        if d.name in table:
            raise ValueError(f"op {d.name} is in the table twice")
        table[d.name] = d
    return table


OPS: Mapping[str, OpDef] = _table()
"""The op vocabulary: name -> OpDef. Backends' tables must have exactly these keys."""

__all__ = [
    "ATTR_KINDS",
    "FAMILIES",
    "MAX_VARIADIC",
    "OPS",
    "REDUCTIONS",
    "Elementwise",
    "OpDef",
    "binding_dtypes",
    "check_attrs",
    "get_op",
    "graph_specs",
    "infer",
    "names",
    "op_names",
    "operand_dtype",
]
