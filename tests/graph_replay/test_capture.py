"""Captured plans without a GPU: the arena layout, binding slots, refusals, and when plans run eagerly.

The CUDA side (cuda_graph.py) is checked on the GPU machine (test_capture_gpu.py); here the parts
that decide what it does are checked with the NumPy backend and a stand-in capture function.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from emberlink.graph_replay import capture as cap
from emberlink.graph_replay import captured as captured_mod
from emberlink.graph_replay import fusion
from emberlink.graph_replay.cache import GraphCache
from emberlink.graph_replay.captured import CAPTURE_ENV, Captures, open_captures
from emberlink.graph_replay.ir import AttrValue, Graph, Node, Scalar, TensorSpec
from emberlink.graph_replay.numpy_backend import NumpyBackend
from emberlink.graph_replay.ops import check_attrs
from emberlink.graph_replay.plan import FUSED, Plan, Step, compile_plan

from .graphs import Builder, mlp_step


@pytest.fixture(autouse=True)
def fresh_log_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees 'logged once' from a clean slate."""
    monkeypatch.setattr(captured_mod, "_LOGGED", set())


def _x(*shape: int) -> TensorSpec:
    return TensorSpec("float32", shape)


def _scale_graph() -> Graph:
    """out = x * lr + 1.0, with `lr` and `1.0` bindings."""
    nodes = (Node("multiply", (0, 1)), Node("add", (3, 2)))
    return Graph((_x(4),), ("float", "float"), nodes, (4,))


def _take_graph() -> Graph:
    node = Node("take", (0, 1), check_attrs("take", {}))
    return Graph((_x(3), TensorSpec("int64", (2,))), (), (node,), (2,))


def _computed_take_graph() -> Graph:
    """take(x, i + i): indices made on the device, which only the eager path can check."""
    nodes = (Node("add", (1, 1)), Node("take", (0, 2), check_attrs("take", {})))
    return Graph((_x(3), TensorSpec("int64", (2,))), (), nodes, (3,))


# -- early outputs ------------------------------------------------------------------------------------


def test_a_training_step_is_cut_after_its_loss_so_the_loss_is_readable_before_backward() -> None:
    graph = mlp_step(batch=8, sizes=(12, 16, 5))
    loss = graph.outputs[0]
    for plan in (compile_plan(graph), compile_plan(graph, fusion=_FuseAll())):
        split = cap.early_split(plan)
        assert split is not None
        assert plan.steps[split.at - 1].out == loss and plan.steps[split.at - 1].op == "cross_entropy"
        assert split.outputs == (loss,)
        # The backward pass (every matmul but the forward's two) and the updates come after the cut.
        assert [s.op for s in plan.steps[: split.at]].count("matmul") == 2
        assert [s.op for s in plan.steps[split.at :]].count("matmul") == 3


def test_the_small_outputs_made_before_the_cut_come_out_with_the_first_graph_a_large_one_at_the_end() -> None:
    """The loss comes out early; z (the logits, over EARLY_BYTES), made before the loss too, waits
    for the end (an early output is copied to page-locked host memory every replay), as does the
    bias made after the loss."""
    g = Builder([_x(64, 4), _x(4, 300), TensorSpec("int64", (64,)), _x(300)], ["float"])
    x, w, y, b, lr = range(5)
    z = g.add("matmul", x, w)
    loss = g.add("cross_entropy", z, y)
    new_w = w
    for _ in range(4):
        new_w = g.add("subtract", new_w, g.add("multiply", w, lr))
    new_b = g.add("subtract", b, g.add("multiply", b, lr))
    split = cap.early_split(compile_plan(g.graph([new_b, loss, z, new_w])))
    assert split is not None and split.outputs == (loss,)
    assert cap.EARLY_BYTES < 64 * 300 * 4


