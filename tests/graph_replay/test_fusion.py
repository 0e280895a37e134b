"""Fusion on the CPU: which steps form chains, and that a chain run member by member (the reference a
CUDA kernel must match) gives exactly the unfused values; plus the kernel source the CuPy backend compiles."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emberlink.graph_replay import fusion
from emberlink.graph_replay.backend import run_plan
from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.graph_replay.numpy_backend import INTO_TABLE, OP_TABLE, NumpyBackend
from emberlink.graph_replay.ops import OPS
from emberlink.graph_replay.plan import FUSED, MAX_FUSED, Plan, Step, compile_plan, run_chain

from .graphs import mlp_inputs, mlp_step, random_graph


class ReferenceFusion:
    """Fuses what the CuPy backend fuses, but runs a chain member by member with the NumPy ops."""

    def fusable(self, step: Step) -> bool:
        return fusion.fusable(step)

    def build(self, step: Step) -> Any:
        return fusion.kernel_source(step)  # also proves every chain the grouping makes can be written


def _fused_op(xp: Any, args: Sequence[Any], step: Step) -> Any:
    return run_chain(xp, OP_TABLE, step, args)


def _fused_into(xp: Any, args: Sequence[Any], step: Step, out: Any) -> Any:
    np.copyto(out, run_chain(xp, OP_TABLE, step, args))
    return out


TABLE = {**OP_TABLE, FUSED: _fused_op}
INTO = {**INTO_TABLE, FUSED: _fused_into}


def _run(plan: Plan, inputs: Sequence[np.ndarray], bindings: Sequence[Any]) -> list[np.ndarray]:
    with np.errstate(all="ignore"):
        return run_plan(plan, [a.copy() for a in inputs], bindings, xp=np, table=TABLE, into_table=INTO)


def test_an_mlp_step_fuses_its_elementwise_tails_and_gives_identical_values() -> None:
    graph = mlp_step()
    inputs, bindings = mlp_inputs(graph)
    fused = compile_plan(graph, fusion=ReferenceFusion())
    chains = [s.label for s in fused.steps if s.op == FUSED]
    # relu backward, the scaled softmax gradient, and one SGD update per parameter
    assert "fused(greater, multiply)" in chains
    assert "fused(subtract, multiply)" in chains
    assert chains.count("fused(multiply, subtract)") == 4
    assert len(fused.steps) < len(compile_plan(graph).steps)
    want = _run(compile_plan(graph, reuse=False), inputs, bindings)
    for a, b in zip(want, _run(fused, inputs, bindings), strict=True):
        np.testing.assert_array_equal(a, b)


def test_inner_values_of_a_chain_never_exist_and_are_never_freed() -> None:
    plan = compile_plan(mlp_step(), fusion=ReferenceFusion())
    inner = {m.out for s in plan.steps if s.op == FUSED for m in s.chain[:-1]}
    assert inner
    for s in plan.steps:
        assert not inner & set(s.inputs) and not inner & set(s.free)


def test_a_value_kept_as_an_output_ends_a_chain() -> None:
    spec = TensorSpec("float32", (16,))
    g = Graph((spec,), (), (Node("exp", (0,)), Node("negative", (1,)), Node("tanh", (2,))), (2, 3))
    plan = compile_plan(g, fusion=ReferenceFusion())
    assert [s.label for s in plan.steps] == ["fused(exp, negative)", "tanh"]


def test_a_value_with_two_consumers_is_materialized() -> None:
    spec = TensorSpec("float32", (16,))
    nodes = (Node("exp", (0,)), Node("negative", (1,)), Node("tanh", (1,)), Node("add", (2, 3)))
    plan = compile_plan(Graph((spec,), (), nodes, (4,)), fusion=ReferenceFusion())
    assert [s.label for s in plan.steps] == ["exp", "fused(negative, tanh, add)"]
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    (out,) = _run(plan, [x], [])
    np.testing.assert_array_equal(out, -np.exp(x) + np.tanh(np.exp(x)))


def test_chains_are_bounded_in_length() -> None:
    spec = TensorSpec("float32", (4,))
    nodes = tuple(Node("negative", (k,)) for k in range(3 * MAX_FUSED))
    plan = compile_plan(Graph((spec,), (), nodes, (len(nodes),)), fusion=ReferenceFusion())
    assert all(len(s.chain) <= MAX_FUSED for s in plan.steps)
    (out,) = _run(plan, [np.ones(4, np.float32)], [])
    np.testing.assert_array_equal(out, np.ones(4, np.float32))  # an even number of negations


def test_ints_and_float16_do_not_fuse() -> None:
    for dtype in ("int32", "int64", "float16"):
        spec = TensorSpec(dtype, (4,))
        g = Graph((spec,), (), (Node("negative", (0,)), Node("abs", (1,))), (2,))
        assert all(s.op != FUSED for s in compile_plan(g, fusion=ReferenceFusion()).steps)


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_graphs_fused_give_the_unfused_values(seed: int) -> None:
    rng = np.random.default_rng(seed)
    graph = random_graph(rng)
    inputs = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)]
    bindings = [float(rng.standard_normal())]
    want = _run(compile_plan(graph, reuse=False), inputs, bindings)
    got = _run(compile_plan(graph, fusion=ReferenceFusion()), inputs, bindings)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_numpy_backend_never_fuses() -> None:
    plan = compile_plan(mlp_step())
    assert NumpyBackend().plan_for(plan) is plan and not plan.fused


# -- kernel source ---------------------------------------------------------------------------------


def test_relu_backward_kernel_casts_the_mask_and_multiplies() -> None:
    spec = TensorSpec("float32", (8, 4))
    g = Graph(
        (spec, spec),
        ("int",),
        (Node("greater", (0, 2)), Node("multiply", (1, 3))),
        (4,),
    )
    (step,) = compile_plan(g, fusion=ReferenceFusion()).steps
    src = fusion.kernel_source(step)
    assert src.in_params == "float32 in0, float32 in1, float32 in2"
    assert step.inputs == (0, 2, 1)  # x, the binding 0, g: in order of first use
    assert src.params == ((0, None), (1, "float32"), (2, None))  # the binding goes as a float32
    assert src.out_params == "float32 out0"
    assert src.body.splitlines() == [
        "bool t0 = (bool)(in0 > in1);",
        "float t1 = (float)(in2 * ((float)t0));",
        "out0 = t1;",
    ]


def test_maximum_and_relu_kernels_propagate_nan_like_numpy() -> None:
    spec = TensorSpec("float64", (3,))
    g = Graph((spec, spec), (), (Node("relu", (0,)), Node("maximum", (2, 1))), (3,))
    (step,) = compile_plan(g, fusion=ReferenceFusion()).steps
    body = fusion.kernel_source(step).body
    assert "((in0 > (double)0 || in0 != in0) ? in0 : (double)0)" in body
    assert "((t0 > in1 || t0 != t0) ? t0 : in1)" in body


def test_one_binding_used_in_two_dtypes_becomes_two_parameters() -> None:
    g = Graph(
        (TensorSpec("float32", (3,)), TensorSpec("float64", (3,))),
        ("float",),
        (Node("multiply", (0, 2)), Node("multiply", (1, 2)), Node("add", (3, 4))),
        (5,),
    )
    (step,) = compile_plan(g, fusion=ReferenceFusion()).steps
    src = fusion.kernel_source(step)
    assert [p for p in src.params if p[1] is not None] == [(1, "float32"), (1, "float64")]
    args = fusion.call_args(
        src, [np.zeros(3, np.float32), 0.1, np.zeros(3)], lambda v, d: np.dtype(d).type(v)
    )
    assert [type(a).__name__ for a in args] == ["ndarray", "float32", "ndarray", "float64"]


def test_a_kernel_cuda_refuses_runs_its_chain_unfused_with_the_same_values() -> None:
    from emberlink.graph_replay.cupy_backend import _FusedKernel

    class Refused(Exception):
        pass

    def refuse(*args: Any) -> Any:
        raise Refused("nvrtc: error")

    graph = mlp_step()
    inputs, bindings = mlp_inputs(graph)
    plan = compile_plan(graph, fusion=ReferenceFusion())
    kernels = {}
    for s in plan.steps:
        if s.op == FUSED:
            kernels[s] = _FusedKernel(refuse, fusion.kernel_source(s), dict(OP_TABLE), Refused)

    table = {**OP_TABLE, FUSED: lambda xp, args, step: kernels[step](xp, step, args)}
    into = {**INTO_TABLE, FUSED: lambda xp, args, step, out: kernels[step](xp, step, args, out)}
    with np.errstate(all="ignore"):
        got = run_plan(plan, [a.copy() for a in inputs], bindings, xp=np, table=table, into_table=into)
    want = _run(compile_plan(graph, reuse=False), inputs, bindings)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(isinstance(k.broken, Refused) for k in kernels.values())


@pytest.mark.parametrize("op", sorted(fusion.FUSABLE_OPS - {"where"}))
def test_every_fusable_op_writes_its_table_expression_into_the_kernel(op: str) -> None:
    unary = OPS[op].family == "unary"
    dtype = "bool" if op.startswith("logical") else "float32"
    spec = TensorSpec(dtype, (4,))
    first = Node("logical_not" if dtype == "bool" else "negative", (0,))
    second = Node(op, (2,)) if unary else Node(op, (2, 1))
    (step,) = compile_plan(Graph((spec, spec), (), (first, second), (3,)), fusion=ReferenceFusion()).steps
    assert step.label == f"fused({first.op}, {op})"
    operands = ["t0"] if unary else ["t0", "in1"]
    ctype = fusion.CTYPES[step.chain[1].operand_dtype or step.chain[1].out_spec.dtype]
    assert fusion.expression(op, operands, ctype) in fusion.kernel_source(step).body
