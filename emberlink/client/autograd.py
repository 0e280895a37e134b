"""Reverse-mode autograd over recorded ops: `backward` and `no_grad`; records, never computes.

Each op on a tensor that requires grad hangs a `GradNode` on its result (tensor.py). `backward`
walks those nodes from the loss in topological order, applies `gradients.RULES` (which record
more ops on the same device), accumulates into each leaf's `.grad`, and frees each node as it
goes, so the values it saved stop being outputs of the next flush.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self, TypeVar

from emberlink.client.gradients import RULES, UNIT_SEED
from emberlink.client.tensor import GRAD_MODE, GradNode, Tensor, create
from emberlink.errors import DeviceError, ShapeError

F = TypeVar("F", bound=Callable[..., Any])


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


def _topological(root: GradNode) -> list[GradNode]:
    """Nodes reachable from `root`, each before the nodes of the values it was computed from."""
    order: list[GradNode] = []
    seen: set[int] = set()
    stack: list[tuple[GradNode, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        parents = node.parents
        if parents is None:
            raise RuntimeError(
                "backward through a graph a second time: its history was freed by the first backward()"
            )
        stack.append((node, True))
        for p in parents:
            if type(p) is GradNode and id(p) not in seen:
                stack.append((p, False))
    order.reverse()
    return order


def backward(root: Tensor, gradient: Tensor | None = None) -> None:
    """Accumulate d(root)/d(leaf) into `.grad` of every leaf that requires grad."""
    if not root._rg:
        raise RuntimeError("backward() on a tensor that does not require grad (no leaf it depends on does)")
    node = root._ctx
    g: Tensor | float
    if gradient is None:
        if root.size != 1:
            raise ShapeError(
                f"backward() without a gradient needs a one-element tensor, got shape {root.shape}"
            )
        if node is not None and node.op in UNIT_SEED:
            g = 1.0  # the rule folds the seed into a binding: no ones tensor, no multiply
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
        if node is None:  # the root is itself a leaf (g is a tensor: UNIT_SEED needs an op)
            assert isinstance(g, Tensor)
            _accumulate(root, g)
        else:
            _run(node, g)
    finally:
        GRAD_MODE.enabled = prev


def _accumulate(leaf: Tensor, g: Tensor) -> None:
    # In place, as torch does: `.grad` keeps its Tensor object, so a step replayed by emberlink.jit
    # that accumulates into it reads and rebinds the same object (client/trace.py). Each leaf gets
    # its own object, since a rule may hand one gradient to several inputs.
    if leaf.grad is None:
        leaf.grad = g.detach()
    else:
        leaf.grad._v = (leaf.grad + g)._v


def _run(root: GradNode, g: Tensor | float) -> None:
    grads: dict[int, Tensor | float] = {id(root): g}
    for node in _topological(root):
        gn = grads.pop(id(node), None)
        parents = node.parents
        assert parents is not None
        if gn is not None:
            for p, gp in zip(parents, RULES[node.op](gn, node), strict=True):
                if p is None or gp is None:
                    continue
                if type(p) is GradNode:
                    k = id(p)
                    acc = grads.get(k)
                    grads[k] = gp if acc is None else acc + gp
                else:
                    _accumulate(p, gp)
        # Free the history as we go: saved values stop being outputs of the next flush.
        node.parents = node.saved = node.out = None
