"""Captured CUDA graphs against the eager CuPy path they replace (GPU machine only, with nvmath-python).

The eager path is the reference: every op case, an MLP step, dropout and new bindings give the
same values captured as eager; captured memory is charged, shown and freed with its plan and its
session.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import emberlink as el
from emberlink.graph_replay.capture import HOST_CHECKED_OPS
from emberlink.graph_replay.captured import CAPTURE_ENV, Captures, open_captures
from emberlink.graph_replay.cuda_graph import CapturedPlan
from emberlink.graph_replay.ir import AttrValue, Graph, Node, TensorSpec
from emberlink.graph_replay.nvmath_matmul import WORKSPACE_BYTES
from emberlink.graph_replay.ops import check_attrs
from emberlink.graph_replay.plan import Plan, compile_plan

from ..training import train_steps
from .cases import CASE_IDS, CASES, Case, assert_close
from .graphs import Builder, mlp_inputs, mlp_step

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend() -> Any:
    pytest.importorskip("nvmath")
    from emberlink.graph_replay.cupy_backend import CupyBackend

    return CupyBackend()


@pytest.fixture
def captures(backend: Any) -> Iterator[Captures]:
    caps = open_captures(backend)
    assert caps is not None, "capture should serve a CuPy backend with nvmath-python installed"
    yield caps
    caps.close()


def _numpy(backend: Any, outs: list[Any]) -> list[np.ndarray]:
    backend.synchronize()
    return [backend.to_numpy(o) for o in outs]


def _other(a: np.ndarray) -> np.ndarray:
    """Different values of the same spec (reversed), still in any op's domain where `a` is."""
    return np.ascontiguousarray(a.reshape(-1)[::-1].reshape(a.shape))


def _three_runs(
    backend: Any, caps: Captures, plan: Plan, inputs: list[np.ndarray], bindings: list[Any]
) -> Any:
    """Eager and capturing runs on other inputs, then a replay on `inputs`: the replay's outputs."""
    other = [backend.from_numpy(_other(a)) for a in inputs]
    caps.run(plan, other, bindings)  # eager
    caps.run(plan, other, bindings)  # captures
    return _numpy(backend, caps.run(plan, [backend.from_numpy(a) for a in inputs], bindings))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_op_case_gives_the_same_values_captured_as_eager(
    backend: Any, captures: Captures, case: Case
) -> None:
    plan = case.plan()
    (got,) = _three_runs(backend, captures, plan, case.inputs(), case.bindings())
    (want,) = _numpy(
        backend, backend.run(case.plan(), [backend.from_numpy(a) for a in case.inputs()], case.bindings())
    )
    # Indices given on the device are checked by the eager path alone (see the host-index test below).
    assert captures.captured(plan) is (case.op not in HOST_CHECKED_OPS)
    if case.op == "matmul":  # cuBLAS through nvmath, with CuPy's algorithm choice: rounding may differ
        assert_close(got, want, case.id)
    else:
        np.testing.assert_array_equal(got, want, err_msg=case.id)


def test_an_mlp_step_captured_replays_the_eager_values_step_after_step(
    backend: Any, captures: Captures
) -> None:
    graph = mlp_step(batch=128, sizes=(784, 512, 10))
    inputs, bindings = mlp_inputs(graph)
    plan, eager_plan = compile_plan(graph), compile_plan(graph)
    ins_c = [backend.from_numpy(a) for a in inputs]
    ins_e = list(ins_c)
    for step in range(6):  # eager, capture, four replays; the new parameters fed back each time
        outs_c = captures.run(plan, ins_c, bindings)
        outs_e = backend.run(eager_plan, ins_e, bindings)
        for g, w in zip(_numpy(backend, outs_c), _numpy(backend, outs_e), strict=True):
            assert_close(g, w, f"mlp step {step}", loose=True)
        ins_c = [ins_c[0], *outs_c[1:5], ins_c[5]]
        ins_e = [ins_e[0], *outs_e[1:5], ins_e[5]]
    assert captures.captured(plan) and captures.replays == 4


