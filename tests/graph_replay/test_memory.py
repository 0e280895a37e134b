"""Memory figures: the meter counts each live buffer once, the NumPy backend reports real bytes, and a
plan's admission peak is never below what a run of it allocates."""

from __future__ import annotations

import threading
import tracemalloc
from typing import Any

import numpy as np
import pytest

from emberlink.graph_replay import memory
from emberlink.graph_replay.ir import Graph, Node, Scalar, TensorSpec, kind_of_scalar
from emberlink.graph_replay.memory import MemoryMeter, plan_peak_bytes
from emberlink.graph_replay.numpy_backend import NumpyBackend
from emberlink.graph_replay.ops import check_attrs
from emberlink.graph_replay.plan import compile_plan

from .graphs import Builder, mlp_inputs, mlp_step


def test_a_tracked_array_counts_until_it_is_garbage() -> None:
    meter = MemoryMeter()
    a = np.zeros(1000, np.float64)
    meter.track(a)
    assert meter.in_use == 8000 and meter.peak == 8000
    del a
    assert meter.in_use == 0 and meter.peak == 8000


def test_views_and_repeats_count_their_buffer_once() -> None:
    meter = MemoryMeter()
    a = np.zeros((10, 100), np.float32)
    meter.track(a)
    meter.track(a)
    meter.track(a.T)
    meter.track(a[3:5].reshape(-1))
    assert meter.in_use == 4000 and meter.buffers == 1


def test_a_view_keeps_its_buffer_counted_after_the_owner_name_is_gone() -> None:
    meter = MemoryMeter()
    a = np.zeros(256, np.float32)
    view = a[:10]
    meter.track(view)
    del a
    assert meter.in_use == 1024  # the view holds the whole buffer alive
    del view
    assert meter.in_use == 0


def test_reset_peak_starts_from_what_is_in_use() -> None:
    meter = MemoryMeter()
    keep = np.zeros(100, np.uint8)
    meter.track(keep)
    temp = np.zeros(1000, np.uint8)
    meter.track(temp)
    del temp
    assert meter.peak == 1100
    meter.reset_peak()
    assert meter.peak == 100 and meter.in_use == 100


