"""Buffer reuse and keep-every-intermediate plans: same values, inputs and outputs never clobbered."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emberlink.graph_replay.backend import run_plan
from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.graph_replay.numpy_backend import INTO_TABLE, OP_TABLE, NumpyBackend
from emberlink.graph_replay.ops import OPS, check_attrs
from emberlink.graph_replay.plan import REUSE_OPS, Step, compile_plan, derive_plan

from .graphs import mlp_inputs, mlp_step, random_graph


def _chain(n: int, size: int = 1000) -> Graph:
    nodes = tuple(Node("exp" if k % 2 else "negative", (k,)) for k in range(n))
    return Graph((TensorSpec("float32", (size,)),), (), nodes, (n,))


def _run(
    backend: NumpyBackend, graph: Graph, inputs: Sequence[np.ndarray], bindings: Sequence[Any]
) -> list[Any]:
    plan = compile_plan(graph)
    return [backend.to_numpy(o) for o in backend.run(plan, [backend.from_numpy(a) for a in inputs], bindings)]


def _spying_into_table(calls: list[tuple[str, int]]) -> dict[str, Any]:
    def wrap(fn: Any) -> Any:
        def spy(xp: Any, args: Sequence[Any], step: Step, out: Any) -> Any:
            calls.append((step.op, step.out))
            return fn(xp, args, step, out)

        return spy

    return {op: wrap(fn) for op, fn in INTO_TABLE.items()}


def test_the_into_table_has_exactly_the_reusable_ops() -> None:
    assert set(INTO_TABLE) == REUSE_OPS


def test_reuse_gives_the_same_results_as_fresh_arrays_on_an_mlp_training_step() -> None:
    graph = mlp_step()
    inputs, bindings = mlp_inputs(graph)
    assert compile_plan(graph).reused_steps >= 6
    fresh = _run(NumpyBackend(reuse=False), graph, inputs, bindings)
    reused = _run(NumpyBackend(), graph, inputs, bindings)
    kept = _run(NumpyBackend(keep_intermediates=True), graph, inputs, bindings)
    for a, b, c in zip(fresh, reused, kept, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_every_planned_reuse_happens_at_run_time_on_an_mlp_step() -> None:
    """The run loop's exclusivity check accepts every buffer the plan offers when nothing else holds it."""
    graph = mlp_step()
    inputs, bindings = mlp_inputs(graph)
    plan = compile_plan(graph)
    calls: list[tuple[str, int]] = []
    run_plan(plan, inputs, bindings, xp=np, table=OP_TABLE, into_table=_spying_into_table(calls))
    assert len(calls) == plan.reused_steps


def test_reuse_never_writes_into_inputs_or_outputs() -> None:
    graph = mlp_step()
    inputs, bindings = mlp_inputs(graph)
    plan = compile_plan(graph)
    first = graph.first_node_value
    for step in plan.steps:
        if step.into is not None:
            assert step.into >= first and step.into not in graph.outputs
    copies = [a.copy() for a in inputs]
    outs = NumpyBackend().run(plan, inputs, bindings)
    for a, b in zip(inputs, copies, strict=True):
        np.testing.assert_array_equal(a, b)
    # No two outputs share a buffer, and none shares one with an input.
    for i, o in enumerate(outs):
        for other in outs[i + 1 :] + list(inputs):
            assert not np.shares_memory(o, other)


def test_a_buffer_seen_through_a_later_view_is_not_written_into() -> None:
    # t = exp(x); v = permute(t); u = negative(t) would write into t, but v still reads t later.
    g = Graph(
        (TensorSpec("float32", (3, 4)),),
        (),
        (
            Node("exp", (0,)),
            Node("permute_dims", (1,), check_attrs("permute_dims", {"axes": (1, 0)})),
            Node("negative", (1,)),
            Node("permute_dims", (3,), check_attrs("permute_dims", {"axes": (1, 0)})),
            Node("add", (2, 4)),
        ),
        (5,),
    )
    plan = compile_plan(g)
    assert plan.steps[2].into is None  # negative(t) must not overwrite t: the view (2) is read at step 4
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    (out,) = NumpyBackend().run(plan, [x], [])
    np.testing.assert_array_equal(out, np.exp(x).T + (-np.exp(x)).T)


def test_a_buffer_kept_as_an_output_through_a_view_is_not_written_into() -> None:
    g = Graph(
        (TensorSpec("float32", (6,)),),
        (),
        (
            Node("exp", (0,)),
            Node("reshape", (1,), check_attrs("reshape", {"shape": (2, 3)})),
            Node("negative", (1,)),
        ),
        (2, 3),
    )
    plan = compile_plan(g)
    assert all(s.into is None for s in plan.steps)
    x = np.linspace(0, 1, 6, dtype=np.float32)
    view, neg = NumpyBackend().run(plan, [x], [])
    np.testing.assert_array_equal(view, np.exp(x).reshape(2, 3))
    np.testing.assert_array_equal(neg, -np.exp(x))