@pytest.mark.parametrize("one_graph", [True, False], ids=["event-inside-one-graph", "two-graphs"])
def test_a_split_steps_later_outputs_keep_their_values_whether_held_for_steps_or_let_go_at_once(
    backend: Any, captures: Captures, one_graph: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training step is cut after its loss: one graph records the loss's event between its two
    parts (or, where the driver cannot, two graphs, the second one's outputs made while the first
    runs). Its outputs (the parameters) are in arrays the replay takes again once nothing holds
    them. Fed back step after step and held for none to four more steps (or to the end), each
    step's outputs are the eager step's, and a held one is never overwritten by a later step."""
    from emberlink.graph_replay.cuda_graph import capturer_for

    if not one_graph:
        monkeypatch.setattr(capturer_for(backend), "record_node", None)
    graph = mlp_step(batch=128, sizes=(784, 512, 10))
    inputs, bindings = mlp_inputs(graph)
    plan, eager_plan = compile_plan(graph), compile_plan(graph)
    ins_c = [backend.from_numpy(a) for a in inputs]
    ins_e = list(ins_c)
    held: list[tuple[int, int, list[Any]]] = []  # (step, let go after this step, its outputs)
    kept: list[tuple[int, list[Any], list[np.ndarray]]] = []  # held to the end, with their values
    for step in range(16):  # eager, capture, 14 replays
        outs_c = captures.run(plan, ins_c, bindings)
        outs_e = backend.run(eager_plan, ins_e, bindings)
        want = _numpy(backend, outs_e)
        for g, w in zip(_numpy(backend, outs_c), want, strict=True):
            assert_close(g, w, f"mlp step {step}", loose=True)
        if step % 7 == 3:
            kept.append((step, outs_c, want))
        else:
            held.append((step, step + step % 5, outs_c))
        held = [h for h in held if h[1] > step]
        ins_c = [ins_c[0], *outs_c[1:5], ins_c[5]]
        ins_e = [ins_e[0], *outs_e[1:5], ins_e[5]]
        del outs_c, outs_e
    assert captures.captured(plan) and captures.replays == 14
    captured = captures._entries[id(plan)].captured
    assert isinstance(captured, CapturedPlan) and captured.split, "a training step splits after its loss"
    assert captured.graphs == (1 if one_graph else 2)
    for step, outs, want in kept:
        for g, w in zip(_numpy(backend, outs), want, strict=True):
            assert_close(g, w, f"mlp step {step}, held to the end", loose=True)


@pytest.mark.parametrize("one_graph", [True, False], ids=["event-inside-one-graph", "two-graphs"])
def test_a_large_output_made_before_the_cut_comes_out_at_the_end_with_the_eager_values(
    backend: Any, captures: Captures, one_graph: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that gathers its batch in its own graph (the resident loader's take, folded into a
    jitted step) makes the batch, an output over EARLY_BYTES, before its loss: the loss comes out
    early, the batch at the end with the rest, each replay with the eager values."""
    from emberlink.graph_replay import capture as cap
    from emberlink.graph_replay.cuda_graph import capturer_for

    if not one_graph:
        monkeypatch.setattr(capturer_for(backend), "record_node", None)
    f32 = "float32"
    g = Builder(
        [
            TensorSpec(f32, (4096, 32)),
            TensorSpec("int64", (4096,)),
            TensorSpec("int32", (1024,)),
            TensorSpec(f32, (32, 10)),
        ],
        ["float"],
    )
    data_x, data_y, idx, w, lr = range(5)
    x = g.add("take", data_x, idx, axis=0)  # 128 KiB
    y = g.add("take", data_y, idx, axis=0)
    z = g.add("matmul", x, w)
    loss = g.add("cross_entropy", z, y)
    # After the cut, work a backend cannot fuse away (the gradient's matmuls, as a real step has).
    xt = g.add("permute_dims", x, axes=(1, 0))
    new_w = w
    for _ in range(4):
        grad = g.add("matmul", xt, g.add("softmax", g.add("matmul", x, new_w), axis=1))
        new_w = g.add("subtract", new_w, g.add("multiply", grad, lr))
    graph = g.graph([x, y, loss, new_w])
    plan, eager_plan = compile_plan(graph), compile_plan(graph)
    split = cap.early_split(plan)
    assert split is not None and loss in split.outputs and x not in split.outputs
    rng = np.random.default_rng(21)
    dx = backend.from_numpy(rng.standard_normal((4096, 32)).astype(np.float32))
    dy = backend.from_numpy(rng.integers(0, 10, 4096))
    weight = backend.from_numpy(rng.standard_normal((32, 10)).astype(np.float32))
    for step in range(6):  # eager, capture, four replays, each on other rows
        rows = rng.integers(0, 4096, 1024).astype(np.int32)
        outs_c = captures.run(plan, [dx, dy, rows, weight], [0.1])
        outs_e = backend.run(eager_plan, [dx, dy, backend.from_numpy(rows), weight], [0.1])
        for got, want in zip(_numpy(backend, outs_c), _numpy(backend, outs_e), strict=True):
            assert_close(got, want, f"step {step}", loose=True)
    captured = captures._entries[id(plan)].captured
    assert isinstance(captured, CapturedPlan) and captured.split and captures.replays == 4


_SPIN = r"""
extern "C" __global__ void emberlink_test_spin(volatile int* flag) {
    // Holds its stream until flag[0] is set, or gives up after 5 s and says so in flag[1] (so a
    // read that waits for the stream fails the test rather than hanging it).
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        if (flag[0] != 0) return;
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < 5000000000ULL);
    flag[1] = 1;
}
"""


def test_a_replayed_steps_loss_is_readable_while_later_work_on_its_stream_waits(
    backend: Any, captures: Captures
) -> None:
    """The loss of a captured training step is copied out by the first of its two graphs: a read
    (async, and blocking from another thread) finishes while a kernel queued after the replay
    holds the stream, which a read queued behind the whole step could not."""
    import threading

    import cupy

    graph = mlp_step(batch=128, sizes=(784, 512, 10))
    inputs, bindings = mlp_inputs(graph)
    plan = compile_plan(graph)
    ins = [backend.from_numpy(a) for a in inputs]
    (want,) = _numpy(backend, backend.run(compile_plan(graph), ins, bindings)[:1])
    for _ in range(2):  # eager, capture
        captures.run(plan, ins, bindings)
    # Everything the reads and the release use exists before the stream is held (first uses can
    # allocate page-locked memory or load modules, which may wait for the device to go idle).
    outs = captures.run(plan, ins, bindings)
    backend.to_numpy_async(outs[0]).result()
    backend.to_numpy(outs[0])
    flag = cupy.zeros(2, np.int32)
    one = cupy.cuda.alloc_pinned_memory(4)
    np.frombuffer(one, np.int32, 1)[0] = 1
    release = cupy.cuda.Stream(non_blocking=True)
    spin = cupy.RawKernel(_SPIN, "emberlink_test_spin")
    backend.synchronize()
    outs = captures.run(plan, ins, bindings)
    assert captures.replays == 2
    spin((1,), (1,), (flag,))  # holds the stream after the replay
    got: list[np.ndarray] = []
    try:
        read = backend.to_numpy_async(outs[0])
        threading.Thread(target=lambda: got.append(backend.to_numpy(outs[0])), daemon=True).start()
        _wait_until(lambda: read.done() and len(got) == 1)
    finally:  # let the stream go, from beside it (a copy: no kernel, no module to load)
        runtime = cupy.cuda.runtime
        runtime.memcpyAsync(flag.data.ptr, one.ptr, 4, runtime.memcpyHostToDevice, release.ptr)
        backend.synchronize()
    assert int(flag[1]) == 0, "the reads finished only once the kernel holding the stream gave up"
    for value in (read.result(), got[0]):
        assert_close(value, want, "the early loss", loose=True)
    for g, w in zip(_numpy(backend, outs), _numpy(backend, backend.run(compile_plan(graph), ins, bindings))):
        assert_close(g, w, "the step's outputs", loose=True)


def test_each_replayed_steps_loss_reads_as_its_own_value_however_late_it_is_read(
    backend: Any, captures: Captures
) -> None:
    """The first graph writes the loss into a host copy that a later call staged in the same
    buffer overwrites: losses read one step late, after four more steps and never in order all
    give their own step's value, blocking and async."""
    graph = mlp_step(batch=128, sizes=(784, 512, 10))
    inputs, bindings = mlp_inputs(graph)
    plan = compile_plan(graph)
    ins = [backend.from_numpy(a) for a in inputs]
    rng = np.random.default_rng(5)
    losses, want = [], []
    for step in range(8):  # eager, capture, six replays, each on its own batch
        x = backend.from_numpy(rng.standard_normal(inputs[0].shape).astype(np.float32))
        outs = captures.run(plan, [x, *ins[1:]], bindings)
        (expected,) = _numpy(backend, backend.run(compile_plan(graph), [x, *ins[1:]], bindings)[:1])
        losses.append(outs[0])
        want.append(expected)
        if step >= 3:  # one step late, as a loop reading the last step's loss does
            assert_close(backend.to_numpy(losses[step - 1]), want[step - 1], f"step {step - 1}", loose=True)
    assert captures.replays == 6
    reads = [backend.to_numpy_async(loss) for loss in losses]
    for step in (7, 2, 5, 3, 6, 4):
        assert_close(backend.to_numpy(losses[step]), want[step], f"step {step}, read late", loose=True)
        assert_close(reads[step].result(), want[step], f"step {step}, async", loose=True)


def test_new_binding_values_reach_a_replay(backend: Any, captures: Captures) -> None:
    """A learning rate and an offset that change every call, in a fused chain and a plain op."""
    full: dict[str, AttrValue] = {"shape": (3,), "dtype": "float64"}
    nodes = (Node("multiply", (0, 1)), Node("add", (3, 2)), Node("full", (2,), check_attrs("full", full)))
    graph = Graph((TensorSpec("float32", (1000,)),), ("float", "float"), nodes, (4, 5))
    plan, eager = compile_plan(graph), compile_plan(graph)
    x = backend.from_numpy(np.linspace(-1, 1, 1000, dtype=np.float32))
    for k, (lr, off) in enumerate([(0.1, 1.0), (0.2, 2.0), (0.3, -3.5), (1e-3, 7.0)]):
        got = _numpy(backend, captures.run(plan, [x], [lr, off]))
        want = _numpy(backend, backend.run(eager, [x], [lr, off]))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"call {k}")
        np.testing.assert_array_equal(got[1], np.full(3, off))
    assert captures.captured(plan)


