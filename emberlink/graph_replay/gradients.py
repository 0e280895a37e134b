"""Gradient rules, one per differentiable op, referenced by the op table; they only record.

A rule never imports the client: it gets a `Recorder` (the client's, which records ops on the
device of the node being differentiated), the output gradient `g` and the node (`Recorded`: what
the forward op kept), and returns one gradient per input (None for inputs that take none).
The values a rule handles are the client's tensors; rules use only their operators (`+ - * / **
@ > ==`), their metadata (`shape`, `ndim`, `dtype`) and the Tensor methods `reshape`,
`broadcast_to`, `permute`, `astype` and the elementwise math methods (`cos`, `sign`, ...).
Because rules are ordinary recorded ops, a step's forward, backward and optimizer update land in
one pending segment and run as one graph.

Every rule returns gradients already reduced to the input's shape (`fit` sums over broadcast
axes) and cast to the input's dtype. `g` is the Python float 1.0, not a tensor, for the ops whose
`Grad.unit_seed` is set, when `loss.backward()` seeds them itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

Spec = tuple[str, tuple[int, ...]]
Attrs = tuple[tuple[str, Any], ...]


class Recorded(Protocol):
    """A recorded op as its rule sees it (the client's GradNode).

    `parents[i]` is None when input `i` takes no gradient; `saved` holds the inputs (tensor
    values or Python scalars) when the op's `Grad.saves_inputs`, `out` the output value when
    `Grad.saves_output`; `specs[i]` is input `i`'s `(dtype, shape)`, or its kind for a scalar.
    """

    @property
    def parents(self) -> Any: ...
    @property
    def saved(self) -> Any: ...
    @property
    def out(self) -> Any: ...
    @property
    def specs(self) -> Sequence[Any]: ...
    @property
    def attrs(self) -> Attrs: ...
    @property
    def dev(self) -> Any:
        """The device the node's values live on (for `Recorder.full`)."""
        ...


class Recorder(Protocol):
    """What a rule records with; the client implements it on the node's device."""

    def apply(self, op: str, args: Sequence[Any], attrs: Attrs = ()) -> Any:
        """Record `op` on tensor (or scalar) operands; returns the result tensor."""
        ...

    def full(self, node: Recorded, value: float, spec: Spec) -> Any:
        """A tensor of `spec` filled with `value`, on `node`'s device."""
        ...

    def operand(self, value: Any) -> Any:
        """A saved value (`node.saved[i]` or `node.out`) as an operand: a history-free tensor, or
        the Python scalar it was."""
        ...


Rule = Callable[[Recorder, Any, Recorded], Sequence[Any]]
Derivative = Callable[[Any, Any, Any], Any]
"""`(g, x, y) -> g * dy/dx` of a unary elementwise op (x its input, y its output, either None
when the op does not save it)."""


@dataclass(frozen=True, kw_only=True)
class Grad:
    """An op's gradient: its rule and what the forward pass keeps alive for it until backward."""

    rule: Rule
    saves_inputs: bool = False
    saves_output: bool = False
    unit_seed: bool = False
    """Whether the rule takes the implicit seed of `loss.backward()` as the Python float 1.0."""


def fit(ns: Recorder, g: Any, spec: Spec | str) -> Any:
    """`g` reduced to an operand's shape and cast to its dtype; None for a scalar operand."""
    if isinstance(spec, str):
        return None
    dtype, shape = spec
    gshape = g.shape
    if gshape == shape and g.dtype == dtype:
        return g
    if gshape != shape:
        lead = len(gshape) - len(shape)
        axes = tuple(range(lead)) + tuple(
            lead + i for i, d in enumerate(shape) if d == 1 and gshape[lead + i] != 1
        )
        if axes:
            g = ns.apply("sum", (g,), (("axis", axes), ("keepdims", False)))
        if g.shape != shape:
            g = g.reshape(shape)
    if g.dtype != dtype:
        g = g.astype(dtype)
    return g


def _zeros_where(ns: Recorder, mask: Any, g: Any, keep_if: bool) -> Any:
    return ns.apply("where", (mask, g, 0) if keep_if else (mask, 0, g))


# -- elementwise -----------------------------------------------------------------------------------


def unary(derivative: Derivative, *, saves: str) -> Grad:
    """The Grad of a unary elementwise op from its derivative; `saves` is "input", "output",
    "both" or "none": what `derivative` reads."""
    if saves not in ("input", "output", "both", "none"):
        raise ValueError(f"saves must be 'input', 'output', 'both' or 'none', got {saves!r}")

    def rule(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
        x = None if n.saved is None else ns.operand(n.saved[0])
        y = None if n.out is None else ns.operand(n.out)
        return (fit(ns, derivative(g, x, y), n.specs[0]),)

    return Grad(rule=rule, saves_inputs=saves in ("input", "both"), saves_output=saves in ("output", "both"))


def _zero(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    spec = n.specs[0]
    return (ns.full(n, 0.0, (spec[0], spec[1])),)


ZERO = Grad(rule=_zero)
"""The gradient of a piecewise-constant op (floor, round, ...): zeros of the input's spec, as in
PyTorch (the result still takes part in autograd)."""


def _add(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    ga = fit(ns, g, n.specs[0]) if n.parents[0] is not None else None
    gb = fit(ns, g, n.specs[1]) if n.parents[1] is not None else None
    return ga, gb


def _subtract(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    ga = fit(ns, g, n.specs[0]) if n.parents[0] is not None else None
    gb = fit(ns, -g, n.specs[1]) if n.parents[1] is not None else None
    return ga, gb


def _multiply(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    a, b = ns.operand(n.saved[0]), ns.operand(n.saved[1])
    ga = fit(ns, g * b, n.specs[0]) if n.parents[0] is not None else None
    gb = fit(ns, g * a, n.specs[1]) if n.parents[1] is not None else None
    return ga, gb


def _divide(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    a, b = ns.operand(n.saved[0]), ns.operand(n.saved[1])
    ga = fit(ns, g / b, n.specs[0]) if n.parents[0] is not None else None
    gb = fit(ns, -(g * a) / (b * b), n.specs[1]) if n.parents[1] is not None else None
    return ga, gb


def _pow(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    a, b, out = ns.operand(n.saved[0]), ns.operand(n.saved[1]), ns.operand(n.out)
    ga = fit(ns, g * (b * a ** (b - 1)), n.specs[0]) if n.parents[0] is not None else None
    log_a = math.log(a) if isinstance(a, float | int) else a.log()
    gb = fit(ns, g * (out * log_a), n.specs[1]) if n.parents[1] is not None else None
    return ga, gb


def _extremum(ge: bool) -> Rule:
    def rule(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
        a, b = ns.operand(n.saved[0]), ns.operand(n.saved[1])
        # Ties send the whole gradient to the first operand, so the two parts sum to g.
        mask = ns.apply("greater_equal" if ge else "less_equal", (a, b))
        ga = fit(ns, _zeros_where(ns, mask, g, True), n.specs[0]) if n.parents[0] is not None else None
        gb = fit(ns, _zeros_where(ns, mask, g, False), n.specs[1]) if n.parents[1] is not None else None
        return ga, gb

    return rule


BINARY: dict[str, Grad] = {
    "add": Grad(rule=_add),
    "subtract": Grad(rule=_subtract),
    "multiply": Grad(rule=_multiply, saves_inputs=True),
    "divide": Grad(rule=_divide, saves_inputs=True),
    "pow": Grad(rule=_pow, saves_inputs=True, saves_output=True),
    "maximum": Grad(rule=_extremum(True), saves_inputs=True),
    "minimum": Grad(rule=_extremum(False), saves_inputs=True),
}
"""The binary elementwise ops that take a gradient (comparisons and logical ops take none)."""


def _where(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    c = ns.operand(n.saved[0])
    gx = fit(ns, _zeros_where(ns, c, g, True), n.specs[1]) if n.parents[1] is not None else None
    gy = fit(ns, _zeros_where(ns, c, g, False), n.specs[2]) if n.parents[2] is not None else None
    return None, gx, gy


WHERE = Grad(rule=_where, saves_inputs=True)


def _astype(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    return (g.astype(n.specs[0][0]),)


ASTYPE = Grad(rule=_astype)


# -- reductions ------------------------------------------------------------------------------------


def _keepdims_shape(shape: tuple[int, ...], axis: tuple[int, ...] | None) -> tuple[int, ...]:
    return tuple(1 if axis is None or i in axis else d for i, d in enumerate(shape))


def _reduction_parts(g: Any, n: Recorded) -> tuple[Any, tuple[int, ...], tuple[int, ...] | None]:
    """The output gradient with the reduced axes kept (size 1), the input shape, and the axes."""
    axis, shape = dict(n.attrs)["axis"], n.specs[0][1]
    return g.reshape(_keepdims_shape(shape, axis)), shape, axis


def _count(shape: tuple[int, ...], axis: tuple[int, ...] | None) -> int:
    n = 1
    for i, d in enumerate(shape):
        if axis is None or i in axis:
            n *= d
    return n


def _sum(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    if isinstance(g, float):  # the implicit seed of backward(): every element gets 1
        return (ns.full(n, g, n.specs[0]),)
    gk, shape, _ = _reduction_parts(g, n)
    return (gk.broadcast_to(shape),)


def _mean(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    count = max(_count(n.specs[0][1], dict(n.attrs)["axis"]), 1)
    if isinstance(g, float):  # the implicit seed of backward(): every element gets 1/count
        return (ns.full(n, g / count, n.specs[0]),)
    gk, shape, _ = _reduction_parts(g, n)
    return (fit(ns, (gk / count).broadcast_to(shape), n.specs[0]),)


def _extreme_value(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    gk, _, axis = _reduction_parts(g, n)
    x, out = ns.operand(n.saved[0]), ns.operand(n.out).reshape(gk.shape)
    # Every element equal to the extreme shares the gradient equally.
    mask = (x == out).astype(x.dtype)
    count = ns.apply("sum", (mask,), (("axis", axis), ("keepdims", True)))
    return (mask * (gk / count),)


def _prod(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    gk, _, _ = _reduction_parts(g, n)
    x, out = ns.operand(n.saved[0]), ns.operand(n.out).reshape(gk.shape)
    return ((gk * out) / x,)  # no zeros in x: the product rule through division


SUM = Grad(rule=_sum, unit_seed=True)
MEAN = Grad(rule=_mean, unit_seed=True)
EXTREME = Grad(rule=_extreme_value, saves_inputs=True, saves_output=True)
PROD = Grad(rule=_prod, saves_inputs=True, saves_output=True)


# -- linear algebra and shapes ---------------------------------------------------------------------

_SWAP_LAST: dict[int, Attrs] = {}


def _mT(ns: Recorder, x: Any) -> Any:
    """The last two axes swapped; recorded directly (this runs twice per matmul per step)."""
    n = x.ndim
    attrs = _SWAP_LAST.get(n)
    if attrs is None:
        axes = (*range(n - 2), n - 1, n - 2)
        attrs = _SWAP_LAST[n] = (("axes", axes),)
    return ns.apply("permute_dims", (x,), attrs)


def _matmul(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    a, b = ns.operand(n.saved[0]), ns.operand(n.saved[1])
    if a.ndim == 1 or b.ndim == 1:
        return _matmul_vector(ns, g, n, a, b)
    ga = fit(ns, g @ _mT(ns, b), n.specs[0]) if n.parents[0] is not None else None
    gb = fit(ns, _mT(ns, a) @ g, n.specs[1]) if n.parents[1] is not None else None
    return ga, gb


def _matmul_vector(ns: Recorder, g: Any, n: Recorded, a: Any, b: Any) -> Sequence[Any]:
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
    ga = fit(ns, g2 @ _mT(ns, b2), (n.specs[0][0], a2.shape)) if n.parents[0] is not None else None
    gb = fit(ns, _mT(ns, a2) @ g2, (n.specs[1][0], b2.shape)) if n.parents[1] is not None else None
    return (
        None if ga is None else ga.reshape(a.shape),
        None if gb is None else gb.reshape(b.shape),
    )


MATMUL = Grad(rule=_matmul, saves_inputs=True)


def _reshape_back(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    return (g.reshape(n.specs[0][1]),)


def _permute_dims(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    axes = dict(n.attrs)["axes"]
    inverse = [0] * len(axes)
    for i, a in enumerate(axes):
        inverse[a] = i
    return (g.permute(inverse),)


def _broadcast_to(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    return (fit(ns, g, n.specs[0]),)


def _concat(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    axis = dict(n.attrs)["axis"]
    grads: list[Any] = []
    offset = 0
    for p, (_, shape) in zip(n.parents, n.specs, strict=True):
        size = shape[axis]
        if p is not None:
            key = tuple(("s", 0, d, 1) for d in shape[:axis]) + (("s", offset, offset + size, 1),)
            grads.append(ns.apply("getitem", (g,), (("key", key),)))
        else:
            grads.append(None)
        offset += size
    return grads


def _stack(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    axis = dict(n.attrs)["axis"]
    lead = tuple(("s", 0, d, 1) for d in g.shape[:axis])
    return [
        None if p is None else ns.apply("getitem", (g,), (("key", (*lead, ("i", i))),))
        for i, p in enumerate(n.parents)
    ]


RESHAPE_BACK = Grad(rule=_reshape_back)
PERMUTE_DIMS = Grad(rule=_permute_dims)
BROADCAST_TO = Grad(rule=_broadcast_to)
CONCAT = Grad(rule=_concat)
STACK = Grad(rule=_stack)


# -- indexing and training -------------------------------------------------------------------------


def _getitem(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    key = dict(n.attrs)["key"]
    return (ns.apply("getitem_grad", (g,), (("key", key), ("shape", n.specs[0][1]))),)


def _take(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    axis = dict(n.attrs)["axis"]
    idx, shape = ns.operand(n.saved[1]), n.specs[0][1]
    if axis is None:
        flat = ns.apply("scatter_add", (g, idx), (("axis", None), ("size", math.prod(shape))))
        return flat.reshape(shape), None
    return ns.apply("scatter_add", (g, idx), (("axis", axis), ("size", shape[axis]))), None


def _softmax(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    axis = dict(n.attrs)["axis"]
    y = ns.operand(n.out)
    dot = ns.apply("sum", (g * y,), (("axis", (axis,)), ("keepdims", True)))
    return (fit(ns, y * (g - dot), n.specs[0]),)


def _log_softmax(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    axis = dict(n.attrs)["axis"]
    total = ns.apply("sum", (g,), (("axis", (axis,)), ("keepdims", True)))
    return (fit(ns, g - ns.operand(n.out).exp() * total, n.specs[0]),)


def _cross_entropy(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    reduction = dict(n.attrs)["reduction"]
    logits, labels = ns.operand(n.saved[0]), ns.operand(n.saved[1])
    rows, classes = logits.shape
    p = ns.apply("softmax", (logits,), (("axis", 1),))
    onehot = ns.apply("one_hot", (labels,), (("dtype", logits.dtype), ("num_classes", classes)))
    d = p - onehot
    # (softmax - one_hot) * g / N; with the implicit seed g = 1.0 the scale is a binding.
    if reduction == "mean":
        scale = g / max(rows, 1)
    elif reduction == "sum" or isinstance(g, float):
        scale = g
    else:
        scale = g.reshape(rows, 1)
    return d * scale, None


def _window_attrs(n: Recorded) -> Attrs:
    return tuple((k, v) for k, v in n.attrs if k in ("dilation", "kernel_size", "padding", "stride"))


def _unfold(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    # fold is unfold's adjoint: each input element gets the sum of the columns it was copied to.
    out_size = n.specs[0][1][2:]
    attrs = tuple(sorted((*_window_attrs(n), ("output_size", out_size))))
    return (ns.apply("fold", (g,), attrs),)


def _fold(ns: Recorder, g: Any, n: Recorded) -> Sequence[Any]:
    return (ns.apply("unfold", (g,), _window_attrs(n)),)


GETITEM = Grad(rule=_getitem)
TAKE = Grad(rule=_take, saves_inputs=True)
SOFTMAX = Grad(rule=_softmax, saves_output=True)
LOG_SOFTMAX = Grad(rule=_log_softmax, saves_output=True)
CROSS_ENTROPY = Grad(rule=_cross_entropy, saves_inputs=True, unit_seed=True)
UNFOLD = Grad(rule=_unfold)
FOLD = Grad(rule=_fold)

__all__ = [
    "ASTYPE",
    "BINARY",
    "BROADCAST_TO",
    "CONCAT",
    "CROSS_ENTROPY",
    "EXTREME",
    "FOLD",
    "GETITEM",
    "LOG_SOFTMAX",
    "MATMUL",
    "MEAN",
    "PERMUTE_DIMS",
    "PROD",
    "RESHAPE_BACK",
    "SOFTMAX",
    "STACK",
    "SUM",
    "TAKE",
    "UNFOLD",
    "WHERE",
    "ZERO",
    "Derivative",
    "Grad",
    "Recorded",
    "Recorder",
    "Rule",
    "fit",
    "unary",
]