def test_a_small_output_gathered_from_inputs_alone_is_no_cut_the_loss_after_it_is() -> None:
    """A resident batch gathered in the step's own graph (DataLoader + emberlink.jit): its labels
    are a small output made first; the cut stays after the loss."""
    g = Builder([_x(64, 4), TensorSpec("int64", (64,)), TensorSpec("int32", (8,)), _x(4, 300)], ["float"])
    data_x, data_y, idx, w, lr = range(5)
    x = g.add("take", data_x, idx, axis=0)
    y = g.add("take", data_y, idx, axis=0)
    loss = g.add("cross_entropy", g.add("matmul", x, w), y)
    new_w = w
    for _ in range(4):
        new_w = g.add("subtract", new_w, g.add("multiply", w, lr))
    plan = compile_plan(g.graph([x, y, loss, new_w]))
    split = cap.early_split(plan)
    assert split is not None
    assert plan.steps[split.at - 1].out == loss
    assert split.outputs == (x, y, loss)  # all small here
    big = Builder(
        [_x(4096, 32), TensorSpec("int64", (4096,)), TensorSpec("int32", (1024,)), _x(32, 10)], ["float"]
    )
    data_x, data_y, idx, w, lr = range(5)
    x = big.add("take", data_x, idx, axis=0)  # the batch: 128 KiB, over EARLY_BYTES
    y = big.add("take", data_y, idx, axis=0)
    loss = big.add("cross_entropy", big.add("matmul", x, w), y)
    new_w = w
    for _ in range(4):
        new_w = big.add("subtract", new_w, big.add("multiply", w, lr))
    split = cap.early_split(compile_plan(big.graph([x, y, loss, new_w])))
    assert split is not None and split.outputs == (y, loss)  # the batch itself waits for the end


def test_no_cut_when_the_small_output_is_made_last_or_little_work_follows_it() -> None:
    g = Builder([_x(8, 4), _x(4, 3), TensorSpec("int64", (8,))], [])
    x, w, y = range(3)
    loss = g.add("cross_entropy", g.add("matmul", x, w), y)
    assert cap.early_split(compile_plan(g.graph([loss]))) is None  # an evaluation step
    z = g.add("matmul", x, w)
    after = g.add("multiply", g.add("exp", z), z)
    assert cap.early_split(compile_plan(g.graph([loss, after]))) is None  # 3 steps after: too few
    assert cap.early_split(compile_plan(g.graph([loss, g.add("sqrt", after)]))) is not None  # 4 after
    assert cap.early_split(compile_plan(_scale_graph())) is None  # its only output is its last step


# -- the arena layout ---------------------------------------------------------------------------------


def test_arena_reuses_a_freed_block_first_fit() -> None:
    layout = cap.ArenaLayout()
    a = layout.alloc(1000)
    b = layout.alloc(100)
    layout.free(a)
    c = layout.alloc(600)  # fits where `a` was
    assert (a, b, c) == (0, 1024, 0)
    assert layout.high_water == 1024 + 512


def test_arena_merges_neighbouring_free_blocks() -> None:
    layout = cap.ArenaLayout()
    blocks = [layout.alloc(512) for _ in range(3)]
    layout.alloc(512)  # keeps the three from merging with the end
    layout.free(blocks[0])
    layout.free(blocks[2])
    layout.free(blocks[1])
    assert layout.alloc(1536) == 0
    assert layout.high_water == 2048


def test_arena_grows_a_free_block_at_its_end_rather_than_leave_it() -> None:
    layout = cap.ArenaLayout()
    layout.alloc(512)
    tail = layout.alloc(512)
    layout.free(tail)
    assert layout.alloc(2048) == 512
    assert layout.high_water == 512 + 2048


def test_arena_size_follows_liveness_not_the_sum_of_allocations() -> None:
    layout = cap.ArenaLayout()
    for _ in range(10):  # a chain: each value dies once the next exists
        prev = layout.alloc(4096)
        nxt = layout.alloc(4096)
        layout.free(prev)
        layout.free(nxt)
    assert layout.allocations == 20 and layout.high_water == 8192