def test_a_binding_equal_to_the_last_but_of_another_sign_or_object_reaches_a_replay(
    backend: Any, captures: Captures
) -> None:
    """Equal binding values (new objects, as a worker decodes them) reuse the staged slots; a zero
    of the other sign (0.0 == -0.0) does not: the product's sign bits are the eager ones."""
    nodes = (Node("multiply", (0, 1)),)
    graph = Graph((TensorSpec("float32", (8,)),), ("float",), nodes, (2,))
    plan, eager = compile_plan(graph), compile_plan(graph)
    x = backend.from_numpy(np.linspace(1, 2, 8, dtype=np.float32))
    for k, value in enumerate([0.0, float("0.0"), -0.0, float("-0.0"), 0.0, float("1.5"), 1.5, -0.0]):
        (got,) = _numpy(backend, captures.run(plan, [x], [value]))
        (want,) = _numpy(backend, backend.run(eager, [x], [value]))
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want), err_msg=f"call {k}: {value!r}")
        np.testing.assert_array_equal(got, want, err_msg=f"call {k}: {value!r}")
    assert captures.replays == 6


def test_a_binding_equal_to_the_last_but_of_a_type_the_graph_refuses_fails_as_on_the_eager_path(
    backend: Any, captures: Captures
) -> None:
    """A replay checks its bindings again unless they are the last call's, type included: True
    equals 1, but an int binding given as a bool fails as the eager path fails it."""
    graph = Graph((TensorSpec("float32", (8,)),), ("int",), (Node("add", (0, 1)),), (2,))
    plan, eager = compile_plan(graph), compile_plan(graph)
    x = backend.from_numpy(np.linspace(1, 2, 8, dtype=np.float32))
    for _ in range(3):  # eager, capture, replay
        captures.run(plan, [x], [1])
    with pytest.raises(el.errors.ExecutionError, match="binding 0 must be a Python int") as eager_error:
        backend.run(eager, [x], [True])
    with pytest.raises(el.errors.ExecutionError) as replay_error:
        captures.run(plan, [x], [True])
    assert str(replay_error.value) == str(eager_error.value)
    for value in (1, 2, 2):
        (got,) = _numpy(backend, captures.run(plan, [x], [value]))
        (want,) = _numpy(backend, backend.run(eager, [x], [value]))
        np.testing.assert_array_equal(got, want, err_msg=f"binding {value}")
    assert captures.captured(plan) and captures.replays == 4


