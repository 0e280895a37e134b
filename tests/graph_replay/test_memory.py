"""Memory figures: the meter counts each live buffer once, and the NumPy backend reports real bytes."""

from __future__ import annotations

import threading

import numpy as np

from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.graph_replay.memory import MemoryMeter
from emberlink.graph_replay.numpy_backend import NumpyBackend
from emberlink.graph_replay.plan import compile_plan

from .graphs import mlp_inputs, mlp_step


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
