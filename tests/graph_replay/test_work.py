"""A plan's estimated work (graph_replay/work.py): what the worker's work limits compare against."""

from __future__ import annotations

from emberlink.graph_replay import ops
from emberlink.graph_replay.ir import TensorSpec
from emberlink.graph_replay.plan import compile_plan
from emberlink.graph_replay.work import COST, TRANSCENDENTAL_FLOPS, Work, plan_work

from .graphs import Builder

F32 = "float32"


def test_a_matmul_counts_two_flops_per_multiply_add() -> None:
    g = Builder([TensorSpec(F32, (8, 3, 5)), TensorSpec(F32, (5, 7))], [])
    plan = compile_plan(g.graph([g.add("matmul", 0, 1)]))
    assert plan_work(plan) == Work(elements=8 * 3 * 5 + 5 * 7 + 8 * 3 * 7, flops=2 * 8 * 3 * 7 * 5)


def test_a_view_touches_nothing_and_its_reader_touches_all_it_sees() -> None:
    n = 1 << 33
    g = Builder([TensorSpec(F32, (1,))], [])
    plan = compile_plan(g.graph([g.add("sum", g.add("broadcast_to", 0, shape=(n,)))]))
    assert plan_work(plan) == Work(elements=n + 1, flops=n)


def test_ops_slower_per_element_than_add_count_their_elements_that_many_times() -> None:
    g = Builder([], ["int"])
    out = g.add("exp", g.add("randn", 0, shape=(10,), dtype=F32))
    work = plan_work(compile_plan(g.graph([out])))
    assert work.elements == 10 * COST["randn"] + (10 + 10) * COST["exp"]
    assert work.flops == 10 + TRANSCENDENTAL_FLOPS * 10


def test_a_float64_matmul_counts_twice_the_flops_of_a_float32_one() -> None:
    flops = {}
    for dtype in ("float32", "float64"):
        g = Builder([TensorSpec(dtype, (4, 4))], [])
        flops[dtype] = plan_work(compile_plan(g.graph([g.add("matmul", 0, 0)]))).flops
    assert flops["float64"] == 2 * flops["float32"] == 2 * 2 * 4 * 4 * 4


def test_every_op_of_the_op_table_has_a_work_cost() -> None:
    assert sorted(set(ops.OPS) - set(COST)) == [], "ops with no entry in graph_replay/work.COST"
    assert sorted(set(COST) - set(ops.OPS)) == [], "COST entries for ops that are not in the op table"


def test_a_sliding_window_counts_the_image_and_its_columns_at_its_cost() -> None:
    g = Builder([TensorSpec(F32, (2, 3, 8, 8))], [])
    attrs = {"kernel_size": (3, 3), "dilation": (1, 1), "padding": (1, 1), "stride": (1, 1)}
    cols = g.add("unfold", 0, **attrs)
    image = g.add("fold", cols, output_size=(8, 8), **attrs)
    work = plan_work(compile_plan(g.graph([image])))
    n_image, n_cols = 2 * 3 * 8 * 8, 2 * 3 * 9 * 64
    assert work.elements == (n_image + n_cols) * (COST["unfold"] + COST["fold"])
