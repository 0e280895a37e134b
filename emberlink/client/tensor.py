"""Tensor: a lazy handle on a device value, and the one recording path every op goes through.

Nothing here computes: an op checks its operands, infers the output's dtype and shape with
`graph_replay.ops.infer` (memoized, so a repeated step does not re-infer), appends a node to its
device's pending segment and returns a new Tensor. Reads (`numpy`, `float`, `item`, ...) are the
only place that waits for the device.

Tensors are immutable: there is no in-place op. An optimizer "updates" a Parameter by rebinding
it to a new value, which is how forward, backward and the update of a step become one graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, overload

import numpy as np

from emberlink.client import autograd, indexing
from emberlink.client.autograd import (
    DIFFERENTIABLE,
    GRAD_MODE,
    SAVES_INPUTS,
    SAVES_OUTPUT,
    UNIT_SEED,
    GradNode,
)
from emberlink.client.dtypes import dtype_name
from emberlink.client.executor import DeviceStats
from emberlink.client.future import ArrayFuture
from emberlink.client.value import Spec, Value
from emberlink.errors import DeviceError, DTypeError, ShapeError
from emberlink.graph_replay import ops
from emberlink.graph_replay.gradients import Recorded
from emberlink.graph_replay.ir import TensorSpec, binding_spec
from emberlink.protocol.dtypes import FLOAT_DTYPES

Scalar = bool | int | float

_KIND = {bool: "bool", int: "int", float: "float"}
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_FLOATS = frozenset(FLOAT_DTYPES)

# -- emberlink.jit hooks (client/jit.py, client/trace.py); kept here in one place so they can move as a
# unit. Besides these: one `JIT_TRACE` check each in `apply`, `create` and `Tensor.__init__`, one
# TracedScalar case in `scalar()`, and `_kind` where a binding's kind is looked up.
JIT_TRACE: Any = None
"""The `trace.Trace` of the `emberlink.jit` call being traced (or run eagerly under its rules) now,
else None. `apply`, `create` and `Tensor.__init__` check it once each and report to it only while
it is set."""


class TracedScalar:
    """Base of emberlink.jit's scalar arguments (client/trace.py): a float or int subclass that,
    while its trace runs, `scalar()` keeps as it is, so it is recorded as a binding jit can name;
    outside its trace, `scalar()` turns it into a plain number."""

    __slots__ = ()
    kind: str

    def binding(self) -> Scalar:
        raise NotImplementedError


def _kind(s: Scalar) -> str:
    kind = _KIND.get(type(s))
    return kind if kind is not None else s.kind  # type: ignore[union-attr]  # a TracedScalar


# -- end of emberlink.jit hooks ---------------------------------------------------------------------


class TensorDevice(Protocol):
    """A tensor's device as this module sees it: `client.device.Device`, which imports this module
    (so this one names it only through this protocol; device.py checks Device against it)."""

    @property
    def name(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def _record(
        self, op: str, ins: Sequence[Value | Scalar], attrs: tuple[Any, ...], spec: Spec
    ) -> Value: ...
    def _read(self, v: Value) -> np.ndarray: ...
    def flush(self) -> None: ...
    def sync(self) -> None: ...
    def close(self) -> None: ...
    def stats(self) -> DeviceStats: ...
    def memory_stats(self) -> dict[str, int]: ...
    def tensor(self, data: Any, dtype: Any = None) -> Tensor: ...
    def zeros(self, shape: Any, dtype: Any = ...) -> Tensor: ...
    def ones(self, shape: Any, dtype: Any = ...) -> Tensor: ...
    def full(self, shape: Any, fill_value: Scalar, dtype: Any = None) -> Tensor: ...
    def arange(
        self, start: float, stop: float | None = None, step: float = 1, dtype: Any = None
    ) -> Tensor: ...
    def eye(self, n: int, m: int | None = None, k: int = 0, dtype: Any = ...) -> Tensor: ...
    def rand(self, shape: Any, *, seed: int, dtype: Any = ...) -> Tensor: ...
    def randn(self, shape: Any, *, seed: int, dtype: Any = ...) -> Tensor: ...


# Memo of ops.infer: (op, attrs, *operand specs or binding kinds) -> output spec.
_INFER: dict[tuple[Any, ...], Spec] = {}
_INFER_LIMIT = 1 << 16


def _infer_miss(op: str, attrs: tuple[Any, ...], specs: Sequence[Spec | str], key: tuple[Any, ...]) -> Spec:
    in_specs = [binding_spec(s) if type(s) is str else TensorSpec(*s) for s in specs]
    out = ops.infer(op, in_specs, attrs)
    spec = (out.dtype, out.shape)
    if len(_INFER) >= _INFER_LIMIT:
        _INFER.clear()
    _INFER[key] = spec
    return spec


def scalar(value: object) -> Scalar | None:
    """`value` as an exact Python bool, int or float if it is a scalar; None if it is not one."""
    t = type(value)
    if t is float or t is bool:
        return value  # type: ignore[return-value]
    if t is int:
        if not _INT64_MIN <= value <= _INT64_MAX:  # type: ignore[operator]
            raise DTypeError(f"the int scalar {value} does not fit in int64")
        return value  # type: ignore[return-value]
    if isinstance(value, TracedScalar):  # emberlink.jit: a scalar argument (a binding while traced)
        return value.binding()
    if isinstance(value, np.generic):
        if isinstance(value, np.bool_):
            return bool(value)
        if isinstance(value, np.integer):
            return scalar(int(value))
        if isinstance(value, np.floating):
            return float(value)
        return None
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return scalar(int(value))
    if isinstance(value, float):
        return float(value)
    return None


def apply(op: str, args: Sequence[Tensor | Scalar], attrs: tuple[Any, ...] = ()) -> Tensor:
    """Record `op` on its tensor operands' device; Python scalars become bindings.

    `attrs` is a tuple of `(name, value)` pairs sorted by name, already normalized by the caller.
    This is the hot path of every step: keep it free of anything a replayed step does not need.
    """
    vals: list[Value | Scalar] = []
    specs: list[Spec | str] = []
    dev: TensorDevice | None = None
    needs_grad = False
    for a in args:
        if isinstance(a, Tensor):
            v = a._v
            if dev is None:
                dev = v.dev
            elif v.dev is not dev:
                _raise_mixed(op, args)
            vals.append(v)
            specs.append(v.spec)
            if a._rg:
                needs_grad = True
        else:
            kind = _KIND.get(type(a))
            if kind is None or kind == "int":  # ints are range-checked, others normalized
                s = scalar(a)
                if s is None:
                    raise TypeError(f"{op}: unsupported operand of type {type(a).__name__}")
                a, kind = s, _kind(s)
            vals.append(a)
            specs.append(kind)
    if dev is None:
        raise TypeError(f"{op}: needs at least one tensor operand")
    if JIT_TRACE is not None:  # emberlink.jit: the trace learns which buffers the step reads
        JIT_TRACE.operands(dev, args)
    key = (op, attrs, *specs)
    spec = _INFER.get(key)
    if spec is None:
        spec = _infer_miss(op, attrs, specs, key)
    out = Tensor(dev._record(op, vals, attrs, spec))
    if needs_grad and GRAD_MODE.enabled and op in DIFFERENTIABLE and spec[0] in _FLOATS:
        out._rg = True
        out._ctx = GradNode(
            op,
            tuple([(a._ctx or a) if isinstance(a, Tensor) and a._rg else None for a in args]),
            vals if op in SAVES_INPUTS else None,
            specs,
            attrs,
            out._v if op in SAVES_OUTPUT else None,
            dev,
        )
    return out


def create(dev: TensorDevice, op: str, bindings: Sequence[Scalar], attrs: tuple[Any, ...]) -> Tensor:
    """Record a creation op (no tensor operands) on `dev`."""
    specs = [_kind(b) for b in bindings]
    key = (op, attrs, *specs)
    spec = _INFER.get(key)
    if spec is None:
        spec = _infer_miss(op, attrs, specs, key)
    if JIT_TRACE is not None:  # emberlink.jit: the trace learns its device before the first node
        JIT_TRACE.operands(dev, ())
    return Tensor(dev._record(op, list(bindings), attrs, spec))


def _raise_mixed(op: str, args: Sequence[object]) -> None:
    names = [str(a._v.dev) for a in args if isinstance(a, Tensor)]
    if "unplaced" in names:
        raise DeviceError(f"{op}: a parameter is not on a device yet; call module.to(device) first")
    raise DeviceError(
        f"{op}: operands are on different devices ({', '.join(names)}); move one explicitly with t.to(device)"
    )


def _binop(op: str, a: object, b: object) -> Tensor:
    # Operator entry: anything but a Tensor or a scalar is NotImplemented, so Python can try the
    # other operand; a NumPy array gets a clear error instead of a silent implicit upload.
    for x in (a, b):
        if not isinstance(x, Tensor) and scalar(x) is None:
            if isinstance(x, np.ndarray):
                raise TypeError(
                    f"{op}: cannot mix a NumPy array with a Tensor; upload it with dev.tensor(array)"
                )
            return NotImplemented  # type: ignore[no-any-return]
    return apply(op, (a, b))  # type: ignore[arg-type]


def norm_axis(op: str, axis: object, ndim: int, *, extra: int = 0) -> int:
    """A possibly negative axis as an int in `[0, ndim + extra)`; ShapeError otherwise."""
    try:
        a: int = int(axis)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{op}: axis must be an int, got {type(axis).__name__}") from None
    n = ndim + extra
    if not -n <= a < n:
        raise ShapeError(f"{op}: axis {a} is out of range for a tensor of rank {ndim}")
    return a + n if a < 0 else a


def norm_axes(op: str, axis: object, ndim: int) -> tuple[int, ...] | None:
    """Reduction axes as a sorted tuple, or None for all of them."""
    if axis is None:
        return None
    raw = axis if isinstance(axis, tuple | list) else (axis,)
    axes = sorted({norm_axis(op, a, ndim) for a in raw})
    if len(axes) != len(raw):
        raise ShapeError(f"{op}: repeated axis in {axis!r}")
    return None if len(axes) == ndim else tuple(axes)


def norm_shape(shape: object) -> tuple[int, ...]:
    """`3`, `(2, 3)` or `[2, 3]` as a tuple of ints (not yet checked for negatives)."""
    if isinstance(shape, int | np.integer):
        return (int(shape),)
    try:
        return tuple(int(d) for d in shape)  # type: ignore[attr-defined]
    except TypeError:
        raise TypeError(f"a shape is an int or a sequence of ints, got {shape!r}") from None


def _shape_args(shape: tuple[Any, ...]) -> tuple[int, ...]:
    # reshape(2, 3) and reshape((2, 3)) both work, as in NumPy and torch.
    if len(shape) == 1 and not isinstance(shape[0], int | np.integer):
        return norm_shape(shape[0])
    return norm_shape(shape)


def _elementwise_method(op: str) -> Callable[[Tensor], Tensor]:
    """The Tensor method of unary elementwise op `op` (an op-table entry of family "unary")."""
    if ops.get_op(op).family != "unary":
        raise ValueError(f"{op} is not a unary elementwise op")

    def method(self: Tensor) -> Tensor:
        return apply(op, (self,))

    method.__name__ = method.__qualname__ = op
    method.__doc__ = f"Elementwise {op} (recorded; see `emberlink.{op}`)."
    return method


class Tensor:
    """A lazily computed array on a Device. Create one with `dev.tensor(...)`, `dev.zeros(...)`, ...

    Arithmetic and comparisons use Python operators (`+ - * / ** @ == != < <= > >=`, `& | ~` on
    bools) with NumPy broadcasting and Python scalars on either side (`2 * x`, `x > 0`). Two
    tensors promote as in NumPy within a kind; across kinds the float (or int) operand's dtype
    wins (`int64 + float16` is float16). A Python scalar never widens a tensor of its kind
    (`float16 * 0.5` stays float16). The methods follow NumPy and the Array API (`sum`, `mean`,
    `max`, `reshape`, `permute`, `transpose`, `T`, `mT`, `broadcast_to`, `expand_dims`, `squeeze`,
    `take`, `astype`, ...); the same operations are functions of the `emberlink` namespace
    (`el.exp`, `el.matmul`, `el.permute_dims`, `el.concat`, `el.stack`, `el.where`, ...).

    Shapes and dtypes are known without running anything, and a bad shape raises at the line that
    recorded the op. Reading the data (`numpy()`, `float(t)`, `int(t)`, `bool(t)`, `item()`,
    `np.asarray(t)`) runs everything recorded so far on the device; `read_async()` starts a read
    and returns a future without waiting.
    """

    __slots__ = ("__weakref__", "_ctx", "_rg", "_v", "grad")
    __array_ufunc__ = None  # NumPy defers to our operators instead of reading the tensor

    _v: Value
    _rg: bool
    _ctx: GradNode | None
    grad: Tensor | None

    def __init__(self, value: Value) -> None:
        self._v = value
        self._rg = False
        self._ctx = None
        self.grad = None
        if JIT_TRACE is not None:  # emberlink.jit: tensors made while tracing may hold its outputs
            JIT_TRACE.created(self)

    # -- metadata (no device work) ----------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        return self._v.spec[1]

    @property
    def dtype(self) -> str:
        """The dtype's NumPy name: "float32", "int64", "bool", ..."""
        return self._v.spec[0]

    @property
    def ndim(self) -> int:
        return len(self._v.spec[1])

    @property
    def size(self) -> int:
        n = 1
        for d in self._v.spec[1]:
            n *= d
        return n

    @property
    def device(self) -> TensorDevice:
        """The Device this tensor lives on (a `client.device.Device`)."""
        dev: TensorDevice = self._v.dev
        return dev

    @property
    def requires_grad(self) -> bool:
        return self._rg

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        if flag and self.dtype not in FLOAT_DTYPES:
            raise DTypeError(f"only float tensors can require gradients, not {self.dtype}")
        if not flag and self._ctx is not None:
            raise ValueError("requires_grad can only be turned off on a leaf tensor; use detach()")
        self._rg = bool(flag)

    @property
    def is_leaf(self) -> bool:
        return self._ctx is None

    def __repr__(self) -> str:
        state = "pending" if self._v.node is not None else "ready"
        grad = ", requires_grad=True" if self._rg else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, device={self._v.dev}, {state}{grad})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self) -> Iterator[Tensor]:
        for i in range(len(self)):
            yield self[i]

    __hash__ = object.__hash__  # identity, as for any mutable-looking handle; == is elementwise

    # -- reads (these run the pending work) --------------------------------------------------------

    def numpy(self) -> np.ndarray:
        """The data as a new NumPy array (runs pending work; one round trip on a remote device)."""
        array: np.ndarray = self._v.dev._read(self._v)
        return array

    def read_async(self) -> ArrayFuture:
        """Start reading the data and return at once, with a future of what `numpy()` returns.

        Pending work and the read are sent before this returns; nothing waits for the device.
        `fut.result(timeout)` gives the array, `fut.item()` the scalar, `fut.done()` says whether
        it has arrived. A failure is raised there, with the type `numpy()` would raise. For logging
        a loss while later steps run: `futs.append(loss.read_async())`, read the done ones later.
        """
        future: ArrayFuture = self._v.dev._read_async(self._v)
        return future

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy is False:
            raise ValueError("a Tensor's data lives on its device: converting it always copies")
        a = self.numpy()
        return a if dtype is None else a.astype(dtype, copy=False)

    def item(self) -> Scalar:
        """The value of a one-element tensor as a Python scalar."""
        if self.size != 1:
            raise ValueError(f"item() needs a tensor with one element, got shape {self.shape}")
        value: Scalar = self.numpy().item()
        return value

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError(f"the truth value of a tensor of shape {self.shape} is ambiguous")
        return bool(self.item())

    def to(self, device: TensorDevice) -> Tensor:
        """This tensor on `device`: read here and uploaded there (crossing devices is explicit)."""
        if device is self._v.dev:
            return self
        if not callable(getattr(device, "tensor", None)):
            raise TypeError(f"to() takes a Device (e.g. el.Device.cpu()), got {type(device).__name__}")
        out = device.tensor(self.numpy())
        out._rg = self._rg and self._ctx is None
        return out

    def detach(self) -> Tensor:
        """The same value without autograd history (shares the data; tensors are immutable)."""
        return Tensor(self._v)

    def backward(self, gradient: Tensor | None = None) -> None:
        """Accumulate d(self)/d(leaf) into each leaf's `.grad`; frees this graph's history."""
        if not self._rg:
            raise RuntimeError(
                "backward() on a tensor that does not require grad (no leaf it depends on does)"
            )
        node = self._ctx
        g: Tensor | float
        if gradient is None:
            if self.size != 1:
                raise ShapeError(
                    f"backward() without a gradient needs a one-element tensor, got shape {self.shape}"
                )
            if node is not None and node.op in UNIT_SEED:
                g = 1.0  # the rule folds the seed into a binding: no ones tensor, no multiply
            else:
                g = create(self.device, "ones", (), (("dtype", self.dtype), ("shape", self.shape)))
        else:
            if not isinstance(gradient, Tensor):
                raise TypeError(f"gradient must be a Tensor, got {type(gradient).__name__}")
            if gradient.device is not self.device:
                raise DeviceError(f"gradient is on {gradient.device}, the tensor on {self.device}")
            if gradient.shape != self.shape:
                raise ShapeError(f"gradient shape {gradient.shape} != tensor shape {self.shape}")
            g = gradient.detach().astype(self.dtype)
        if node is not None:
            autograd.run(node, g, RECORDER)
            return
        with autograd.no_grad():  # the tensor is itself a leaf; g is a tensor (UNIT_SEED needs an op)
            autograd.accumulate(self, g)

    # -- operators --------------------------------------------------------------------------------

    def __add__(self, o: object) -> Tensor:
        return _binop("add", self, o)

    def __radd__(self, o: object) -> Tensor:
        return _binop("add", o, self)

    def __sub__(self, o: object) -> Tensor:
        return _binop("subtract", self, o)

    def __rsub__(self, o: object) -> Tensor:
        return _binop("subtract", o, self)

    def __mul__(self, o: object) -> Tensor:
        return _binop("multiply", self, o)

    def __rmul__(self, o: object) -> Tensor:
        return _binop("multiply", o, self)

    def __truediv__(self, o: object) -> Tensor:
        return _binop("divide", self, o)

    def __rtruediv__(self, o: object) -> Tensor:
        return _binop("divide", o, self)

    def __pow__(self, o: object) -> Tensor:
        return _binop("pow", self, o)

    def __rpow__(self, o: object) -> Tensor:
        return _binop("pow", o, self)

    def __matmul__(self, o: object) -> Tensor:
        if not isinstance(o, Tensor):
            return NotImplemented
        return apply("matmul", (self, o))

    def __rmatmul__(self, o: object) -> Tensor:
        if not isinstance(o, Tensor):
            return NotImplemented
        return apply("matmul", (o, self))

    def __neg__(self) -> Tensor:
        return apply("negative", (self,))

    def __pos__(self) -> Tensor:
        return self

    def __abs__(self) -> Tensor:
        return apply("abs", (self,))

    def __invert__(self) -> Tensor:
        if self.dtype != "bool":
            raise DTypeError(f"~ is logical_not and needs a bool tensor, got {self.dtype}")
        return apply("logical_not", (self,))

    def __and__(self, o: object) -> Tensor:
        return _binop("logical_and", self, o)

    def __rand__(self, o: object) -> Tensor:
        return _binop("logical_and", o, self)

    def __or__(self, o: object) -> Tensor:
        return _binop("logical_or", self, o)

    def __ror__(self, o: object) -> Tensor:
        return _binop("logical_or", o, self)

    # Against a tensor or a scalar `==` and `!=` are ops; against anything else Python falls back
    # to identity and gives a bool (so `t == None` is False and `t in [None]` works).
    @overload  # type: ignore[override]
    def __eq__(self, o: Tensor | Scalar | np.generic) -> Tensor: ...
    @overload
    def __eq__(self, o: object) -> Tensor | bool: ...
    def __eq__(self, o: object) -> Tensor | bool:
        return _binop("equal", self, o)

    @overload  # type: ignore[override]
    def __ne__(self, o: Tensor | Scalar | np.generic) -> Tensor: ...
    @overload
    def __ne__(self, o: object) -> Tensor | bool: ...
    def __ne__(self, o: object) -> Tensor | bool:
        return _binop("not_equal", self, o)

    def __lt__(self, o: object) -> Tensor:
        return _binop("less", self, o)

    def __le__(self, o: object) -> Tensor:
        return _binop("less_equal", self, o)

    def __gt__(self, o: object) -> Tensor:
        return _binop("greater", self, o)

    def __ge__(self, o: object) -> Tensor:
        return _binop("greater_equal", self, o)

    def __setitem__(self, key: object, value: object) -> None:
        raise TypeError("tensors are immutable; build a new one (e.g. with where(mask, value, t))")

    # -- elementwise math -------------------------------------------------------------------------

    # One line each, from the op table: `x.exp()` records `exp` as `el.exp(x)` does.
    abs = _elementwise_method("abs")
    arctan = _elementwise_method("arctan")
    ceil = _elementwise_method("ceil")
    cos = _elementwise_method("cos")
    cosh = _elementwise_method("cosh")
    exp = _elementwise_method("exp")
    expm1 = _elementwise_method("expm1")
    floor = _elementwise_method("floor")
    isfinite = _elementwise_method("isfinite")
    isinf = _elementwise_method("isinf")
    isnan = _elementwise_method("isnan")
    log = _elementwise_method("log")
    log1p = _elementwise_method("log1p")
    logical_not = _elementwise_method("logical_not")
    negative = _elementwise_method("negative")
    relu = _elementwise_method("relu")
    round = _elementwise_method("round")
    sigmoid = _elementwise_method("sigmoid")
    sign = _elementwise_method("sign")
    sin = _elementwise_method("sin")
    sinh = _elementwise_method("sinh")
    sqrt = _elementwise_method("sqrt")
    square = _elementwise_method("square")
    tanh = _elementwise_method("tanh")
    trunc = _elementwise_method("trunc")

    def astype(self, dtype: Any) -> Tensor:
        """A copy converted to `dtype` (a name like "float16" or a NumPy dtype)."""
        name = dtype_name(dtype)
        if name == self.dtype:
            return self
        return apply("astype", (self,), (("dtype", name),))

    # -- reductions -------------------------------------------------------------------------------

    def _reduce(self, op: str, axis: Any, keepdims: bool) -> Tensor:
        axes = norm_axes(op, axis, self.ndim)
        return apply(op, (self,), (("axis", axes), ("keepdims", bool(keepdims))))

    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce("sum", axis, keepdims)

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce("mean", axis, keepdims)

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce("max", axis, keepdims)

    def min(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce("min", axis, keepdims)

    def prod(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce("prod", axis, keepdims)

    def any(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        """Whether any element (along `axis`) is true / non-zero (a bool tensor)."""
        return self.astype("bool")._reduce("max", axis, keepdims)

    def all(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        """Whether every element (along `axis`) is true / non-zero (a bool tensor)."""
        return self.astype("bool")._reduce("min", axis, keepdims)

    def argmax(self, axis: int | None = None, keepdims: bool = False) -> Tensor:
        """Index of the largest element (int64): over the flattened tensor when `axis` is None."""
        a = None if axis is None else norm_axis("argmax", axis, self.ndim)
        return apply("argmax", (self,), (("axis", a), ("keepdims", bool(keepdims))))

    def argmin(self, axis: int | None = None, keepdims: bool = False) -> Tensor:
        """Index of the smallest element (int64): over the flattened tensor when `axis` is None."""
        a = None if axis is None else norm_axis("argmin", axis, self.ndim)
        return apply("argmin", (self,), (("axis", a), ("keepdims", bool(keepdims))))

    # -- shape ------------------------------------------------------------------------------------

    def reshape(self, *shape: Any) -> Tensor:
        """`t.reshape(2, -1)` or `t.reshape((2, -1))`; one dimension may be -1."""
        new = _shape_args(shape)
        size = self.size
        if new.count(-1) > 1 or any(d < -1 for d in new):
            raise ShapeError(f"reshape: bad target shape {new} (one -1 at most, no other negatives)")
        if -1 in new:
            known = 1
            for d in new:
                if d != -1:
                    known *= d
            if known == 0 or size % known:
                raise ShapeError(f"reshape: cannot reshape {self.shape} ({size} elements) to {new}")
            new = tuple(size // known if d == -1 else d for d in new)
        if new == self.shape:
            return self
        n = 1
        for d in new:
            n *= d
        if n != size:
            raise ShapeError(f"reshape: cannot reshape {self.shape} ({size} elements) to {new}")
        return apply("reshape", (self,), (("shape", new),))

    def permute(self, *axes: Any) -> Tensor:
        """Reorder the axes: `t.permute(2, 0, 1)` or `t.permute((2, 0, 1))` (Array API permute_dims)."""
        perm = _shape_args(axes)
        if len(perm) != self.ndim:
            raise ShapeError(f"permute: axes {perm} do not match a tensor of shape {self.shape}")
        norm = tuple(norm_axis("permute", a, self.ndim) for a in perm)
        if sorted(norm) != list(range(self.ndim)):
            raise ShapeError(f"permute: {perm} is not a permutation of the axes of shape {self.shape}")
        if norm == tuple(range(self.ndim)):
            return self
        return apply("permute_dims", (self,), (("axes", norm),))

    def transpose(self, axis0: int = -2, axis1: int = -1) -> Tensor:
        """Swap two axes (torch's meaning); by default the last two (a batch of matrices)."""
        if self.ndim < 2:
            raise ShapeError(f"transpose: needs at least 2 axes, got shape {self.shape}")
        a = norm_axis("transpose", axis0, self.ndim)
        b = norm_axis("transpose", axis1, self.ndim)
        perm = list(range(self.ndim))
        perm[a], perm[b] = perm[b], perm[a]
        return self.permute(perm)

    @property
    def T(self) -> Tensor:
        """All axes reversed (the matrix transpose for a 2-D tensor)."""
        return self.permute(tuple(range(self.ndim - 1, -1, -1)))

    @property
    def mT(self) -> Tensor:
        """The last two axes swapped (a batch of matrices transposed)."""
        return self.transpose(-2, -1)

    def broadcast_to(self, *shape: Any) -> Tensor:
        new = _shape_args(shape)
        if new == self.shape:
            return self
        return apply("broadcast_to", (self,), (("shape", new),))

    def expand_dims(self, axis: int) -> Tensor:
        """A new axis of size 1 at `axis` (which may be -1 for the end)."""
        a = norm_axis("expand_dims", axis, self.ndim, extra=1)
        return apply("expand_dims", (self,), (("axis", a),))

    def squeeze(self, axis: int | Sequence[int] | None = None) -> Tensor:
        """Drop axes of size 1: the given ones, or all of them."""
        if axis is None:
            axes = tuple(i for i, d in enumerate(self.shape) if d == 1)
        else:
            axes = norm_axes("squeeze", axis, self.ndim) or tuple(range(self.ndim))
        if not axes:
            return self
        return apply("squeeze", (self,), (("axis", axes),))

    def flatten(self) -> Tensor:
        return self.reshape(-1)

    # -- indexing ---------------------------------------------------------------------------------

    def __getitem__(self, key: Any) -> Tensor:
        """Basic indexing (ints, slices with any bounds and steps, None, ...) and integer-tensor take.

        `x[idx]` with an integer Tensor `idx` takes along axis 0; `x[:, idx]` or `x[..., idx]` along
        that axis. Boolean masks are not supported (their result shape depends on the data): use
        `where(mask, x, 0)`.
        """
        items = key if isinstance(key, tuple) else (key,)
        if any(isinstance(it, Tensor) for it in items):
            return self._take_key(items)
        if any(isinstance(it, list | np.ndarray) for it in items):
            raise TypeError("index with an integer Tensor (dev.tensor(indices)), not a list or array")
        plan = indexing.normalize_key(key, self.shape)
        out = self if not plan.key else apply("getitem", (self,), (("key", plan.key),))
        for axis, length in plan.flips:
            rev = create(self._v.dev, "arange", (), _arange_attrs(length - 1, -1, -1, "int64"))
            out = apply("take", (out, rev), (("axis", axis),))
        return out

    def _take_key(self, items: tuple[Any, ...]) -> Tensor:
        axis = indexing.tensor_axis(items, self.ndim, Tensor)
        if axis is None:
            raise TypeError(
                "an index tensor can only be combined with ':' and '...' (e.g. x[idx], x[:, idx])"
            )
        (idx,) = (it for it in items if isinstance(it, Tensor))
        if idx.dtype == "bool":
            raise TypeError("boolean mask indexing is not supported (data-dependent shape); use where()")
        return apply("take", (self, idx), (("axis", axis),))

    def take(self, indices: Tensor, axis: int | None = 0) -> Tensor:
        """Elements at integer `indices` along `axis` (NumPy take; axis None: the flattened tensor)."""
        a = None if axis is None else norm_axis("take", axis, self.ndim)
        return apply("take", (self, indices), (("axis", a),))

    # -- linear algebra ---------------------------------------------------------------------------

    def matmul(self, other: Tensor) -> Tensor:
        return apply("matmul", (self, other))


def _arange_attrs(start: float, stop: float, step: float, dtype: str) -> tuple[Any, ...]:
    return (("dtype", dtype), ("start", start), ("step", step), ("stop", stop))


class _Recorder:
    """What gradient rules record with (`graph_replay.gradients.Recorder`): ops on tensors of the
    node's device, and saved values turned back into history-free tensors."""

    def apply(self, op: str, args: Sequence[Any], attrs: tuple[tuple[str, Any], ...] = ()) -> Tensor:
        return apply(op, args, attrs)

    def full(self, node: Recorded, value: float, spec: Spec) -> Tensor:
        return create(node.dev, "full", (value,), (("dtype", spec[0]), ("shape", spec[1])))

    def operand(self, value: Any) -> Any:
        return value if isinstance(value, bool | int | float) else Tensor(value)


RECORDER = _Recorder()
"""The one Recorder: it keeps no state (every op goes to its operands' device)."""