def test_arrays_dying_on_other_threads_are_uncounted() -> None:
    meter = MemoryMeter()
    arrays = [np.zeros(100, np.uint8) for _ in range(200)]
    for array in arrays:
        meter.track(array)
    del array
    assert meter.in_use == 20_000

    def drop(part: list[np.ndarray]) -> None:
        part.clear()

    parts = [arrays[i::4] for i in range(4)]
    del arrays
    threads = [threading.Thread(target=drop, args=(p,)) for p in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert meter.in_use == 0 and meter.buffers == 0


def test_memory_stats_report_nonzero_in_use_and_peak_after_a_run() -> None:
    backend = NumpyBackend()
    graph = mlp_step()
    inputs, bindings = mlp_inputs(graph)
    inputs = [backend.from_numpy(a) for a in inputs]
    plan = compile_plan(graph)
    outs = backend.run(plan, inputs, bindings)
    stats = backend.memory_stats()
    held = sum(a.nbytes for a in inputs) + sum(o.nbytes for o in outs)
    assert stats["in_use_bytes"] == held
    assert stats["peak_bytes"] > held  # intermediates were alive during the run
    assert stats["pool_bytes"] == stats["in_use_bytes"]
    del outs
    assert backend.memory_stats()["in_use_bytes"] == sum(a.nbytes for a in inputs)


def test_the_measured_peak_follows_the_plan_estimate_on_a_chain() -> None:
    nodes = tuple(Node("exp" if k % 2 else "negative", (k,)) for k in range(4))
    graph = Graph((TensorSpec("float32", (1000,)),), (), nodes, (4,))
    for reuse, results in ((False, 2), (True, 1)):
        backend = NumpyBackend(reuse=reuse)
        plan = compile_plan(graph, reuse=reuse)
        backend.run(plan, [np.zeros(1000, np.float32)], [])
        measured = backend.memory_stats()["peak_bytes"]
        assert measured == plan.input_bytes + plan.peak_bytes == 4000 + results * 4000


def test_a_rise_measured_from_a_start_is_recorded_again_above_a_later_start() -> None:
    meter = MemoryMeter()
    held = np.zeros(1000, np.uint8)
    meter.track(held)
    token = meter.start_rise()
    assert token == 1000
    temp = np.zeros(500, np.uint8)
    meter.track(temp)
    del temp
    assert meter.end_rise(token) == 500
    assert meter.peak == 1500 and meter.in_use == 1000
    meter.reset_peak()
    more = np.zeros(200, np.uint8)
    meter.track(more)
    meter.add_rise(500)  # the same run again, now above 1200 bytes in use
    assert meter.peak == 1700 and meter.in_use == 1200


def test_a_measurement_leaves_the_high_point_and_its_reset_alone() -> None:
    meter = MemoryMeter()
    temp = np.zeros(5000, np.uint8)
    meter.track(temp)
    del temp
    start = meter.start_rise()
    assert start == 0
    assert meter.start_rise() is None  # one measurement at a time
    assert meter.peak == 5000  # the high point from before it still reads
    meter.reset_peak()
    assert meter.peak == 0
    assert meter.end_rise(start) == 0
    assert meter.peak == 0  # the reset holds after it
    assert meter.start_rise() == 0  # the next one may start


def _reshape_graph() -> Graph:
    """exp of a reshaped input: the reshape is a view of a C-ordered input, a copy of any other."""
    spec = TensorSpec("float32", (100, 10))
    nodes = (Node("reshape", (0,), check_attrs("reshape", {"shape": (1000,)})), Node("exp", (1,)))
    return Graph((spec,), (), nodes, (2,))


def test_replays_report_the_same_peak_as_the_run_that_counted_every_step() -> None:
    graph = mlp_step(batch=64, sizes=(100, 128, 10))
    inputs, bindings = mlp_inputs(graph)
    backend = NumpyBackend()
    plan = compile_plan(graph)
    held = [backend.from_numpy(a) for a in inputs]
    peaks = []
    for _ in range(3):
        backend.reset_peak()
        outs = backend.run(plan, held, bindings)
        peaks.append(backend.memory_stats()["peak_bytes"])
        del outs
    assert peaks[0] > sum(a.nbytes for a in held)
    assert peaks == [peaks[0]] * 3


def test_a_replay_with_inputs_of_another_layout_is_counted_step_by_step() -> None:
    plan = compile_plan(_reshape_graph())
    backend = NumpyBackend()
    c_order = backend.from_numpy(np.ones((100, 10), np.float32))
    f_order = backend.from_numpy(np.asfortranarray(np.ones((100, 10), np.float32)))
    peaks = []
    for x in (c_order, f_order, c_order, f_order):
        backend.reset_peak()
        outs = backend.run(plan, [x], [])
        peaks.append(backend.memory_stats()["peak_bytes"])
        del outs
    held = c_order.nbytes + f_order.nbytes
    assert peaks == [held + 4000, held + 8000] * 2  # exp's result; with the F-ordered input, the copy too


def test_keeping_every_intermediate_of_an_mlp_step_costs_more_than_freeing() -> None:
    graph = mlp_step(batch=64, sizes=(100, 128, 10))
    inputs, bindings = mlp_inputs(graph)
    peaks = {}
    for name, backend in {"free": NumpyBackend(), "keep": NumpyBackend(keep_intermediates=True)}.items():
        held = [backend.from_numpy(a.copy()) for a in inputs]
        backend.reset_peak()
        backend.run(compile_plan(graph), held, bindings)
        peaks[name] = backend.memory_stats()["peak_bytes"]
    assert peaks["free"] < peaks["keep"]


# -- the admission peak: an upper bound on what a run allocates --------------------------------------

N = 1 << 15  # elements of the test arrays: large enough that Python's own allocations are noise
SLACK = 16 << 10  # Python objects the run makes (lists of values, messages)


def _peak_cases() -> dict[str, tuple[Graph, list[np.ndarray], list[Scalar]]]:
    f32, f16 = "float32", "float16"
    cases: dict[str, tuple[Graph, list[np.ndarray], list[Scalar]]] = {}

    def case(name: str, inputs: list[np.ndarray], bindings: list[Scalar], build: Any) -> None:
        g = Builder(
            [TensorSpec(str(a.dtype), a.shape) for a in inputs], [kind_of_scalar(b) for b in bindings]
        )
        cases[name] = (g.graph(build(g)), inputs, bindings)

    x = np.linspace(-2, 2, N, dtype=np.float32)
    m = x.reshape(128, N // 128)
    ints = np.arange(N, dtype=np.int32) % 7
    case("sigmoid chain", [x], [], lambda g: [g.add("sum", g.add("sigmoid", g.add("exp", 0)))])
    case("int plus float casts", [ints, x], [], lambda g: [g.add("add", 0, 1)])
    case(
        "broadcast then materialize",
        [x[:1].copy()],
        [2.0],
        lambda g: [g.add("sum", g.add("multiply", g.add("broadcast_to", 0, shape=(N,)), 1))],
    )
    case(
        "permute then reshape copies",
        [m],
        [],
        lambda g: [g.add("reshape", g.add("permute_dims", 0, axes=(1, 0)), shape=(N,))],
    )
    case(
        "slice output of a dying base",
        [x],
        [],
        lambda g: [g.add("getitem", g.add("negative", 0), key=(("s", 0, 16, 1),))],
    )
    case(
        "matmul float16",
        [m.astype(np.float16), m.T.copy().astype(np.float16)],
        [],
        lambda g: [g.add("matmul", 0, 1)],
    )
    case(
        "softmax and log_softmax",
        [m],
        [],
        lambda g: [g.add("softmax", 0, axis=1), g.add("log_softmax", 0, axis=0)],
    )
    case(
        "cross entropy",
        [m, (np.arange(128) % 5).astype(np.int64)],
        [],
        lambda g: [g.add("cross_entropy", 0, 1)],
    )
    case(
        "one hot of small ints",
        [ints.astype(np.uint8)],
        [],
        lambda g: [g.add("one_hot", 0, num_classes=7, dtype=f32)],
    )
    case(
        "take and scatter_add",
        [x, ints],
        [],
        lambda g: [g.add("scatter_add", g.add("take", 0, 1, axis=0), 1, axis=0, size=N)],
    )
    case(
        "arange rand randn",
        [],
        [7],
        lambda g: [
            g.add("arange", start=0, stop=N, step=1, dtype=f32),
            g.add("rand", 0, shape=(N,), dtype=f32),
            g.add("randn", 0, shape=(N,), dtype=f16),
        ],
    )
    case(
        "mean of ints and concat",
        [ints, x],
        [],
        lambda g: [g.add("mean", 0, axis=None, keepdims=False), g.add("concat", 0, 1, axis=0)],
    )
    case(
        "where and astype",
        [x],
        [0.5],
        lambda g: [g.add("where", g.add("greater", 0, 1), g.add("astype", 0, dtype="float64"), 1)],
    )
    return cases


PEAK_CASES = _peak_cases()


@pytest.mark.parametrize("name", sorted(PEAK_CASES))
def test_the_admission_peak_bounds_what_a_run_really_allocates(name: str) -> None:
    graph, inputs, bindings = PEAK_CASES[name]
    plan = compile_plan(graph)
    backend = NumpyBackend()
    held = [backend.from_numpy(a) for a in inputs]
    backend.run(plan, held, bindings)  # once, so first-use caches are not counted
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        outs = backend.run(plan, held, bindings)
        allocated = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    del outs
    assert allocated <= plan_peak_bytes(plan) + SLACK


def test_the_admission_peak_of_an_mlp_step_is_close_to_what_it_allocates() -> None:
    graph = mlp_step(batch=256, sizes=(256, 512, 64))
    inputs, bindings = mlp_inputs(graph)
    plan = compile_plan(graph)
    backend = NumpyBackend()
    held = [backend.from_numpy(a) for a in inputs]
    backend.run(plan, held, bindings)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        backend.run(plan, held, bindings)
        allocated = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    estimate = plan_peak_bytes(plan)
    assert allocated <= estimate + SLACK
    assert estimate <= 4 * allocated  # conservative, not absurd: honest plans still fit honest quotas


def test_a_tracked_buffer_costs_the_meter_its_weak_reference_and_key_alone() -> None:
    # A session may hold tens of thousands of tiny arrays; each object the meter keeps per buffer
    # is one more small allocation that outlives the session as allocator fragmentation (issue 12).
    # Two per buffer: the weak reference and its dict key (an int), no callback object of its own.
    meter = MemoryMeter()
    arrays = [np.ones(1, np.float32) for _ in range(2000)]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for a in arrays:
            meter.track(a)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    only = [tracemalloc.Filter(True, memory.__file__)]
    grown = after.filter_traces(only).compare_to(before.filter_traces(only), "filename")
    blocks = sum(s.count_diff for s in grown)
    assert meter.buffers == len(arrays)
    assert blocks <= 2 * len(arrays) + 20  # + the dict's table, rebuilt as it grows