def test_host_and_device_inputs_reach_a_replay_whichever_kind_it_was_captured_with(
    backend: Any, captures: Captures
) -> None:
    """Input 0 is captured from host memory (staged, uploaded by the graph), input 1 from the
    device (gathered by the graph's copy kernel); later calls bring each as either kind."""
    graph = Graph(
        (TensorSpec("float32", (3, 5)), TensorSpec("float32", (5,))), (), (Node("add", (0, 1)),), (2,)
    )
    plan, eager = compile_plan(graph), compile_plan(graph)
    rng = np.random.default_rng(3)

    def pair() -> tuple[np.ndarray, np.ndarray]:
        return rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32)

    dev = backend.from_numpy
    for k, kinds in enumerate(["hd", "hd", "hd", "dd", "hh", "dh"]):
        a, b = pair()
        ins = [a if kinds[0] == "h" else dev(a), b if kinds[1] == "h" else dev(b)]
        (got,) = _numpy(backend, captures.run(plan, ins, []))
        (want,) = _numpy(backend, backend.run(eager, [dev(a), dev(b)], []))
        np.testing.assert_array_equal(got, want, err_msg=f"call {k} ({kinds})")
    assert captures.captured(plan) and captures.replays == 4


def test_a_device_input_passed_again_or_replaced_at_the_same_address_gives_its_own_values(
    backend: Any, captures: Captures
) -> None:
    """A replay does not copy a device input its fixed buffer already holds (the same array as the
    last launch's); a new array is copied, also one the pool put where a dead one was."""
    graph = Graph((TensorSpec("float32", (1000,)),), (), (Node("exp", (0,)),), (1,))
    plan, eager = compile_plan(graph), compile_plan(graph)
    rng = np.random.default_rng(11)
    x = backend.from_numpy(rng.standard_normal(1000).astype(np.float32))
    for k in range(4):  # eager, capture, replays of the same array
        (got,) = _numpy(backend, captures.run(plan, [x], []))
        (want,) = _numpy(backend, backend.run(eager, [x], []))
        np.testing.assert_array_equal(got, want, err_msg=f"call {k}")
    address = x.data.ptr
    reused = False
    calls = 0
    # Where the pool puts a new array depends on its free blocks, which earlier tests left: new
    # arrays until one lands where the dead one was (at least four).
    while calls < 4 or not reused and calls < 32:
        del x
        x = backend.from_numpy(rng.standard_normal(1000).astype(np.float32))
        reused |= x.data.ptr == address
        address = x.data.ptr
        (got,) = _numpy(backend, captures.run(plan, [x], []))
        (want,) = _numpy(backend, backend.run(eager, [x], []))
        np.testing.assert_array_equal(got, want, err_msg=f"new array {calls}")
        calls += 1
    assert reused, "the pool never reused the dead input's memory: the case this test is for did not occur"
    assert captures.replays == 2 + calls


