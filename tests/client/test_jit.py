"""emberlink.jit: a traced step replays with results identical to eager, on every device kind."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest

import emberlink as el
from emberlink import Device
from emberlink.client import device as device_module

nn = el.nn
F = el.nn.functional


def _model(dev: Device) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8, seed=0), nn.ReLU(), nn.Linear(8, 3, seed=1)).to(dev)


def _batches(n: int, batch: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [(rng.standard_normal((batch, 6), dtype=np.float32), rng.integers(0, 3, batch)) for _ in range(n)]


def _params(model: nn.Module) -> list[np.ndarray]:
    return [p.numpy() for p in model.parameters()]


def _train_step(model: nn.Module, opt: Any, x: el.Tensor, y: el.Tensor, lr: float) -> el.Tensor:
    opt.lr = lr
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


OPTIMIZERS: list[tuple[str, Callable[[list[Any]], Any]]] = [
    ("sgd-momentum", lambda ps: el.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("sgd-nesterov", lambda ps: el.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)),
    ("adam", lambda ps: el.optim.Adam(ps, lr=0.01)),
    ("adamw", lambda ps: el.optim.AdamW(ps, lr=0.01, weight_decay=0.1)),
]


@pytest.mark.parametrize(("name", "make_opt"), OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_jitted_training_step_equals_eager_bitwise_step_by_step(
    dev: Device, name: str, make_opt: Callable[[list[Any]], Any]
) -> None:
    eager_model, jit_model = _model(dev), _model(dev)
    eager_opt, jit_opt = make_opt(eager_model.parameters()), make_opt(jit_model.parameters())
    step = el.jit(_train_step)
    for i, (x, y) in enumerate(_batches(6)):
        lr = 0.05 / (1 + i)  # a schedule: a scalar argument that changes every call
        want = _train_step(eager_model, eager_opt, dev.tensor(x), dev.tensor(y), lr)
        got = step(jit_model, jit_opt, dev.tensor(x), dev.tensor(y), lr)
        assert got.numpy().tobytes() == want.numpy().tobytes(), f"loss differs at step {i}"
        for pa, pb in zip(_params(jit_model), _params(eager_model), strict=True):
            np.testing.assert_array_equal(pa, pb)
        for ta, tb in zip(jit_model.parameters(), eager_model.parameters(), strict=True):
            assert ta.grad is not None and tb.grad is not None  # .grad is state too
            np.testing.assert_array_equal(ta.grad.numpy(), tb.grad.numpy())
    assert dev.stats()["jit_replays"] == 4  # calls 3 to 6


def test_replay_records_nothing_and_is_one_executor_call(dev: Device) -> None:
    model = _model(dev)
    opt = el.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = el.jit(_train_step)
    batches = _batches(8)
    for x, y in batches[:4]:  # eager, trace, then a first replay (its batch differs from the trace's)
        float(step(model, opt, dev.tensor(x), dev.tensor(y), 0.1))
    before = dev.stats()
    for x, y in batches[4:]:
        float(step(model, opt, dev.tensor(x), dev.tensor(y), 0.1))
    after = dev.stats()

    def grew(counter: str) -> int:
        return cast(dict[str, int], after)[counter] - cast(dict[str, int], before)[counter]

    for counter in ("nodes_recorded", "graphs_built", "graph_memo_hits", "flushes", "graphs_registered"):
        assert grew(counter) == 0, counter
    assert grew("jit_replays") == 4
    assert grew("graph_replays") == 4
    if "batches_sent" in after:  # remote: the step and its loss read travel as one batch
        assert grew("batches_sent") == 4
        assert grew("batches_repeated") == 4  # each a Repeat of the step before
        assert grew("round_trips") == 4


def test_each_new_signature_runs_eagerly_then_traces(dev: Device) -> None:
    calls: list[int] = []

    @el.jit
    def f(x: el.Tensor, s: float) -> el.Tensor:
        calls.append(1)  # a Python side effect: runs at calls 1 and 2 of a signature only
        return (x * s).sum()

    def run(x: el.Tensor, s: float) -> tuple[float, int]:
        before = len(calls)
        return float(f(x, s)), len(calls) - before

    a = dev.tensor([1.0, 2.0])
    assert [run(a, 2.0) for _ in range(4)] == [(6.0, 1), (6.0, 1), (6.0, 0), (6.0, 0)]
    longer = dev.tensor([1.0, 2.0, 3.0])  # shape
    assert [run(longer, 2.0) for _ in range(3)] == [(12.0, 1), (12.0, 1), (12.0, 0)]
    wide = dev.tensor([1.0, 2.0], dtype="float64")  # dtype
    assert [run(wide, 0.5) for _ in range(3)] == [(1.5, 1), (1.5, 1), (1.5, 0)]
    grad = dev.tensor([1.0, 2.0])
    grad.requires_grad = True  # requires_grad
    assert [run(grad, 1.0) for _ in range(3)] == [(3.0, 1), (3.0, 1), (3.0, 0)]
    assert [run(a, 3) for _ in range(3)] == [(9.0, 1), (9.0, 1), (9.0, 0)]  # scalar kind: int
    # the first signature still replays, and a scalar's value is not part of a signature
    assert [run(a, 5.0) for _ in range(2)] == [(15.0, 0), (15.0, 0)]


def test_beyond_the_signature_bound_calls_run_eagerly_with_one_warning(dev: Device) -> None:
    calls: list[int] = []

    @el.jit(max_signatures=2)
    def f(x: el.Tensor) -> el.Tensor:
        calls.append(1)
        return x + 1.0

    for n in (1, 2):
        for _ in range(3):
            np.testing.assert_array_equal(f(dev.zeros(n)).numpy(), np.ones(n))
    assert len(calls) == 4
    with pytest.warns(RuntimeWarning, match="more than 2 signatures"):
        np.testing.assert_array_equal(f(dev.zeros(3)).numpy(), np.ones(3))
    for _ in range(3):  # eager every time, warned once
        np.testing.assert_array_equal(f(dev.zeros(4)).numpy(), np.ones(4))
    assert len(calls) == 8
    np.testing.assert_array_equal(f(dev.zeros(2)).numpy(), np.ones(2))  # kept ones still replay
    assert len(calls) == 8


@pytest.mark.parametrize(
    "read",
    [
        lambda t: float(t),
        lambda t: t.numpy(),
        lambda t: t.item(),
        lambda t: np.asarray(t),
        lambda t: bool(t > 0),
        lambda t: t.device.sync(),
        lambda t: t.device.memory_stats(),
    ],
    ids=["float", "numpy", "item", "asarray", "bool", "sync", "memory_stats"],
)
def test_reading_a_value_inside_jit_raises_and_says_what_to_do(
    dev: Device, read: Callable[[Any], Any]
) -> None:
    @el.jit
    def f(x: el.Tensor) -> el.Tensor:
        y = x.sum()
        read(y)
        return y

    x = dev.tensor([1.0, 2.0])
    for _ in range(2):  # the first call runs eagerly, under the same rule
        with pytest.raises(
            el.JitError, match=r"inside a function compiled with emberlink.jit.*read it after"
        ):
            f(x)
    assert float(x.sum()) == 3.0  # the device goes on working


def test_reading_an_argument_buffer_inside_jit_raises(dev: Device) -> None:
    @el.jit
    def f(x: el.Tensor) -> el.Tensor:
        if float(x[0]) > 0:  # control flow on a value: cannot be replayed
            return x
        return -x

    with pytest.raises(el.JitError):
        f(dev.tensor([1.0]))
    with pytest.raises(el.JitError):
        f(dev.tensor([1.0]))


def test_a_scalar_argument_changes_results_exactly_as_eager(dev: Device) -> None:
    @el.jit
    def f(x: el.Tensor, scale: float, shift: int) -> el.Tensor:
        return x * scale + shift

    x = dev.tensor(np.linspace(-1, 1, 7, dtype=np.float32))
    for i in range(6):
        scale, shift = 0.1 * (i + 1), -i
        np.testing.assert_array_equal(f(x, scale, shift).numpy(), (x * scale + shift).numpy())
    numpy_scalars: Any = (np.float32(0.7), np.int64(2))  # NumPy scalars are scalar arguments too
    np.testing.assert_array_equal(f(x, *numpy_scalars).numpy(), (x * 0.7 + 2).numpy())
    assert dev.stats()["jit_replays"] == 5


def test_a_scalar_argument_used_as_a_python_number_keys_the_trace_by_value(dev: Device) -> None:
    calls: list[int] = []

    @el.jit
    def f(x: el.Tensor, lr: float) -> el.Tensor:
        calls.append(1)
        return x * (lr * 2.0)  # Python arithmetic: the product would be a constant of the trace

    x = dev.tensor([1.0, 3.0])
    got = [f(x, lr).numpy().tolist() for lr in (0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.5)]
    assert got == [[1.0, 3.0]] * 3 + [[0.5, 1.5]] * 3 + [[1.0, 3.0]]
    assert len(calls) == 4  # 0.5: eager, trace; 0.25: eager, trace; 0.5 again: replay


def test_a_learning_rate_passed_through_the_optimizer_is_a_binding(dev: Device) -> None:
    model = _model(dev)
    opt = el.optim.SGD(model.parameters(), lr=0.1)
    calls: list[int] = []

    @el.jit
    def step(x: el.Tensor, y: el.Tensor, lr: float) -> el.Tensor:
        calls.append(1)
        return _train_step(model, opt, x, y, lr)

    for i, (x, y) in enumerate(_batches(5)):
        step(dev.tensor(x), dev.tensor(y), 0.1 / (i + 1))
    assert len(calls) == 2
    assert type(opt.lr) is not float  # the traced argument is still there after the trace ...
    np.testing.assert_array_equal((dev.tensor([1.0]) * opt.lr).numpy(), [np.float32(opt.lr)])  # ... usable


def test_python_side_effects_run_only_in_the_first_two_calls(dev: Device) -> None:
    log: list[str] = []
    counter = {"n": 0}

    @el.jit
    def f(x: el.Tensor) -> el.Tensor:
        counter["n"] += 1
        log.append("called")
        return x + float(counter["n"])  # a Python number: the value of the trace call is kept

    x = dev.zeros(2)
    assert [f(x).numpy().tolist() for _ in range(4)] == [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    assert log == ["called", "called"]


def test_outputs_carry_no_autograd_history(dev: Device) -> None:
    w = dev.tensor([1.0, 2.0])
    w.requires_grad = True

    @el.jit
    def f(w: el.Tensor) -> tuple[el.Tensor, el.Tensor]:
        y = (w * w).sum()
        return y, w * 3.0

    for _ in range(3):
        y, z = f(w)
        assert not y.requires_grad and not z.requires_grad
        with pytest.raises(RuntimeError, match="does not require grad"):
            y.backward()


def test_gradients_accumulate_across_jitted_calls_as_eager(dev: Device) -> None:
    eager_model, jit_model = _model(dev), _model(dev)

    def accumulate(model: nn.Module, x: el.Tensor, y: el.Tensor) -> el.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # no zero_grad: micro-batches add up in .grad
        return loss

    step = el.jit(accumulate)
    for x, y in _batches(5):
        accumulate(eager_model, dev.tensor(x), dev.tensor(y))
        step(jit_model, dev.tensor(x), dev.tensor(y))
    for a, b in zip(jit_model.parameters(), eager_model.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        np.testing.assert_array_equal(a.grad.numpy(), b.grad.numpy())


def test_result_structure_and_non_tensor_leaves_come_back(dev: Device) -> None:
    @el.jit
    def f(x: el.Tensor, k: int) -> dict[str, Any]:
        return {"sum": x.sum(), "pair": (x * 2.0, [x, "tag"]), "k": k, "none": None}

    for k in range(4):
        x = dev.tensor([1.0, float(k)])
        out = f(x, k)
        assert set(out) == {"sum", "pair", "k", "none"} and out["none"] is None and out["k"] == k
        assert float(out["sum"]) == 1.0 + k
        np.testing.assert_array_equal(out["pair"][0].numpy(), [2.0, 2.0 * k])
        assert isinstance(out["pair"][1], list) and out["pair"][1][1] == "tag"
        np.testing.assert_array_equal(out["pair"][1][0].numpy(), [1.0, float(k)])


def test_the_same_tensor_passed_twice_is_its_own_signature(dev: Device) -> None:
    @el.jit
    def f(a: el.Tensor, b: el.Tensor) -> el.Tensor:
        return a - b

    x = dev.tensor([5.0, 7.0])
    for _ in range(3):
        np.testing.assert_array_equal(f(x, x).numpy(), [0.0, 0.0])
    for _ in range(3):
        np.testing.assert_array_equal(f(x, dev.tensor([1.0, 1.0])).numpy(), [4.0, 6.0])


def test_pending_arguments_and_earlier_work_run_before_a_replay(dev: Device) -> None:
    @el.jit
    def f(x: el.Tensor) -> el.Tensor:
        return x * 10.0

    base = dev.tensor([1.0, 2.0])
    for i in range(4):
        np.testing.assert_array_equal(f(base + float(i)).numpy(), [10.0 * (1 + i), 10.0 * (2 + i)])


def test_a_replay_frees_the_old_state_and_a_tensor_sharing_it_keeps_its_values(dev: Device) -> None:
    """A replay rebinds each parameter to the step's output: the buffer it held before is freed
    (the parameter's own Value takes the new one when nothing else holds it), and a tensor that
    shares the parameter's value from before the step (`detach()`) keeps that value."""
    model = _model(dev)
    opt = el.optim.SGD(model.parameters(), lr=0.5)
    step = el.jit(_train_step)
    data = [(dev.tensor(x), dev.tensor(y)) for x, y in _batches(6)]
    for x, y in data[:3]:  # eager, traced, replayed
        float(step(model, opt, x, y, 0.5))
    dev.sync()
    in_use = dev.memory_stats()["in_use_bytes"]
    first = next(iter(model.parameters()))
    before = first.detach()  # shares the parameter's value: it must not change under it
    values = before.numpy()
    float(step(model, opt, *data[3], 0.5))
    np.testing.assert_array_equal(before.numpy(), values)
    assert not np.array_equal(first.numpy(), values)
    del before
    own = weakref.ref(first._v)  # (a weak reference: holding it would keep the Value from this)
    for x, y in data[4:]:
        float(step(model, opt, x, y, 0.5))
    assert first._v is own()  # nothing else held it: no Value made a step
    dev.sync()
    assert dev.memory_stats()["in_use_bytes"] == in_use  # every step's old state freed
    eager_model = _model(dev)
    eager_opt = el.optim.SGD(eager_model.parameters(), lr=0.5)
    for x, y in data:
        float(_train_step(eager_model, eager_opt, x, y, 0.5))
    for pa, pb in zip(_params(model), _params(eager_model), strict=True):
        np.testing.assert_array_equal(pa, pb)


def test_captured_state_is_read_at_every_replay(dev: Device) -> None:
    model = _model(dev)

    @el.jit
    def predict(x: el.Tensor) -> el.Tensor:
        out: el.Tensor = model(x)
        return out

    x = dev.tensor(_batches(1)[0][0])
    for i in range(4):
        for p in model.parameters():
            p.assign(np.full(p.shape, 0.1 * i, dtype=np.float32))  # changed outside the function
        want = model(x).numpy()
        np.testing.assert_array_equal(predict(x).numpy(), want)


def test_a_random_op_with_a_constant_seed_warns_and_a_seed_argument_does_not(dev: Device) -> None:
    drop = nn.Dropout(0.5, seed=3)

    @el.jit
    def fixed(x: el.Tensor) -> el.Tensor:
        out: el.Tensor = drop(x)
        return out

    @el.jit
    def seeded(x: el.Tensor, seed: int) -> el.Tensor:
        return F.dropout(x, 0.5, seed=seed)

    x = dev.ones(64)
    fixed(x)
    with pytest.warns(RuntimeWarning, match="constant seed"):
        fixed(x)
    masks = [seeded(x, s).numpy() for s in range(4)]
    for s, mask in enumerate(masks):
        np.testing.assert_array_equal(mask, F.dropout(x, 0.5, seed=s).numpy())
    assert not np.array_equal(masks[2], masks[3])


def test_flush_by_size_is_held_back_while_tracing(dev: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_module, "MAX_PENDING", 4)

    @el.jit
    def f(x: el.Tensor) -> el.Tensor:
        for _ in range(10):
            x = x * 1.5 + 1.0
        return x

    want = np.array([1.0, 2.0], dtype=np.float32)
    for _ in range(10):
        want = want * np.float32(1.5) + np.float32(1.0)
    for _ in range(3):
        np.testing.assert_array_equal(f(dev.tensor([1.0, 2.0])).numpy(), want)
    assert dev.stats()["jit_replays"] == 1


def test_a_function_without_tensor_arguments_traces_its_captured_device(dev: Device) -> None:
    state = dev.tensor([0.0, 0.0])
    pending = state + 5.0  # recorded before the calls: must not become part of the trace

    @el.jit
    def bump(amount: float) -> el.Tensor:
        state._v = (state + dev.full((2,), amount))._v  # in-place state, as optimizers do
        return state * 1.0

    outs = [bump(float(i)).numpy().tolist() for i in range(1, 5)]
    assert outs == [[1.0, 1.0], [3.0, 3.0], [6.0, 6.0], [10.0, 10.0]]
    assert pending.numpy().tolist() == [5.0, 5.0]


def test_nested_jitted_functions_run_inside_the_outer_trace(dev: Device) -> None:
    @el.jit
    def inner(x: el.Tensor) -> el.Tensor:
        return x * 2.0

    @el.jit
    def outer(x: el.Tensor) -> el.Tensor:
        return inner(x) + 1.0

    for i in range(4):
        np.testing.assert_array_equal(outer(dev.tensor([float(i)])).numpy(), [2.0 * i + 1.0])


def test_a_jitted_method_binds_its_instance(dev: Device) -> None:
    class Scaler:
        def __init__(self, k: float) -> None:
            self.k = k

        @el.jit
        def apply(self, x: el.Tensor) -> el.Tensor:
            return x * self.k

    a, b = Scaler(2.0), Scaler(3.0)
    x = dev.tensor([1.0])
    for _ in range(3):
        assert float(a.apply(x)) == 2.0 and float(b.apply(x)) == 3.0


def test_a_jitted_function_on_a_closed_device_raises(device_factory: Callable[[], Device]) -> None:
    dev = device_factory()
    f = el.jit(lambda x: x + 1.0)
    x = dev.tensor([1.0])
    for _ in range(3):
        f(x)
    dev.close()
    with pytest.raises(el.DeviceError, match="closed"):
        f(x)


def test_tensors_on_several_devices_raise(dev: Device) -> None:
    cpu = Device.cpu()
    try:
        f = el.jit(lambda a, b: a + b)
        with pytest.raises(el.JitError, match="several devices"):
            f(dev.tensor([1.0]), cpu.tensor([1.0]))
        other = cpu.tensor([2.0])
        g = el.jit(lambda a: a.sum() + other.sum())
        with pytest.raises(el.JitError, match="one device"):
            g(dev.tensor([1.0]))
    finally:
        cpu.close()


def test_an_unhashable_argument_is_a_type_error_that_names_the_fix(dev: Device) -> None:
    f = el.jit(lambda x: x)
    with pytest.raises(TypeError, match=r"ndarray.*dev.tensor\(array\)"):
        f(np.ones(3))
    with pytest.raises(TypeError, match="set"):
        f({1, 2})


def test_a_tensor_argument_gets_its_own_gradient_at_every_call(dev: Device) -> None:
    w = dev.tensor([[1.0, -2.0], [0.5, 3.0]])

    def saliency(x: el.Tensor) -> el.Tensor:
        loss = (x @ w).square().sum()
        loss.backward()
        return loss

    step = el.jit(saliency)
    for i in range(4):
        x, ref = dev.tensor([[float(i), 1.0]]), dev.tensor([[float(i), 1.0]])
        x.requires_grad = ref.requires_grad = True
        step(x)
        saliency(ref)
        assert x.grad is not None and ref.grad is not None
        np.testing.assert_array_equal(x.grad.numpy(), ref.grad.numpy())


def test_accumulating_into_a_tensor_arguments_grad_is_refused(dev: Device) -> None:
    @el.jit
    def f(x: el.Tensor) -> el.Tensor:
        loss = (x * x).sum()
        loss.backward()
        return loss

    x = dev.tensor([1.0, 2.0])
    x.requires_grad = True
    f(x)  # .grad None: eager
    f(x)  # .grad set: another signature, eager
    with pytest.raises(el.JitError, match=r"\.grad of tensor argument 0"):
        f(x)  # its trace would add into this tensor's .grad


def test_keyword_arguments_are_part_of_the_signature(dev: Device) -> None:
    @el.jit
    def f(x: el.Tensor, *, scale: float = 1.0, bias: el.Tensor | None = None) -> el.Tensor:
        return x * scale if bias is None else x * scale + bias

    x, b = dev.tensor([1.0, 2.0]), dev.tensor([10.0, 20.0])
    for i in range(3):
        np.testing.assert_array_equal(f(x, scale=float(i)).numpy(), [1.0 * i, 2.0 * i])
        np.testing.assert_array_equal(f(x, scale=float(i), bias=b).numpy(), [10.0 + i, 20.0 + 2 * i])


def test_state_replaced_by_a_new_tensor_object_is_refused(dev: Device) -> None:
    class Average:
        def __init__(self) -> None:
            self.value = dev.zeros(2)

    avg = Average()

    @el.jit
    def update(x: el.Tensor) -> el.Tensor:
        avg.value = avg.value * 0.5 + x  # a new object: a replay would keep reading the old one
        return avg.value

    update(dev.ones(2))
    with pytest.raises(el.JitError, match="replaced by a new Tensor object"):
        update(dev.ones(2))


# -- pending work folded into a call's graph --------------------------------------------------------------


def _executes(dev: Device) -> int:
    stats = dev.stats()
    return int(stats["graphs_registered"]) + int(stats["graph_replays"])


def _runs(dev: Device, f: Callable[..., el.Tensor], *args: el.Tensor) -> tuple[list[float], int]:
    """What `f(*args)` returns, read, and how many graphs ran for it (`args` are pending work)."""
    before = _executes(dev)
    out = f(*args).numpy().tolist()
    return out, _executes(dev) - before


def test_a_pending_argument_and_its_work_run_as_one_graph_with_its_bindings(dev: Device) -> None:
    f = el.jit(lambda x: x * 10.0)
    base = dev.tensor([1.0, 2.0])
    got = [_runs(dev, f, base + float(i)) for i in range(5)]  # a new binding each call
    assert [v for v, _ in got] == [[10.0 * (1 + i), 10.0 * (2 + i)] for i in range(5)]
    assert [n for _, n in got[2:]] == [1, 1, 1]  # replays: `base + i` and `* 10` one graph
    assert dev.stats()["pending_nodes"] == 0


def test_pending_arguments_passed_in_another_order_are_bound_where_they_are_passed(dev: Device) -> None:
    f = el.jit(lambda a, b: a - b * 2.0)
    for i in range(6):
        p, q = dev.tensor([1.0]) + float(i), dev.tensor([100.0]) + 0.0  # recorded in this order
        args = (p, q) if i % 2 == 0 else (q, p)
        want = [1.0 + i - 200.0] if i % 2 == 0 else [100.0 - 2.0 * (1.0 + i)]
        assert f(*args).numpy().tolist() == want, i


@pytest.mark.parametrize("first", ["read", "other"])
def test_state_the_function_reads_that_is_pending_too_runs_first(dev: Device, first: str) -> None:
    """Eager updates of the state the function reads (`read`) or of other state with the same
    structure (`other`) are pending work like the argument's; the results follow the state read."""
    read, other = nn.Linear(2, 2, seed=0).to(dev), nn.Linear(2, 2, seed=1).to(dev)
    opts = {id(m): el.optim.SGD(m.parameters(), lr=0.1) for m in (read, other)}
    f = el.jit(lambda x: read(x))
    order = [read, other] if first == "read" else [other, read]
    for i in range(6):
        updated = order[i % 2]
        F.mse_loss(updated(dev.tensor(np.ones((1, 2), np.float32))), dev.zeros((1, 2))).backward()
        opts[id(updated)].step()  # the new parameters are pending
        opts[id(updated)].zero_grad()
        x = np.array([[1.0, -2.0]], np.float32)
        got = f(dev.tensor(x) * 1.0).numpy()
        assert got.tobytes() == read(dev.tensor(x)).numpy().tobytes(), i


def test_a_pending_argument_that_requires_grad_runs_its_work_first(dev: Device) -> None:
    w = dev.tensor([1.0, 2.0])
    w.requires_grad = True
    f = el.jit(lambda x: (x * x).sum())
    for i in range(4):
        got, runs = _runs(dev, f, w * float(i + 1))  # pending, with autograd history
        assert got == pytest.approx(5.0 * (i + 1) ** 2)
        if i >= 2:
            assert runs == 2  # the pending work's own graph, then the replay


def test_pending_work_of_more_structures_than_the_bound_runs_first_and_stays_exact(dev: Device) -> None:
    f = el.jit(lambda x: x * 3.0, max_signatures=1)
    base = dev.tensor([1.0, 2.0])
    runs = []
    for i in range(8):
        x = base + 1.0 if i % 2 == 0 else (base * 2.0) - 1.0  # two structures of pending work
        got, n = _runs(dev, f, x)
        assert got == ([6.0, 9.0] if i % 2 == 0 else [3.0, 9.0]), i
        runs.append(n)
    # The structure of the second call (which traced) is folded; the other, past the bound of one,
    # runs as its own graph before the plain replay.
    assert runs[4:] == [2, 1, 2, 1]
