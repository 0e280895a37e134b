"""What running a compiled plan costs in work, estimated from specs before it runs; no arrays, no I/O.

Two figures, both upper-bound estimates a worker compares with its limits (server/limits.py):
- elements touched: for every step that computes (views do not), the elements of its tensor
  operands plus those of its result, times the op's `COST`: how many times slower than a plain
  elementwise op (`add`) it is per element touched. A sum over a one-element input broadcast to
  2^33 elements touches 2^33 elements, though nothing that large is ever allocated.
- FLOPs: a matmul `2 * m * n * k` per batch (twice that in float64, which runs at half the rate),
  a reduction one per operand element, a transcendental function `TRANSCENDENTAL_FLOPS` per
  element, any other op one per element of its largest operand or result. A fused step counts
  its members.
`COST` was measured with NumPy on the 2-core development machine (ns per element touched, warm
buffers, 2^22 elements): a plain elementwise op, a comparison, a fill or a sum 0.1-0.25 ns; sign
0.23; prod 0.74; concat and stack 0.4-0.5; getitem_grad 0.24; unfold 0.35 and fold 0.64 (3x3
windows, all of the image and its columns counted); sigmoid 0.8; where 0.6; softmax 1.2-2.2;
cross-entropy 4.2; arange 3.4, rand 12.5 and randn 49 per result element; np.add.at (scatter_add)
1.2. Every op of the op table has its entry (tests/graph_replay/test_work.py checks it), so an op
that joins the table is estimated on purpose, not by default.
"""

from __future__ import annotations

from dataclasses import dataclass

from emberlink.graph_replay import inference, ops
from emberlink.graph_replay.ir import TensorSpec
from emberlink.graph_replay.plan import FUSED, Plan, Step

UNARY_FLOAT = tuple(name for name, d in ops.OPS.items() if d.infer is inference.unary_float)
"""The unary ops with a float result (exp, log, ...): transcendental, so slower per element."""

VIEW_OPS = frozenset({"permute_dims", "broadcast_to", "expand_dims", "getitem", "reshape", "squeeze"})
"""Ops that may touch nothing (a view); a copying reshape is counted by the step that reads it."""

COST: dict[str, int] = {
    **{op: 0 for op in VIEW_OPS},
    **{op: 1 for op in ("add", "subtract", "multiply", "divide", "maximum", "minimum", "negative", "abs")},
    **{op: 1 for op in ("relu", "square", "round", "floor", "ceil", "trunc", "isfinite", "isinf", "isnan")},
    **{op: 1 for op in ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")},
    **{op: 1 for op in ("logical_and", "logical_or", "logical_not", "zeros", "ones", "full", "eye")},
    **{op: 1 for op in ("sum", "mean", "max", "min", "argmax", "argmin", "matmul")},  # matmul: its FLOPs
    **{op: 2 for op in (*UNARY_FLOAT, "pow", "astype", "take", "sign", "getitem_grad")},
    "sigmoid": 4,
    "where": 3,
    "stack": 3,
    "concat": 4,
    "unfold": 3,
    "fold": 5,
    "prod": 5,
    "one_hot": 5,
    "scatter_add": 8,
    "softmax": 12,
    "log_softmax": 12,
    "cross_entropy": 24,
    "arange": 20,
    "rand": 64,
    "randn": 256,
}
"""Work per element touched, relative to `add` (see the module docstring), for every op of the op
table (views: 0, they touch nothing)."""

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
        cost = max(COST[s.op] for s in members)
        elements += (_tensor_elements(step.in_specs) + step.out_spec.size) * cost
        flops += sum(_flops(s) for s in members)
    return Work(elements, flops)


def _tensor_elements(specs: tuple[TensorSpec, ...]) -> int:
    return sum(s.size for s in specs if not s.weak)


def _flops(step: Step) -> int:
    op, out = step.op, step.out_spec
    if op == "matmul":
        x = step.in_specs[0]
        k = x.shape[-1] if x.ndim else 1
        return 2 * max(out.size, 1) * k * (2 if out.dtype == "float64" else 1)
    if op in _REDUCTIONS:
        return _tensor_elements(step.in_specs)
    if op in _PER_OPERAND_ELEMENT:
        return _PER_OPERAND_ELEMENT[op] * step.in_specs[0].size
    if op in _COSTLY:
        return TRANSCENDENTAL_FLOPS * out.size
    return max([out.size, *(s.size for s in step.in_specs if not s.weak)])


__all__ = ["COST", "TRANSCENDENTAL_FLOPS", "VIEW_OPS", "Work", "plan_work"]