def test_a_replays_result_is_never_overwritten_while_it_or_its_memory_is_held(
    backend: Any, captures: Captures
) -> None:
    """Later replays give their results in the memory of earlier ones that nothing holds any
    more; a result held as itself, through a view, or through its memory alone keeps its values."""
    import cupy

    graph = Graph((TensorSpec("float32", (1000,)),), (), (Node("exp", (0,)),), (1,))
    plan, eager = compile_plan(graph), compile_plan(graph)
    rng = np.random.default_rng(13)
    held: list[tuple[int, Any]] = []
    want = []
    for k in range(17):  # eager, capture, 15 replays
        a = rng.standard_normal(1000).astype(np.float32)
        (out,) = captures.run(plan, [backend.from_numpy(a)], [])
        (expected,) = _numpy(backend, backend.run(eager, [backend.from_numpy(a)], []))
        want.append(expected)
        kind = k % 5
        if kind == 0:
            held.append((k, out))  # the result itself
        elif kind == 1:
            held.append((k, out[1:]))  # a view of it
        elif kind == 2:
            held.append((k, cupy.ndarray(out.shape, out.dtype, memptr=out.data)))  # its memory pointer
        elif kind == 3:
            held.append((k, cupy.ndarray((999,), out.dtype, memptr=out.data + 4)))  # its memory
        else:  # read, then dropped: its memory is free for a later replay's result
            np.testing.assert_array_equal(backend.to_numpy(out), expected, err_msg=f"call {k}")
        del out
    assert captures.replays == 15
    backend.synchronize()
    for k, array in held:
        got = cupy.asnumpy(array)
        np.testing.assert_array_equal(got, want[k][-got.size :], err_msg=f"call {k}, held as kind {k % 5}")


def test_a_large_batch_on_a_cuda_device_is_staged_in_page_locked_memory() -> None:
    pytest.importorskip("nvmath")
    import cupy

    rng = np.random.default_rng(12)
    data = rng.standard_normal((256, 128)).astype(np.float32)  # 128 KiB: over PINNED_UPLOAD_BYTES
    w = rng.standard_normal((128, 4)).astype(np.float32)
    with el.Device.cuda(0) as dev:
        weight = dev.tensor(w)
        for k in range(4):  # eager, capture, replays: each batch read by the graph where it lies
            batch = data * np.float32(k + 1)
            x = dev.tensor(batch)
            stored = dev._executor._store[x._v.buf]  # type: ignore[attr-defined]
            pointer = cupy.cuda.runtime.pointerGetAttributes(stored.ctypes.data)
            assert isinstance(stored, np.ndarray) and pointer.type == 1  # cudaMemoryTypeHost
            batch[...] = 0  # the tensor holds its own copy
            got = (x @ weight).numpy()
            np.testing.assert_allclose(got, (data * np.float32(k + 1)) @ w, rtol=1e-4, atol=1e-4)
        assert dev.stats()["captured_replays"] == 2


def test_on_a_cuda_device_data_uploaded_once_moves_to_the_gpu_when_a_second_replay_reads_it() -> None:
    """Batches uploaded beforehand end up on the GPU, as PyTorch keeps resident data (not copied
    in from page-locked memory by every replay); a take's indices, checked on the host before each
    replay, stay in host memory, so the plan stays captured."""
    pytest.importorskip("nvmath")
    import cupy

    data = np.random.default_rng(13).standard_normal((256, 256)).astype(np.float32)  # page-locked
    rows = np.arange(0, 256, 2, dtype=np.int32)

    @el.jit
    def gathered(x: el.Tensor, idx: el.Tensor) -> el.Tensor:
        return (x.take(idx, axis=0) * 2.0).sum(axis=0)

    with el.Device.cuda(0) as dev:
        x, idx = dev.tensor(data), dev.tensor(rows)
        store = dev._executor._store  # type: ignore[attr-defined]
        for _ in range(6):
            got = gathered(x, idx).numpy()
            np.testing.assert_allclose(got, (data[rows] * 2.0).sum(axis=0), rtol=1e-5, atol=1e-4)
        assert isinstance(store[x._v.buf], cupy.ndarray)
        assert isinstance(store[idx._v.buf], np.ndarray)
        assert dev.stats()["captured_replays"] >= 3


