"""Fused elementwise kernels and buffer reuse on CuPy against the NumPy reference (GPU machine only)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from emberlink.graph_replay import fusion
from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.graph_replay.numpy_backend import NumpyBackend
from emberlink.graph_replay.ops import OPS, check_attrs
from emberlink.graph_replay.plan import FUSED, Plan, compile_plan

from .graphs import mlp_inputs, mlp_step, random_graph

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp() -> Any:
    import cupy

    return cupy


def _backend(**options: Any) -> Any:
    from emberlink.graph_replay.cupy_backend import CupyBackend

    return CupyBackend(**options)


def assert_close(got: np.ndarray, want: np.ndarray, label: str, *, loose: bool = True) -> None:
    """Bools exactly; floats to float32-level (float64 outputs of a chain may come from float32
    math) or, with `loose=False`, float64-level tolerance, scaled by the largest finite value."""
    assert got.dtype == want.dtype and got.shape == want.shape, (label, got.dtype, want.dtype)
    if got.dtype.kind != "f":
        np.testing.assert_array_equal(got, want, err_msg=label)
        return
    rtol = 1e-4 if loose else 1e-10
    finite = np.abs(want[np.isfinite(want)]).astype(np.float64)
    scale = max(1.0, float(finite.max())) if finite.size else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, equal_nan=True, err_msg=label)


def _run(
    backend: Any, graph: Graph, inputs: list[np.ndarray], bindings: list[Any], plan: Plan | None = None
) -> list[np.ndarray]:
    plan = compile_plan(graph) if plan is None else plan
    outs = backend.run(plan, [backend.from_numpy(a) for a in inputs], bindings)
    backend.synchronize()
    return [backend.to_numpy(o) for o in outs]


def test_an_mlp_step_fused_matches_the_numpy_reference() -> None:
    graph = mlp_step(batch=64, sizes=(100, 128, 10))
    inputs, bindings = mlp_inputs(graph)
    backend = _backend()
    plan = compile_plan(graph)
    fused = backend.plan_for(plan)
    assert sum(s.op == FUSED for s in fused.steps) >= 6
    want = _run(NumpyBackend(), graph, inputs, bindings)
    got = _run(backend, graph, inputs, bindings, plan)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_close(a, b, f"output {i}", loose=True)
    # Every kernel compiled (one CUDA refused would have run unfused and be marked broken).
    assert all(s.kernel.broken is None for s in fused.steps if s.op == FUSED)


def test_fused_and_reused_match_plain_cupy() -> None:
    graph = mlp_step(batch=64, sizes=(100, 128, 10))
    inputs, bindings = mlp_inputs(graph, seed=3)
    plain = _run(_backend(fuse=False, reuse=False), graph, inputs, bindings)
    for options in ({"fuse": True, "reuse": False}, {"fuse": False, "reuse": True}, {}):
        got = _run(_backend(**options), graph, inputs, bindings)
        for i, (a, b) in enumerate(zip(got, plain, strict=True)):
            assert_close(a, b, f"{options} output {i}", loose=True)


def test_inputs_are_never_written_into_on_the_gpu(cp: Any) -> None:
    graph = mlp_step()
    inputs, bindings = mlp_inputs(graph)
    backend = _backend()
    held = [backend.from_numpy(a) for a in inputs]
    outs = backend.run(compile_plan(graph), held, bindings)
    backend.synchronize()
    for a, h in zip(inputs, held, strict=True):
        np.testing.assert_array_equal(cp.asnumpy(h), a)
    for i, o in enumerate(outs):
        for other in outs[i + 1 :] + held:
            assert o.data.ptr != other.data.ptr


@pytest.mark.parametrize("seed", range(60))
def test_random_graphs_fused_match_the_numpy_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    graph = random_graph(rng)
    inputs = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)]
    bindings = [float(rng.standard_normal())]
    with np.errstate(all="ignore"):
        want = _run(NumpyBackend(), graph, inputs, bindings)
    backend = _backend()
    plan = compile_plan(graph)
    got = _run(backend, graph, inputs, bindings, plan)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_close(a, b, f"seed {seed} output {i}", loose=True)
    assert all(s.kernel.broken is None for s in backend.plan_for(plan).steps if s.op == FUSED)


_NAN = np.array([np.nan, -np.nan, 1.0, -2.0, 0.0, -0.0, np.inf, -np.inf], np.float64)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "op", sorted(fusion.FUSABLE_OPS - {"where", "logical_not", "logical_and", "logical_or"})
)
def test_each_fusable_op_in_a_chain_matches_numpy_including_nan_and_signed_zero(op: str, dtype: str) -> None:
    spec = TensorSpec(dtype, (8, 8))
    unary = OPS[op].family == "unary"
    second = Node(op, (2,)) if unary else Node(op, (2, 1))
    g = Graph((spec, spec), (), (Node("negative", (0,)), second), (3,))
    backend = _backend()
    plan = compile_plan(g)
    assert [s.op for s in backend.plan_for(plan).steps] == [FUSED]
    x = np.resize(_NAN, (8, 8)).astype(dtype)
    y = np.resize(_NAN[::-1], (8, 8)).T.astype(dtype).copy()
    with np.errstate(all="ignore"):
        want = _run(NumpyBackend(), g, [x, y], [])[0]
    got = _run(backend, g, [x, y], [], plan)[0]
    assert backend.plan_for(plan).steps[0].kernel.broken is None
    assert_close(got, want, f"{op} {dtype}", loose=dtype == "float32")
    if op in ("negative", "abs"):
        # Signed zeros must survive the chain; a NaN's sign bit is not something results depend
        # on (seen on an H200: the fused float64 kernel gave abs(-nan) its sign bit, NumPy did not).
        signed = ~np.isnan(want)
        np.testing.assert_array_equal(np.signbit(got)[signed], np.signbit(want)[signed])


def test_where_and_logical_ops_fuse_and_match() -> None:
    f32 = TensorSpec("float32", (5, 6))
    g = Graph(
        (f32, f32),
        ("float",),
        (
            Node("greater", (0, 2)),  # 3
            Node("less", (1, 2)),  # 4
            Node("logical_and", (3, 4)),  # 5
            Node("logical_not", (5,)),  # 6
            Node("where", (6, 0, 2)),  # 7
            Node("sigmoid", (7,)),  # 8
        ),
        (8,),
    )
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2, 5, 6)).astype(np.float32)
    backend = _backend()
    assert [s.op for s in backend.plan_for(compile_plan(g)).steps] == [FUSED]
    assert_close(
        _run(backend, g, [x, y], [0.25])[0], _run(NumpyBackend(), g, [x, y], [0.25])[0], "where", loose=True
    )


def test_broadcasting_chains_fuse_and_match() -> None:
    g = Graph(
        (TensorSpec("float32", (64, 32)), TensorSpec("float32", (32,)), TensorSpec("float32", (64, 1))),
        ("float",),
        (Node("multiply", (1, 3)), Node("add", (0, 4)), Node("subtract", (5, 2)), Node("exp", (6,))),
        (7,),
    )
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(s.shape).astype(np.float32) for s in g.inputs]
    backend = _backend()
    assert [s.op for s in backend.plan_for(compile_plan(g)).steps] == [FUSED]
    assert_close(
        _run(backend, g, inputs, [0.5])[0], _run(NumpyBackend(), g, inputs, [0.5])[0], "bc", loose=True
    )


def test_identical_chains_share_one_kernel() -> None:
    backend = _backend()
    spec = TensorSpec("float32", (16,))
    plans = [
        compile_plan(Graph((spec,), ("float",), (Node("multiply", (0, 1)), Node("exp", (2,))), (3,))),
        compile_plan(
            Graph(
                (spec,),
                ("float",),
                (Node("multiply", (0, 1)), Node("exp", (2,)), Node("sum", (3,), check_attrs("sum", {}))),
                (4,),
            )
        ),
    ]
    kernels = [next(s.kernel.kernel for s in backend.plan_for(p).steps if s.op == FUSED) for p in plans]
    assert kernels[0] is kernels[1]
    assert backend.plan_for(plans[0]) is backend.plan_for(plans[0])  # derived once per plan


def test_reuse_lowers_the_pool_peak_of_a_chain(cp: Any) -> None:
    spec = TensorSpec("float32", (1 << 20,))
    nodes = tuple(Node("exp" if k % 2 else "negative", (k,)) for k in range(8))
    graph = Graph((spec,), (), nodes, (8,))
    peaks = {}
    for reuse in (False, True):
        backend = _backend(fuse=False, reuse=reuse)
        x = backend.from_numpy(np.zeros(1 << 20, np.float32))
        backend.run(compile_plan(graph), [x], [])  # warm the pool
        backend.synchronize()
        backend.reset_peak()
        (out,) = backend.run(compile_plan(graph), [x], [])
        backend.synchronize()
        peaks[reuse] = backend.memory_stats()["peak_bytes"]
        del out, x
        cp.get_default_memory_pool().free_all_blocks()
    assert peaks[True] < peaks[False]