def test_an_arena_with_a_limit_refuses_what_passes_it() -> None:
    layout = cap.ArenaLayout(limit=1024)
    layout.alloc(1024)
    with pytest.raises(cap.ArenaFull):
        layout.alloc(1)


# -- binding slots -------------------------------------------------------------------------------------


def test_each_binding_gets_one_slot_per_dtype_it_is_used_as() -> None:
    f16: dict[str, AttrValue] = {"shape": (2,), "dtype": "float16"}
    f32: dict[str, AttrValue] = {"shape": (2,), "dtype": "float32"}
    nodes = (
        Node("add", (0, 2)),  # float32
        Node("add", (1, 2)),  # float64
        Node("full", (2,), check_attrs("full", f16)),
        Node("rand", (3,), check_attrs("rand", f32)),
    )
    graph = Graph((_x(2), TensorSpec("float64", (2,))), ("float", "int"), nodes, (4, 5, 6, 7))
    slots = cap.binding_slots(compile_plan(graph))
    assert slots == (
        cap.Slot(2, "float32"),
        cap.Slot(2, "float64"),
        cap.Slot(2, "float16"),
        cap.Slot(3, cap.SEED),
    )


class _FuseAll:
    def fusable(self, step: Step) -> bool:
        return fusion.fusable(step)

    def build(self, step: Step) -> Any:
        return None


def test_a_fused_chain_reads_its_bindings_through_slots_of_its_kernel_dtypes() -> None:
    plan = compile_plan(_scale_graph(), fusion=_FuseAll())
    assert [s.op for s in plan.steps] == [FUSED]
    assert cap.binding_slots(plan) == (cap.Slot(1, "float32"), cap.Slot(2, "float32"))


def test_slot_values_are_what_the_eager_ops_compute_with() -> None:
    assert cap.slot_value(cap.Slot(0, cap.SEED), -1) == np.uint64(2**64 - 1)
    assert cap.slot_value(cap.Slot(0, "int32"), 2.9) == np.int32(2)
    value = cap.slot_value(cap.Slot(0, "float16"), 0.1)
    assert value.dtype == np.float16 and value == np.float16(0.1)
    with pytest.raises(OverflowError):
        cap.slot_value(cap.Slot(0, "int32"), 2**40)


def test_staging_puts_the_copy_tables_first_then_the_slots_then_aligned_host_inputs() -> None:
    layout = cap.staging_layout(1, (cap.Slot(3, "float16"), cap.Slot(4, cap.SEED)), (None, 10, 300))
    assert (layout.inputs_at, layout.outputs_at, layout.slots_at) == (0, 72, (96, 104))
    assert layout.hosts_at == (None, 256, 512) and layout.nbytes == 812


# -- refusals ------------------------------------------------------------------------------------------


def test_a_take_of_computed_indices_and_wide_concats_cannot_be_captured_but_matmul_can() -> None:
    assert cap.refusal(compile_plan(_computed_take_graph())) == (
        "op take with indices computed on the device cannot be captured"
    )
    assert cap.refusal(compile_plan(_take_graph())) is None  # indices that are an input: checked on the host
    n = cap.MAX_CAPTURED_CONCAT + 1
    wide = Graph(
        tuple(_x(2) for _ in range(n)),
        (),
        (Node("concat", tuple(range(n)), check_attrs("concat", {})),),
        (n,),
    )
    assert cap.refusal(compile_plan(wide)) is not None
    mm = Graph((_x(2, 3), _x(3, 4)), (), (Node("matmul", (0, 1)),), (2,))
    assert cap.refusal(compile_plan(mm)) is None


