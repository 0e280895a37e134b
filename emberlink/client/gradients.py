"""Gradient rules, one per differentiable op, written with Tensor ops; they only record.

A rule gets the output gradient `g` and what the forward op saved, and returns one gradient per
input (None for inputs that take none). Because the rules are ordinary recorded ops, a step's
forward, backward and optimizer update land in one pending segment and run as one graph.

Every rule returns gradients already reduced to the input's shape (`_fit` sums over broadcast
axes) and cast to the input's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from emberlink.client.tensor import GradNode, Scalar, Tensor, apply, create

Spec = tuple[str, tuple[int, ...]]
Rule = Callable[..., Sequence[Tensor | None]]


def _t(v: Any) -> Any:
    """A saved input as an operand: a Value becomes a (history-free) Tensor; a scalar stays."""
    return v if isinstance(v, bool | int | float) else Tensor(v)


def _fit(g: Tensor, spec: Spec | str) -> Tensor | None:
    """`g` reduced to an operand's shape and cast to its dtype; None for a scalar operand."""
    if isinstance(spec, str):
        return None
    gspec = g._v.spec
    if gspec == spec:
        return g
    dtype, shape = spec
    gshape = gspec[1]
    if gshape != shape:
        lead = len(gshape) - len(shape)
        axes = tuple(range(lead)) + tuple(
            lead + i for i, d in enumerate(shape) if d == 1 and gshape[lead + i] != 1
        )
        if axes:
            g = apply("sum", (g,), (("axis", axes), ("keepdims", False)))
        if g.shape != shape:
            g = g.reshape(shape)
    if g.dtype != dtype:
        g = g.astype(dtype)
    return g


def _zeros_where(mask: Tensor, g: Tensor, keep_if: bool) -> Tensor:
    return apply("where", (mask, g, 0) if keep_if else (mask, 0, g))


