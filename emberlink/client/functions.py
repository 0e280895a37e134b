"""The Array-API-style functions of the `emberlink` namespace (`el.exp(x)`, `el.concat([...])`).

Each one records an op, exactly as the Tensor method or operator of the same meaning does; the
names follow the Python Array API standard (`permute_dims`, `concat`, `expand_dims`, ...).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from typing import Any

from emberlink.client.tensor import Scalar, Tensor, apply, norm_axis
from emberlink.graph_replay.ops import MAX_VARIADIC, get_op

Operand = Tensor | Scalar


def _binary(op: str) -> Callable[[Operand, Operand], Tensor]:
    if get_op(op).family != "binary":
        raise ValueError(f"{op} is not a binary elementwise op")

    def fn(a: Operand, b: Operand) -> Tensor:
        return apply(op, (a, b))

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = f"Elementwise {op} with NumPy broadcasting; either operand may be a Python scalar."
    return fn


def _unary(op: str) -> Callable[[Tensor], Tensor]:
    if get_op(op).family != "unary":
        raise ValueError(f"{op} is not a unary elementwise op")

    def fn(x: Tensor) -> Tensor:
        return apply(op, (x,))

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = f"Elementwise {op} (Python Array API semantics)."
    return fn


# One line each, from the op table (a test checks every elementwise op has its line).
add = _binary("add")
subtract = _binary("subtract")
multiply = _binary("multiply")
divide = _binary("divide")
pow = _binary("pow")
maximum = _binary("maximum")
minimum = _binary("minimum")
equal = _binary("equal")
not_equal = _binary("not_equal")
less = _binary("less")
less_equal = _binary("less_equal")
greater = _binary("greater")
greater_equal = _binary("greater_equal")
logical_and = _binary("logical_and")
logical_or = _binary("logical_or")

abs = _unary("abs")
arctan = _unary("arctan")
ceil = _unary("ceil")
cos = _unary("cos")
cosh = _unary("cosh")
exp = _unary("exp")
expm1 = _unary("expm1")
floor = _unary("floor")
isfinite = _unary("isfinite")
isinf = _unary("isinf")
isnan = _unary("isnan")
log = _unary("log")
log1p = _unary("log1p")
logical_not = _unary("logical_not")
negative = _unary("negative")
relu = _unary("relu")
round = _unary("round")
sigmoid = _unary("sigmoid")
sign = _unary("sign")
sin = _unary("sin")
sinh = _unary("sinh")
sqrt = _unary("sqrt")
square = _unary("square")
tanh = _unary("tanh")
trunc = _unary("trunc")


def sum(x: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    return x.sum(axis, keepdims)


def mean(x: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    return x.mean(axis, keepdims)


def max(x: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    return x.max(axis, keepdims)


def min(x: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    return x.min(axis, keepdims)


def prod(x: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    return x.prod(axis, keepdims)


def argmax(x: Tensor, axis: int | None = None, keepdims: bool = False) -> Tensor:
    return x.argmax(axis, keepdims)


def argmin(x: Tensor, axis: int | None = None, keepdims: bool = False) -> Tensor:
    return x.argmin(axis, keepdims)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product with NumPy semantics (batch broadcasting; 1-D operands are promoted)."""
    return apply("matmul", (a, b))


def reshape(x: Tensor, shape: Sequence[int]) -> Tensor:
    return x.reshape(shape)


def permute_dims(x: Tensor, axes: Sequence[int]) -> Tensor:
    return x.permute(axes)


def broadcast_to(x: Tensor, shape: Sequence[int]) -> Tensor:
    return x.broadcast_to(shape)


def expand_dims(x: Tensor, axis: int) -> Tensor:
    return x.expand_dims(axis)


def squeeze(x: Tensor, axis: int | Sequence[int] | None = None) -> Tensor:
    return x.squeeze(axis)


def astype(x: Tensor, dtype: Any) -> Tensor:
    return x.astype(dtype)


def take(x: Tensor, indices: Tensor, axis: int | None = 0) -> Tensor:
    """Elements of `x` at integer `indices` along `axis` (NumPy take; None: the flattened `x`)."""
    return x.take(indices, axis)


def where(condition: Tensor, x: Operand, y: Operand) -> Tensor:
    """`x` where `condition` (a bool tensor) is true, else `y`; scalars allowed for `x` and `y`."""
    return apply("where", (condition, x, y))


def _tensors(op: str, tensors: Sequence[Tensor]) -> list[Tensor]:
    items = list(tensors)
    if not items:
        raise ValueError(f"{op}: needs at least one tensor")
    for t in items:
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: takes a sequence of Tensors, got a {type(t).__name__}")
    return items


def concat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Join tensors along an existing axis."""
    items = _tensors("concat", tensors)
    a = norm_axis("concat", axis, items[0].ndim)
    while builtins.len(items) > MAX_VARIADIC:  # the op takes at most 64 inputs: join in rounds
        items = [concat(items[i : i + MAX_VARIADIC], a) for i in range(0, builtins.len(items), MAX_VARIADIC)]
    return apply("concat", items, (("axis", a),))


def stack(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Join tensors of one shape along a new axis."""
    items = _tensors("stack", tensors)
    a = norm_axis("stack", axis, items[0].ndim, extra=1)
    if builtins.len(items) > MAX_VARIADIC:
        return concat([t.expand_dims(a) for t in items], a)
    return apply("stack", items, (("axis", a),))
