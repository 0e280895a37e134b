"""Elementwise steps four float32 values a thread (vector.py) on CuPy: the same bits as the
ElementwiseKernel of the same expression, fused or alone, eager or captured (GPU machine only)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from emberlink.graph_replay import fusion, vector
from emberlink.graph_replay.captured import Captures, open_captures
from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.graph_replay.numpy_backend import NumpyBackend, host_scalar
from emberlink.graph_replay.ops import OPS, check_attrs
from emberlink.graph_replay.plan import FUSED, compile_plan

from .cases import assert_close
from .graphs import mlp_inputs, mlp_step

pytestmark = pytest.mark.gpu

ROWS, COLS = 256, 512  # 512 KiB of float32: past vector.MIN_BYTES
_SPECIAL = np.array([np.nan, 1.0, -2.0, 0.0, -0.0, np.inf, -np.inf, 0.5], np.float32)
FLOAT_OPS = sorted(
    op
    for op in fusion.FUSABLE_OPS
    if OPS[op].family in ("unary", "binary")
    and op not in ("logical_not", "logical_and", "logical_or", "isnan", "isinf", "isfinite")
    and op not in ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")
)


@pytest.fixture(scope="module")
def cp() -> Any:
    import cupy

    return cupy


@pytest.fixture(scope="module")
def backend() -> Any:
    from emberlink.graph_replay.cupy_backend import CupyBackend

    return CupyBackend()


def _values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    a = np.random.default_rng(seed).uniform(-3, 3, shape).astype(np.float32)
    flat = a.reshape(-1)
    flat[: len(_SPECIAL) * 50 : 50] = _SPECIAL  # NaN, signed zeros and infinities among them
    return a


def _vector_layouts(backend: Any) -> set[str]:
    """The layouts of the vector kernels `backend` has compiled (none refused by CUDA)."""
    functions = backend._vectors._functions
    assert all(f is not None for f in functions.values()), "CUDA refused a vector kernel"
    return {key[3] for key in functions}


LAYOUTS = {"full": "FF", "row": "FP", "binding": "FV"}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("op", FLOAT_OPS)
def test_each_float32_op_four_values_a_thread_gives_its_elementwise_kernels_bits(
    cp: Any, backend: Any, op: str, layout: str
) -> None:
    unary = OPS[op].family == "unary"
    if unary and layout != "full":
        pytest.skip("a unary op has one layout")  # the parametrization's cross product, not a gap
    x = _values((ROWS, COLS), 1)
    if unary:
        g = Graph((TensorSpec("float32", x.shape),), (), (Node(op, (0,)),), (1,))
        inputs, bindings = [x], []
    elif layout == "binding":
        g = Graph((TensorSpec("float32", x.shape),), ("float",), (Node(op, (0, 1)),), (2,))
        inputs, bindings = [x], [0.75]
    else:
        y = _values((ROWS, COLS) if layout == "full" else (COLS,), 2)
        g = Graph(
            (TensorSpec("float32", x.shape), TensorSpec("float32", y.shape)), (), (Node(op, (0, 1)),), (2,)
        )
        inputs, bindings = [x, y], []
    plan = compile_plan(g)
    (step,) = plan.steps
    before = len(backend._vectors._functions)
    (got,) = backend.run(plan, [backend.from_numpy(a) for a in inputs], bindings)
    source = fusion.kernel_source(dataclasses.replace(step, chain=(step,)))
    kernel = cp.ElementwiseKernel(source.in_params, source.out_params, source.body, source.name)
    args = [cp.asarray(a) for a in inputs] + list(bindings)
    want = kernel(
        *fusion.call_args(source, args, lambda v, d: v if isinstance(v, cp.ndarray) else host_scalar(v, d))
    )
    np.testing.assert_array_equal(
        cp.asnumpy(got).view(np.uint32), cp.asnumpy(want).view(np.uint32), err_msg=op
    )
    with np.errstate(all="ignore"):
        (reference,) = NumpyBackend().run(plan, inputs, bindings)
    assert_close(cp.asnumpy(got), reference, op)
    expected = "F" if unary else LAYOUTS[layout]
    assert expected in _vector_layouts(backend)
    assert len(backend._vectors._functions) >= before  # compiled once per source and layout


def test_a_non_contiguous_operand_keeps_the_elementwise_kernel_and_its_values(backend: Any) -> None:
    spec = TensorSpec("float32", (COLS, ROWS))
    g = Graph(
        (spec, TensorSpec("float32", (ROWS, COLS))),
        (),
        (Node("permute_dims", (0,), check_attrs("permute_dims", {"axes": (1, 0)})), Node("add", (2, 1))),
        (3,),
    )
    inputs = [_values(spec.shape, 3), _values((ROWS, COLS), 4)]
    got = backend.to_numpy(backend.run(compile_plan(g), [backend.from_numpy(a) for a in inputs], [])[0])
    np.testing.assert_array_equal(got, inputs[0].T + inputs[1])


@pytest.fixture
def captures(backend: Any) -> Iterator[Captures]:
    pytest.importorskip("nvmath")
    caps = open_captures(backend)
    assert caps is not None
    yield caps
    caps.close()


def test_a_large_mlp_step_with_vector_kernels_fused_and_alone_matches_numpy_eager_and_captured(
    backend: Any, captures: Captures
) -> None:
    graph = mlp_step(batch=256, sizes=(512, 1024, 16))  # hidden activations and W1: 1 and 2 MiB
    inputs, bindings = mlp_inputs(graph, seed=5)
    plan, eager_plan = compile_plan(graph), compile_plan(graph)
    assert any(s.op == FUSED for s in backend.plan_for(plan).steps)
    ins_c = [backend.from_numpy(a) for a in inputs]
    ins_e = list(ins_c)
    host = list(inputs)
    for step in range(5):  # eager, capture, three replays; the new parameters fed back each time
        outs_c = captures.run(plan, ins_c, bindings)
        outs_e = backend.run(eager_plan, ins_e, bindings)
        with np.errstate(all="ignore"):
            outs_n = NumpyBackend().run(compile_plan(graph), host, bindings)
        got_c, got_e = ([backend.to_numpy(o) for o in outs] for outs in (outs_c, outs_e))
        for c, e, n in zip(got_c, got_e, outs_n, strict=True):
            np.testing.assert_array_equal(c, e, err_msg=f"step {step}: captured against eager")
            assert_close(e, np.asarray(n), f"step {step}: against NumPy")
        ins_c = [ins_c[0], *outs_c[1:5], ins_c[5]]
        ins_e = [ins_e[0], *outs_e[1:5], ins_e[5]]
        host = [host[0], *got_e[1:5], host[5]]
    assert captures.captured(plan) and captures.replays == 3
    layouts = _vector_layouts(backend)
    assert any("P" in k for k in layouts), layouts  # the bias add, a row broadcast
    assert vector.MIN_BYTES <= 256 * 1024 * 4
