"""The reference backend: each op's meaning, over an array module `xp`, run on NumPy here; no I/O.

The functions below take `xp` (NumPy here, CuPy in cupy_backend.py) so the two backends share one
definition; CuPy replaces only the entries it must. An elementwise op's meaning is its op-table
entry's `ref` (ops.py), run here after the operand casts. `OP_TABLE` is an explicit dict from op name to
function, never a `getattr` on a name that came over the wire. Operands are cast to the step's
`operand_dtype` first and weak scalars (bindings) become scalars of that dtype, so NumPy's and
CuPy's own promotion rules never decide a result. float16 reductions, softmaxes, cross-entropy and
matmul accumulate in float32.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from emberlink.errors import DTypeError
from emberlink.graph_replay import rng
from emberlink.graph_replay.backend import Array, IntoFn, OpFn, Ready, run_plan
from emberlink.graph_replay.inference import window_counts
from emberlink.graph_replay.ir import Key, Scalar
from emberlink.graph_replay.memory import MemoryMeter
from emberlink.graph_replay.ops import OPS, Elementwise, names
from emberlink.graph_replay.plan import REUSE_OPS, Plan, Step, derive_plan
from emberlink.protocol.dtypes import DTYPES, KIND_OF_DTYPE


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
# Each elementwise op's meaning is its op-table entry's `ref`; these run it on the step's operands.


def _elementwise_operands(xp: Any, args: Sequence[Any], step: Step) -> Sequence[Any]:
    """The operands cast as `_operands` casts them, touching only those `step.casts` names (an
    `astype` call on an array of the right dtype already costs ~0.3 µs, and a step has several)."""
    casts = step.casts
    if not casts:
        return args
    dtype = cast(str, step.operand_dtype)
    out = list(args)
    for k in casts:
        out[k] = as_operand(xp, out[k], dtype)
    return out


def _elementwise(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return _REF[step.op](xp, *(_elementwise_operands(xp, args, step) if step.casts else args))


def _elementwise_into(xp: Any, args: Sequence[Any], step: Step, out: Any) -> Array:
    return _REF[step.op](xp, *(_elementwise_operands(xp, args, step) if step.casts else args), out=out)


_REF: dict[str, Elementwise] = {name: d.ref for name, d in OPS.items() if d.ref is not None}


def _where(xp: Any, args: Sequence[Any], step: Step) -> Array:
    a, b = _operands(xp, args[1:], step)
    return xp.where(args[0], a, b)


def _astype(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return args[0].astype(step.out_spec.dtype)


# -- reductions ------------------------------------------------------------------------------------


_NP_REDUCE: dict[str, Any] = {"sum": np.add.reduce, "prod": np.multiply.reduce}


def _reduce(xp: Any, args: Sequence[Any], step: Step) -> Array:
    x, axis, keepdims, out = args[0], step.attrs["axis"], step.attrs["keepdims"], step.out_spec.dtype
    if step.op in ("sum", "prod"):
        if (
            xp is np
        ):  # the ufunc's own reduce, as np.sum calls it: its Python wrapper costs more than a small sum
            reduce = _NP_REDUCE[step.op]
            return reduce(x, axis=axis, dtype=_wide(out), keepdims=keepdims).astype(out, copy=False)
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
    if not step.casts and step.operand_dtype == dtype and dtype != "float16":
        return xp.matmul(args[0], args[1])  # both operands of the result's dtype already
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


def wide_indices(indices: Any) -> Any:
    """Indices (or labels) of a small int dtype widened to int64, so that bounds checks, `arange`
    of the class count and CuPy's kernels never compute in uint8/int8/int16 (where 300 wraps)."""
    return indices.astype(np.int64) if indices.dtype.itemsize < 4 else indices


