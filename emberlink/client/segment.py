"""Turns a recorded segment into its canonical Graph; pure functions, run only on a memo miss.

While recording, the Device keeps each node as `(op, refs, attrs)`, where a ref is a node index
(>= 0), an input slot `s` (encoded `-1 - 2*s`, slots numbered by first use) or a binding `b`
(encoded `-2 - 2*b`, one per Python scalar in recording order). That list, the input specs, the
binding kinds and the output node indices are the memo key; `build_graph` is a function of the
key alone, so a cached result is valid for every segment with the same key.

Nodes that no output depends on are dropped here (a tensor computed and forgotten costs nothing),
and the inputs and bindings they alone used with them; `Built.input_slots` and
`Built.binding_slots` say which recorded ones the graph keeps, in the graph's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from emberlink.graph_replay import ops
from emberlink.graph_replay.ir import AttrValue, Graph, Node, TensorSpec

Ref = int
Attrs = tuple[tuple[str, AttrValue], ...]
Entry = tuple[str, tuple[Ref, ...], Attrs]
Spec = tuple[str, tuple[int, ...]]


def input_ref(slot: int) -> Ref:
    return -1 - 2 * slot


def binding_ref(index: int) -> Ref:
    return -2 - 2 * index


@dataclass(frozen=True, slots=True)
class Built:
    """A graph and how the recorded inputs and bindings map onto its slots (None: unchanged)."""

    graph: Graph
    input_slots: tuple[int, ...] | None
    binding_slots: tuple[int, ...] | None


def live_nodes(entries: Sequence[Entry], outputs: Sequence[int]) -> list[bool]:
    """Which nodes an output depends on."""
    live = [False] * len(entries)
    for i in outputs:
        live[i] = True
    for i in range(len(entries) - 1, -1, -1):
        if live[i]:
            for r in entries[i][1]:
                if r >= 0:
                    live[r] = True
    return live


def build_graph(
    entries: Sequence[Entry], in_specs: Sequence[Spec], bind_kinds: Sequence[str], outputs: Sequence[int]
) -> Built:
    """The canonical Graph of a segment: dead nodes dropped, inputs renumbered by first use."""
    live = live_nodes(entries, outputs)
    in_slots: dict[int, int] = {}
    bind_slots: dict[int, int] = {}
    for i, (_, refs, _) in enumerate(entries):
        if not live[i]:
            continue
        for r in refs:
            if r < 0:
                if r & 1:  # odd: an input slot
                    in_slots.setdefault((-1 - r) >> 1, len(in_slots))
                else:
                    bind_slots.setdefault((-2 - r) >> 1, len(bind_slots))
    n_in, n_bind = len(in_slots), len(bind_slots)
    number: dict[int, int] = {}
    nodes: list[Node] = []
    for i, (op, refs, attrs) in enumerate(entries):
        if not live[i]:
            continue
        inputs = tuple(
            number[r] if r >= 0 else in_slots[(-1 - r) >> 1] if r & 1 else n_in + bind_slots[(-2 - r) >> 1]
            for r in refs
        )
        number[i] = n_in + n_bind + len(nodes)
        nodes.append(Node(op, inputs, ops.check_attrs(op, attrs)))
    kept_inputs = tuple(in_slots)  # dicts keep insertion order: graph slot order
    kept_bindings = tuple(bind_slots)
    graph = Graph(
        inputs=tuple(TensorSpec(*in_specs[s]) for s in kept_inputs),
        bindings=tuple(bind_kinds[b] for b in kept_bindings),
        nodes=tuple(nodes),
        outputs=tuple(number[i] for i in outputs),
    )
    same_inputs = kept_inputs == tuple(range(len(in_specs)))
    same_bindings = kept_bindings == tuple(range(len(bind_kinds)))
    return Built(graph, None if same_inputs else kept_inputs, None if same_bindings else kept_bindings)
