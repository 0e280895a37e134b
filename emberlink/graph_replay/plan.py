"""Plan compilation: execution order, frees after last use and peak memory, from specs alone; no arrays.

A plan is compiled once per graph (and cached beside it on the worker), so everything a replay
can know in advance is worked out here: each step's input and output specs, the dtype its operands
are cast to, and the values whose last use it is. Nodes that no output depends on are dropped.
Inputs and bindings belong to the caller and are never freed by a plan; outputs are never freed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from emberlink.graph_replay.ir import AttrValue, Graph, TensorSpec
from emberlink.graph_replay.ops import graph_specs, operand_dtype

_STEP_OVERHEAD = 512
_VALUE_OVERHEAD = 96


@dataclass(frozen=True, eq=False, slots=True)
class Step:
    """One node to run: its value numbers, specs, attrs, and what to drop once it has run."""

    node: int
    op: str
    inputs: tuple[int, ...]
    attrs: Mapping[str, AttrValue]
    in_specs: tuple[TensorSpec, ...]
    out_spec: TensorSpec
    out: int
    operand_dtype: str | None
    free: tuple[int, ...]


@dataclass(frozen=True, eq=False, slots=True)
class Plan:
    """A compiled graph. `peak_bytes` counts the arrays the plan itself allocates (not the inputs)."""

    graph: Graph
    specs: tuple[TensorSpec, ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    peak_bytes: int
    peak_values: int
    input_bytes: int
    output_bytes: int

    @property
    def overhead_bytes(self) -> int:
        """A rough estimate of the host memory this plan object takes, for cache budgets."""
        return _STEP_OVERHEAD * len(self.steps) + _VALUE_OVERHEAD * len(self.specs)


def _live_nodes(graph: Graph) -> list[bool]:
    """Which nodes some output depends on (walking back from the outputs)."""
    first = graph.first_node_value
    needed = [False] * len(graph.nodes)
    stack = [v - first for v in graph.outputs if v >= first]
    while stack:
        i = stack.pop()
        if needed[i]:
            continue
        needed[i] = True
        stack.extend(v - first for v in graph.nodes[i].inputs if v >= first)
    return needed


def compile_plan(graph: Graph) -> Plan:
    """Compile `graph`; ShapeError/DTypeError if it does not infer (see `ops.graph_specs`)."""
    specs = graph_specs(graph)
    first = graph.first_node_value
    needed = _live_nodes(graph)
    kept = set(graph.outputs)
    last_use: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        if needed[i]:
            for v in node.inputs:
                last_use[v] = i
    frees: dict[int, list[int]] = {}
    for v, i in last_use.items():
        if v >= first and v not in kept:
            frees.setdefault(i, []).append(v)

    steps: list[Step] = []
    live_bytes = live_values = peak_bytes = peak_values = 0
    for i, node in enumerate(graph.nodes):
        if not needed[i]:
            continue
        out = first + i
        in_specs = tuple(specs[v] for v in node.inputs)
        free = tuple(sorted(frees.get(i, ())))
        steps.append(
            Step(
                node=i,
                op=node.op,
                inputs=node.inputs,
                attrs=dict(node.attrs),
                in_specs=in_specs,
                out_spec=specs[out],
                out=out,
                operand_dtype=operand_dtype(node.op, in_specs),
                free=free,
            )
        )
        live_bytes += specs[out].nbytes
        live_values += 1
        peak_bytes, peak_values = max(peak_bytes, live_bytes), max(peak_values, live_values)
        live_bytes -= sum(specs[v].nbytes for v in free)
        live_values -= len(free)

    return Plan(
        graph=graph,
        specs=specs,
        steps=tuple(steps),
        outputs=graph.outputs,
        peak_bytes=peak_bytes,
        peak_values=peak_values,
        input_bytes=sum(s.nbytes for s in graph.inputs),
        output_bytes=sum(specs[v].nbytes for v in set(graph.outputs) if v >= first),
    )


__all__ = ["Plan", "Step", "compile_plan"]