def _take(xp: Any, args: Sequence[Any], step: Step) -> Array:
    x, indices = args[0], wide_indices(args[1])
    axis = step.attrs["axis"]
    if xp is not np and indices.size:
        # CuPy's take wraps out-of-range indices silently; NumPy raises. Check, so both fail alike
        # (one device sync per take: a wrong embedding id must not train on someone else's row).
        n = x.size if axis is None else x.shape[cast(int, axis)]
        if bool(((indices < -n) | (indices >= n)).any()):
            raise IndexError(f"index out of range for an axis of size {n}")
    return xp.take(x, indices, axis=axis)


def scatter_index(step: Step, indices: Any) -> tuple[Any, ...]:
    """The index tuple that `scatter_add` adds the gradient at."""
    axis = step.attrs["axis"]
    if axis is None:
        return (indices,)
    axis = cast(int, axis)
    ndim = step.out_spec.ndim
    return (slice(None),) * (axis + ndim if axis < 0 else axis) + (indices,)


def _scatter_add(xp: Any, args: Sequence[Any], step: Step) -> Array:
    g, indices = args[0], wide_indices(args[1])
    out = xp.zeros(step.out_spec.shape, dtype=step.out_spec.dtype)
    np.add.at(out, scatter_index(step, indices), g)
    return out


# -- sliding windows -------------------------------------------------------------------------------
# Both loops run over the kernel's kh * kw offsets, each one strided slice of the whole batch, so
# NumPy and CuPy run the same few large array operations (and CuPy's capture sees plain kernels).


def window(step: Step, spatial: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """An unfold or fold step's kernel_size, dilation, padding, stride and window counts (oh, ow)
    for an image of `spatial` (H, W)."""
    a = step.attrs
    names = ("kernel_size", "dilation", "padding", "stride")
    return (*(cast(tuple[int, int], a[n]) for n in names), window_counts(step.op, spatial, a))


def _offsets(step: Step, spatial: tuple[int, int]) -> Any:
    """For each kernel offset (i, j): its index and the strided slices of the padded image it reads."""
    (kh, kw), (dh, dw), _, (sh, sw), (oh, ow) = window(step, spatial)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (oh - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)
            yield i, j, (slice(None), slice(None), rows, cols)


def _unfold(xp: Any, args: Sequence[Any], step: Step) -> Array:
    x = args[0]
    n, c, h, w = x.shape
    (kh, kw), _, (ph, pw), _, (oh, ow) = window(step, (h, w))
    if ph or pw:
        padded = xp.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=x.dtype)
        padded[:, :, ph : ph + h, pw : pw + w] = x
        x = padded
    out = xp.empty((n, c, kh, kw, oh, ow), dtype=x.dtype)
    for i, j, where in _offsets(step, (h, w)):
        out[:, :, i, j] = x[where]
    return out.reshape(step.out_spec.shape)


def _fold(xp: Any, args: Sequence[Any], step: Step) -> Array:
    cols = args[0]
    n, c, h, w = step.out_spec.shape
    (kh, kw), _, (ph, pw), _, (oh, ow) = window(step, (h, w))
    acc = _wide(step.out_spec.dtype)
    blocks = cols.reshape(n, c, kh, kw, oh, ow).astype(acc, copy=False)
    out = xp.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=acc)
    for i, j, where in _offsets(step, (h, w)):
        view = out[where]
        xp.add(view, blocks[:, :, i, j], out=view)  # not `+=`: that copies the view onto itself
    if ph or pw:
        out = xp.ascontiguousarray(out[:, :, ph : ph + h, pw : pw + w])
    return out.astype(step.out_spec.dtype, copy=False)


# -- training --------------------------------------------------------------------------------------


def _log_softmax_wide(xp: Any, x: Any, dtype: str, axis: int) -> Any:
    """log_softmax of `x` (of dtype `dtype`: named by the step's spec, as `str(x.dtype)` costs
    ~2 µs) in the accumulation dtype (float16 widened), stable by subtracting the max. A new array
    of its own (never `x`), so callers may write into it."""
    xf = x.astype(_wide(dtype), copy=False)
    if xf.size == 0:
        return xf.copy()
    if xp is np:  # the same ufuncs without np.max's and np.sum's Python wrappers, in place where
        # the value dies (identical results: those wrappers call these reductions)
        shifted = np.subtract(xf, np.maximum.reduce(xf, axis=axis, keepdims=True))
        total = np.add.reduce(np.exp(shifted), axis=axis, keepdims=True)
        return np.subtract(shifted, np.log(total, out=total), out=shifted)
    shifted = xf - xp.max(xf, axis=axis, keepdims=True)
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=axis, keepdims=True))


