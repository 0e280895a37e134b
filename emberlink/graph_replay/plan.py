"""Plan compilation: execution order, frees after last use, buffer reuse, fusion groups; no arrays.

A plan is compiled once per graph (and cached beside it on the worker), so everything a replay
can know in advance is worked out here: each step's input and output specs, the dtype its operands
are cast to, the values whose last use it is, and which dying buffer it may write its result into.

Rules of this file (everything that decides what a run may free or overwrite lives here):
- Nodes that no output depends on are dropped.
- Inputs and bindings belong to the caller: never freed, never written into. Outputs are never
  freed and never written into; an output may *receive* a dying intermediate's buffer.
- Buffer reuse (`Step.into`): an elementwise step (`REUSE_OPS`, or a fused chain) may write its
  result into one of its own inputs `v` when `v` is an intermediate whose last use is this step,
  has exactly the result's dtype and shape, is not itself a view (`VIEW_OPS`), and no view of it
  is another input of the step, is used later, or is kept as an output. The run loop checks again at run time that the buffer owns
  its memory and that nothing else refers to it, so a backend op that unexpectedly returns a view
  costs a missed reuse, never a clobbered value.
- `keep_intermediates=True` compiles a plan that frees nothing and reuses nothing: the live set
  only grows. It exists to measure what freeing saves; nothing else should use it.
- Fusion (`compile_plan(..., fusion=...)`, used by the CuPy backend) replaces a tree of
  fusable steps whose inner values have exactly one consumer and are not outputs with one step
  of op `FUSED` at the root's place; the inner values never exist. `Step.chain` holds the
  members in order, `Step.kernel` what the backend built to run them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from emberlink.graph_replay.ir import AttrValue, Graph, TensorSpec
from emberlink.graph_replay.ops import OPS, graph_specs, operand_dtype

_STEP_OVERHEAD = 512
_VALUE_OVERHEAD = 96

FUSED = "fused"
"""The op name of a fused step. Not an op of the IR: no graph can name it (the decoder refuses it)."""

VIEW_OPS = frozenset(name for name, d in OPS.items() if d.view)
"""Ops whose result may share memory with their first input (the op table's `view`)."""

REUSE_OPS = frozenset(name for name, d in OPS.items() if d.into)
"""Elementwise ops a backend can write into an existing buffer of the result's spec (`out=`;
the op table's `into`)."""

MAX_FUSED = 32
"""Most steps one fused chain takes (bounds kernel size and compile time)."""


@dataclass(frozen=True, eq=False, slots=True)
class Step:
    """One node to run: its value numbers, specs, attrs, what to drop once it has run, and where
    its result may go (`into`: a dying input's value number, or None for a fresh array).

    `casts`: the positions of the operands a backend must bring to `operand_dtype` before
    computing (bindings, and arrays of another dtype); every other operand has that dtype already,
    and `where`'s condition is never cast. Empty where the op has no operand dtype.
    """

    node: int
    op: str
    inputs: tuple[int, ...]
    attrs: Mapping[str, AttrValue]
    in_specs: tuple[TensorSpec, ...]
    out_spec: TensorSpec
    out: int
    operand_dtype: str | None
    free: tuple[int, ...]
    into: int | None = None
    chain: tuple[Step, ...] = ()
    kernel: Any = None
    casts: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        """The op for messages: `add`, or `fused(add, relu)` for a fused chain."""
        if self.op == FUSED:
            return f"{FUSED}({', '.join(s.op for s in self.chain)})"
        return self.op


@dataclass(frozen=True, eq=False, slots=True, weakref_slot=True)
class Plan:
    """A compiled graph. `peak_bytes` estimates, from specs, the arrays the plan itself allocates
    at their high point (inputs apart); backends measure the real figure."""

    graph: Graph
    specs: tuple[TensorSpec, ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    peak_bytes: int
    peak_values: int
    input_bytes: int
    output_bytes: int
    keep_intermediates: bool = False
    reuse: bool = True
    fused: bool = False

    @property
    def overhead_bytes(self) -> int:
        """A rough estimate of the host memory this plan object takes, for cache budgets."""
        return _STEP_OVERHEAD * len(self.steps) + _VALUE_OVERHEAD * len(self.specs)

    @property
    def reused_steps(self) -> int:
        """Steps that write into a dying input's buffer."""
        return sum(1 for s in self.steps if s.into is not None)


class Fusion(Protocol):
    """What a backend tells the compiler about fusing: which steps may join a chain, and how to
    build the thing that runs a chain (called once per fused step, when the plan is compiled)."""

    def fusable(self, step: Step) -> bool: ...
    def build(self, step: Step) -> Any: ...


def compile_plan(
    graph: Graph,
    *,
    keep_intermediates: bool = False,
    reuse: bool = True,
    fusion: Fusion | None = None,
) -> Plan:
    """Compile `graph`; ShapeError/DTypeError if it does not infer (see `ops.graph_specs`)."""
    return _assemble(graph, graph_specs(graph), keep_intermediates, reuse, fusion)


def derive_plan(
    plan: Plan,
    *,
    keep_intermediates: bool | None = None,
    reuse: bool | None = None,
    fusion: Fusion | None = None,
) -> Plan:
    """`plan`'s graph compiled again with other options (None: as `plan` has it); no re-inference."""
    keep = plan.keep_intermediates if keep_intermediates is None else keep_intermediates
    return _assemble(plan.graph, plan.specs, keep, plan.reuse if reuse is None else reuse, fusion)


def _assemble(
    graph: Graph,
    specs: Sequence[TensorSpec],
    keep_intermediates: bool,
    reuse: bool,
    fusion: Fusion | None,
) -> Plan:
    steps = _base_steps(graph, specs)
    if fusion is not None:
        steps = _fuse(steps, specs, set(graph.outputs), fusion)
    first = graph.first_node_value
    kept = set(graph.outputs)
    last_use: dict[int, int] = {}
    for i, step in enumerate(steps):
        for v in step.inputs:
            last_use[v] = i
    if not keep_intermediates:
        frees: dict[int, list[int]] = {}
        for v, i in last_use.items():
            if v >= first and v not in kept:
                frees.setdefault(i, []).append(v)
        steps = [dataclasses.replace(s, free=tuple(sorted(frees.get(i, ())))) for i, s in enumerate(steps)]
        if reuse:
            steps = _assign_reuse(steps, specs, first, kept, last_use)
    peak_bytes, peak_values = _estimate_peak(steps, specs)
    return Plan(
        graph=graph,
        specs=tuple(specs),
        steps=tuple(steps),
        outputs=graph.outputs,
        peak_bytes=peak_bytes,
        peak_values=peak_values,
        input_bytes=sum(s.nbytes for s in graph.inputs),
        output_bytes=sum(specs[v].nbytes for v in set(graph.outputs) if v >= first),
        keep_intermediates=keep_intermediates,
        reuse=reuse and not keep_intermediates,
        fused=fusion is not None,
    )


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


def _base_steps(graph: Graph, specs: Sequence[TensorSpec]) -> list[Step]:
    """One Step per needed node, in graph order, with nothing freed or reused yet."""
    first = graph.first_node_value
    steps: list[Step] = []
    for i, (node, needed) in enumerate(zip(graph.nodes, _live_nodes(graph))):
        if not needed:
            continue
        in_specs = tuple(specs[v] for v in node.inputs)
        cast = operand_dtype(node.op, in_specs)
        steps.append(
            Step(
                node=i,
                op=node.op,
                inputs=node.inputs,
                attrs=dict(node.attrs),
                in_specs=in_specs,
                out_spec=specs[first + i],
                out=first + i,
                operand_dtype=cast,
                free=(),
                casts=_casts(node.op, in_specs, cast),
            )
        )
    return steps


def _casts(op: str, in_specs: Sequence[TensorSpec], cast: str | None) -> tuple[int, ...]:
    """`Step.casts`: the operands not already of the operand dtype `cast`."""
    if cast is None:
        return ()
    skip = 1 if op == "where" else 0  # the condition stays bool
    return tuple(k for k in range(skip, len(in_specs)) if in_specs[k].weak or in_specs[k].dtype != cast)


def _assign_reuse(
    steps: list[Step], specs: Sequence[TensorSpec], first: int, kept: set[int], last_use: Mapping[int, int]
) -> list[Step]:
    """Give each elementwise step a dying input of the result's spec to write into, where safe."""
    # Which buffer each value lives in: a view op's result in its input's, anything else its own.
    root: dict[int, int] = {}
    for s in steps:
        root[s.out] = root.get(s.inputs[0], s.inputs[0]) if s.op in VIEW_OPS and s.inputs else s.out
    # The last step at which a buffer is still read through any value that lives in it.
    buffer_last: dict[int, int] = {}
    protected: set[int] = set()
    for v, r in root.items():
        buffer_last[r] = max(buffer_last.get(r, -1), last_use.get(v, -1))
        if v in kept:
            protected.add(r)
    out: list[Step] = []
    for i, s in enumerate(steps):
        if s.op in REUSE_OPS or s.op == FUSED:
            for v in dict.fromkeys(s.inputs):
                if (
                    v >= first
                    and root.get(v) == v
                    and v not in protected
                    and buffer_last.get(v) == i
                    and specs[v] == s.out_spec
                    and not any(u != v and root.get(u) == v for u in s.inputs)
                ):
                    s = dataclasses.replace(s, into=v)
                    break
        out.append(s)
    return out


def _estimate_peak(steps: Sequence[Step], specs: Sequence[TensorSpec]) -> tuple[int, int]:
    """The live set's high point from specs: each result counts from its step to its free; a
    result written into a dying input takes over that input's bytes instead of adding its own."""
    live_bytes = live_values = peak_bytes = peak_values = 0
    for s in steps:
        if s.into is None:
            live_bytes += specs[s.out].nbytes
            live_values += 1
        peak_bytes, peak_values = max(peak_bytes, live_bytes), max(peak_values, live_values)
        for v in s.free:
            if v != s.into:
                live_bytes -= specs[v].nbytes
                live_values -= 1
    return peak_bytes, peak_values


# -- fusion ------------------------------------------------------------------------------------------


def _fuse(steps: list[Step], specs: Sequence[TensorSpec], outputs: set[int], fusion: Fusion) -> list[Step]:
    """Merge trees of fusable steps (inner values with one consumer, not outputs) into FUSED steps."""
    producer = {s.out: i for i, s in enumerate(steps)}
    consumers: dict[int, set[int]] = {}
    for i, s in enumerate(steps):
        for v in s.inputs:
            consumers.setdefault(v, set()).add(i)
    ok = [fusion.fusable(s) for s in steps]
    groups: dict[int, list[int]] = {}  # root step index -> member step indices
    for i, s in enumerate(steps):
        if not ok[i]:
            continue
        members = [i]
        for v in dict.fromkeys(s.inputs):
            j = producer.get(v)
            if (
                j is not None
                and ok[j]
                and v not in outputs
                and consumers[v] == {i}
                and j in groups
                and len(members) + len(groups[j]) <= MAX_FUSED
            ):
                members.extend(groups.pop(j))
        groups[i] = sorted(members)
    absorbed = {j for root, members in groups.items() for j in members if j != root}
    out: list[Step] = []
    for i, s in enumerate(steps):
        if i in absorbed:
            continue
        members = groups.get(i, [i])
        out.append(s if len(members) == 1 else _fused_step([steps[j] for j in members], specs, fusion))
    return out


def _fused_step(members: list[Step], specs: Sequence[TensorSpec], fusion: Fusion) -> Step:
    root = members[-1]
    inner = {m.out for m in members[:-1]}
    ext = list(dict.fromkeys(v for m in members for v in m.inputs if v not in inner))
    step = Step(
        node=root.node,
        op=FUSED,
        inputs=tuple(ext),
        attrs={},
        in_specs=tuple(specs[v] for v in ext),
        out_spec=root.out_spec,
        out=root.out,
        operand_dtype=None,
        free=(),
        chain=tuple(members),
    )
    return dataclasses.replace(step, kernel=fusion.build(step))


def run_chain(xp: Any, table: Mapping[str, Callable[..., Any]], step: Step, args: Sequence[Any]) -> Any:
    """A fused step run one member at a time with `table`'s ops: the reference a kernel must match."""
    env: dict[int, Any] = dict(zip(step.inputs, args))
    for m in step.chain:
        env[m.out] = xp.asarray(table[m.op](xp, [env[v] for v in m.inputs], m))
    return env[step.out]


__all__ = [
    "FUSED",
    "MAX_FUSED",
    "REUSE_OPS",
    "VIEW_OPS",
    "Fusion",
    "Plan",
    "Step",
    "compile_plan",
    "derive_plan",
    "run_chain",
]
