"""Lazy recording, flush points, memoized graphs, outputs = live handles, and freeing buffers."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import emberlink as el
from emberlink import Device
from emberlink.client import device as device_module
from emberlink.client import segment
from emberlink.graph_replay.ir import Node, TensorSpec

F = el.nn.functional


def _mlp(dev: Device, momentum: float = 0.0) -> tuple[el.nn.Module, el.optim.SGD]:
    nn = el.nn
    model = nn.Sequential(nn.Linear(6, 8, seed=0), nn.ReLU(), nn.Linear(8, 3, seed=1)).to(dev)
    return model, el.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)


def _step(dev: Device, model, opt, batch: int = 5, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    x = dev.tensor(rng.standard_normal((batch, 6)).astype("float32"))
    y = dev.tensor(rng.integers(0, 3, batch))
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def test_ops_are_recorded_not_run_until_a_read(dev: Device) -> None:
    x = dev.tensor([1.0, 2.0])
    y = (x * 2.0).exp().sum()
    stats = dev.stats()
    assert stats["pending_nodes"] == 3 and stats["flushes"] == 0
    assert "pending" in repr(y)
    assert float(y) == pytest.approx(np.exp(2.0) + np.exp(4.0))
    assert dev.stats()["pending_nodes"] == 0 and dev.stats()["flushes"] == 1
    assert "ready" in repr(y)


def test_sync_flushes_and_waits(dev: Device) -> None:
    x = dev.tensor([1.0])
    y = x + 1.0
    dev.sync()
    assert dev.stats()["flushes"] == 1 and "ready" in repr(y)
    dev.sync()  # nothing pending: no new graph
    assert dev.stats()["flushes"] == 1


def test_same_training_step_twice_builds_one_graph(dev: Device) -> None:
    model, opt = _mlp(dev)
    losses = [_step(dev, model, opt, seed=i) for i in range(3)]
    stats = dev.stats()
    assert stats["graphs_built"] == 1
    assert stats["graph_memo_hits"] == 2
    assert stats["graphs_registered"] == 1
    assert all(np.isfinite(losses))


def test_a_new_learning_rate_is_a_binding_not_a_new_graph(dev: Device) -> None:
    model, opt = _mlp(dev)
    _step(dev, model, opt)
    opt.lr = 0.01
    _step(dev, model, opt)
    assert dev.stats()["graphs_built"] == 1


def test_a_new_batch_shape_builds_a_new_graph(dev: Device) -> None:
    model, opt = _mlp(dev)
    _step(dev, model, opt, batch=5)
    _step(dev, model, opt, batch=7)
    _step(dev, model, opt, batch=5)
    assert dev.stats()["graphs_built"] == 2


def test_momentum_step_is_stable_from_the_second_step(dev: Device) -> None:
    model, opt = _mlp(dev, momentum=0.9)
    for i in range(4):
        _step(dev, model, opt, seed=i)
    # step 1 creates the momentum buffers, steps 2.. share one graph
    assert dev.stats()["graphs_built"] == 2


def test_python_scalars_are_bindings(dev: Device) -> None:
    x = dev.tensor([1.0, 2.0])
    assert float((x * 2.0).sum()) == 6.0
    assert float((x * 3.0).sum()) == 9.0
    assert dev.stats()["graphs_built"] == 1
    assert float((x * 3).sum()) == 9.0  # an int scalar is another binding kind
    assert dev.stats()["graphs_built"] == 2


def test_equal_subscripts_normalize_to_one_key_and_one_graph(dev: Device) -> None:
    x = dev.tensor(np.arange(12.0).reshape(3, 4))
    assert [float(x[k].sum()) for k in (1, (1, slice(None)), (1, Ellipsis), (-2,))] == [22.0] * 4
    assert float(x[:, 1:-1].sum()) == float(x[0:3, 1:3].sum()) == float(x[..., -3:3].sum())
    assert dev.stats()["graphs_built"] == 2


def test_outputs_are_exactly_the_values_still_referenced(dev: Device) -> None:
    x = dev.tensor([1.0, 2.0])
    a = x + 1.0
    b = a * 2.0
    c = b - 1.0
    del a, b
    np.testing.assert_array_equal(c.numpy(), [3.0, 5.0])
    assert dev.stats()["outputs_kept"] == 1


def test_a_value_kept_alive_is_materialized_and_read_without_rerunning(dev: Device) -> None:
    x = dev.tensor([1.0, 2.0])
    a = x + 1.0
    b = a * 2.0
    b.numpy()
    assert dev.stats()["outputs_kept"] == 2
    np.testing.assert_array_equal(a.numpy(), [2.0, 3.0])
    assert dev.stats()["flushes"] == 1


def test_values_saved_for_backward_are_outputs_until_backward_runs(dev: Device) -> None:
    w = dev.tensor([1.0, 2.0])
    w.requires_grad = True
    loss = ((w * 3.0).exp()).sum()
    float(loss)  # flush before backward: exp's output is saved for the backward pass
    kept = dev.stats()["outputs_kept"]
    assert kept == 2
    loss.backward()
    assert w.grad is not None  # set by the backward() above
    np.testing.assert_allclose(w.grad.numpy(), 3.0 * np.exp([3.0, 6.0]), rtol=1e-6)


def test_a_dead_computation_is_not_run(dev: Device) -> None:
    x = dev.tensor([1.0, 2.0])
    bad = x[dev.tensor([7])]  # out of range: would fail if it ran
    del bad
    assert float(x.sum()) == 3.0
    dev.sync()


def test_freed_tensors_release_device_memory(dev: Device) -> None:
    base = dev.memory_stats()["in_use_bytes"]
    x = dev.tensor(np.zeros(1 << 18, dtype="float32"))  # 1 MiB
    y = x + 1.0
    dev.sync()
    assert dev.memory_stats()["in_use_bytes"] >= base + 2 * (1 << 20)
    del x, y
    gc.collect()
    dev.sync()
    assert dev.memory_stats()["in_use_bytes"] <= base + (1 << 16)
    assert dev.memory_stats()["peak_bytes"] >= 2 * (1 << 20)


def test_memory_stats_count_what_was_dropped_without_a_sync(dev: Device) -> None:
    """memory_stats() answers for everything done so far: a tensor deleted just before is gone."""
    base = dev.memory_stats()["in_use_bytes"]
    x = dev.tensor(np.ones(1 << 18, dtype="float32"))  # 1 MiB
    assert float(x.sum()) == float(1 << 18)
    assert dev.memory_stats()["in_use_bytes"] >= base + (1 << 20)
    del x
    gc.collect()
    assert dev.memory_stats()["in_use_bytes"] <= base + (1 << 16)


def test_a_long_recording_flushes_itself(dev: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_module, "MAX_PENDING", 50)
    x = dev.tensor([0.0])
    for _ in range(120):
        x = x + 1.0
    assert dev.stats()["flushes"] == 2
    assert float(x) == 120.0


def test_many_freed_uploads_are_dropped_without_a_read(dev: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_module, "MAX_DROPS", 10)
    base = dev.memory_stats()["in_use_bytes"]
    for _ in range(25):
        dev.tensor(np.zeros(1 << 16, dtype="float32"))
    dev.sync()
    assert dev.memory_stats()["in_use_bytes"] <= base + (1 << 18)


def test_a_parameter_rebound_by_the_optimizer_frees_its_old_buffer(dev: Device) -> None:
    model, opt = _mlp(dev)
    _step(dev, model, opt)
    first = dev.memory_stats()["in_use_bytes"]
    for i in range(5):
        _step(dev, model, opt, seed=i)
    assert dev.memory_stats()["in_use_bytes"] <= first


# -- the canonical graph of a segment (pure) --------------------------------------------------------


def test_build_graph_numbers_inputs_by_first_use_and_drops_dead_nodes() -> None:
    a, b = segment.input_ref(0), segment.input_ref(1)
    k0 = segment.binding_ref(0)
    entries = [
        ("multiply", (b, k0), ()),  # node 0: dead (no output depends on it)
        ("add", (b, a), ()),  # node 1
        ("exp", (1,), ()),  # node 2
    ]
    specs = [("float32", (2,)), ("float64", (2,))]
    built = segment.build_graph(entries, specs, ["float"], [2])
    g = built.graph
    assert g.inputs == (TensorSpec("float64", (2,)), TensorSpec("float32", (2,)))
    assert g.bindings == ()
    assert g.nodes == (Node("add", (0, 1)), Node("exp", (2,)))
    assert g.outputs == (3,)
    assert built.input_slots == (1, 0) and built.binding_slots == ()


def test_build_graph_keeps_slots_unchanged_when_nothing_is_dropped() -> None:
    entries = [("multiply", (segment.input_ref(0), segment.binding_ref(0)), ())]
    built = segment.build_graph(entries, [("float32", (3,))], ["float"], [0])
    assert built.input_slots is None and built.binding_slots is None
    assert built.graph.nodes == (Node("multiply", (0, 1)),)
    assert built.graph.outputs == (2,)