def _softmax(xp: Any, args: Sequence[Any], step: Step) -> Array:
    x = _operands(xp, args, step)[0]
    lsm = _log_softmax_wide(xp, x, cast(str, step.operand_dtype), cast(int, step.attrs["axis"]))
    out = lsm if step.op == "log_softmax" else xp.exp(lsm, out=lsm)
    return out.astype(step.out_spec.dtype, copy=False)


def _cross_entropy(xp: Any, args: Sequence[Any], step: Step) -> Array:
    """Mean/sum/none of -log_softmax(logits)[i, labels[i]]; a label outside [0, C) gives NaN."""
    logits, labels = args[0], wide_indices(args[1])
    n, c = logits.shape
    wide = _wide(step.in_specs[0].dtype)
    lsm = _log_softmax_wide(xp, logits, wide, 1)
    if xp is np and n and 0 <= np.minimum.reduce(labels) and np.maximum.reduce(labels) < c:
        # every label valid (the usual case): one gather, no masks (the same values)
        nll = np.negative(lsm[np.arange(n), labels])
    else:
        valid = (labels >= 0) & (labels < c)
        picked = xp.take_along_axis(lsm, xp.where(valid, labels, 0)[:, None], axis=1)[:, 0]
        nll = xp.where(valid, -picked, host_scalar(float("nan"), wide))
    reduction = step.attrs["reduction"]
    if reduction != "none":
        nll = np.add.reduce(nll, axis=None) if xp is np else xp.sum(nll)  # np.sum's own reduction
        if reduction == "mean":
            nll = nll / host_scalar(n, wide)
    return nll.astype(step.out_spec.dtype, copy=False)


def _one_hot(xp: Any, args: Sequence[Any], step: Step) -> Array:
    labels = wide_indices(args[0])
    classes = xp.arange(step.out_spec.shape[-1], dtype=labels.dtype)
    return (labels[..., None] == classes).astype(step.out_spec.dtype)


OP_TABLE: dict[str, OpFn] = {
    "zeros": _zeros,
    "ones": _ones,
    "full": _full,
    "arange": _arange,
    "eye": _eye,
    "rand": _rand,
    "randn": _randn,
    **dict.fromkeys(_REF, _elementwise),
    "where": _where,
    "astype": _astype,
    **dict.fromkeys(names("reduction"), _reduce),
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
    "unfold": _unfold,
    "fold": _fold,
    "getitem_grad": _getitem_grad,
    "scatter_add": _scatter_add,
}
"""Op name -> implementation; exactly the keys of `ops.OPS` (a test checks it)."""


INTO_TABLE: dict[str, IntoFn] = dict.fromkeys(REUSE_OPS, _elementwise_into)
"""Op name -> implementation writing into a given buffer; exactly `plan.REUSE_OPS`."""


MAX_LAYOUTS = 8
"""Input layouts (strides) whose measured rise a plan keeps at once (memory.py)."""

_DTYPE_OBJECTS = frozenset(np.dtype(name) for name in DTYPES)
"""The dtypes a backend array may have, as dtype objects (native byte order only)."""


