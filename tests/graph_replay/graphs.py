"""Graphs for the plan tests: a hand-written MLP training step and random elementwise graphs with views."""

from __future__ import annotations

from typing import Any

import numpy as np

from emberlink.errors import DTypeError, ShapeError
from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.graph_replay.ops import check_attrs, infer

F32 = "float32"


class Builder:
    """Appends nodes with inference, so a test graph is valid by construction."""

    def __init__(self, inputs: list[TensorSpec], bindings: list[str]) -> None:
        self.inputs = inputs
        self.bindings = bindings
        self.specs: list[TensorSpec] = [*inputs, *(TensorSpec(k, (), weak=True) for k in bindings)]
        self.nodes: list[Node] = []

    def add(self, op: str, *ins: int, **attrs: Any) -> int:
        node = Node(op, tuple(ins), check_attrs(op, attrs))
        self.specs.append(infer(op, [self.specs[v] for v in ins], node.attrs))
        self.nodes.append(node)
        return len(self.specs) - 1

    def graph(self, outputs: list[int]) -> Graph:
        return Graph(tuple(self.inputs), tuple(self.bindings), tuple(self.nodes), tuple(outputs))


def mlp_step(batch: int = 8, sizes: tuple[int, int, int] = (12, 16, 5)) -> Graph:
    """Forward, backward and SGD update of a 2-layer ReLU MLP with a softmax cross-entropy loss.

    Inputs: x, W1, b1, W2, b2, labels. Bindings: 1/batch, 0 (relu threshold), lr x4.
    Outputs: loss and the four new parameters.
    """
    n, d, h, c = batch, *sizes
    g = Builder(
        [
            TensorSpec(F32, (n, d)),
            TensorSpec(F32, (d, h)),
            TensorSpec(F32, (h,)),
            TensorSpec(F32, (h, c)),
            TensorSpec(F32, (c,)),
            TensorSpec("int64", (n,)),
        ],
        ["float", "int", "float", "float", "float", "float"],
    )
    x, w1, b1, w2, b2, y, inv_n, zero, *lr = range(12)
    h1p = g.add("add", g.add("matmul", x, w1), b1)
    h1 = g.add("relu", h1p)
    z = g.add("add", g.add("matmul", h1, w2), b2)
    loss = g.add("cross_entropy", z, y)
    dz = g.add(
        "multiply",
        g.add("subtract", g.add("softmax", z, axis=1), g.add("one_hot", y, num_classes=c, dtype=F32)),
        inv_n,
    )
    dw2 = g.add("matmul", g.add("permute_dims", h1, axes=(1, 0)), dz)
    db2 = g.add("sum", dz, axis=(0,))
    dh1 = g.add(
        "multiply", g.add("matmul", dz, g.add("permute_dims", w2, axes=(1, 0))), g.add("greater", h1p, zero)
    )
    dw1 = g.add("matmul", g.add("permute_dims", x, axes=(1, 0)), dh1)
    db1 = g.add("sum", dh1, axis=(0,))
    new = [
        g.add("subtract", p, g.add("multiply", grad, rate))
        for p, grad, rate in zip((w1, b1, w2, b2), (dw1, db1, dw2, db2), lr)
    ]
    return g.graph([loss, *new])


def mlp_inputs(graph: Graph, seed: int = 0) -> tuple[list[np.ndarray], list[Any]]:
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in graph.inputs:
        if spec.dtype == "int64":
            arrays.append(rng.integers(0, graph.inputs[3].shape[1], spec.shape))
        else:
            arrays.append(rng.standard_normal(spec.shape).astype(spec.dtype))
    n = graph.inputs[0].shape[0]
    return arrays, [1.0 / n, 0, 0.1, 0.1, 0.05, 0.05]


_UNARY = ["negative", "abs", "square", "exp", "tanh", "relu", "sigmoid", "sqrt", "log"]
_BINARY = ["add", "subtract", "multiply", "divide", "maximum", "minimum", "greater", "less_equal"]


def random_graph(rng: np.random.Generator, n_nodes: int = 14) -> Graph:
    """A random graph of elementwise ops, views (reshape, permute, broadcast, getitem), casts and
    reductions over two float32 inputs and a float binding; some intermediates are outputs."""
    g = Builder([TensorSpec(F32, (3, 4)), TensorSpec(F32, (4,))], ["float"])
    tensors = [0, 1]
    while len(g.nodes) < n_nodes:
        kind = rng.integers(0, 10)
        a = int(rng.choice(tensors[-6:] if rng.random() < 0.7 else tensors))
        b = int(rng.choice(tensors + [2]))
        try:
            if kind < 3:
                v = g.add(str(rng.choice(_UNARY)), a)
            elif kind < 7:
                v = g.add(str(rng.choice(_BINARY)), a, b)
            elif kind == 7:
                shape = g.specs[a].shape
                view = int(rng.integers(0, 4))
                if view == 0 and len(shape) == 2:
                    v = g.add("permute_dims", a, axes=(1, 0))
                elif view == 1:
                    v = g.add("reshape", a, shape=(int(np.prod(shape)),))
                elif view == 2 and shape == (4,):
                    v = g.add("broadcast_to", a, shape=(3, 4))
                else:
                    v = g.add("getitem", a, key=(("s", 0, 1, 1),))
            elif kind == 8:
                v = g.add("where", g.add("greater", a, 2), a, b)
            else:
                v = g.add("astype", a, dtype="float64" if g.specs[a].dtype == F32 else F32)
        except (ShapeError, DTypeError):
            continue
        if g.specs[v].dtype in ("float32", "float64"):
            tensors.append(v)
    node_values = [v for v in tensors if v >= 3]
    picks = {node_values[-1], *(int(v) for v in rng.choice(node_values, size=2))}
    return g.graph(sorted(picks))
