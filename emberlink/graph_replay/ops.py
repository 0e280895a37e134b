"""The op table: every op's inputs, attrs and shape/dtype inference; no arrays, no I/O.

Rules of this file (everything that decides whether a node is well formed lives here):
- `OPS` is the whole op vocabulary. A name not in it is refused everywhere (here, by the decoder,
  by the backends' tables); nothing ever looks an op up with `getattr`.
- Every op has exactly one output, whose spec `infer` computes from the input specs and the attrs
  alone. The client calls it when recording, the worker over a whole graph when decoding.
- Input kinds: `x` a tensor, `xb` a tensor or a binding, `b` a binding of any kind, `b_int` an int
  binding. Binary ops need at least one tensor.
- Attr values (checked in attrs.py) have exact Python types (`int` never accepts `bool`, tuples are tuples) and ints fit
  in int64. `check_attrs` returns them as the sorted `(name, value)` tuple a `Node` holds, with
  defaults filled in, so that one meaning has one canonical form.
- Each op's inference lives in inference.py; this table says which function infers which op.
- Errors: `DTypeError` for dtypes (operands, `dtype` attrs) and attr values of the wrong Python
  type; `ShapeError` for everything else (shapes, axes, arity, unknown ops or attrs). Messages
  name the op and every operand's shape or dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from emberlink.errors import DTypeError, ShapeError
from emberlink.graph_replay import inference as inf
from emberlink.graph_replay.attrs import ATTR_KINDS, FLOAT_DTYPES, REDUCTIONS, check_attr_value
from emberlink.graph_replay.inference import BINARY, LOGICAL, UNARY_FLOAT, UNARY_SAME
from emberlink.graph_replay.ir import AttrValue, Graph, TensorSpec, binding_spec
from emberlink.graph_replay.promotion import float_dtype_for, promote, promote_all

InferFn = Callable[[str, Sequence[TensorSpec], Mapping[str, AttrValue]], TensorSpec]
Attrs = Mapping[str, AttrValue] | Iterable[tuple[str, AttrValue]]

MAX_VARIADIC = 64
"""Most inputs of `concat` and `stack`."""


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
    """The dtype a backend brings the operands to before computing, where the op has one.

    Binary ops, `where`, `concat`, `stack`, `matmul` and the float-only ops; None for the rest.
    Weak scalars are cast to it too (docs/internals.md: "backends cast the scalar first").
    """
    if op in LOGICAL:
        return "bool"
    if op == "divide":
        return float_dtype_for(TensorSpec(promote(in_specs[0], in_specs[1]), ()))
    if op in BINARY or op == "matmul":
        return promote(in_specs[0], in_specs[1])
    if op == "where":
        return promote(in_specs[1], in_specs[2])
    if op in ("concat", "stack"):
        return promote_all(in_specs)
    if op in UNARY_FLOAT or op in ("softmax", "log_softmax", "mean"):
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


def binding_dtypes(graph: Graph) -> tuple[str | None, ...]:
    """For each binding, the one dtype every use of it casts it to, or None (uses differ, or none).

    A backend never computes with a binding's own value: binary ops and `where` cast it to their
    `operand_dtype`, `full` to its output dtype. So a float binding whose only dtype is float32 may
    travel as a float32 without changing any result (the client's encoder uses this).
    """
    specs = graph_specs(graph)
    first_binding = len(graph.inputs)
    found: list[set[str | None]] = [set() for _ in graph.bindings]
    for i, node in enumerate(graph.nodes):
        in_specs = [specs[v] for v in node.inputs]
        if node.op == "full":
            cast: str | None = specs[graph.node_value(i)].dtype
        elif node.op in BINARY or node.op == "where":
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


_SHAPE_DTYPE = {"shape": "shape", "dtype": "dtype"}
_REDUCE_ATTRS = {"axis": "axis", "keepdims": "bool"}
_ARG_ATTRS = {"axis": "axis_opt", "keepdims": "bool"}
_NO_AXIS_KEEP: dict[str, AttrValue] = {"axis": None, "keepdims": False}


def _table() -> dict[str, OpDef]:
    defs = [
        OpDef("zeros", (), _SHAPE_DTYPE, inf.creation),
        OpDef("ones", (), _SHAPE_DTYPE, inf.creation),
        OpDef("full", ("b",), _SHAPE_DTYPE, inf.creation),
        OpDef(
            "arange",
            (),
            {"start": "number", "stop": "number", "step": "number", "dtype": "dtype"},
            inf.arange,
        ),
        OpDef("eye", (), {"n": "count", "m": "count", "k": "int", "dtype": "dtype"}, inf.eye, {"k": 0}),
        OpDef("rand", ("b_int",), {"shape": "shape", "dtype": "float_dtype"}, inf.rand),
        OpDef("randn", ("b_int",), {"shape": "shape", "dtype": "float_dtype"}, inf.rand),
        *(OpDef(name, ("x",), {}, inf.unary) for name in (*UNARY_SAME, *UNARY_FLOAT, "logical_not")),
        *(OpDef(name, ("xb", "xb"), {}, inf.binary) for name in BINARY),
        OpDef("where", ("x", "xb", "xb"), {}, inf.where),
        OpDef("astype", ("x",), {"dtype": "dtype"}, inf.astype),
        *(
            OpDef(name, ("x",), _REDUCE_ATTRS, inf.reduce, _NO_AXIS_KEEP)
            for name in ("sum", "mean", "max", "min", "prod")
        ),
        *(OpDef(name, ("x",), _ARG_ATTRS, inf.reduce, _NO_AXIS_KEEP) for name in ("argmax", "argmin")),
        OpDef("matmul", ("x", "x"), {}, inf.matmul),
        OpDef("reshape", ("x",), {"shape": "shape"}, inf.reshape),
        OpDef("permute_dims", ("x",), {"axes": "axes"}, inf.permute_dims),
        OpDef("broadcast_to", ("x",), {"shape": "shape"}, inf.broadcast_to),
        OpDef("expand_dims", ("x",), {"axis": "axis_int"}, inf.expand_dims),
        OpDef("squeeze", ("x",), {"axis": "axis_tuple"}, inf.squeeze),
        OpDef("concat", ("x",), {"axis": "axis_int"}, inf.concat, {"axis": 0}, variadic=True),
        OpDef("stack", ("x",), {"axis": "axis_int"}, inf.concat, {"axis": 0}, variadic=True),
        OpDef("getitem", ("x",), {"key": "key"}, inf.getitem),
        OpDef("take", ("x", "x"), {"axis": "axis_opt"}, inf.take, {"axis": None}),
        OpDef("softmax", ("x",), {"axis": "axis_int"}, inf.softmax, {"axis": -1}),
        OpDef("log_softmax", ("x",), {"axis": "axis_int"}, inf.softmax, {"axis": -1}),
        OpDef(
            "cross_entropy", ("x", "x"), {"reduction": "reduction"}, inf.cross_entropy, {"reduction": "mean"}
        ),
        OpDef("one_hot", ("x",), {"num_classes": "count", "dtype": "dtype"}, inf.one_hot),
        OpDef("getitem_grad", ("x",), {"key": "key", "shape": "shape"}, inf.getitem_grad),
        OpDef("scatter_add", ("x", "x"), {"axis": "axis_opt", "size": "count"}, inf.scatter_add),
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
    "binding_dtypes",
    "check_attrs",
    "get_op",
    "graph_specs",
    "infer",
    "op_names",
    "operand_dtype",
]
