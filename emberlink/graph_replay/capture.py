"""What a plan needs to run as one captured CUDA graph, worked out from the plan alone; no CuPy, no I/O.

cuda_graph.py captures a plan; this module decides the parts that need no GPU, so they are tested
on any machine:

- `refusal(plan)`: why a plan cannot be captured (an op that reads device values back to the
  host, or that CuPy stages through reused pinned buffers), or None.
- Host-checked takes (`host_checks`): on CuPy, `take` checks its indices' range on the device and
  reads the answer back (so that an out-of-range index fails as on NumPy), which a graph cannot
  do. A take whose indices are an input of the graph is captured all the same: its indices must
  then arrive in host memory (an uploaded index batch, as DataLoader's resident batches are) and
  a replay checks their range there, before the launch, raising what the eager op raises.
- Binding slots: a captured graph never sees a binding's Python value, since anything passed by
  value at capture time is baked into the graph. Each binding instead lives in a slot of the
  graph's staging buffer (copied to the device by the graph's first node), one slot per binding
  and dtype it is used as, holding exactly what the eager ops would compute from it
  (`numpy_backend.host_scalar`, or a seed taken modulo 2**64). So replays with new learning rates
  or dropout seeds give the eager values without a new capture.
- The staging layout: that buffer's copy tables, slots, and the regions of inputs that arrive in
  host memory (an uploaded batch), which the same first node copies to the device.
- `early_split`: where to cut a plan into two graphs so that a small output made early (a
  training step's loss, made by the forward pass) can be read while the rest (the backward pass
  and the update) still runs.
- `ArenaLayout`: the first-fit placement of a run's intermediates in one arena. Fed the run's
  allocations and frees in order (frees follow the plan's liveness, `Step.free`), it gives the
  arena's size; a capture then places the same sequence inside an arena of that size, so a replay
  allocates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from emberlink.graph_replay import fusion, ops
from emberlink.graph_replay.ir import Scalar
from emberlink.graph_replay.numpy_backend import host_scalar
from emberlink.graph_replay.plan import FUSED, Plan, Step
from emberlink.graph_replay.rng import MASK64

BINARY = frozenset(ops.names("binary"))
"""The binary elementwise ops: a binding operand is read at the step's operand dtype."""

HOST_CHECKED_OPS = frozenset({"take"})
"""Ops that check their indices on the host before a captured graph runs them (see `host_checks`);
a graph holds them only where those indices are an input of the graph."""

MAX_CAPTURED_CONCAT = 8
"""CuPy joins more arrays than this in one kernel whose pointer table it uploads through a pinned
buffer that it reuses once the upload is done; a replay would read whatever is there by then."""

SEED = "seed"
"""The slot dtype of a `rand`/`randn` seed: the binding modulo 2**64, as a uint64."""

ALIGN = 512
"""Arena offsets and sizes are multiples of this (CuPy's own allocation unit)."""


def refusal(plan: Plan) -> str | None:
    """Why `plan` (as the backend runs it, fused) cannot be captured; None if it can."""
    n_inputs = len(plan.graph.inputs)
    for step in plan.steps:
        if step.op in HOST_CHECKED_OPS and step.inputs[1] >= n_inputs:
            return f"op {step.op} with indices computed on the device cannot be captured"
        if step.op in ("concat", "stack") and len(step.inputs) > MAX_CAPTURED_CONCAT:
            return f"{step.op} of more than {MAX_CAPTURED_CONCAT} arrays cannot be captured"
        if step.op == FUSED and getattr(step.kernel, "broken", None) is not None:
            return "a fused kernel that CUDA did not compile cannot be captured"
    return None


@dataclass(frozen=True, slots=True)
class HostCheck:
    """Input `input` holds indices into an axis of `size`: every one must be in [-size, size)."""

    input: int
    size: int


def host_checks(plan: Plan) -> tuple[HostCheck, ...]:
    """The index checks a replay of `plan` makes on the host (one per host-checked op)."""
    out: dict[HostCheck, None] = {}
    for step in plan.steps:
        if step.op in HOST_CHECKED_OPS:
            x = step.in_specs[0]
            axis = step.attrs.get("axis")
            size = x.size if axis is None else x.shape[cast(int, axis)]
            out[HostCheck(step.inputs[1], size)] = None
    return tuple(out)


def check_indices(check: HostCheck, indices: Any) -> None:
    """StagingError unless `indices` is a host array whose every index is in range: the call then
    runs eagerly, which checks on the device and raises the eager op's error."""
    if not isinstance(indices, np.ndarray):
        raise StagingError(f"input {check.input}: indices on the device are checked by the eager path")
    if indices.size and (int(indices.min()) < -check.size or int(indices.max()) >= check.size):
        raise StagingError(f"input {check.input}: an index is out of range for an axis of size {check.size}")


# -- early outputs -----------------------------------------------------------------------------------

EARLY_BYTES = 64 << 10
"""Outputs up to this size (a loss, a metric) are the ones a replay makes readable early."""