def test_a_take_of_input_indices_is_checked_on_the_host_against_its_axis() -> None:
    nodes = (Node("take", (0, 1), check_attrs("take", {"axis": 1})),)
    plan = compile_plan(Graph((_x(2, 5), TensorSpec("int32", (3,))), (), nodes, (2,)))
    (check,) = cap.host_checks(plan)
    assert check == cap.HostCheck(1, 5)
    cap.check_indices(check, np.array([0, 4, -5], np.int32))  # NumPy's range: [-5, 5)
    for bad in ([0, 5, 1], [-6, 0, 0]):
        with pytest.raises(cap.StagingError, match="out of range for an axis of size 5"):
            cap.check_indices(check, np.array(bad, np.int32))
    with pytest.raises(cap.StagingError, match="on the device"):  # a device array: the eager path checks
        cap.check_indices(check, memoryview(b"\0" * 12))
    assert cap.host_checks(compile_plan(_take_graph())) == (cap.HostCheck(1, 3),)  # axis None: the size


# -- Captures: when a plan runs eagerly, captured or replayed ------------------------------------------


class FakeCaptured:
    """Replays by running the plan on NumPy, and records what happened to it."""

    def __init__(self, nbytes: int = 1000, staging_error: bool = False) -> None:
        self._nbytes = nbytes
        self.replays = 0
        self.freed = False
        self.staging_error = staging_error

    @property
    def nbytes(self) -> int:
        return 0 if self.freed else self._nbytes

    def replay(self, inputs: Sequence[Any], bindings: Sequence[Scalar]) -> list[Any]:
        if self.staging_error:
            raise cap.StagingError("cannot stage")
        self.replays += 1
        return [np.full_like(inputs[0], -1.0)]  # recognisably not the eager result

    def free(self) -> None:
        self.freed = True


class FakeCapture:
    def __init__(self, error: BaseException | None = None, **kwargs: Any) -> None:
        self.error = error
        self.made: list[FakeCaptured] = []
        self.kwargs = kwargs

    def __call__(
        self, plan: Plan, inputs: Sequence[Any], bindings: Sequence[Scalar]
    ) -> tuple[Any, list[Any]]:
        if self.error is not None:
            raise self.error
        captured = FakeCaptured(**self.kwargs)
        self.made.append(captured)
        return captured, NumpyBackend().run(plan, inputs, bindings)


_IN = [np.arange(4, dtype=np.float32)]
_EAGER = _IN[0] * 0.5 + 1.0


def _run(caps: Captures, plan: Plan, times: int) -> list[np.ndarray]:
    return [caps.run(plan, _IN, [0.5, 1.0])[0] for _ in range(times)]


def test_the_first_run_is_eager_the_second_captures_and_later_ones_replay() -> None:
    fake = FakeCapture()
    caps = Captures(NumpyBackend(), fake)
    plan = compile_plan(_scale_graph())
    first, second, third = _run(caps, plan, 3)
    np.testing.assert_array_equal(first, _EAGER)
    np.testing.assert_array_equal(second, _EAGER)  # the capturing run's own outputs
    assert len(fake.made) == 1 and fake.made[0].replays == 1
    np.testing.assert_array_equal(third, -1.0)
    assert caps.captured(plan) and caps.replays == 1 and caps.nbytes == 1000


def test_host_inputs_are_wanted_once_the_next_run_captures_or_replays() -> None:
    caps = Captures(NumpyBackend(), FakeCapture())
    plan = compile_plan(_scale_graph())
    assert not caps.takes_host(plan)  # the first run is eager
    caps.run(plan, _IN, [0.5, 1.0])
    assert caps.takes_host(plan)  # the next one captures
    caps.run(plan, _IN, [0.5, 1.0])
    assert caps.takes_host(plan)  # and later ones replay
    take = compile_plan(_computed_take_graph())
    caps.run(take, [np.arange(3, dtype=np.float32), np.array([0, 1])], [])
    assert not caps.takes_host(take)  # eager for good


def test_a_takes_input_indices_are_the_inputs_a_replay_checks_on_the_host() -> None:
    caps = Captures(NumpyBackend(), FakeCapture())
    take = Node("take", (0, 1), check_attrs("take", {"axis": 0}))
    plan = compile_plan(Graph((TensorSpec("float32", (5, 2)), TensorSpec("int32", (3,))), (), (take,), (2,)))
    assert caps.host_checked(plan) == {1}  # its first run is eager, later ones replay
    caps.run(plan, [np.zeros((5, 2), np.float32), np.array([0, 4, 1], np.int32)], [])
    assert caps.host_checked(plan) == {1}
    scale = compile_plan(_scale_graph())
    caps.run(scale, _IN, [0.5, 1.0])
    assert caps.host_checked(scale) == frozenset()


