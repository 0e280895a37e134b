"""Which calls run four float32 values a thread, and the kernel source for them (vector.py)."""

from __future__ import annotations

import dataclasses

import pytest

from emberlink.graph_replay import fusion, vector
from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.graph_replay.plan import compile_plan

BIG = (1024, 4096)
AT = 1 << 20  # an aligned address


def test_full_row_scalar_and_value_arguments_each_get_their_letter() -> None:
    args = [(BIG, True, AT), ((4096,), True, AT), ((), True, AT + 4), None, ((1, 1024, 4096), True, AT)]
    assert vector.layout(BIG, args) == "FPSVF"


@pytest.mark.parametrize(
    ("out", "arg", "why"),
    [
        (BIG, (BIG, False, AT), "a strided view"),
        (BIG, (BIG, True, AT + 4), "an address off the 16-byte boundary"),
        (BIG, ((1024, 1), True, AT), "a column broadcast"),
        (BIG, ((6,), True, AT), "a row that is not the output's last dim"),
        ((1023, 4095), ((1023, 4095), True, AT), "a size not divisible by 4"),
        ((64, 64), ((64, 64), True, AT), "an output below MIN_BYTES"),
    ],
)
def test_calls_outside_the_layouts_keep_the_elementwise_kernel(
    out: tuple[int, ...], arg: tuple[tuple[int, ...], bool, int], why: str
) -> None:
    assert vector.layout(out, [arg]) is None, why


def _source(op: str, specs: tuple[TensorSpec, ...], bindings: tuple[str, ...] = ()) -> fusion.KernelSource:
    n = len(specs) + len(bindings)
    (step,) = compile_plan(Graph(specs, bindings, (Node(op, tuple(range(n))),), (n,))).steps
    return fusion.kernel_source(dataclasses.replace(step, chain=(step,)))


def test_a_bias_add_reads_its_row_by_period_and_computes_each_lane_with_the_chains_own_text() -> None:
    source = _source("add", (TensorSpec("float32", BIG), TensorSpec("float32", (4096,))))
    code = vector.kernel_code(source, "FP")
    assert "in1_[i % p1]" in code and "in0_[i]" in code
    assert code.count(source.body.splitlines()[0].strip()) == 4  # once per lane
    for lane in vector.LANES:
        assert f"r.{lane} = out0;" in code
    assert f"void {vector.kernel_name(source, 'FP')}(" in code


def test_a_binding_is_a_value_on_the_eager_path_and_a_pointer_read_once_when_captured() -> None:
    source = _source("multiply", (TensorSpec("float32", BIG),), ("float",))
    assert "const float in1," in vector.kernel_code(source, "FV")
    captured = vector.kernel_code(source, "FS")
    assert "const float* in1_" in captured and "const float in1 = *in1_;" in captured


def test_only_all_float32_sources_are_covered_and_a_layout_must_fit_the_source() -> None:
    f32, f64 = TensorSpec("float32", BIG), TensorSpec("float64", BIG)
    assert vector.float32_only(_source("add", (f32, f32)))
    assert not vector.float32_only(_source("add", (f64, f64)))
    assert not vector.float32_only(_source("greater", (f32, f32)))  # a bool output
    with pytest.raises(ValueError, match="layout of 1 arguments"):
        vector.kernel_code(_source("add", (f32, f32)), "F")