EARLY_MIN_AFTER = 4
"""Fewest steps after the cut that pay for a second launch (a few µs of host time)."""


@dataclass(frozen=True, slots=True)
class EarlySplit:
    """`plan.steps[:at]` run as the first graph, then `outputs` (node values, in first-listed
    order) are copied out and readable; the second graph runs the rest."""

    at: int
    outputs: tuple[int, ...]


def early_split(plan: Plan) -> EarlySplit | None:
    """The cut just after the first step that makes a small output (at most EARLY_BYTES) from a
    value another step made, when at least a quarter of the plan's steps, and EARLY_MIN_AFTER, come
    after it; None otherwise (one graph serves).

    A small output made from the graph's inputs alone (a resident batch's labels, gathered in a
    jitted step's own graph: client/jit.py folds the gather in) is no cut: it comes first, and
    cutting there would leave the loss to the end of the step. The small outputs made before the
    cut are copied out with the first graph (into page-locked host memory, where a read finds
    them); a larger one made there (the batch a folded gather makes) waits for the end like the
    rest, since copying it to the host every step would cost PCIe time (on the H200, the big MLP's
    16 MiB batch: ~310 µs a step of copy kernel, measured with torch.profiler).
    """
    first_node = plan.graph.first_node_value
    outputs = {v for v in plan.outputs if v >= first_node}
    steps = plan.steps
    at = next(
        (
            i + 1
            for i, s in enumerate(steps)
            if s.out in outputs
            and plan.specs[s.out].nbytes <= EARLY_BYTES
            and any(v >= first_node for v in s.inputs)
        ),
        None,
    )
    if at is None or len(steps) - at < max(EARLY_MIN_AFTER, len(steps) // 4):
        return None
    made = {s.out for s in steps[:at]}
    small = tuple(v for v in dict.fromkeys(plan.outputs) if v in made and plan.specs[v].nbytes <= EARLY_BYTES)
    return EarlySplit(at, small)


# -- binding slots -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Slot:
    """One binding as one dtype: `value` is the binding's value number, `dtype` a NumPy dtype name
    or `SEED`."""

    value: int
    dtype: str

    @property
    def np_dtype(self) -> np.dtype[np.generic]:
        return np.dtype("uint64" if self.dtype == SEED else self.dtype)


def step_slots(step: Step, first_binding: int, first_node: int) -> tuple[str | None, ...]:
    """For each input of `step`: the slot dtype it takes if it is a binding, else None.

    For a fused step, a binding the kernel takes in several dtypes is listed by `fused_slots`.
    """
    out: list[str | None] = []
    for v in step.inputs:
        if not first_binding <= v < first_node:
            out.append(None)
        elif step.op in ("rand", "randn"):
            out.append(SEED)
        elif step.op == "full":
            out.append(step.out_spec.dtype)
        elif step.op in BINARY or step.op == "where":
            out.append(step.operand_dtype)
        elif step.op == FUSED:
            out.append(None)  # see fused_slots
        else:
            raise ValueError(
                f"{step.label} (node {step.node}) takes a binding no captured op knows how to read"
            )
    return tuple(out)


def fused_slots(step: Step) -> tuple[tuple[int, str | None], ...]:
    """A fused step's kernel arguments: `(input position, None)` for an array, `(input position,
    dtype)` for a binding read as `dtype` (fusion.kernel_source's `params`)."""
    return fusion.kernel_source(step).params


def binding_slots(plan: Plan) -> tuple[Slot, ...]:
    """Every (binding, dtype) pair the steps of `plan` read, in first-use order."""
    graph = plan.graph
    first_binding, first_node = len(graph.inputs), graph.first_node_value
    found: dict[Slot, None] = {}
    for step in plan.steps:
        if step.op == FUSED:
            for i, dtype in fused_slots(step):
                if dtype is not None:
                    found[Slot(step.inputs[i], dtype)] = None
            continue
        for v, dtype in zip(step.inputs, step_slots(step, first_binding, first_node)):
            if dtype is not None:
                found[Slot(v, dtype)] = None
    return tuple(found)


def slot_value(slot: Slot, value: Scalar) -> np.generic:
    """What a slot holds for a binding's `value`: what the eager op would compute with.

    Raises what `host_scalar` raises (e.g. OverflowError for an int out of the dtype's range).
    """
    if slot.dtype == SEED:
        return np.uint64(int(value) & MASK64)
    result: np.generic = host_scalar(value, slot.dtype)
    return result


# -- the arena ---------------------------------------------------------------------------------------


class CaptureRefused(Exception):
    """A plan cannot be captured (the message says why); `outputs`: the call's results if the
    attempt computed them before it stopped, else None (the caller runs the plan eagerly)."""

    def __init__(self, reason: str, outputs: list[Any] | None = None) -> None:
        super().__init__(reason)
        self.outputs = outputs


class StagingError(Exception):
    """A call's bindings cannot be staged (e.g. an int out of the range of the dtype it is used
    as): the caller runs the plan eagerly, which raises the error the eager ops raise."""


class ArenaFull(Exception):
    """An allocation did not fit the arena (the run allocated differently from the sizing run)."""


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class ArenaLayout:
    """First-fit placement of blocks in `[0, limit)` (no limit: as far as needed); no memory.

    `alloc` returns an offset, `free` gives a block back (merging it with free neighbours);
    `high_water` is the end of the furthest block ever placed: the arena's size.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.high_water = 0
        self._free: list[tuple[int, int]] = []  # (offset, size), sorted, merged, below high_water
        self._live: dict[int, int] = {}  # offset -> size
        self.allocations = 0

    def alloc(self, nbytes: int) -> int:
        size = aligned(max(nbytes, 1))
        self.allocations += 1
        for k, (off, room) in enumerate(self._free):
            if room >= size:
                if room == size:
                    del self._free[k]
                else:
                    self._free[k] = (off + size, room - size)
                self._live[off] = size
                return off
        off = self.high_water
        if self._free and self._free[-1][0] + self._free[-1][1] == off:
            off = self._free.pop()[0]  # grow the free block at the end rather than leave it
        if self.limit is not None and off + size > self.limit:
            raise ArenaFull(f"{size} bytes at offset {off} do not fit an arena of {self.limit}")
        self._live[off] = size
        self.high_water = max(self.high_water, off + size)
        return off

    def free(self, offset: int) -> None:
        size = self._live.pop(offset)
        blocks = self._free
        k = 0
        while k < len(blocks) and blocks[k][0] < offset:
            k += 1
        blocks.insert(k, (offset, size))
        if k + 1 < len(blocks) and blocks[k][0] + blocks[k][1] == blocks[k + 1][0]:
            blocks[k] = (blocks[k][0], blocks[k][1] + blocks.pop(k + 1)[1])
        if k > 0 and blocks[k - 1][0] + blocks[k - 1][1] == blocks[k][0]:
            blocks[k - 1] = (blocks[k - 1][0], blocks[k - 1][1] + blocks.pop(k)[1])

    @property
    def live_bytes(self) -> int:
        return sum(self._live.values())


# -- the staging buffer ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StagingLayout:
    """Byte offsets in the buffer a replay fills on the host and the graph's first node copies to
    the device: the input copy table, the output copy table (3 uint64 per row: source address,
    destination address, bytes), the binding slots (8 bytes each), then one region per input that
    arrives in host memory (`hosts_at`, None for the others), `HOST_ALIGN`-aligned: its device copy
    is the graph's fixed buffer for that input. Last, not copied to the device: one region per
    early output (`early_at`), which the first graph's copy kernel writes straight into (page-locked
    memory is addressable from the device), so a read of such an output copies nothing."""

    inputs_at: int
    outputs_at: int
    slots_at: tuple[int, ...]
    hosts_at: tuple[int | None, ...]
    nbytes: int
    early_at: tuple[int, ...] = ()


HOST_ALIGN = 256


def staging_layout(
    n_outputs: int,
    slots: Sequence[Slot],
    host_nbytes: Sequence[int | None],
    early_nbytes: Sequence[int] = (),
) -> StagingLayout:
    """The layout for `len(host_nbytes)` inputs, where `host_nbytes[i]` is input `i`'s size if it
    is staged from host memory, else None; `n_outputs` rows of the output table; and a region of
    each size in `early_nbytes` (the early outputs' host copies)."""
    inputs_at = 0
    outputs_at = inputs_at + 24 * len(host_nbytes)
    at = outputs_at + 24 * n_outputs
    slots_at = []
    for _ in slots:
        slots_at.append(at)
        at += 8
    hosts_at: list[int | None] = []
    for n in host_nbytes:
        if n is None:
            hosts_at.append(None)
            continue
        at = -(-at // HOST_ALIGN) * HOST_ALIGN
        hosts_at.append(at)
        at += n
    early_at: list[int] = []
    for n in early_nbytes:
        at = -(-at // HOST_ALIGN) * HOST_ALIGN
        early_at.append(at)
        at += n
    return StagingLayout(inputs_at, outputs_at, tuple(slots_at), tuple(hosts_at), max(at, 8), tuple(early_at))


__all__ = [
    "ALIGN",
    "EARLY_BYTES",
    "EARLY_MIN_AFTER",
    "HOST_ALIGN",
    "HOST_CHECKED_OPS",
    "MAX_CAPTURED_CONCAT",
    "SEED",
    "ArenaFull",
    "ArenaLayout",
    "CaptureRefused",
    "EarlySplit",
    "HostCheck",
    "Slot",
    "StagingError",
    "StagingLayout",
    "aligned",
    "binding_slots",
    "check_indices",
    "early_split",
    "fused_slots",
    "host_checks",
    "refusal",
    "slot_value",
    "staging_layout",
    "step_slots",
]