class NumpyBackend:
    """Runs plans on the CPU with NumPy. Memory figures are exact for arrays (see memory.py).

    `keep_intermediates=True` runs every plan as if compiled without frees (and without buffer
    reuse), for measuring what freeing saves; `reuse=False` runs without buffer reuse. Plans
    compiled with other options are compiled again once, with this backend's, and kept beside the
    original for as long as it lives.
    """

    name = "numpy"
    runs_inline = True

    def __init__(self, *, keep_intermediates: bool = False, reuse: bool = True) -> None:
        self.keep_intermediates = keep_intermediates
        self.reuse = reuse and not keep_intermediates
        self._meter = MemoryMeter()
        self._variants: weakref.WeakKeyDictionary[Plan, Plan] = weakref.WeakKeyDictionary()
        # How far each plan's run raised memory in use, by its inputs' strides (memory.py).
        self._rises: weakref.WeakKeyDictionary[Plan, dict[tuple[Any, ...], int]] = weakref.WeakKeyDictionary()

    def plan_for(self, plan: Plan) -> Plan:
        """The plan this backend runs for `plan`: `plan` itself, or its variant with this backend's options."""
        if plan.keep_intermediates == self.keep_intermediates and plan.reuse == self.reuse:
            return plan
        variant = self._variants.get(plan)
        if variant is None:
            variant = derive_plan(plan, keep_intermediates=self.keep_intermediates, reuse=self.reuse)
            self._variants[plan] = variant
        return variant

    def from_numpy(self, a: Any) -> Array:
        if a.dtype not in _DTYPE_OBJECTS:  # not str(a.dtype): ~2 µs in NumPy 2, on every upload
            raise DTypeError(f"dtype {a.dtype} is not one of {DTYPES}")
        self._meter.track(a)
        return a

    def to_numpy(self, a: Array) -> Any:
        return np.asarray(a, order="C")

    def run(self, plan: Plan, inputs: Sequence[Array], bindings: Sequence[Scalar]) -> list[Array]:
        meter = self._meter
        track = meter.track  # inputs are checked by run_plan, before any step
        for a in inputs:
            track(a)
        plan = self.plan_for(plan)
        # A run's rise in memory depends on the plan and its inputs' layouts only (memory.py): count
        # each step the first time, then record the rise measured then.
        rises = self._rises.get(plan)
        layout = tuple([a.strides for a in inputs])
        rise = None if rises is None else rises.get(layout)
        # inf and nan are results here, as on a GPU, not warnings.
        with np.errstate(all="ignore"):
            if rise is not None:
                meter.add_rise(rise)
                outs = run_plan(plan, inputs, bindings, xp=np, table=OP_TABLE, into_table=INTO_TABLE)
            else:
                start = meter.start_rise()
                try:
                    outs = run_plan(
                        plan, inputs, bindings, xp=np, table=OP_TABLE, into_table=INTO_TABLE, after_step=track
                    )
                finally:
                    rise = None if start is None else meter.end_rise(start)
                if rise is not None:  # None: another run was measuring (on another thread)
                    if rises is None:
                        rises = self._rises[plan] = {}
                    if len(rises) >= MAX_LAYOUTS:
                        rises.clear()
                    rises[layout] = rise
        for a in outs:
            track(a)
        return outs

    def nbytes(self, a: Array) -> int:
        return int(a.nbytes)

    def memory_stats(self) -> dict[str, int]:
        """`in_use_bytes`: live arrays this backend made or was given; `peak_bytes`: its high point
        since start or `reset_peak`; `pool_bytes`: equal to in_use (NumPy keeps no pool: freed
        arrays go straight back to the allocator)."""
        in_use = self._meter.in_use
        return {"in_use_bytes": in_use, "peak_bytes": self._meter.peak, "pool_bytes": in_use}

    def reset_peak(self) -> None:
        """Make `peak_bytes` measure from now (it starts at what is in use now)."""
        self._meter.reset_peak()

    def synchronize(self) -> None:
        return None

    def bind_thread(self) -> None:
        return None

    def free_bytes(self) -> int | None:
        return None  # host memory: the worker reads the host's available memory itself

    def to_numpy_async(self, a: Array) -> Ready:
        return Ready(np.array(a, copy=True))  # the stored array itself must stay the store's

    def host_buffer(self, nbytes: int) -> None:
        return None  # the arrays live in ordinary memory already


__all__ = [
    "INTO_TABLE",
    "OP_TABLE",
    "NumpyBackend",
    "as_operand",
    "host_scalar",
    "index_tuple",
    "scatter_index",
    "wide_indices",
    "window",
]