def test_a_take_of_uploaded_indices_is_captured_and_checked_on_the_host(
    backend: Any, captures: Captures
) -> None:
    """DataLoader's resident batches: take(data, idx) with idx uploaded each call. A replay gives
    the eager rows; an index out of range fails as the eager take fails, and the capture stays."""
    take = Node("take", (0, 1), check_attrs("take", {"axis": 0}))
    graph = Graph((TensorSpec("float32", (50, 7)), TensorSpec("int32", (16,))), (), (take,), (2,))
    plan = compile_plan(graph)
    data = np.arange(350, dtype=np.float32).reshape(50, 7)
    on_device = backend.from_numpy(data)
    rng = np.random.default_rng(5)
    for k in range(5):
        idx = rng.integers(-50, 50, 16).astype(np.int32)
        (got,) = _numpy(backend, captures.run(plan, [on_device, idx], []))
        np.testing.assert_array_equal(got, data[idx], err_msg=f"call {k}")
    assert captures.captured(plan) and captures.replays == 3
    bad = np.zeros(16, np.int32)
    bad[3] = 50
    with pytest.raises(el.errors.ExecutionError, match="out of range"):
        captures.run(plan, [on_device, bad], [])
    assert captures.captured(plan)


def test_pinned_host_inputs_and_back_to_back_replays_give_the_eager_values(
    backend: Any, captures: Captures
) -> None:
    """Calls staged while earlier launches still run (no read in between), with the batch in
    pinned memory (read by the graph where it lies) or in ordinary memory."""
    cupyx = pytest.importorskip("cupyx")

    graph = Graph(
        (TensorSpec("float32", (256, 64)), TensorSpec("float32", (64,))),
        ("float",),
        (Node("multiply", (0, 2)),),
        (3,),
    )
    graph = Graph(graph.inputs, graph.bindings, (*graph.nodes, Node("add", (3, 1))), (4,))
    plan = compile_plan(graph)
    rng = np.random.default_rng(9)
    bias = backend.from_numpy(rng.standard_normal(64).astype(np.float32))
    wants, outs = [], []
    for k in range(8):
        x = rng.standard_normal((256, 64)).astype(np.float32)
        given = x
        if k % 2:
            given = cupyx.empty_pinned(x.shape, x.dtype)
            given[...] = x
        (out,) = captures.run(plan, [given, bias], [0.5 + k])
        outs.append(out)
        wants.append(x * np.float32(0.5 + k) + backend.to_numpy(bias))
    for k, (out, want) in enumerate(zip(_numpy(backend, outs), wants, strict=True)):
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6, err_msg=f"call {k}")  # float32 rounding
    assert captures.captured(plan) and captures.replays == 6


