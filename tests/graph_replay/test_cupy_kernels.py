"""cupy_kernels' entries fall back to the reference where their kernels do not serve (any machine).

The kernels themselves run on the GPU machine (test_cupy_backend.py compares them with the
reference entries); here an array module that is NumPy with a RawModule of our own shows which
cases reach a kernel and that a kernel CUDA will not compile leaves the reference's values.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

from emberlink.graph_replay.cupy_kernels import MAX_ROW, Kernels
from emberlink.graph_replay.numpy_backend import OP_TABLE

from .cases import CASES, Case


class CompileError(Exception):
    pass


class Module:
    """A RawModule that records what was asked of it; `fails` makes it refuse to compile."""

    def __init__(self, calls: list[str], fails: bool) -> None:
        self.calls, self.fails = calls, fails

    def get_function(self, name: str) -> Any:
        if self.fails:
            raise CompileError("error: something CUDA refused")
        self.calls.append(name)
        return lambda grid, block, args: None  # the output stays as allocated: never compared


def _kernels(fails: bool = False) -> tuple[Kernels, list[str]]:
    calls: list[str] = []
    xp = types.SimpleNamespace(
        RawModule=lambda code, name_expressions: Module(calls, fails),
        ascontiguousarray=np.ascontiguousarray,
        empty=np.empty,
    )
    return Kernels(xp, CompileError), calls


def _case(case_id: str) -> Case:
    return next(c for c in CASES if c.id == case_id)


def _run(kernels: Kernels, case: Case) -> np.ndarray:
    step = case.plan().steps[0]
    with np.errstate(all="ignore"):
        return np.asarray(kernels.table()[case.op](np, case.inputs(), step))


def _want(case: Case) -> np.ndarray:
    step = case.plan().steps[0]
    with np.errstate(all="ignore"):
        return np.asarray(OP_TABLE[case.op](np, case.inputs(), step))


@pytest.mark.parametrize(
    ("case_id", "kernel"),
    [
        ("unfold-k3-pad1", "emberlink_unfold<float>"),
        ("fold-k2x3-dil2-s2x1-pad1x2", "emberlink_fold<float>"),
        ("softmax-long-rows-masked", "emberlink_softmax<float>"),
        ("log_softmax-f64-3d", "emberlink_softmax<double>"),
    ],
)
def test_float_cases_reach_their_kernel(case_id: str, kernel: str) -> None:
    kernels, calls = _kernels()
    _run(kernels, _case(case_id))
    assert calls == [kernel]


@pytest.mark.parametrize(
    "case_id",
    [
        "unfold-f16",  # float16, ints: the reference
        "unfold-u8",
        "fold-int32",
        "fold-f16-accumulates-wide",
        "unfold-f64-empty-batch",  # nothing to launch
        "softmax-axis0-f64",  # not the last axis
        "log_softmax-f16",
        "log_softmax-int-gives-f32",  # the operand is cast first: the reference does that
    ],
)
def test_what_no_kernel_covers_runs_the_reference(case_id: str) -> None:
    kernels, calls = _kernels()
    case = _case(case_id)
    np.testing.assert_array_equal(_run(kernels, case), _want(case))
    assert calls == []


def test_rows_longer_than_a_warp_takes_run_the_reference() -> None:
    kernels, calls = _kernels()
    x = np.linspace(-1, 1, 2 * (MAX_ROW + 1), dtype=np.float32).reshape(2, MAX_ROW + 1)
    case = Case("softmax-past-max-row", "softmax", (x,), {})
    np.testing.assert_array_equal(_run(kernels, case), _want(case))
    assert calls == []


def test_kernels_cuda_does_not_compile_leave_the_reference_values() -> None:
    kernels, _ = _kernels(fails=True)
    for case_id in ("unfold-k3-pad1", "fold-k3", "softmax-long-rows-masked"):
        case = _case(case_id)
        np.testing.assert_array_equal(_run(kernels, case), _want(case))
    assert isinstance(kernels.broken, CompileError)
