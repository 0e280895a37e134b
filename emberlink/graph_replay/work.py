"""What running a compiled plan costs in work, estimated from specs before it runs; no arrays, no I/O.

Two figures, both upper-bound estimates a worker compares with its limits (server/limits.py):
- elements touched: for every step that computes (views do not), the elements of its tensor
  operands plus those of its result, the result counted `PASSES[op]` times for the ops that make
  it in several passes (arange, rand, randn). A sum over a one-element input broadcast to 2^33
  elements touches 2^33 elements, though nothing that large is ever allocated.
- FLOPs: a matmul `2 * m * n * k` per batch, a reduction one per operand element, a softmax or a
  cross-entropy about five, a transcendental function `TRANSCENDENTAL_FLOPS`, any other op one per
  result element. A fused step counts its members.
An op this file does not know counts as elementwise; ops with more work per element than that
(a convolution, attention) must be added here when they join the op table.
"""

from __future__ import annotations

from dataclasses import dataclass

from emberlink.graph_replay.inference import UNARY_FLOAT
from emberlink.graph_replay.ir import TensorSpec
from emberlink.graph_replay.plan import FUSED, Plan, Step

VIEW_OPS = frozenset({"permute_dims", "broadcast_to", "expand_dims", "getitem", "reshape", "squeeze"})
"""Ops that may touch nothing (a view); a copying reshape is counted by the step that reads it."""

PASSES = {"arange": 4, "rand": 8, "randn": 16}
"""Passes over result-sized arrays an op makes (numpy_backend.py, rng.py); one for the rest."""

TRANSCENDENTAL_FLOPS = 8
"""FLOPs counted per element of exp, log, sqrt, tanh, sigmoid, sin, cos and pow."""
_PER_OPERAND_ELEMENT = {"softmax": 5, "log_softmax": 5, "cross_entropy": 6}
_REDUCTIONS = frozenset({"sum", "mean", "prod", "max", "min", "argmax", "argmin"})
_COSTLY = frozenset({*UNARY_FLOAT, "pow"})


@dataclass(frozen=True, slots=True)
class Work:
    """Estimated work of one run of a plan."""

    elements: int
    flops: int


def plan_work(plan: Plan) -> Work:
    """The elements a run of `plan` touches and the FLOPs it does (see the module docstring)."""
    elements = flops = 0
    for step in plan.steps:
        if step.op in VIEW_OPS:
            continue
        members = step.chain if step.op == FUSED else (step,)
        passes = max(PASSES.get(s.op, 1) for s in members)
        elements += _tensor_elements(step.in_specs) + step.out_spec.size * passes
        flops += sum(_flops(s) for s in members)
    return Work(elements, flops)


def _tensor_elements(specs: tuple[TensorSpec, ...]) -> int:
    return sum(s.size for s in specs if not s.weak)


def _flops(step: Step) -> int:
    op, out = step.op, step.out_spec
    if op == "matmul":
        x = step.in_specs[0]
        k = x.shape[-1] if x.ndim else 1
        return 2 * max(out.size, 1) * k
    if op in _REDUCTIONS:
        return _tensor_elements(step.in_specs)
    if op in _PER_OPERAND_ELEMENT:
        return _PER_OPERAND_ELEMENT[op] * step.in_specs[0].size
    if op in _COSTLY:
        return TRANSCENDENTAL_FLOPS * out.size
    return max([out.size, *(s.size for s in step.in_specs if not s.weak)])


__all__ = ["PASSES", "TRANSCENDENTAL_FLOPS", "VIEW_OPS", "Work", "plan_work"]
