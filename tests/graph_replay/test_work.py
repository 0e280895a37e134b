"""A plan's estimated work (graph_replay/work.py): what the worker's work limits compare against."""

from __future__ import annotations

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