def test_an_upload_moves_to_the_device_when_a_second_replay_reads_it_unless_checked_on_the_host() -> None:
    moved: list[int] = []

    def to_device(i: int, a: np.ndarray) -> Any:
        moved.append(i)
        return ("device", i)

    uploads = captured_mod.HostUploads()
    batch, indices, data = np.ones(4), np.arange(2), ("device", 9)

    def call() -> list[Any]:
        return uploads.place([7, 8, 9], [batch, indices, data], frozenset({1}), to_device)

    assert call() == [batch, indices, data]  # the first replay copies them in itself
    assert call() == [("device", 7), indices, data]  # read again: moved, but for the checked indices
    assert moved == [7]
    uploads.place([5], [batch], frozenset(), to_device)  # id 5 read once by a replay
    uploads.forget([5])  # then given a new value (or dropped): no replay has read that one
    uploads.place([5], [batch], frozenset(), to_device)
    assert moved == [7]  # read once since: stays on the host
    uploads.place([5], [batch], frozenset(), to_device)
    assert moved == [7, 5]  # read twice: moved
    copied = uploads.eager([3, 4], [batch, indices], frozenset({1}), to_device, lambda a: ("copy", len(a)))
    assert copied == [("device", 3), ("copy", 2)]  # an eager run: checked indices only copied
    assert moved == [7, 5, 3]


def test_a_plans_first_run_gets_its_uploads_by_the_eager_rule_later_runs_by_the_replay_rule() -> None:
    caps = Captures(NumpyBackend(), FakeCapture())
    plan = compile_plan(_scale_graph())
    uploads = captured_mod.HostUploads()
    moved: list[int] = []

    def to_device(i: int, a: np.ndarray) -> Any:
        moved.append(i)
        return a

    def run() -> None:
        inputs = uploads.prepare(caps, plan, [1], [np.array(_IN[0])], to_device, lambda a: a)
        caps.run(plan, inputs, [0.5, 1.0])

    run()  # eager: the upload moves at once
    assert moved == [1]
    run()  # captures: read once, it stays on the host
    assert moved == [1]
    run()  # replays: read twice, it moves
    assert moved == [1, 1]


def test_a_plan_with_an_uncapturable_op_runs_eagerly_and_the_reason_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeCapture()
    caps = Captures(NumpyBackend(), fake)
    x, i = np.arange(3, dtype=np.float32), np.array([1, 0])
    with caplog.at_level(logging.INFO, logger="emberlink.capture"):
        for _ in range(2):  # two plans of the same graph, three runs each
            plan = compile_plan(_computed_take_graph())
            for _ in range(3):
                np.testing.assert_array_equal(caps.run(plan, [x, i], [])[0], [2.0, 0.0])
    assert fake.made == [] and not caps.captured(plan)
    assert [r.getMessage() for r in caplog.records] == [
        "plans run eagerly, without CUDA graphs: op take with indices computed on the device cannot be captured"
    ]