def test_host_inputs_of_every_kind_and_size_reach_a_replay_and_stay_alive_until_it_has_run(
    backend: Any, captures: Captures
) -> None:
    """A host input in page-locked memory is read where it lies by the graph (up to
    ZERO_COPY_BYTES, at any address, as an inline upload starts where its message's bytes end) or
    copied by the DMA engine (larger); one in ordinary memory goes through its staging region, the
    same two ways. Calls are staged back to back, their inputs let go at once: each keeps its
    values until its launch has read them. For plans captured with host inputs and with device
    inputs alike."""
    import cupy

    from emberlink.graph_replay.cuda_graph import ZERO_COPY_BYTES

    big_n, small_n = ZERO_COPY_BYTES // 4 + 1000, 301  # 1204 bytes: 75 16-byte words and 4 more
    nodes = (Node("multiply", (0, 2)), Node("multiply", (1, 2)))
    graph = Graph(
        (TensorSpec("float32", (big_n,)), TensorSpec("float32", (small_n,))), ("float",), nodes, (3, 4)
    )
    rng = np.random.default_rng(21)

    def given(a: np.ndarray, kind: str) -> Any:
        if kind == "device":
            return backend.from_numpy(a)
        if kind == "pageable":
            return a.copy()
        offset = {"pinned": 0, "odd": 3, "unaligned": 8}[kind]
        memory = cupy.cuda.alloc_pinned_memory(a.nbytes + 16)
        pinned = np.frombuffer(memory, np.uint8, a.nbytes + 16)[offset : offset + a.nbytes].view(a.dtype)
        pinned[...] = a
        return pinned

    kinds = ["pinned", "odd", "unaligned", "pageable", "device"]
    for first in ("pageable", "device"):
        plan = compile_plan(graph)
        outs, wants = [], []
        for k in range(14):  # eager, capture, 12 replays with pairs of kinds
            big = rng.standard_normal(big_n).astype(np.float32)
            small = rng.standard_normal(small_n).astype(np.float32)
            kind_big, kind_small = (first, first) if k < 2 else (kinds[k % 5], kinds[(k + k // 5) % 5])
            factor = 0.5 + k
            outs.append(captures.run(plan, [given(big, kind_big), given(small, kind_small)], [factor]))
            wants.append([big * np.float32(factor), small * np.float32(factor)])
        for k, (out, want) in enumerate(zip(outs, wants, strict=True)):
            for g, w in zip(_numpy(backend, out), want, strict=True):
                np.testing.assert_array_equal(g, w, err_msg=f"captured from {first}, call {k}")
        assert captures.captured(plan)
    assert captures.replays == 24


def test_random_ops_give_the_eager_values_for_each_new_seed(backend: Any, captures: Captures) -> None:
    spec: dict[str, AttrValue] = {"shape": (257, 3), "dtype": "float32"}
    attrs = check_attrs("randn", spec)
    graph = Graph((), ("int", "int"), (Node("randn", (0,), attrs), Node("rand", (1,), attrs)), (2, 3))
    plan, eager = compile_plan(graph), compile_plan(graph)
    for seeds in ([1, 2], [3, -4], [2**63 + 5, 0], [7, 7]):
        got = _numpy(backend, captures.run(plan, [], seeds))
        want = _numpy(backend, backend.run(eager, [], seeds))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    assert captures.captured(plan)


def test_an_int_binding_out_of_range_fails_as_on_the_eager_path(backend: Any, captures: Captures) -> None:
    plan = compile_plan(Graph((TensorSpec("int32", (2,)),), ("int",), (Node("add", (0, 1)),), (2,)))
    x = backend.from_numpy(np.zeros(2, np.int32))
    for _ in range(2):
        captures.run(plan, [x], [5])
    assert captures.captured(plan)
    with pytest.raises(el.errors.ExecutionError, match=r"add \(node 0\) failed"):
        captures.run(plan, [x], [2**40])
    np.testing.assert_array_equal(_numpy(backend, captures.run(plan, [x], [6]))[0], [6, 6])


# -- on devices: dropout, Device.cuda, a cuda worker ---------------------------------------------------


def _dropout_training(steps: int) -> tuple[list[float], int]:
    """Losses of a dropout MLP trained on Device.cuda(0), and how many steps replayed a capture."""
    nn = el.nn
    with el.Device.cuda(0) as dev:
        model = nn.Sequential(
            nn.Linear(64, 128, seed=1), nn.ReLU(), nn.Dropout(0.3, seed=5), nn.Linear(128, 10, seed=2)
        ).to(dev)
        opt = el.optim.SGD(model.parameters(), lr=0.1)
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal((32, 64), dtype=np.float32), rng.integers(0, 10, 32)
        losses = train_steps(dev, model, opt, x, y, steps)
        return losses, int(dev.stats()["captured_replays"])


def test_a_dropout_training_step_captured_equals_eager_for_the_same_seeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("nvmath")
    captured, replays = _dropout_training(8)
    monkeypatch.setenv(CAPTURE_ENV, "0")
    eager, none = _dropout_training(8)
    assert replays == 6 and none == 0  # eager, capture, then six replays
    np.testing.assert_allclose(captured, eager, rtol=1e-5)
    assert len(set(captured)) == len(captured)  # a new dropout seed every step


def test_a_cuda_device_frees_its_captured_graphs_when_it_closes() -> None:
    pytest.importorskip("nvmath")
    import cupy

    pool = cupy.get_default_memory_pool()
    a = np.linspace(0, 1, 1 << 20, dtype=np.float32)
    with el.Device.cuda(0) as dev:
        x = dev.tensor(a)
        for _ in range(3):
            assert (
                abs(float((x * 2.0).exp().sum()) - float(np.exp(a * 2).sum(dtype=np.float64))) < 1e-2 * a.size
            )
        held = pool.used_bytes()
        assert dev.stats()["captured_replays"] == 1
        del x
    assert pool.used_bytes() <= held - (8 << 20)  # x, its fixed input buffer and the arena


# -- a cuda worker: the cache and the session pay for captures, and get the memory back ---------------


@pytest.fixture
def cuda_worker() -> Iterator[Any]:
    pytest.importorskip("nvmath")
    from emberlink.server.background import BackgroundWorker

    with BackgroundWorker(grpc=False, memory=True, device="cuda:0", graph_cache_bytes=12 << 20) as worker:
        yield worker


def memory_device(worker: Any) -> el.Device:
    """A remote Device over the worker's in-process memory endpoint."""
    import os

    from emberlink.client.remote import connect_link
    from emberlink.protocol.identity import Identity
    from emberlink.transport import memory

    executor = connect_link(
        lambda: memory.connect(worker.memory_name, hub=worker.hub),
        worker.node_id,
        Identity.generate(os.urandom),
        path="memory",
        loop_thread=worker.loop_thread,
        timeout=10,
    )
    return el.Device(executor, "remote-memory")


def worker_stats(dev: el.Device) -> dict[str, Any]:
    stats: dict[str, Any] = dev._executor.worker_stats()  # type: ignore[attr-defined]
    return stats


def _wait_until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_worker_charges_captures_frees_them_on_eviction_and_recaptures_after_reregistration(
    cuda_worker: Any,
) -> None:
    backend = cuda_worker.worker.device.backend
    a = np.linspace(-1, 1, 1 << 20, dtype=np.float32)  # 4 MiB: each capture holds more than 8 MiB
    want_a = {k: float(np.exp(a * np.float32(k)).sum(dtype=np.float64)) for k in (1.0, 2.0, 3.0)}
    want_b = float(np.tanh(a - np.float32(1)).sum(dtype=np.float64))

    def graph_a(x: Any, k: float) -> float:
        return float((x * k).exp().sum())

    def graph_b(x: Any) -> float:
        return float((x - 1.0).tanh().sum())

    with memory_device(cuda_worker) as dev:
        x = dev.tensor(a)
        dev.sync()
        pool_before = backend.pool.used_bytes()
        assert graph_a(x, 1.0) == pytest.approx(want_a[1.0], rel=1e-4)  # eager
        s0 = worker_stats(dev)
        assert graph_a(x, 2.0) == pytest.approx(want_a[2.0], rel=1e-4)  # captured
        s1 = worker_stats(dev)
        # The capture is charged to the client's cache entry and to the session: after it the
        # session pays for x and the capture alone. (Not a difference from s0: since the eager
        # path moved x to the device, its host copy stays charged until the worker lets it go.)
        charged = s1["cache_size"] - s0["cache_size"]
        assert charged >= 8 << 20
        assert abs((s1["session_bytes"] - a.nbytes) - s1["cache_size"]) <= 64 << 10
        assert s1["in_use_bytes"] >= s0["in_use_bytes"] + (8 << 20)  # memory_stats shows them
        assert backend.pool.used_bytes() >= pool_before + (8 << 20)
        assert graph_a(x, 3.0) == pytest.approx(want_a[3.0], rel=1e-4)  # replayed
        assert worker_stats(dev)["session_captured_replays"] == 1

        for _ in range(3):  # B captured too: past the 12 MiB budget, so A's entry is evicted
            assert graph_b(x) == pytest.approx(want_b, rel=1e-4)
        s2 = worker_stats(dev)
        assert s2["cache_evictions"] >= 1 and s2["cache_entries"] == 1  # only B's
        # The session pays for x and B's capture alone: A's was freed with its entry.
        assert abs((s2["session_bytes"] - a.nbytes) - s2["cache_size"]) <= 64 << 10
        assert s2["cache_size"] >= 8 << 20

        for k in (1.0, 2.0, 3.0, 2.0):  # A again: re-registered, eager, captured, replayed
            assert graph_a(x, k) == pytest.approx(want_a[k], rel=1e-4)
        s3 = worker_stats(dev)
        assert s3["session_captured_replays"] == 1 + 1 + 2  # A, B, then A again
        assert s3["cache_evictions"] >= 2
        del x
    _wait_until(lambda: not cuda_worker.worker.sessions)
    assert cuda_worker.worker.held.used == 0  # the session's tensors and captures are all released
    assert backend.pool.used_bytes() <= pool_before + WORKSPACE_BYTES  # cuBLAS's stays with the device


def test_an_upload_a_second_replay_reads_is_moved_to_the_device_and_gives_the_same_values(
    cuda_worker: Any,
) -> None:
    """A batch uploaded once and used on many steps (as PyTorch keeps resident data) is copied in
    by the graph on its first replay and lives on the device from its second on; a batch used
    once stays in host memory, copied in by its one replay."""
    import cupy

    rng = np.random.default_rng(5)
    batches = [rng.standard_normal(1 << 16, dtype=np.float32) for _ in range(4)]
    want = [float(np.exp(b * np.float32(0.5)).sum(dtype=np.float64)) for b in batches]
    with memory_device(cuda_worker) as dev:
        xs = [dev.tensor(b) for b in batches]
        for k in (0, 1, 2, 1, 2, 1, 3):  # 0 eager, then captured and replayed
            assert float((xs[k] * 0.5).exp().sum()) == pytest.approx(want[k], rel=1e-4)
        (session,) = cuda_worker.worker.sessions
        kinds = [type(session._store.get(x._v.buf)) for x in xs]
        # 0: moved by its eager run; 1, 2: read by a second replay; 3: read by one replay only.
        assert kinds == [cupy.ndarray, cupy.ndarray, cupy.ndarray, np.ndarray]
        np.testing.assert_array_equal(xs[1].numpy(), batches[1])


def test_a_take_with_indices_uploaded_once_stays_captured_on_a_worker_for_every_step(
    cuda_worker: Any,
) -> None:
    """An index tensor uploaded once and taken with on every step stays in host memory on the
    worker, where each replay checks it: moved to the device like a batch uploaded beforehand,
    every later step would run eagerly."""
    data = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    rows = [np.arange(k, 64, 4, dtype=np.int32) for k in range(2)]

    @el.jit
    def gather(x: el.Tensor, idx: el.Tensor) -> el.Tensor:
        return (x.take(idx, axis=0) * 2.0).sum(axis=1)

    with memory_device(cuda_worker) as dev:
        x = dev.tensor(data)
        indices = [dev.tensor(r) for r in rows]  # uploaded once, each used on many steps
        for step in range(8):
            got = gather(x, indices[step % 2]).numpy()
            np.testing.assert_array_equal(
                got, (data[rows[step % 2]] * 2.0).sum(axis=1), err_msg=f"step {step}"
            )
        # Call 1 eager, call 2 traced (eager on the worker too, then captured), the rest replays.
        assert worker_stats(dev)["session_captured_replays"] >= 5