def _add(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    return _fit(g, n.specs[0]) if n.parents[0] is not None else None, _fit(g, n.specs[1]) if n.parents[
        1
    ] is not None else None


def _subtract(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    return _fit(g, n.specs[0]) if n.parents[0] is not None else None, _fit(-g, n.specs[1]) if n.parents[
        1
    ] is not None else None


def _multiply(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    a, b = _t(n.saved[0]), _t(n.saved[1])
    return _fit(g * b, n.specs[0]) if n.parents[0] is not None else None, _fit(
        g * a, n.specs[1]
    ) if n.parents[1] is not None else None


def _divide(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    a, b = _t(n.saved[0]), _t(n.saved[1])
    ga = _fit(g / b, n.specs[0]) if n.parents[0] is not None else None
    gb = _fit(-(g * a) / (b * b), n.specs[1]) if n.parents[1] is not None else None
    return ga, gb


def _pow(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    a, b, out = _t(n.saved[0]), _t(n.saved[1]), Tensor(n.out)
    ga = _fit(g * (b * a ** (b - 1)), n.specs[0]) if n.parents[0] is not None else None
    log_a = math.log(a) if isinstance(a, float | int) else a.log()
    gb = _fit(g * (out * log_a), n.specs[1]) if n.parents[1] is not None else None
    return ga, gb


def _extremum(ge: bool) -> Rule:
    def rule(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
        a, b = _t(n.saved[0]), _t(n.saved[1])
        # Ties send the whole gradient to the first operand, so the two parts sum to g.
        mask = apply("greater_equal" if ge else "less_equal", (a, b))
        ga = _fit(_zeros_where(mask, g, True), n.specs[0]) if n.parents[0] is not None else None
        gb = _fit(_zeros_where(mask, g, False), n.specs[1]) if n.parents[1] is not None else None
        return ga, gb

    return rule


def _where(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    c = Tensor(n.saved[0])
    gx = _fit(_zeros_where(c, g, True), n.specs[1]) if n.parents[1] is not None else None
    gy = _fit(_zeros_where(c, g, False), n.specs[2]) if n.parents[2] is not None else None
    return None, gx, gy


def _unary(fn: Callable[[Tensor, Any, Any], Tensor]) -> Rule:
    def rule(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
        x = None if n.saved is None else Tensor(n.saved[0])
        out = None if n.out is None else Tensor(n.out)
        return (_fit(fn(g, x, out), n.specs[0]),)

    return rule


_UNARY: dict[str, Callable[[Tensor, Any, Any], Tensor]] = {
    "negative": lambda g, x, y: -g,
    "abs": lambda g, x, y: g * x.sign(),
    "exp": lambda g, x, y: g * y,
    "log": lambda g, x, y: g / x,
    "sqrt": lambda g, x, y: (g / y) * 0.5,
    "square": lambda g, x, y: g * (x * 2.0),
    "tanh": lambda g, x, y: g * (1.0 - y * y),
    "sigmoid": lambda g, x, y: g * (y * (1.0 - y)),
    "relu": lambda g, x, y: g * (x > 0),
    "sin": lambda g, x, y: g * x.cos(),
    "cos": lambda g, x, y: -(g * x.sin()),
}


def _astype(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    return (g.astype(n.specs[0][0]),)


def _keepdims_shape(shape: tuple[int, ...], axis: tuple[int, ...] | None) -> tuple[int, ...]:
    return tuple(1 if axis is None or i in axis else d for i, d in enumerate(shape))


def _reduction_parts(g: Tensor, n: GradNode) -> tuple[Tensor, tuple[int, ...], tuple[int, ...] | None]:
    """The output gradient with the reduced axes kept (size 1), the input shape, and the axes."""
    attrs = dict(n.attrs)
    axis, shape = attrs["axis"], n.specs[0][1]
    kshape = _keepdims_shape(shape, axis)
    return g.reshape(kshape), shape, axis


def _count(shape: tuple[int, ...], axis: tuple[int, ...] | None) -> int:
    n = 1
    for i, d in enumerate(shape):
        if axis is None or i in axis:
            n *= d
    return n


def _sum(g: Tensor | float, n: GradNode) -> Sequence[Tensor | None]:
    if isinstance(g, float):  # the implicit seed of backward(): every element gets 1
        return (create(n.dev, "full", (g,), (("dtype", n.specs[0][0]), ("shape", n.specs[0][1]))),)
    gk, shape, _ = _reduction_parts(g, n)
    return (gk.broadcast_to(shape),)


def _mean(g: Tensor | float, n: GradNode) -> Sequence[Tensor | None]:
    count = max(_count(n.specs[0][1], dict(n.attrs)["axis"]), 1)
    if isinstance(g, float):  # the implicit seed of backward(): every element gets 1/count
        return (create(n.dev, "full", (g / count,), (("dtype", n.specs[0][0]), ("shape", n.specs[0][1]))),)
    gk, shape, _ = _reduction_parts(g, n)
    return (_fit((gk / count).broadcast_to(shape), n.specs[0]),)


def _extreme_value(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    gk, _, axis = _reduction_parts(g, n)
    x, out = Tensor(n.saved[0]), Tensor(n.out).reshape(gk.shape)
    # Every element equal to the extreme shares the gradient equally.
    mask = (x == out).astype(x.dtype)
    count = apply("sum", (mask,), (("axis", axis), ("keepdims", True)))
    return (mask * (gk / count),)


def _prod(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    gk, _, _ = _reduction_parts(g, n)
    x, out = Tensor(n.saved[0]), Tensor(n.out).reshape(gk.shape)
    return ((gk * out) / x,)  # no zeros in x: the product rule through division


_SWAP_LAST: dict[int, tuple[tuple[str, tuple[int, ...]], ...]] = {}


def _mT(x: Tensor) -> Tensor:
    """The last two axes swapped; recorded directly (this runs twice per matmul per step)."""
    n = x.ndim
    attrs = _SWAP_LAST.get(n)
    if attrs is None:
        axes = (*range(n - 2), n - 1, n - 2)
        attrs = _SWAP_LAST[n] = (("axes", axes),)
    return apply("permute_dims", (x,), attrs)


def _matmul(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    a, b = Tensor(n.saved[0]), Tensor(n.saved[1])
    if a.ndim == 1 or b.ndim == 1:
        return _matmul_vector(g, n, a, b)
    ga = _fit(g @ _mT(b), n.specs[0]) if n.parents[0] is not None else None
    gb = _fit(_mT(a) @ g, n.specs[1]) if n.parents[1] is not None else None
    return ga, gb


def _matmul_vector(g: Tensor, n: GradNode, a: Tensor, b: Tensor) -> Sequence[Tensor | None]:
    # Promote 1-D operands the way matmul does, then reuse the matrix rule's algebra.
    a2 = a.reshape(1, a.shape[0]) if a.ndim == 1 else a
    b2 = b.reshape(b.shape[0], 1) if b.ndim == 1 else b
    gshape = g.shape
    if a.ndim == 1:
        cut = len(gshape) - (b.ndim > 1)
        gshape = (*gshape[:cut], 1, *gshape[cut:])
    if b.ndim == 1:
        gshape = (*gshape, 1)
    g2 = g.reshape(gshape)
    ga = _fit(g2 @ _mT(b2), (n.specs[0][0], a2.shape)) if n.parents[0] is not None else None
    gb = _fit(_mT(a2) @ g2, (n.specs[1][0], b2.shape)) if n.parents[1] is not None else None
    return (
        None if ga is None else ga.reshape(a.shape),
        None if gb is None else gb.reshape(b.shape),
    )


def _reshape_back(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    return (g.reshape(n.specs[0][1]),)


def _permute_dims(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    axes = dict(n.attrs)["axes"]
    inverse = [0] * len(axes)
    for i, a in enumerate(axes):
        inverse[a] = i
    return (g.permute(inverse),)


def _broadcast_to(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    return (_fit(g, n.specs[0]),)


def _concat(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    axis = dict(n.attrs)["axis"]
    grads: list[Tensor | None] = []
    offset = 0
    for p, (_, shape) in zip(n.parents, n.specs, strict=True):
        size = shape[axis]
        if p is not None:
            key = tuple(("s", 0, d, 1) for d in shape[:axis]) + (("s", offset, offset + size, 1),)
            grads.append(apply("getitem", (g,), (("key", key),)))
        else:
            grads.append(None)
        offset += size
    return grads


def _stack(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    axis = dict(n.attrs)["axis"]
    lead = tuple(("s", 0, d, 1) for d in g.shape[:axis])
    return [
        None if p is None else apply("getitem", (g,), (("key", (*lead, ("i", i))),))
        for i, p in enumerate(n.parents)
    ]


def _getitem(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    key = dict(n.attrs)["key"]
    return (apply("getitem_grad", (g,), (("key", key), ("shape", n.specs[0][1]))),)


def _take(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    axis = dict(n.attrs)["axis"]
    idx, shape = Tensor(n.saved[1]), n.specs[0][1]
    if axis is None:
        size = 1
        for d in shape:
            size *= d
        flat = apply("scatter_add", (g, idx), (("axis", None), ("size", size)))
        return flat.reshape(shape), None
    return apply("scatter_add", (g, idx), (("axis", axis), ("size", shape[axis]))), None


def _softmax(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    axis = dict(n.attrs)["axis"]
    y = Tensor(n.out)
    dot = apply("sum", (g * y,), (("axis", (axis,)), ("keepdims", True)))
    return (_fit(y * (g - dot), n.specs[0]),)


def _log_softmax(g: Tensor, n: GradNode) -> Sequence[Tensor | None]:
    axis = dict(n.attrs)["axis"]
    total = apply("sum", (g,), (("axis", (axis,)), ("keepdims", True)))
    return (_fit(g - Tensor(n.out).exp() * total, n.specs[0]),)


def _cross_entropy(g: Tensor | float, n: GradNode) -> Sequence[Tensor | None]:
    reduction = dict(n.attrs)["reduction"]
    logits, labels = Tensor(n.saved[0]), Tensor(n.saved[1])
    rows, classes = logits.shape
    p = apply("softmax", (logits,), (("axis", 1),))
    onehot = apply("one_hot", (labels,), (("dtype", logits.dtype), ("num_classes", classes)))
    d = p - onehot
    # (softmax - one_hot) * g / N; with the implicit seed g = 1.0 the scale is a binding.
    if reduction == "mean":
        scale: Tensor | Scalar = g / max(rows, 1)
    elif reduction == "sum" or isinstance(g, float):
        scale = g
    else:
        scale = g.reshape(rows, 1)
    return d * scale, None


UNIT_SEED = frozenset({"cross_entropy", "sum", "mean"})
"""Ops whose rule takes the implicit seed of `loss.backward()` as the Python float 1.0."""

RULES: dict[str, Rule] = {
    "add": _add,
    "subtract": _subtract,
    "multiply": _multiply,
    "divide": _divide,
    "pow": _pow,
    "maximum": _extremum(True),
    "minimum": _extremum(False),
    "where": _where,
    **{op: _unary(fn) for op, fn in _UNARY.items()},
    "astype": _astype,
    "sum": _sum,
    "mean": _mean,
    "max": _extreme_value,
    "min": _extreme_value,
    "prod": _prod,
    "matmul": _matmul,
    "reshape": _reshape_back,
    "expand_dims": _reshape_back,
    "squeeze": _reshape_back,
    "permute_dims": _permute_dims,
    "broadcast_to": _broadcast_to,
    "concat": _concat,
    "stack": _stack,
    "getitem": _getitem,
    "take": _take,
    "softmax": _softmax,
    "log_softmax": _log_softmax,
    "cross_entropy": _cross_entropy,
}
"""Op name -> gradient rule. Ops not here (comparisons, argmax, sign, creation, ...) pass no gradient."""

__all__ = ["RULES", "create"]