def test_an_input_is_never_written_into_even_when_its_last_use_is_elementwise() -> None:
    plan = compile_plan(Graph((TensorSpec("float32", (5,)),), (), (Node("exp", (0,)),), (1,)))
    assert plan.steps[0].into is None
    x = np.zeros(5, np.float32)
    (out,) = NumpyBackend().run(plan, [x], [])
    assert not np.shares_memory(out, x) and (x == 0).all()


def test_a_buffer_someone_else_holds_is_not_written_into() -> None:
    """The run-time check: a result that unexpectedly refers to its input is never overwritten."""
    plan = compile_plan(_chain(3))
    assert plan.steps[1].into == 1
    kept: list[Any] = []

    def leaky_negative(xp: Any, args: Sequence[Any], step: Step) -> Any:
        out = np.negative(args[0])
        kept.append(out)  # e.g. a backend op that caches its result
        return out

    table = {**OP_TABLE, "negative": leaky_negative}
    calls: list[tuple[str, int]] = []
    x = np.ones(1000, np.float32)
    (out,) = run_plan(plan, [x], [], xp=np, table=table, into_table=_spying_into_table(calls))
    # exp (step 1) found value 1 held by `kept` and allocated; negative (step 2) still reused.
    assert calls == [("negative", 3)]
    np.testing.assert_array_equal(kept[0], -np.ones(1000, np.float32))
    np.testing.assert_array_equal(out, -np.exp(-np.ones(1000, np.float32)))


def test_keep_intermediates_plans_free_nothing_and_reuse_nothing() -> None:
    plan = compile_plan(mlp_step(), keep_intermediates=True)
    assert all(s.free == () and s.into is None for s in plan.steps)
    assert plan.keep_intermediates and not plan.reuse
    assert derive_plan(plan, keep_intermediates=False, reuse=True).reused_steps > 0


def test_peak_live_bytes_with_frees_are_at_most_those_without_on_a_chain() -> None:
    graph = _chain(8, size=1 << 16)
    x = np.zeros(1 << 16, np.float32)
    peaks = {}
    for name, backend in {
        "reuse": NumpyBackend(),
        "free": NumpyBackend(reuse=False),
        "keep": NumpyBackend(keep_intermediates=True),
    }.items():
        xin = backend.from_numpy(x.copy())
        backend.reset_peak()
        backend.run(compile_plan(graph), [xin], [])
        peaks[name] = backend.memory_stats()["peak_bytes"]
    size = x.nbytes
    assert peaks["reuse"] <= peaks["free"] <= peaks["keep"]
    assert peaks["keep"] == size + 8 * size  # the input and every one of the 8 results
    assert peaks["free"] == size + 2 * size  # the input, one dying value and the next
    assert peaks["reuse"] == size + size  # the input and one buffer written over and over


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_graphs_give_the_same_values_with_and_without_reuse(seed: int) -> None:
    rng = np.random.default_rng(seed)
    graph = random_graph(rng)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    bindings = [float(rng.standard_normal())]
    results = []
    for backend in (NumpyBackend(reuse=False), NumpyBackend(), NumpyBackend(keep_intermediates=True)):
        inputs = [x.copy(), b.copy()]
        outs = backend.run(compile_plan(graph), inputs, bindings)
        np.testing.assert_array_equal(inputs[0], x)  # inputs are never written into
        np.testing.assert_array_equal(inputs[1], b)
        results.append([o.copy() for o in outs])
    for got in results[1:]:
        for a, c in zip(results[0], got, strict=True):
            np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("op", sorted(REUSE_OPS))
def test_each_reusable_op_gives_the_same_values_into_a_buffer(op: str) -> None:
    bool_op = op.startswith("logical")
    dtype = "bool" if bool_op else "float32"
    spec = TensorSpec(dtype, (4, 5))
    rng = np.random.default_rng(1)
    x = rng.random((4, 5)) < 0.5 if bool_op else rng.standard_normal((4, 5)).astype(np.float32)
    y = rng.random((4, 5)) < 0.5 if bool_op else rng.standard_normal((4, 5)).astype(np.float32)
    unary = OPS[op].family == "unary"
    # A producer that makes a fresh buffer of the same spec, then the op consuming it as it dies.
    first = Node("logical_not", (0,)) if bool_op else Node("negative", (0,))
    second = Node(op, (2,)) if unary else Node(op, (2, 1))
    g = Graph((spec, spec), (), (first, second), (3,))
    plan = compile_plan(g)
    if plan.specs[3] == plan.specs[2]:
        assert plan.steps[1].into == 2
    with np.errstate(all="ignore"):
        want = NumpyBackend(reuse=False).run(plan, [x, y], [])[0]
    got = NumpyBackend().run(plan, [x, y], [])[0]
    np.testing.assert_array_equal(got, want)