@pytest.mark.parametrize("error", [cap.CaptureRefused("no way"), RuntimeError("cuda said no")])
def test_a_failed_capture_runs_the_plan_eagerly_from_then_on(
    error: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeCapture(error)
    caps = Captures(NumpyBackend(), fake)
    plan = compile_plan(_scale_graph())
    with caplog.at_level(logging.INFO, logger="emberlink.capture"):
        for got in _run(caps, plan, 4):
            np.testing.assert_array_equal(got, _EAGER)
    assert not caps.captured(plan)
    assert len(caplog.records) == 1 and str(error) in caplog.records[0].getMessage()


def test_a_capture_the_owner_does_not_admit_is_freed_and_the_plan_runs_eagerly() -> None:
    fake = FakeCapture()
    asked: list[int] = []

    def admit(key: bytes | None, plan: Plan, nbytes: int) -> bool:
        asked.append(nbytes)
        return False

    caps = Captures(NumpyBackend(), fake, admit=admit)
    plan = compile_plan(_scale_graph())
    for got in _run(caps, plan, 4):
        np.testing.assert_array_equal(got, _EAGER)
    assert asked == [1000] and fake.made[0].freed and fake.made[0].replays == 0


def test_bindings_that_cannot_be_staged_run_eagerly_and_the_capture_stays() -> None:
    caps = Captures(NumpyBackend(), FakeCapture(staging_error=True))
    plan = compile_plan(_scale_graph())
    for got in _run(caps, plan, 4):
        np.testing.assert_array_equal(got, _EAGER)
    assert caps.captured(plan)


def test_a_dropped_plan_frees_its_capture_and_tells_the_owner() -> None:
    released: list[tuple[bytes | None, Plan | None, int]] = []
    fake = FakeCapture()
    caps = Captures(
        NumpyBackend(), fake, admit=lambda k, p, n: True, release=lambda k, p, n: released.append((k, p, n))
    )
    plan = compile_plan(_scale_graph())
    for _ in range(2):
        caps.run(plan, _IN, [0.5, 1.0], b"gid")
    del plan  # what the graph cache does when it evicts the entry
    assert fake.made[0].freed and released == [(b"gid", None, 1000)] and caps.nbytes == 0


def test_closing_frees_every_capture_and_names_the_plans_still_alive() -> None:
    released: list[tuple[bytes | None, Plan | None, int]] = []
    fake = FakeCapture()
    caps = Captures(NumpyBackend(), fake, release=lambda k, p, n: released.append((k, p, n)))
    plan = compile_plan(_scale_graph())
    _run(caps, plan, 3)
    caps.close()
    assert fake.made[0].freed and released == [(None, plan, 1000)]
    np.testing.assert_array_equal(_run(caps, plan, 1)[0], _EAGER)  # after close: eager again


# -- open_captures: when capture cannot serve at all --------------------------------------------------


class _FakeCupyBackend(NumpyBackend):
    name = "cupy"


def test_the_numpy_backend_gets_no_captures_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="emberlink.capture"):
        assert open_captures(NumpyBackend()) is None
        assert open_captures(NumpyBackend()) is None
    assert len(caplog.records) == 1 and "CuPy backend" in caplog.records[0].getMessage()


@pytest.fixture
def no_nvmath(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in [n for n in sys.modules if n == "nvmath" or n.startswith("nvmath.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nvmath", None)  # `import nvmath` now raises ImportError
    yield


@pytest.mark.usefixtures("no_nvmath")
def test_without_nvmath_plans_run_eagerly_and_it_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="emberlink.capture"):
        assert open_captures(_FakeCupyBackend()) is None
        assert open_captures(_FakeCupyBackend()) is None
    assert len(caplog.records) == 1
    assert "nvmath-python is missing" in caplog.records[0].getMessage()


@pytest.mark.usefixtures("no_nvmath")
def test_a_local_device_without_nvmath_runs_its_plans_eagerly() -> None:
    from emberlink.client.device import Device
    from emberlink.client.local import LocalExecutor

    with Device(LocalExecutor(_FakeCupyBackend()), "fake-cuda") as dev:
        x = dev.tensor(np.arange(4, dtype=np.float32))
        for _ in range(3):
            np.testing.assert_array_equal((x * 2.0 + 1.0).numpy(), np.arange(4) * 2.0 + 1.0)


def test_capture_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CAPTURE_ENV, "0")
    assert open_captures(_FakeCupyBackend()) is None


# -- the cache counts captured graphs -------------------------------------------------------------------


