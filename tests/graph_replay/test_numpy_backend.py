"""The NumPy reference backend: every op's values against direct NumPy, and the run loop's rules."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from emberlink.errors import DTypeError, ExecutionError, OutOfMemory
from emberlink.graph_replay.backend import run_plan
from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.graph_replay.numpy_backend import OP_TABLE, NumpyBackend
from emberlink.graph_replay.ops import OPS, check_attrs, infer, operand_dtype
from emberlink.graph_replay.plan import Step, compile_plan

from .cases import CASE_IDS, CASES, Case, assert_close, run_case


def test_backend_table_has_exactly_the_ops_of_the_op_table() -> None:
    assert set(OP_TABLE) == set(OPS)


def test_every_op_has_a_case() -> None:
    assert {case.op for case in CASES} == set(OPS)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_op_value_matches_direct_numpy(case: Case) -> None:
    assert case.expect is not None
    got = run_case(NumpyBackend(), case)
    assert_close(got, case.expect(*case.args), case.id)


def test_rand_numbers_depend_only_on_seed_and_element_index() -> None:
    flat = run_case(NumpyBackend(), Case("a", "rand", (9,), {"shape": (12,), "dtype": "float64"}))
    square = run_case(NumpyBackend(), Case("b", "rand", (9,), {"shape": (3, 4), "dtype": "float64"}))
    other = run_case(NumpyBackend(), Case("c", "rand", (10,), {"shape": (12,), "dtype": "float64"}))
    np.testing.assert_array_equal(flat.reshape(3, 4), square)
    assert not np.array_equal(flat, other)
    assert 0.0 <= flat.min() and flat.max() < 1.0


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_rand_stays_below_one_in_every_dtype(dtype: str) -> None:
    got = run_case(NumpyBackend(), Case("r", "rand", (1,), {"shape": (200_000,), "dtype": dtype}))
    assert got.dtype == dtype and 0.0 <= got.min() and got.max() < 1.0


def test_randn_has_unit_moments() -> None:
    got = run_case(NumpyBackend(), Case("n", "randn", (3,), {"shape": (100_000,), "dtype": "float64"}))
    assert abs(got.mean()) < 0.02 and abs(got.std() - 1.0) < 0.02 and np.isfinite(got).all()


# -- failures --------------------------------------------------------------------------------------


def _one_node(op: str, inputs: Sequence[TensorSpec], bindings: Sequence[str], attrs: dict[str, Any]) -> Graph:
    refs = tuple(range(len(inputs) + len(bindings)))
    return Graph(tuple(inputs), tuple(bindings), (Node(op, refs, check_attrs(op, attrs)),), (len(refs),))


def test_take_out_of_range_is_an_execution_error_naming_the_op() -> None:
    g = _one_node("take", [TensorSpec("float32", (3,)), TensorSpec("int64", (1,))], [], {})
    plan = compile_plan(g)
    with pytest.raises(ExecutionError, match=r"take \(node 0\) failed: IndexError"):
        NumpyBackend().run(plan, [np.zeros(3, np.float32), np.array([7])], [])


def test_int_binding_out_of_range_for_an_int32_tensor_is_an_execution_error() -> None:
    plan = compile_plan(_one_node("add", [TensorSpec("int32", (2,))], ["int"], {}))
    with pytest.raises(ExecutionError, match=r"add \(node 0\) failed"):
        NumpyBackend().run(plan, [np.zeros(2, np.int32)], [2**40])


def test_memory_error_becomes_out_of_memory_naming_the_op() -> None:
    def boom(xp: Any, args: Sequence[Any], step: Step) -> Any:
        raise MemoryError("cannot allocate")

    plan = compile_plan(_one_node("exp", [TensorSpec("float32", (2,))], [], {}))
    with pytest.raises(OutOfMemory, match=r"exp \(node 0\): out of memory: cannot allocate"):
        run_plan(plan, [np.zeros(2, np.float32)], [], xp=np, table={"exp": boom})


def test_an_op_missing_from_the_backend_table_is_an_execution_error() -> None:
    plan = compile_plan(_one_node("exp", [TensorSpec("float32", (2,))], [], {}))
    with pytest.raises(ExecutionError, match="this backend has no such op"):
        run_plan(plan, [np.zeros(2, np.float32)], [], xp=np, table={})


def test_a_result_that_disagrees_with_inference_is_caught() -> None:
    plan = compile_plan(_one_node("exp", [TensorSpec("float32", (2,))], [], {}))
    table = {"exp": lambda xp, args, step: xp.exp(args[0]).astype(np.float64)}
    with pytest.raises(
        ExecutionError, match="internal error: produced float64 \\(2,\\), inference says float32"
    ):
        run_plan(plan, [np.zeros(2, np.float32)], [], xp=np, table=table)


def test_inputs_must_match_the_graph_specs() -> None:
    plan = compile_plan(_one_node("exp", [TensorSpec("float32", (2,))], [], {}))
    with pytest.raises(ExecutionError, match="input 0 is float64 \\(2,\\), the graph wants float32 \\(2,\\)"):
        NumpyBackend().run(plan, [np.zeros(2)], [])
    with pytest.raises(ExecutionError, match="graph takes 1 inputs, got 0"):
        NumpyBackend().run(plan, [], [])


@pytest.mark.parametrize(("kind", "value"), [("int", 1.5), ("int", True), ("bool", 1), ("float", "x")])
def test_bindings_must_have_the_graph_kind(kind: str, value: Any) -> None:
    plan = compile_plan(_one_node("add", [TensorSpec("float32", (2,))], [kind], {}))
    with pytest.raises(ExecutionError, match=f"binding 0 must be a Python {kind}"):
        NumpyBackend().run(plan, [np.zeros(2, np.float32)], [value])


def test_an_int_is_accepted_for_a_float_binding() -> None:
    plan = compile_plan(_one_node("add", [TensorSpec("float32", (2,))], ["float"], {}))
    (out,) = NumpyBackend().run(plan, [np.zeros(2, np.float32)], [2])
    np.testing.assert_array_equal(out, [2.0, 2.0])


def test_from_numpy_refuses_dtypes_off_the_allow_list() -> None:
    with pytest.raises(DTypeError, match="uint16"):
        NumpyBackend().from_numpy(np.zeros(2, np.uint16))


# -- plans and memory ------------------------------------------------------------------------------


def _chain(n: int, size: int = 1000) -> Graph:
    nodes = tuple(Node("exp" if k % 2 else "negative", (k,)) for k in range(n))
    return Graph((TensorSpec("float32", (size,)),), (), nodes, (n,))


def test_plan_frees_each_value_after_its_last_use_on_a_chain() -> None:
    plan = compile_plan(_chain(6), reuse=False)
    assert [s.free for s in plan.steps] == [(), (1,), (2,), (3,), (4,), (5,)]
    assert plan.peak_values == 2
    assert plan.peak_bytes == 2 * 4000
    assert plan.input_bytes == 4000 and plan.output_bytes == 4000


def test_plan_with_reuse_writes_each_chain_step_into_the_dying_previous_value() -> None:
    plan = compile_plan(_chain(6))
    assert [s.into for s in plan.steps] == [None, 1, 2, 3, 4, 5]  # never into the input (0)
    assert plan.peak_values == 1 and plan.peak_bytes == 4000


def test_plan_never_frees_inputs_or_outputs() -> None:
    g = Graph(
        (TensorSpec("float32", (10,)),),
        ("float",),
        (Node("multiply", (0, 1)), Node("exp", (2,)), Node("add", (2, 3))),
        (2, 4),
    )
    plan = compile_plan(g, reuse=False)
    freed = {v for s in plan.steps for v in s.free}
    assert freed == {3}
    assert plan.peak_values == 3
    reusing = compile_plan(g)
    assert [s.into for s in reusing.steps] == [None, None, 3]  # the output 2 is never written into
    assert reusing.peak_values == 2


def test_plan_casts_only_bindings_and_arrays_of_another_dtype() -> None:
    g = Graph(
        (TensorSpec("float32", (3,)), TensorSpec("int32", (3,)), TensorSpec("bool", (3,))),
        ("float",),
        (
            Node("add", (0, 0)),  # both float32 already: nothing to cast
            Node("add", (0, 1)),  # the int32 array
            Node("multiply", (0, 3)),  # the binding
            Node("where", (2, 1, 0)),  # the int32 value, never the condition
            Node("exp", (2,)),  # bool to float32
        ),
        (4, 5, 6, 7, 8),
    )
    plan = compile_plan(g)
    assert [s.casts for s in plan.steps] == [(), (1,), (1,), (1,), (0,)]
    outs = NumpyBackend().run(
        plan, [np.ones(3, np.float32), np.arange(3, dtype=np.int32), np.ones(3, bool)], [2.5]
    )
    np.testing.assert_array_equal(outs[1], [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(outs[2], [2.5, 2.5, 2.5])
    np.testing.assert_array_equal(outs[3], [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(outs[4], np.exp(np.ones(3, np.float32)))
    assert all(o.dtype == np.float32 for o in outs)


def test_plan_drops_nodes_no_output_needs() -> None:
    g = Graph((TensorSpec("float32", (4,)),), (), (Node("exp", (0,)), Node("log", (0,))), (2,))
    plan = compile_plan(g)
    assert [s.op for s in plan.steps] == ["log"]
    (out,) = NumpyBackend().run(plan, [np.ones(4, np.float32)], [])
    np.testing.assert_array_equal(out, np.zeros(4, np.float32))


def test_run_loop_drops_references_after_last_use() -> None:
    """At each step only the previous value is still alive: the loop drops the rest."""
    produced: list[weakref.ref[np.ndarray]] = []
    alive_counts: list[int] = []

    def record(xp: Any, args: Sequence[Any], step: Step) -> Any:
        alive_counts.append(sum(r() is not None for r in produced))
        out = np.exp(args[0]) if step.op == "exp" else np.negative(args[0])
        produced.append(weakref.ref(out))
        return out

    plan = compile_plan(_chain(8))
    (out,) = run_plan(
        plan, [np.zeros(1000, np.float32)], [], xp=np, table={"exp": record, "negative": record}
    )
    assert alive_counts == [0, 1, 1, 1, 1, 1, 1, 1]
    assert produced[-1]() is out


def test_a_view_output_does_not_keep_its_larger_base_alive() -> None:
    g = Graph(
        (TensorSpec("float32", (100, 100)),),
        (),
        (Node("exp", (0,)), Node("getitem", (1,), check_attrs("getitem", {"key": (("i", 0),)}))),
        (2,),
    )
    (out,) = NumpyBackend().run(compile_plan(g), [np.zeros((100, 100), np.float32)], [])
    assert out.base is None or out.base.nbytes == out.nbytes


# -- properties ------------------------------------------------------------------------------------

_DTYPES = ["bool", "int32", "int64", "float16", "float32", "float64"]
_NUMERIC_OPS = ["add", "subtract", "multiply", "maximum", "minimum", "less", "equal", "greater_equal"]


def _sample(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    return np.asarray(rng.integers(-4, 5, size=shape).astype(dtype))


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(_NUMERIC_OPS),
    st.sampled_from(_DTYPES),
    st.sampled_from(_DTYPES),
    hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=3),
    st.integers(0, 2**32 - 1),
)
def test_binary_ops_agree_with_inference_and_numpy_in_the_promoted_dtype(
    op: str, da: str, db: str, shapes: Any, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    a, b = _sample(rng, da, shapes.input_shapes[0]), _sample(rng, db, shapes.input_shapes[1])
    case = Case("p", op, (a, b))
    try:
        spec = infer(op, [TensorSpec(da, a.shape), TensorSpec(db, b.shape)])
    except DTypeError:
        assert "bool" in (da, db)  # arithmetic on bool and bool is the only refusal here
        return
    got = run_case(NumpyBackend(), case)  # the run loop checks the result against `spec`
    assert (str(got.dtype), got.shape) == (spec.dtype, spec.shape)
    common = operand_dtype(op, [TensorSpec(da, a.shape), TensorSpec(db, b.shape)])
    fn = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum}
    fn |= {"minimum": np.minimum, "less": np.less, "equal": np.equal, "greater_equal": np.greater_equal}
    want = fn[op](a.astype(common), b.astype(common))
    np.testing.assert_array_equal(got, want)


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(["sum", "mean", "max", "min", "prod", "argmax", "argmin"]),
    st.sampled_from(_DTYPES),
    hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4),
    st.data(),
)
def test_reductions_agree_with_inference_for_any_axes(
    op: str, dtype: str, shape: tuple[int, ...], data: Any
) -> None:
    ndim = len(shape)
    if op in ("argmax", "argmin"):
        axis: Any = data.draw(st.none() | st.integers(-ndim, ndim - 1))
    else:
        axis = data.draw(st.none() | st.integers(-ndim, ndim - 1) | hnp.valid_tuple_axes(ndim))
    keepdims = data.draw(st.booleans())
    x = _sample(np.random.default_rng(0), dtype, shape)
    case = Case("r", op, (x,), {"axis": axis, "keepdims": keepdims})
    got = run_case(NumpyBackend(), case)
    spec = infer(op, [TensorSpec(dtype, shape)], {"axis": axis, "keepdims": keepdims})
    assert (str(got.dtype), got.shape) == (spec.dtype, spec.shape)


def test_a_huge_float_scalar_overflows_float16_to_inf_without_error() -> None:
    x = np.array([1.0, -1.0], np.float16)
    got = run_case(NumpyBackend(), Case("o", "multiply", (x, 1e10)))
    np.testing.assert_array_equal(got, np.array([np.inf, -np.inf], np.float16))
