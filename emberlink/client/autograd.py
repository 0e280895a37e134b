"""Reverse-mode autograd over recorded ops: grad mode, `no_grad`, history nodes and the backward
walk; records through the rules of the op table, never computes, never imports tensor.py.

Each op on a tensor that requires grad hangs a `GradNode` on its result (tensor.py's `apply`).
`run` walks those nodes from the loss in topological order, applies each op's gradient rule from
the op table (`graph_replay.ops.OPS[op].grad`, which records more ops through the `Recorder` the
caller passes), accumulates into each leaf's `.grad`, and frees each node as it goes, so the
values it saved stop being outputs of the next flush.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Self, TypeVar

from emberlink.graph_replay.gradients import Recorder, Rule
from emberlink.graph_replay.ops import OPS

F = TypeVar("F", bound=Callable[..., Any])


class _GradMode(threading.local):
    """Whether ops record autograd history; `emberlink.no_grad()` turns it off in its own thread
    only (as torch's does), so one thread's optimizer step cannot break another's backward."""

    def __init__(self) -> None:
        self.enabled = True


GRAD_MODE = _GradMode()

RULES: dict[str, Rule] = {name: d.grad.rule for name, d in OPS.items() if d.grad is not None}
"""Op name -> gradient rule, from the op table; ops not here pass no gradient."""
DIFFERENTIABLE = frozenset(RULES)
SAVES_INPUTS = frozenset(name for name, d in OPS.items() if d.grad is not None and d.grad.saves_inputs)
"""Ops whose gradient rule needs the input values kept until backward."""
SAVES_OUTPUT = frozenset(name for name, d in OPS.items() if d.grad is not None and d.grad.saves_output)
"""Ops whose gradient rule needs the output value kept until backward."""
UNIT_SEED = frozenset(name for name, d in OPS.items() if d.grad is not None and d.grad.unit_seed)
"""Ops whose rule takes the implicit seed of `loss.backward()` as the Python float 1.0."""


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
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with no_grad():
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class GradNode:
    """Autograd history of one op's result: what its gradient rule needs, and where to send it.

    `parents[i]` is the GradNode of input i, or the input tensor itself when that is a leaf, or
    None when input i takes no gradient. Only the values a rule needs are kept (`saved`, `out`),
    so history does not hold every forward value alive. `run` clears a node once used.
    """

    __slots__ = ("attrs", "dev", "op", "out", "parents", "saved", "specs")

    # Any: rules index these freely; they are None only after backward has used the node.
    parents: Any
    saved: Any
    out: Any

    def __init__(
        self,
        op: str,
        parents: tuple[Any, ...] | None,
        saved: list[Any] | None,
        specs: list[Any],
        attrs: tuple[Any, ...],
        out: Any,
        dev: Any,
    ) -> None:
        self.op = op
        self.parents = parents
        self.saved = saved
        self.specs = specs
        self.attrs = attrs
        self.out = out
        self.dev = dev


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


def accumulate(leaf: Any, g: Any) -> None:
    """Add `g` into a leaf tensor's `.grad`.

    In place, as torch does: `.grad` keeps its Tensor object, so a step replayed by emberlink.jit
    that accumulates into it reads and rebinds the same object (client/trace.py). Each leaf gets
    its own object, since a rule may hand one gradient to several inputs.
    """
    if leaf.grad is None:
        leaf.grad = g.detach()
    else:
        leaf.grad._v = (leaf.grad + g)._v


def run(root: GradNode, g: Any, ns: Recorder) -> None:
    """Send the gradient `g` of `root`'s value back to every leaf, recording through `ns`.

    `g` is a tensor, or the Python float 1.0 for an op in `UNIT_SEED`. Grad mode is off
    meanwhile, so the recorded gradient ops carry no history of their own.
    """
    prev, GRAD_MODE.enabled = GRAD_MODE.enabled, False
    try:
        grads: dict[int, Any] = {id(root): g}
        for node in _topological(root):
            gn = grads.pop(id(node), None)
            parents = node.parents
            if gn is not None:
                for p, gp in zip(parents, RULES[node.op](ns, gn, node), strict=True):
                    if p is None or gp is None:
                        continue
                    if type(p) is GradNode:
                        k = id(p)
                        acc = grads.get(k)
                        grads[k] = gp if acc is None else acc + gp
                    else:
                        accumulate(p, gp)
            # Free the history as we go: saved values stop being outputs of the next flush.
            node.parents = node.saved = node.out = None
    finally:
        GRAD_MODE.enabled = prev


__all__ = [
    "DIFFERENTIABLE",
    "GRAD_MODE",
    "RULES",
    "SAVES_INPUTS",
    "SAVES_OUTPUT",
    "UNIT_SEED",
    "GradNode",
    "accumulate",
    "no_grad",
    "run",
]
