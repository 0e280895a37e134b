"""The reference backend: each op's meaning, over an array module `xp`, run on NumPy here; no I/O.

The functions below take `xp` (NumPy here, CuPy in cupy_backend.py) so the two backends share one
definition; CuPy replaces only the entries it must. `OP_TABLE` is an explicit dict from op name to
function, never a `getattr` on a name that came over the wire. Operands are cast to the step's
`operand_dtype` first and weak scalars (bindings) become scalars of that dtype, so NumPy's and
CuPy's own promotion rules never decide a result. float16 reductions, softmaxes, cross-entropy and
matmul accumulate in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from emberlink.errors import DTypeError
from emberlink.graph_replay import rng
from emberlink.graph_replay.backend import Array, OpFn, run_plan
from emberlink.graph_replay.ir import DTYPES, KIND_OF_DTYPE, Key, Scalar
from emberlink.graph_replay.plan import Plan, Step


def as_operand(xp: Any, v: Any, dtype: str) -> Any:
    """An array arg cast to `dtype`, or a binding (Python scalar) as a NumPy scalar of `dtype`."""
    if isinstance(v, bool | int | float):
        return host_scalar(v, dtype)
    return v.astype(dtype, copy=False)


def host_scalar(value: Scalar, dtype: str) -> Any:
    """A Python scalar as a NumPy scalar of `dtype` (ints out of range fail, floats to ints truncate)."""
    if KIND_OF_DTYPE[dtype] == "int" and isinstance(value, float):
        value = int(value)
    return np.asarray(value, dtype=dtype)[()]


def _wide(dtype: str) -> str:
    """The dtype float16 work accumulates in."""
    return "float32" if dtype == "float16" else dtype


def _operands(xp: Any, args: Sequence[Any], step: Step) -> list[Any]:
    dtype = cast(str, step.operand_dtype)
    return [as_operand(xp, a, dtype) for a in args]


def _attr_shape(step: Step) -> tuple[int, ...]:
    return cast(tuple[int, ...], step.attrs["shape"])


# -- creation --------------------------------------------------------------------------------------


def _zeros(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return xp.zeros(step.out_spec.shape, dtype=step.out_spec.dtype)


def _ones(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return xp.ones(step.out_spec.shape, dtype=step.out_spec.dtype)


def _full(xp: Any, args: Sequence[Any], step: Step) -> Array:
    dtype = step.out_spec.dtype
    return xp.full(step.out_spec.shape, host_scalar(args[0], dtype), dtype=dtype)


def _arange(xp: Any, args: Sequence[Any], step: Step) -> Array:
    start, step_ = step.attrs["start"], step.attrs["step"]
    n = step.out_spec.shape[0]
    exact = isinstance(start, int) and isinstance(step_, int) and isinstance(step.attrs["stop"], int)
    base = xp.arange(n, dtype=np.int64 if exact else np.float64)
    return (base * step_ + start).astype(step.out_spec.dtype)


def _eye(xp: Any, args: Sequence[Any], step: Step) -> Array:
    n, m = step.out_spec.shape
    return xp.eye(n, m, k=step.attrs["k"], dtype=step.out_spec.dtype)


def _rand(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return rng.uniform(xp, cast(int, args[0]), step.out_spec.shape, step.out_spec.dtype)


def _randn(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return rng.normal(xp, cast(int, args[0]), step.out_spec.shape, step.out_spec.dtype)


# -- elementwise -----------------------------------------------------------------------------------


def _sigmoid(xp: Any, x: Any) -> Any:
    xf = x.astype(_wide(str(x.dtype)), copy=False)
    return (1 / (1 + xp.exp(-xf))).astype(x.dtype, copy=False)


def _relu(xp: Any, x: Any) -> Any:
    return xp.maximum(x, host_scalar(0, str(x.dtype)))


_UNARY: dict[str, Any] = {
    "negative": lambda xp, x: xp.negative(x),
    "abs": lambda xp, x: xp.abs(x),
    "square": lambda xp, x: xp.square(x),
    "sign": lambda xp, x: xp.sign(x),
    "relu": _relu,
    "exp": lambda xp, x: xp.exp(x),
    "log": lambda xp, x: xp.log(x),
    "sqrt": lambda xp, x: xp.sqrt(x),
    "tanh": lambda xp, x: xp.tanh(x),
    "sigmoid": _sigmoid,
    "sin": lambda xp, x: xp.sin(x),
    "cos": lambda xp, x: xp.cos(x),
    "logical_not": lambda xp, x: xp.logical_not(x),
}

_BINARY: dict[str, Any] = {
    "add": lambda xp, a, b: xp.add(a, b),
    "subtract": lambda xp, a, b: xp.subtract(a, b),
    "multiply": lambda xp, a, b: xp.multiply(a, b),
    "divide": lambda xp, a, b: xp.true_divide(a, b),
    "pow": lambda xp, a, b: xp.power(a, b),
    "maximum": lambda xp, a, b: xp.maximum(a, b),
    "minimum": lambda xp, a, b: xp.minimum(a, b),
    "equal": lambda xp, a, b: xp.equal(a, b),
    "not_equal": lambda xp, a, b: xp.not_equal(a, b),
    "less": lambda xp, a, b: xp.less(a, b),
    "less_equal": lambda xp, a, b: xp.less_equal(a, b),
    "greater": lambda xp, a, b: xp.greater(a, b),
    "greater_equal": lambda xp, a, b: xp.greater_equal(a, b),
    "logical_and": lambda xp, a, b: xp.logical_and(a, b),
    "logical_or": lambda xp, a, b: xp.logical_or(a, b),
}


def _unary_op(xp: Any, args: Sequence[Any], step: Step) -> Array:
    x = args[0] if step.operand_dtype is None else _operands(xp, args, step)[0]
    return _UNARY[step.op](xp, x)


def _binary_op(xp: Any, args: Sequence[Any], step: Step) -> Array:
    a, b = _operands(xp, args, step)
    return _BINARY[step.op](xp, a, b)


def _where(xp: Any, args: Sequence[Any], step: Step) -> Array:
    a, b = _operands(xp, args[1:], step)
    return xp.where(args[0], a, b)


def _astype(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return args[0].astype(step.out_spec.dtype)


# -- reductions ------------------------------------------------------------------------------------


def _reduce(xp: Any, args: Sequence[Any], step: Step) -> Array:
    x, axis, keepdims, out = args[0], step.attrs["axis"], step.attrs["keepdims"], step.out_spec.dtype
    if step.op in ("sum", "prod"):
        fn = xp.sum if step.op == "sum" else xp.prod
        return fn(x, axis=axis, keepdims=keepdims, dtype=_wide(out)).astype(out, copy=False)
    if step.op == "mean":
        acc = "float64" if x.dtype.kind in "biu" else _wide(out)
        return xp.mean(x, axis=axis, keepdims=keepdims, dtype=acc).astype(out, copy=False)
    fn = {"max": xp.max, "min": xp.min, "argmax": xp.argmax, "argmin": xp.argmin}[step.op]
    return fn(x, axis=axis, keepdims=keepdims).astype(out, copy=False)


# -- linear algebra and shapes ---------------------------------------------------------------------


def _matmul(xp: Any, args: Sequence[Any], step: Step) -> Array:
    dtype = step.out_spec.dtype
    a, b = (a.astype(_wide(dtype), copy=False) for a in args)
    return xp.matmul(a, b).astype(dtype, copy=False)


def _reshape(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return xp.reshape(args[0], _attr_shape(step))


def _permute_dims(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return xp.transpose(args[0], step.attrs["axes"])


def _broadcast_to(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return xp.broadcast_to(args[0], _attr_shape(step))


def _expand_dims(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return xp.expand_dims(args[0], step.attrs["axis"])


def _squeeze(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return xp.reshape(args[0], step.out_spec.shape)


def _concat(xp: Any, args: Sequence[Any], step: Step) -> Array:
    arrays = _operands(xp, args, step)
    if step.op == "stack":
        return xp.stack(arrays, axis=step.attrs["axis"])
    return xp.concatenate(arrays, axis=step.attrs["axis"])


# -- indexing --------------------------------------------------------------------------------------


def index_tuple(key: Key) -> tuple[Any, ...]:
    """A normalized getitem key as a Python indexing tuple."""
    out: list[Any] = []
    for item in key:
        if item[0] == "s":
            _, start, stop, step = cast(tuple[str, int, int, int], item)
            out.append(slice(start, stop, step))
        elif item[0] == "i":
            out.append(cast(tuple[str, int], item)[1])
        else:
            out.append(None)
    return tuple(out)


def _getitem(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return args[0][index_tuple(cast(Key, step.attrs["key"]))]


def _getitem_grad(xp: Any, args: Sequence[Any], step: Step) -> Array:
    out = xp.zeros(step.out_spec.shape, dtype=step.out_spec.dtype)
    out[index_tuple(cast(Key, step.attrs["key"]))] = args[0]
    return out


def _take(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return xp.take(args[0], args[1], axis=step.attrs["axis"])


def scatter_index(step: Step, indices: Any) -> tuple[Any, ...]:
    """The index tuple that `scatter_add` adds the gradient at."""
    axis = step.attrs["axis"]
    if axis is None:
        return (indices,)
    axis = cast(int, axis)
    ndim = step.out_spec.ndim
    return (slice(None),) * (axis + ndim if axis < 0 else axis) + (indices,)


def _scatter_add(xp: Any, args: Sequence[Any], step: Step) -> Array:
    g, indices = args
    out = xp.zeros(step.out_spec.shape, dtype=step.out_spec.dtype)
    np.add.at(out, scatter_index(step, indices), g)
    return out


# -- training --------------------------------------------------------------------------------------


def _log_softmax_wide(xp: Any, x: Any, axis: int) -> Any:
    """log_softmax in the accumulation dtype (float16 widened), stable by subtracting the max."""
    xf = x.astype(_wide(str(x.dtype)), copy=False)
    if xf.size == 0:
        return xf
    shifted = xf - xp.max(xf, axis=axis, keepdims=True)
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=axis, keepdims=True))


def _softmax(xp: Any, args: Sequence[Any], step: Step) -> Array:
    x = _operands(xp, args, step)[0]
    lsm = _log_softmax_wide(xp, x, cast(int, step.attrs["axis"]))
    out = lsm if step.op == "log_softmax" else xp.exp(lsm)
    return out.astype(step.out_spec.dtype, copy=False)


def _cross_entropy(xp: Any, args: Sequence[Any], step: Step) -> Array:
    """Mean/sum/none of -log_softmax(logits)[i, labels[i]]; a label outside [0, C) gives NaN."""
    logits, labels = args
    n, c = logits.shape
    lsm = _log_softmax_wide(xp, logits, 1)
    valid = (labels >= 0) & (labels < c)
    picked = xp.take_along_axis(lsm, xp.where(valid, labels, 0)[:, None], axis=1)[:, 0]
    nll = xp.where(valid, -picked, host_scalar(float("nan"), str(lsm.dtype)))
    if step.attrs["reduction"] == "sum":
        nll = xp.sum(nll)
    elif step.attrs["reduction"] == "mean":
        nll = xp.sum(nll) / host_scalar(n, str(lsm.dtype))
    return nll.astype(step.out_spec.dtype, copy=False)


def _one_hot(xp: Any, args: Sequence[Any], step: Step) -> Array:
    classes = xp.arange(step.out_spec.shape[-1], dtype=args[0].dtype)
    return (args[0][..., None] == classes).astype(step.out_spec.dtype)


OP_TABLE: dict[str, OpFn] = {
    "zeros": _zeros,
    "ones": _ones,
    "full": _full,
    "arange": _arange,
    "eye": _eye,
    "rand": _rand,
    "randn": _randn,
    **{name: _unary_op for name in _UNARY},
    **{name: _binary_op for name in _BINARY},
    "where": _where,
    "astype": _astype,
    **{name: _reduce for name in ("sum", "mean", "max", "min", "prod", "argmax", "argmin")},
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
    "getitem_grad": _getitem_grad,
    "scatter_add": _scatter_add,
}
"""Op name -> implementation; exactly the keys of `ops.OPS` (a test checks it)."""


class NumpyBackend:
    """Runs plans on the CPU with NumPy. Memory figures are estimates from plan specs."""

    name = "numpy"

    def __init__(self) -> None:
        self._peak = 0

    def from_numpy(self, a: Any) -> Array:
        if str(a.dtype) not in DTYPES:
            raise DTypeError(f"dtype {a.dtype} is not one of {DTYPES}")
        return a

    def to_numpy(self, a: Array) -> Any:
        return np.asarray(a, order="C")

    def run(self, plan: Plan, inputs: Sequence[Array], bindings: Sequence[Scalar]) -> list[Array]:
        self._peak = max(self._peak, plan.input_bytes + plan.peak_bytes)
        # inf and nan are results here, as on a GPU, not warnings.
        with np.errstate(all="ignore"):
            return run_plan(plan, inputs, bindings, xp=np, table=OP_TABLE)

    def nbytes(self, a: Array) -> int:
        return int(a.nbytes)

    def memory_stats(self) -> dict[str, int]:
        return {"in_use_bytes": 0, "peak_bytes": self._peak, "pool_bytes": 0}

    def synchronize(self) -> None:
        return None


__all__ = ["OP_TABLE", "NumpyBackend", "as_operand", "host_scalar", "index_tuple", "scatter_index"]
