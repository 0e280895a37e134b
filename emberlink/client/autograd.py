"""Reverse-mode autograd over recorded ops: `backward` and `no_grad`; records, never computes.

Each op on a tensor that requires grad stores `(op, parents, saved inputs, input specs, attrs,
saved output)` on its result. `backward` walks that history from the loss in topological order,
applies `gradients.RULES` (which record more ops on the same device), accumulates into each
leaf's `.grad`, and frees the history as it goes, so the saved values stop being outputs of the
next flush.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self, TypeVar

from emberlink.client.gradients import RULES, UNIT_SEED
from emberlink.client.tensor import GRAD_MODE, Tensor, create
from emberlink.errors import DeviceError, ShapeError

F = TypeVar("F", bound=Callable[..., Any])

_FREED: tuple[Any, ...] = ("freed",)
"""History of a tensor a backward pass already went through."""


class no_grad:
    """Context manager (or decorator) under which ops record no autograd history."""

    def __init__(self) -> None:
        self._prev: list[bool] = []

    def __enter__(self) -> Self:
        self._prev.append(GRAD_MODE.enabled)
        GRAD_MODE.enabled = False
        return self

    def __exit__(self, *exc: object) -> None:
        GRAD_MODE.enabled = self._prev.pop()

    def __call__(self, fn: F) -> F:
        import functools

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with no_grad():
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def _topological(root: Tensor) -> list[Tensor]:
    """Tensors with history reachable from `root`, each before the tensors it was computed from."""
    order: list[Tensor] = []
    seen: set[int] = set()
    stack: list[tuple[Tensor, bool]] = [(root, False)]
    while stack:
        t, done = stack.pop()
        if done:
            order.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        ctx = t._ctx
        if ctx is _FREED:
            raise RuntimeError(
                "backward through a graph a second time: its history was freed by the first backward()"
            )
        if ctx is not None:
            for p in ctx[1]:
                if p is not None and p._ctx is not None and id(p) not in seen:
                    stack.append((p, False))
    order.reverse()
    return order


def backward(root: Tensor, gradient: Tensor | None = None) -> None:
    """Accumulate d(root)/d(leaf) into `.grad` of every leaf that requires grad."""
    if not root._rg:
        raise RuntimeError("backward() on a tensor that does not require grad (no leaf it depends on does)")
    if gradient is None:
        if root.size != 1:
            raise ShapeError(
                f"backward() without a gradient needs a one-element tensor, got shape {root.shape}"
            )
        ctx = root._ctx
        if ctx is not None and ctx is not _FREED and ctx[0] in UNIT_SEED:
            g: Tensor | float = 1.0  # the rule folds the seed into a binding: no ones tensor
        else:
            g = create(root.device, "ones", (), (("dtype", root.dtype), ("shape", root.shape)))
    else:
        if not isinstance(gradient, Tensor):
            raise TypeError(f"gradient must be a Tensor, got {type(gradient).__name__}")
        if gradient.device is not root.device:
            raise DeviceError(f"gradient is on {gradient.device}, the tensor on {root.device}")
        if gradient.shape != root.shape:
            raise ShapeError(f"gradient shape {gradient.shape} != tensor shape {root.shape}")
        g = gradient.detach().astype(root.dtype)
    prev, GRAD_MODE.enabled = GRAD_MODE.enabled, False
    try:
        _run(root, g)
    finally:
        GRAD_MODE.enabled = prev


def _run(root: Tensor, g: Tensor | float) -> None:
    if root._ctx is None:  # the root is itself a leaf
        assert isinstance(g, Tensor)
        root.grad = g if root.grad is None else root.grad + g
        return
    grads: dict[int, Tensor | float] = {id(root): g}
    for t in _topological(root):
        ctx = t._ctx
        t._ctx = _FREED
        gt = grads.pop(id(t), None)
        if gt is None or ctx is None:
            continue
        op, parents, saved, specs, attrs, out = ctx
        for p, gp in zip(parents, RULES[op](gt, parents, saved, specs, attrs, out), strict=True):
            if p is None or gp is None:
                continue
            if p._ctx is None:
                p.grad = gp if p.grad is None else p.grad + gp
            else:
                k = id(p)
                acc = grads.get(k)
                grads[k] = gp if acc is None else acc + gp