def test_the_cache_charges_a_capture_to_its_entry_and_evicts_older_entries_for_it() -> None:
    cache = GraphCache(10_000)
    plans = [compile_plan(_scale_graph()) for _ in range(3)]
    for k, plan in enumerate(plans):
        assert cache.put("c", bytes([k]), plan, 3000)
    assert cache.resize("c", bytes([2]), plans[2], 3000)  # 12000 > 10000: entry 0 goes
    assert ("c", bytes([0])) not in cache and ("c", bytes([2])) in cache
    assert cache.stats("c")["size"] == 9000 and cache.stats("c")["evictions"] == 1
    assert cache.resize("c", bytes([2]), plans[2], -3000)
    assert cache.stats("c")["size"] == 6000


def test_the_cache_refuses_a_capture_that_alone_passes_the_budget_or_lost_its_entry() -> None:
    cache = GraphCache(10_000)
    plan, other = compile_plan(_scale_graph()), compile_plan(_scale_graph())
    cache.put("c", b"g", plan, 3000)
    assert not cache.resize("c", b"g", plan, 8000)
    assert not cache.resize("c", b"g", other, 10)  # the entry holds another plan now
    assert not cache.resize("c", b"missing", plan, 10)
    assert cache.stats("c")["size"] == 3000


# -- whether a host input is pinned (cuda_graph._pinned), without CuPy --------------------------------


class _FakePinned(bytearray):
    """Stands for CuPy's PinnedMemoryPointer (a buffer the pinned pool hands out)."""


class _FakeRuntime:
    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.asked = 0

    def pointerGetAttributes(self, ptr: int) -> Any:
        self.asked += 1
        return type("Attributes", (), {"type": self.answer})()


def _fake_xp(answer: int) -> Any:
    runtime = _FakeRuntime(answer)
    cuda = type("Cuda", (), {"PinnedMemoryPointer": _FakePinned, "runtime": runtime})()
    return type("Xp", (), {"cuda": cuda})()


def test_pinned_input_is_known_from_its_owner_without_asking_the_driver() -> None:
    from emberlink.graph_replay.cuda_graph import MAPPED, _pinned

    xp = _fake_xp(answer=0)  # the driver would say "not pinned": it must not be asked
    buffer = np.frombuffer(_FakePinned(4096), np.uint8, 4000)  # CupyBackend.host_buffer's shape
    upload = buffer.view(np.float32).reshape(10, 100)  # session._upload_array
    inline = np.frombuffer(buffer.data[64:464], np.float32)  # a view of a pinned plaintext
    assert _pinned(xp, upload) == MAPPED
    assert _pinned(xp, inline) == MAPPED
    assert _pinned(xp, inline[::2]) == MAPPED
    assert xp.cuda.runtime.asked == 0


def test_numpy_or_python_memory_is_pageable_without_asking_the_driver() -> None:
    from emberlink.graph_replay.cuda_graph import PAGEABLE, _pinned

    xp = _fake_xp(answer=1)  # the driver would say "pinned": it must not be asked
    assert _pinned(xp, np.zeros((4, 4), np.float32)) == PAGEABLE
    assert _pinned(xp, np.zeros((4, 4), np.float32)[1:]) == PAGEABLE
    assert _pinned(xp, np.frombuffer(bytes(64), np.float32)) == PAGEABLE
    assert _pinned(xp, np.frombuffer(memoryview(bytearray(64))[8:], np.float32)) == PAGEABLE
    assert xp.cuda.runtime.asked == 0


def test_memory_of_an_unknown_owner_is_what_the_driver_says_and_is_copied_by_the_dma_engine() -> None:
    import mmap

    from emberlink.graph_replay.cuda_graph import LOCKED, PAGEABLE, _pinned

    for answer, kind in ((1, LOCKED), (0, PAGEABLE)):  # cudaMemoryTypeHost, cudaMemoryTypeUnregistered
        xp = _fake_xp(answer)
        with mmap.mmap(-1, 64) as region:
            a = np.frombuffer(region, np.float32)
            assert _pinned(xp, a) == kind
            del a
        assert xp.cuda.runtime.asked == 1
