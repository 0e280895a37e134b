"""The CuPy backend against the NumPy reference, op by op on the shared case table (GPU machine only)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from emberlink.errors import ExecutionError, OutOfMemory
from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.graph_replay.numpy_backend import NumpyBackend
from emberlink.graph_replay.ops import check_attrs
from emberlink.graph_replay.plan import compile_plan

from .cases import CASE_IDS, CASES, Case, assert_close, run_case

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cupy_backend() -> Any:
    from emberlink.graph_replay.cupy_backend import CupyBackend

    return CupyBackend()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cupy_matches_the_numpy_reference(cupy_backend: Any, case: Case) -> None:
    want = run_case(NumpyBackend(), case)
    got = run_case(cupy_backend, case)
    assert_close(got, want, case.id, loose=True)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_rand_is_bit_identical_to_numpy(cupy_backend: Any, dtype: str) -> None:
    case = Case("r", "rand", (123456789,), {"shape": (1000, 33), "dtype": dtype})
    np.testing.assert_array_equal(run_case(cupy_backend, case), run_case(NumpyBackend(), case))


def test_randn_matches_numpy_to_float32_rounding(cupy_backend: Any) -> None:
    case = Case("n", "randn", (5,), {"shape": (100_000,), "dtype": "float32"})
    got, want = run_case(cupy_backend, case), run_case(NumpyBackend(), case)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_chain_runs_and_memory_stats_report_the_pool(cupy_backend: Any) -> None:
    nodes = tuple(Node("exp" if k % 2 else "negative", (k,)) for k in range(6))
    plan = compile_plan(Graph((TensorSpec("float32", (1 << 20,)),), (), nodes, (6,)))
    x = cupy_backend.from_numpy(np.zeros(1 << 20, np.float32))
    (out,) = cupy_backend.run(plan, [x], [])
    cupy_backend.synchronize()
    np.testing.assert_allclose(cupy_backend.to_numpy(out)[:3], np.exp(-np.exp(-1.0)), rtol=1e-6)
    stats = cupy_backend.memory_stats()
    assert stats["in_use_bytes"] >= 2 * (4 << 20)
    assert stats["peak_bytes"] >= stats["in_use_bytes"] and stats["pool_bytes"] >= stats["in_use_bytes"]


def test_an_allocation_past_the_device_is_out_of_memory(cupy_backend: Any) -> None:
    g = Graph(
        (),
        (),
        (Node("zeros", (), check_attrs("zeros", {"shape": (1 << 30, 1 << 12), "dtype": "float64"})),),
        (0,),
    )
    with pytest.raises(OutOfMemory, match=r"zeros \(node 0\): out of memory"):
        cupy_backend.run(compile_plan(g), [], [])


def test_an_int_binding_too_large_for_int32_is_an_execution_error(cupy_backend: Any) -> None:
    g = Graph((TensorSpec("int32", (2,)),), ("int",), (Node("add", (0, 1)),), (2,))
    x = cupy_backend.from_numpy(np.zeros(2, np.int32))
    with pytest.raises(ExecutionError, match=r"add \(node 0\) failed"):
        cupy_backend.run(compile_plan(g), [x], [2**40])


@pytest.mark.parametrize("index", [3, 7, -4])
def test_take_out_of_range_is_an_execution_error_as_on_numpy(cupy_backend: Any, index: int) -> None:
    g = Graph(
        (TensorSpec("float32", (3,)), TensorSpec("int64", (1,))),
        (),
        (Node("take", (0, 1), check_attrs("take", {})),),
        (2,),
    )
    x = cupy_backend.from_numpy(np.zeros(3, np.float32))
    i = cupy_backend.from_numpy(np.array([index]))
    with pytest.raises(ExecutionError, match=r"take \(node 0\) failed: IndexError"):
        cupy_backend.run(compile_plan(g), [x, i], [])


# -- fast paths (cupy_kernels.py, cuBLAS through nvmath-python) against the entries they replace --

FAST_OPS = ("unfold", "fold", "softmax", "log_softmax", "matmul")
FAST_CASES = [c for c in CASES if c.op in FAST_OPS]


@pytest.fixture(scope="module")
def reference_backend() -> Any:
    from emberlink.graph_replay.cupy_backend import CupyBackend

    return CupyBackend(fast=False)


@pytest.mark.parametrize("case", FAST_CASES, ids=[c.id for c in FAST_CASES])
def test_fast_paths_give_the_values_of_the_reference_entries(
    cupy_backend: Any, reference_backend: Any, case: Case
) -> None:
    got = run_case(cupy_backend, case)
    want = run_case(reference_backend, case)
    assert cupy_backend.kernels.broken is None  # the kernels compiled, so they ran
    if case.op in ("unfold", "fold"):  # copies, and sums in the reference's order: the same bits
        np.testing.assert_array_equal(got, want, err_msg=case.id)
    else:
        assert_close(got, want, case.id)


@pytest.mark.parametrize("fast", [True, False])
def test_a_matmul_with_a_transposed_batched_operand_matches_numpy(fast: bool) -> None:
    """The weight gradient of a convolution: g (N, O, L) @ cols.mT, cols (N, K, L)."""
    from emberlink.graph_replay.cupy_backend import CupyBackend

    g = Graph(
        (TensorSpec("float32", (3, 4, 20)), TensorSpec("float32", (3, 6, 20))),
        (),
        (
            Node("permute_dims", (1,), check_attrs("permute_dims", {"axes": (0, 2, 1)})),
            Node("matmul", (0, 2)),
        ),
        (3,),
    )
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(s.shape).astype(np.float32) for s in g.inputs]
    backend = CupyBackend(fast=fast)
    (out,) = backend.run(compile_plan(g), [backend.from_numpy(a) for a in inputs], [])
    want = inputs[0] @ inputs[1].transpose(0, 2, 1)
    np.testing.assert_allclose(backend.to_numpy(out), want, rtol=1e-5, atol=1e-5)
