"""A plan captured into one CUDA graph and replayed with one launch, on CuPy and nvmath-python; no policy.

captured.py decides when to capture; this module does it. A captured plan owns:
- staging buffers in pinned host memory (STAGING_BUFFERS of them, filled in turn), which a replay
  fills on the host (the addresses of this call's inputs and outputs, the binding slots of
  capture.py). Several of them, so that staging a call never waits for the launch just before it
  (a loop that reads each loss one step late keeps the GPU fed) and a training step's outputs find
  their arrays free again (see STAGING_BUFFERS);
- one graph per staging buffer (or pair, see below), all captured from the same body: each begins
  with a node that copies its own staging buffer's tables and slots to the device (page-locked
  memory is addressable from the device at its host address), so a replay queues nothing but its
  launch: no host-to-device copy to call for (a `cudaMemcpyAsync` cost ~10 µs of a worker's CPU on
  the H200, two or three a step);
- one fixed device buffer per input, filled by the graph's copy kernel from this call's input
  arrays, wherever they are, by the addresses staged: a device array, a host array in pinned
  memory (a worker decrypts large frames into pinned memory; read where it lies, with no copy on
  the host) or the input's region in the staging buffer (a host array elsewhere is copied there;
  an input that arrived in host memory when the plan was captured has one). A host source larger
  than ZERO_COPY_BYTES is copied by the DMA engine instead (`_send`);
- an arena for every intermediate, laid out by liveness (capture.ArenaLayout), so a replay
  allocates nothing but its outputs;
- the graph: the plan's steps (CuPy's kernels and fused kernels, matmuls through cuBLAS from
  nvmath_matmul.py, `take` without its device-side range check, which staging did on the host),
  then one kernel that copies the outputs into the arrays the replay made for them, so each
  call's results are its own arrays, as on the eager path (outputs up to KEPT_OUTPUT_BYTES are
  new views of arrays the staging buffer keeps and takes again once nothing holds them or their
  memory: a view costs far less than an array from the pool);
- where capture.early_split cuts the plan after its first small output (a training step's loss,
  made by the forward pass), an event between the two parts: the graph runs the steps up to the
  cut, copies out the small outputs made so far, records its staging buffer's `made` event (an
  event record node), then runs the rest. A replay tells the backend (`mark_ready`), so a read of such
  an output waits for that event only, and the time a reader takes to act on it (a client's round
  trip, the next step's Python) overlaps the backward pass and the update. Measured on the H200
  (bench/gpu_step.py), see the README. Where the driver cannot record an event inside a graph,
  two graphs, with the event recorded by the host between their launches (the second graph's
  output arrays made while the GPU runs the first). The first part also writes the early outputs
  into their regions of the staging buffer (page-locked host memory, which the copy kernel
  addresses directly), so such a read is the wait and a copy on the host, with no device-to-host
  copy to queue and wait for (`_EarlyCopy`).

A replay checks only what can differ from the last call: an input's dtype and shape, and the
bindings, which are validated again only when they differ from the last call's (a jitted step
sends the same constants every call); a staging buffer's slots and tables are written only where
they changed since that buffer was last used.

Capturing runs the same body several times. First it runs for real (the sizing run), with every
allocation taken from CuPy's pool and also placed in an `ArenaLayout`; its outputs are that
call's results and the layout's high-water mark is the arena's size. Then it captures the body
once per staging buffer with every allocation placed in the arena by the same first-fit rule; an
allocation past the arena (the body allocated differently) abandons the capture. Work on one
stream runs in order, so a block that one step frees and a later step takes is safe within a
replay, the graphs of all staging buffers share the arena, the fixed buffers and the device copy
of the tables, and replays of all graphs and eager work share the device's current stream.

Everything is called by one thread at a time (a worker's device thread, or its event loop when
that thread is idle; a local device's caller).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from emberlink.errors import ExecutionError, OutOfMemory
from emberlink.graph_replay import capture as cap
from emberlink.graph_replay import nvmath_matmul, rng
from emberlink.graph_replay.backend import _exclusive as exclusive_buffer  # the run loop's check
from emberlink.graph_replay.backend import check_bindings, check_inputs
from emberlink.graph_replay.ir import Scalar
from emberlink.graph_replay.numpy_backend import wide_indices
from emberlink.graph_replay.plan import FUSED, Plan, Step, derive_plan

_COPY_KERNEL = r"""
extern "C" __global__ void emberlink_copy_table(const unsigned long long* table) {
    // One row of (source, destination, bytes) per blockIdx.y; blocks along x stride over it.
    const unsigned long long* row = table + 3 * blockIdx.y;
    const unsigned long long src = row[0], dst = row[1], n = row[2];
    const unsigned long long start = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    if (((src | dst | n) & 15) == 0) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (unsigned long long i = start; i < n / 16; i += stride) d[i] = s[i];
    } else if ((dst & 15) == 0 && (src & 15) != 0) {
        // A source anywhere (a host input where a message's bytes end): each 16-byte word of dst
        // is put together from the two aligned words of src that hold it, the second one taken
        // from the next lane (so each word crosses the bus once), or loaded where that lane has
        // none. (That word holds bytes of the source: it never reaches past its last page.)
        const unsigned int lane = threadIdx.x & 31;
        const unsigned int r = (unsigned int)(src & 15), q = r >> 2, shift = (r & 3) * 8;
        const uint4* s = (const uint4*)(src - r);
        uint4* d = (uint4*)dst;
        const unsigned long long words = n / 16;
        for (unsigned long long first = start - lane; first < words; first += stride) {  // warp-uniform
            const unsigned long long i = first + lane;
            const bool active = i < words;
            uint4 a;
            a.x = a.y = a.z = a.w = 0u;
            if (active) a = s[i];
            uint4 b;
            b.x = __shfl_down_sync(0xffffffffu, a.x, 1);
            b.y = __shfl_down_sync(0xffffffffu, a.y, 1);
            b.z = __shfl_down_sync(0xffffffffu, a.z, 1);
            b.w = __shfl_down_sync(0xffffffffu, a.w, 1);
            if (active && (lane == 31 || i + 1 >= words)) b = s[i + 1];
            if (active) {
                const unsigned int w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                uint4 o;  // (little-endian: byte r of the pair is the low byte of each word)
                o.x = (unsigned int)((((unsigned long long)w[q + 1] << 32) | w[q]) >> shift);
                o.y = (unsigned int)((((unsigned long long)w[q + 2] << 32) | w[q + 1]) >> shift);
                o.z = (unsigned int)((((unsigned long long)w[q + 3] << 32) | w[q + 2]) >> shift);
                o.w = (unsigned int)((((unsigned long long)w[q + 4] << 32) | w[q + 3]) >> shift);
                d[i] = o;
            }
        }
        const unsigned char* sb = (const unsigned char*)src;
        unsigned char* db = (unsigned char*)dst;
        for (unsigned long long i = 16 * words + start; i < n; i += stride) db[i] = sb[i];
    } else if (((src | dst | n) & 3) == 0) {
        const unsigned int* s = (const unsigned int*)src;
        unsigned int* d = (unsigned int*)dst;
        for (unsigned long long i = start; i < n / 4; i += stride) d[i] = s[i];
    } else {
        const unsigned char* s = (const unsigned char*)src;
        unsigned char* d = (unsigned char*)dst;
        for (unsigned long long i = start; i < n; i += stride) d[i] = s[i];
    }
}

extern "C" __global__ void emberlink_copy_words(
    const unsigned long long src, const unsigned long long dst, const unsigned long long n
) {
    // n 8-byte words from src (a staging buffer in page-locked host memory) to dst (the device).
    const unsigned long long* s = (const unsigned long long*)src;
    unsigned long long* d = (unsigned long long*)dst;
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}
"""
_THREADS = 256
_MAX_BLOCKS = 1024

log = logging.getLogger("emberlink.capture")
_LOGGED: set[str] = set()


def _event_node_recorder() -> Callable[[int, int], None] | None:
    """`record(event, stream)`: while `stream` captures, an event record node in its graph
    (`cuEventRecordWithFlags` with CU_EVENT_RECORD_EXTERNAL, which CuPy does not wrap), so a
    launch of that graph records `event` where the node stands; None where the driver has none."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuEventRecordWithFlags
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def record(event: int, stream: int) -> None:
        status = fn(event, stream, 1)  # CU_EVENT_RECORD_EXTERNAL
        if status:
            raise RuntimeError(f"cuEventRecordWithFlags failed: CUresult {status}")

    return record


def _grid(nbytes: Sequence[int]) -> int:
    """Blocks along x for a copy table whose largest row is max(nbytes) (16 bytes a thread a pass)."""
    most = max(nbytes, default=0)
    return max(1, min(_MAX_BLOCKS, math.ceil(most / (16 * _THREADS))))


class Capturer:
    """What every capture on one backend shares: the capture stream, cuBLAS (one handle and
    workspace) and the copy kernel. Built once per backend (`capturer_for`)."""

    def __init__(self, backend: Any) -> None:
        cublas = nvmath_matmul.load()  # first, so a missing nvmath-python is found before anything else
        self._backend = weakref.ref(backend)  # held weakly: `_CAPTURERS` lives as long as the backend
        self.xp = backend.xp
        self.pool = backend.pool
        self.device_id: int = backend.device_id
        with self.xp.cuda.Device(self.device_id):
            self.stream = self.xp.cuda.Stream(non_blocking=True)
            self.gemm = nvmath_matmul.Gemm(self.xp, cublas, strided=getattr(backend, "fast", True))
            self.copy_kernel = self.xp.RawKernel(_COPY_KERNEL, "emberlink_copy_table")
            self.copy_words = self.xp.RawKernel(_COPY_KERNEL, "emberlink_copy_words")
        self.record_node = _event_node_recorder()

    @property
    def backend(self) -> Any:
        backend = self._backend()
        if backend is None:
            raise RuntimeError("the backend of this capturer is gone")
        return backend

    def __call__(
        self, plan: Plan, inputs: Sequence[Any], bindings: Sequence[Scalar]
    ) -> tuple[CapturedPlan, list[Any]]:
        """Capture `plan` while running it for this call: `(captured, this call's outputs)`."""
        with self.xp.cuda.Device(self.device_id):
            variant = self.backend.plan_for(plan)
            if variant is plan:  # the capture must not keep `plan` alive: its death frees the capture
                variant = derive_plan(plan)
            reason = cap.refusal(variant)
            if reason is not None:
                raise cap.CaptureRefused(reason)
            host = tuple(isinstance(a, np.ndarray) for a in inputs)
            for check in cap.host_checks(variant):
                if not host[check.input]:
                    raise cap.CaptureRefused("a take whose indices are on the device cannot be captured")
            try:
                captured = CapturedPlan(self, variant, host)
            except self.xp.cuda.memory.OutOfMemoryError as e:
                raise cap.CaptureRefused(f"no device memory for a capture's buffers: {e}") from e
            outs = captured.capture(inputs, bindings)
            return captured, outs


_CAPTURERS: weakref.WeakKeyDictionary[Any, Capturer] = weakref.WeakKeyDictionary()


def capturer_for(backend: Any) -> Capturer:
    """The backend's Capturer (made on first use); ImportError if nvmath-python is missing."""
    found = _CAPTURERS.get(backend)
    if found is None:
        found = _CAPTURERS[backend] = Capturer(backend)
    return found


class _Block:
    """An arena block while some array uses it: gives its offset back when the last one goes."""

    __slots__ = ("layout", "memory", "offset")

    def __init__(self, layout: cap.ArenaLayout, offset: int, memory: Any) -> None:
        self.layout = layout
        self.offset = offset
        self.memory = memory  # the pool's memory behind a sizing run's block; None in an arena

    def __del__(self) -> None:
        self.layout.free(self.offset)


KEPT_OUTPUT_BYTES = 4 << 20
"""Outputs up to this size are made as views of arrays a staging buffer keeps (`_Staging.templates`):
a view costs a fraction of a new array from the pool (measured on the H200: 7 new arrays 25 µs),
which is most of a small step's staging; a larger output's GPU work dwarfs its allocation."""


class _Probe:
    """Stands in for a template (`.data.mem`, as a CuPy array has) when counting references."""

    __slots__ = ("data", "mem")
    data: Any
    mem: Any


def _idle_counts() -> tuple[int, int, int]:
    """`sys.getrefcount` of a template nothing else holds, of its memory pointer and of its
    memory, counted as `CapturedPlan._make_outputs` counts them (`t = templates[j]` a local):
    measured, not assumed, so the interpreter's counting conventions cancel out."""
    probe = _Probe()
    probe.data = _Probe()
    probe.data.mem = _Probe()
    templates = [probe]
    del probe
    t = templates[0]
    return sys.getrefcount(t), sys.getrefcount(t.data), sys.getrefcount(t.data.mem)


_IDLE = _idle_counts()

STAGING_BUFFERS = 3
"""Staging buffers a captured plan fills in turn. A replay waits only until the launch that last
used the buffer it fills has finished, the third launch before it: a host that runs one launch ahead
(a loop reading each loss one step late) never waits to stage. Three, not two: a training step's
outputs (the parameters) are the next step's inputs and are dropped by the batch after that one,
after its Execute, so with two buffers a kept array (`_Staging.templates`) was still held every
time its buffer came round, and every call made all its outputs anew from the pool, with new
addresses for the output table (Device.cuda jit, small MLP, batches on the device, on the H200,
median µs a call: making the second graph's outputs, with the copy of their changed table rows,
19-20 with two buffers, 11 with three or four, where the kept arrays are taken again every call)."""

ZERO_COPY_BYTES = 1 << 20
"""Host inputs up to this size are read by the graph's copy kernel where they lie (page-locked
memory, addressable from the device; an inline upload starts where its message's bytes end,
anywhere, which the kernel allows for): nothing to queue on the host. Larger ones are copied by
the DMA engine (`cudaMemcpyAsync`, ~10 µs of a worker's CPU on the H200), faster than a kernel's
reads across the bus for that much (the small MLP's 401 KB batch: ~9 µs more GPU time read in
place than copied, on the H200)."""

PAGEABLE, MAPPED, LOCKED = 0, 1, 2
"""What `_pinned` says of a host array's memory: ordinary; CuPy's page-locked memory (the device
reads it at its host address); page-locked memory of another owner (copied by the DMA engine)."""


class _Staging:
    """One staging buffer in pinned host memory (capture.StagingLayout) and what its launch reads."""

    __slots__ = (
        "bound",
        "done",
        "done_ptr",
        "early_views",
        "held",
        "host_views",
        "in_table",
        "made",
        "made_ptr",
        "mem",
        "out_table",
        "ptr",
        "region_ptrs",
        "slot_views",
        "sources",
        "templates",
        "uses",
    )

    def __init__(
        self, xp: Any, plan: Plan, layout: cap.StagingLayout, n_rows: int, slots: Any, early: Sequence[int]
    ) -> None:
        self.mem = xp.cuda.alloc_pinned_memory(layout.nbytes)
        self.ptr: int = self.mem.ptr  # page-locked: the same address on the device
        host = np.frombuffer(self.mem, np.uint8, layout.nbytes)
        self.in_table = host[layout.inputs_at : layout.outputs_at].view(np.uint64).reshape(-1, 3)
        out_end = layout.outputs_at + 24 * n_rows
        self.out_table = host[layout.outputs_at : out_end].view(np.uint64).reshape(-1, 3)
        # The early outputs' host copies, which the first graph writes (see CapturedPlan._row_values).
        specs = [plan.specs[v] for v in early]
        self.early_views: list[np.ndarray] = [
            host[at : at + s.nbytes].view(s.dtype).reshape(s.shape) for s, at in zip(specs, layout.early_at)
        ]
        self.uses = 0  # calls staged in this buffer: a launch's early copies last until the next one
        # Per output row (those up to KEPT_OUTPUT_BYTES): the array whose memory this buffer's
        # calls give their result in, as a new view of it each call. A call takes it again once
        # nothing else holds it, or its memory (no result, view or alias of it lives: its last
        # reader was queued before this launch), else makes a new one and writes its address in
        # this buffer's output table (CapturedPlan._make_outputs).
        self.templates: list[Any] = []
        # What the input table's source addresses (with its sizes) hold now; None: unknown.
        self.sources: list[int] | None = None
        self.slot_views = [
            host[at : at + s.np_dtype.itemsize].view(s.np_dtype) for s, at in zip(slots, layout.slots_at)
        ]
        # Host inputs: their pinned region (written by a replay, copied to the fixed buffer).
        self.host_views: list[np.ndarray | None] = [
            None if at is None else host[at : at + s.nbytes].view(s.dtype).reshape(s.shape)
            for s, at in zip(plan.graph.inputs, layout.hosts_at)
        ]
        self.region_ptrs: list[int] = [0 if at is None else self.ptr + at for at in layout.hosts_at]
        self.in_table[:] = 0
        self.out_table[:] = 0
        self.done = xp.cuda.Event(block=False, disable_timing=True)
        self.made = xp.cuda.Event(block=False, disable_timing=True)  # the early outputs are made
        self.done_ptr: int = self.done.ptr
        self.made_ptr: int = self.made.ptr
        self.held: list[Any] = []  # host arrays its launch reads
        self.bound: list[Any] | None = None  # the bindings its slots hold


def _pinned(xp: Any, a: np.ndarray) -> int:
    """Whether a host array lives in page-locked memory: PAGEABLE, MAPPED or LOCKED.

    Known from what owns the memory where the chain of bases says (CuPy's pinned memory: MAPPED;
    memory NumPy or Python allocated: PAGEABLE); the driver is asked only about other owners (in a
    worker on the H200, under cProfile, `pointerGetAttributes` took 16 µs a call, twice a step).
    """
    owner: Any = a
    pinned = getattr(xp.cuda, "PinnedMemoryPointer", None)
    for _ in range(8):
        if pinned is not None and type(owner) is pinned:
            return MAPPED
        if isinstance(owner, np.ndarray):
            if owner.base is None:
                return PAGEABLE  # NumPy's own allocation (malloc)
            owner = owner.base
        elif isinstance(owner, memoryview):
            owner = owner.obj
        elif isinstance(owner, (bytes, bytearray)):
            return PAGEABLE
        else:
            break
    try:
        locked = int(xp.cuda.runtime.pointerGetAttributes(_address(a)).type) == _HOST_MEMORY
    except Exception:  # noqa: BLE001 - a driver that refuses a pageable pointer: not pinned
        return PAGEABLE
    return LOCKED if locked else PAGEABLE


_HOST_MEMORY = 1  # cudaMemoryTypeHost


def _address(a: np.ndarray) -> int:
    """A host array's address (a little cheaper than `a.ctypes.data`)."""
    return int(a.__array_interface__["data"][0])


def _same_values(values: list[Scalar], bound: list[Scalar] | None) -> bool:
    """Whether binding values (as check_bindings gives them: each position always of one type)
    fill the slots as `bound` did: equal, and a float zero of the same sign (0.0 == -0.0)."""
    if bound is None or values != bound:
        return False
    if 0 in values:
        for v, b in zip(values, bound):
            if type(v) is float and v == 0 and math.copysign(1.0, v) != math.copysign(1.0, cast(float, b)):
                return False
    return True


def _same_bindings(given: list[Scalar], last: list[Scalar], types: list[type], zeros: Sequence[int]) -> bool:
    """Whether bindings as a call gives them are the last call's (`last`, of `types`, with a float
    binding zero at `zeros`): equal, of the same types (1, 1.0 and True are equal), and each float
    zero of the same sign (0.0 == -0.0)."""
    if given != last or list(map(type, given)) != types:
        return False
    for j in zeros:
        if math.copysign(1.0, given[j]) != math.copysign(1.0, last[j]):
            return False
    return True


class CapturedPlan:
    """One plan as CUDA graphs with its own staging, input buffers and arena (see the module doc)."""

    def __init__(self, capturer: Capturer, plan: Plan, host: Sequence[bool]) -> None:
        xp = capturer.xp
        self._c = capturer
        self.plan = plan
        graph = plan.graph
        runtime = xp.cuda.runtime
        # What every replay calls, looked up once.
        self._get_device = runtime.getDevice
        self._device_id = capturer.device_id
        self._current_stream = xp.cuda.get_current_stream
        self._record = runtime.eventRecord
        self._wait = runtime.eventSynchronize
        self._graph_launch = runtime.graphLaunch
        self._memcpy = runtime.memcpyAsync
        self._h2d = runtime.memcpyHostToDevice
        self._new_array = xp.ndarray  # what cupy.empty calls, without its Python wrapper
        self._xp = xp
        self._n_inputs = len(graph.inputs)
        self._input_specs = [(np.dtype(s.dtype), s.shape) for s in graph.inputs]  # (dtype, shape) each
        self._in_nbytes = [s.nbytes for s in graph.inputs]
        self._first_node = graph.first_node_value
        # The last call's bindings as given, their types, and as check_bindings gave them.
        self._given: list[Scalar] | None = None
        self._given_types: list[type] = []
        self._given_zeros: list[int] = []
        self._checked: list[Scalar] = []
        self._float_bindings = tuple(j for j, kind in enumerate(graph.bindings) if kind == "float")
        # Outputs: node values get a copy-table row each (once, however often listed); inputs are
        # returned as they came, as the eager path returns them.
        self._node_outputs = tuple(dict.fromkeys(v for v in plan.outputs if v >= self._first_node))
        # Two graphs where a small output is made early: its outputs' rows come first.
        self._split = cap.early_split(plan)
        if self._split is not None:
            early = self._split.outputs
            self._node_outputs = early + tuple(v for v in self._node_outputs if v not in early)
        self._n_early = n_early = 0 if self._split is None else len(self._split.outputs)
        early = self._node_outputs[:n_early]
        # The output table's rows: first the early outputs into their host copies in the staging
        # buffer, then every node output into the array made for it (its row in `_node_outputs`
        # plus n_early). The first graph copies out the rows up to 2 * n_early, the second the rest.
        self._row_values = early + self._node_outputs
        n_rows = len(self._row_values)
        self._slots = cap.binding_slots(plan)
        self._slot_index = {(s.value, s.dtype): k for k, s in enumerate(self._slots)}
        self._checks = cap.host_checks(plan)
        self._layout = cap.staging_layout(
            n_rows,
            self._slots,
            [s.nbytes if h else None for s, h in zip(graph.inputs, host)],
            [plan.specs[v].nbytes for v in early],
        )
        layout = self._layout
        size = layout.nbytes
        self._staging = [
            _Staging(xp, plan, layout, n_rows, self._slots, early) for _ in range(STAGING_BUFFERS)
        ]
        self._turn = 0
        self._staged = 0  # the staging buffer of the last call staged
        self._dev_mem = self._c.pool.malloc(cap.aligned(size))
        self._dev_ptr: int = self._dev_mem.ptr
        self._slot_arrays = [
            xp.ndarray((), s.np_dtype, memptr=self._dev_mem + at)
            for s, at in zip(self._slots, layout.slots_at)
        ]
        # The fixed buffer of a host input is its region's device copy.
        self._fixed = [
            xp.empty(s.shape, s.dtype)
            if at is None
            else xp.ndarray(s.shape, s.dtype, memptr=self._dev_mem + at)
            for s, at in zip(graph.inputs, layout.hosts_at)
        ]
        for staging in self._staging:
            for row, array in zip(staging.in_table, self._fixed):
                row[1] = array.data.ptr
            for row, v in zip(staging.out_table, self._row_values):
                row[2] = plan.specs[v].nbytes
            for row, at in zip(staging.out_table, layout.early_at):
                row[1] = staging.ptr + at  # page-locked: the same address on the device
        self._fixed_ptrs = [a.data.ptr for a in self._fixed]
        self._out_specs = [(plan.specs[v].shape, np.dtype(plan.specs[v].dtype)) for v in self._node_outputs]
        # Each result: (input number, None) for an input returned as it came, else (0, its row).
        row_of = {v: j for j, v in enumerate(self._node_outputs)}
        self._result_of = [(v, None) if v < self._n_inputs else (0, row_of[v]) for v in plan.outputs]
        # The results a replay marks readable after the first graph: (result, its host copy).
        self._early_results = tuple(
            (k, row_of[v])
            for k, v in enumerate(plan.outputs)
            if v >= self._first_node and row_of[v] < n_early
        )
        self._in_grid = _grid([a.nbytes for a in self._fixed])
        # Each graph's steps and output rows: [(first step, end step, first row, end row), ...].
        n_steps = len(plan.steps)
        if self._split is None:
            self._parts = [(0, n_steps, 0, n_rows)]
        else:
            cut = self._split.at
            self._parts = [(0, cut, 0, 2 * n_early), (cut, n_steps, 2 * n_early, n_rows)]
        # What each graph's first node copies from its staging buffer to the device (byte range):
        # the first, the tables and the slots; the second, the rows of the outputs made after the
        # first launch (see `_replay`).
        tables_end = layout.outputs_at + 24 * n_rows + 8 * len(self._slots)
        self._heads = [(0, tables_end)]
        if self._split is not None:
            self._heads.append((layout.outputs_at + 24 * 2 * n_early, layout.outputs_at + 24 * n_rows))
        self._args = [self._step_args(step) for step in plan.steps]
        self._values: list[Any] = []
        # The device array each fixed buffer holds a copy of (weakly), or None: unknown, or not one.
        self._copied: list[weakref.ref[Any] | None] = [None] * self._n_inputs
        self._arena: Any = None
        self._graphs: list[list[Any]] = []  # per staging buffer, its graphs
        self._execs: list[tuple[int, ...]] = []  # their cudaGraphExec_t handles
        # The outputs up to the first too large to keep have templates (see _Staging.templates).
        kept = next(
            (j for j, v in enumerate(self._node_outputs) if plan.specs[v].nbytes > KEPT_OUTPUT_BYTES), None
        )
        n_kept = len(self._node_outputs) if kept is None else kept
        for staging in self._staging:
            staging.templates = [None] * n_kept
        self._fixed_bytes = (
            cap.aligned(size)
            + STAGING_BUFFERS * size
            + sum(cap.aligned(a.nbytes) for a, at in zip(self._fixed, layout.hosts_at) if at is None)
            + STAGING_BUFFERS * sum(cap.aligned(plan.specs[v].nbytes) for v in self._node_outputs[:n_kept])
        )

    @property
    def nbytes(self) -> int:
        """Device and pinned memory this capture holds."""
        return self._fixed_bytes + (0 if self._arena is None else int(self._arena.mem.size))

    # -- staging -----------------------------------------------------------------------------------

    def _check(self, inputs: Sequence[Any], bindings: Sequence[Scalar]) -> list[Scalar]:
        """This call's bindings as the ops take them, after checking its inputs' dtypes and shapes
        and (unless they are the last call's) its bindings as the eager path does."""
        if [(a.dtype, a.shape) for a in inputs] != self._input_specs:
            check_inputs(self.plan, inputs)  # says which input does not match
        given = list(bindings)
        if self._given is not None and _same_bindings(
            given, self._given, self._given_types, self._given_zeros
        ):
            return self._checked
        self._given = None
        values = check_bindings(self.plan, given)
        self._given_zeros = [j for j in self._float_bindings if given[j] == 0]
        self._checked, self._given_types, self._given = values, list(map(type, given)), given
        return values

    def _stage(self, inputs: Sequence[Any], bindings: Sequence[Scalar], whole: bool = True) -> _Call:
        """Fill the next staging buffer with this call's addresses, bindings and host inputs; with
        `whole` false (a split plan's replay), its outputs up to the early ones only."""
        values = self._check(inputs, bindings)
        for check in self._checks:
            cap.check_indices(check, inputs[check.input])
        n_in = self._n_inputs
        self._staged = self._turn
        staging = self._staging[self._turn]
        staging.uses += 1  # its early copies are this call's from now on
        self._wait(staging.done_ptr)  # the launch that last read this buffer has finished
        staging.held = []
        # The same binding values as this buffer last held (a jitted step's constants): its slots
        # hold them already.
        if values is not staging.bound and not _same_values(values, staging.bound):
            staging.bound = None
            for slot, view in zip(self._slots, staging.slot_views):
                try:
                    view[0] = cap.slot_value(slot, values[slot.value - n_in])
                except (OverflowError, ValueError, TypeError) as e:
                    raise cap.StagingError(str(e)) from e
            staging.bound = values
        call = _Call(staging)
        copied = self._copied
        now: list[weakref.ref[Any] | None] = [None] * n_in
        call.copied = now
        held = call.held
        # Whole columns at once: a numpy row per input costs more than the rest of the loop.
        sources: list[int] = []
        sizes: list[int] = []
        for k, (given, region) in enumerate(zip(inputs, staging.host_views)):
            a: Any = given
            if isinstance(a, np.ndarray):
                nbytes = a.nbytes
                kind = _pinned(self._xp, a) if nbytes and a.flags.c_contiguous else PAGEABLE
                if kind:
                    held.append(a)
                    address = _address(a)
                    # The copy kernel reads it where it is, else the DMA engine copies it.
                    if kind == MAPPED and nbytes <= ZERO_COPY_BYTES:
                        sources.append(address)
                        sizes.append(nbytes)
                    else:
                        call.direct.append((self._fixed_ptrs[k], address, nbytes))
                        sources.append(0)
                        sizes.append(0)
                    continue
                if region is not None:  # into the pinned region, read from there
                    np.copyto(region, a)
                    if nbytes <= ZERO_COPY_BYTES:
                        sources.append(staging.region_ptrs[k])
                        sizes.append(nbytes)
                    else:
                        call.direct.append((self._fixed_ptrs[k], staging.region_ptrs[k], nbytes))
                        sources.append(0)
                        sizes.append(0)
                    continue
                a = self._xp.asarray(a)
                call.keep.append(a)
            elif not a._c_contiguous:  # what a.flags says, without making a Flags object
                a = self._xp.ascontiguousarray(a)
                call.keep.append(a)
            else:
                # A device array never changes once made (results are new arrays; only a dying
                # intermediate is written into): the one the fixed buffer holds needs no copy.
                last = copied[k]
                now[k] = last if last is not None and last() is a else weakref.ref(a)
                if now[k] is last:
                    sources.append(0)
                    sizes.append(0)
                    continue
            sources.append(a.data.ptr)
            sizes.append(self._in_nbytes[k])
        # A training loop's inputs (the last call's results, views of the other buffer's kept
        # arrays) and outputs are where they were the last time this buffer was used.
        known = staging.sources
        if sources != known:
            staging.sources = None
            table = staging.in_table
            if known is None:
                table[:, 0] = sources
                table[:, 2] = sizes
            else:  # a batch's new address: one row, not the columns
                for k, (source, was) in enumerate(zip(sources, known)):
                    if source != was:
                        table[k, 0] = source
                        table[k, 2] = sizes[k]
            staging.sources = sources
        call.inputs = inputs
        # Where the plan is split, only the early outputs are made before the first launch: the
        # rest are made while the GPU runs the first graph (`_replay`).
        self._make_outputs(call, 0, len(self._out_specs) if whole else self._n_early)
        if whole:
            self._results(call)
        return call

    def _make_outputs(self, call: _Call, lo: int, hi: int) -> None:
        """Node outputs lo..hi-1 (in `_node_outputs` order) appended to `call.made`; where one is
        a new array, its row of the staging buffer's output table says where it is."""
        staging = call.staging
        templates = staging.templates
        made = call.made
        n_kept = len(templates)
        n_early = self._n_early
        count = sys.getrefcount
        idle, idle_data, idle_mem = _IDLE
        for j in range(lo, hi):
            if j < n_kept:
                # Taken again if nothing else holds it, its memory pointer or its memory. (No other
                # local may hold the template while they are counted.)
                t = templates[j]
                if (
                    t is None
                    or count(t) != idle
                    or count(t.data) != idle_data
                    or count(t.data.mem) != idle_mem
                ):
                    shape, dtype = self._out_specs[j]
                    t = self._new_array(shape, dtype)  # the old one (if any) lives on in its result
                    staging.out_table[n_early + j, 1] = t.data.ptr
                    templates[j] = t
                made.append(t.view())
                continue
            shape, dtype = self._out_specs[j]  # too large to keep: a new array from the pool
            out = self._new_array(shape, dtype)
            staging.out_table[n_early + j, 1] = out.data.ptr
            made.append(out)

    def _results(self, call: _Call) -> None:
        made, inputs = call.made, call.inputs
        call.results = [inputs[k] if fresh is None else made[fresh] for k, fresh in self._result_of]
        call.inputs = ()

    def _send(self, call: _Call, stream_ptr: int) -> None:
        """Queue the DMA copies of a staged call's large host inputs (ZERO_COPY_BYTES)."""
        memcpy, h2d = self._memcpy, self._h2d
        for dst, src, nbytes in call.direct:
            memcpy(dst, src, nbytes, h2d, stream_ptr)

    def _sent(self, call: _Call, stream_ptr: int) -> None:
        """After the launch: the staging buffer and the host inputs stay ours until it has run."""
        self._copied = call.copied
        staging = call.staging
        self._record(staging.done_ptr, stream_ptr)
        staging.held = call.held
        self._turn = (self._turn + 1) % STAGING_BUFFERS

    # -- the body: what the graph does -------------------------------------------------------------

    def _step_args(self, step: Step) -> list[tuple[bool, int]]:
        """How to gather a step's args: `(False, value)` a value, `(True, slot)` a binding slot."""
        if step.op == FUSED:
            return [(False, v) for v in step.inputs]  # bindings are the kernel's own (fused_slots)
        dtypes = cap.step_slots(step, self._n_inputs, self._first_node)
        return [
            (False, v) if d is None else (True, self._slot_index[(v, d)]) for v, d in zip(step.inputs, dtypes)
        ]

    def _run_step(self, step: Step, args: list[Any], into: Any) -> Any:
        """One step's result; written into `into` (a dying input's buffer) where that is not None."""
        xp = self._c.xp
        op, spec = step.op, step.out_spec
        if op == FUSED:
            call = [
                args[i] if d is None else self._slot_arrays[self._slot_index[(step.inputs[i], d)]]
                for i, d in step.kernel.source.params
            ]
            return step.kernel.launch(call, spec, into)
        if into is not None:
            return self._c.backend.into_table[op](xp, args, step, into)
        if op == "matmul" and spec.dtype in nvmath_matmul.FLOAT_DTYPES:
            return self._c.gemm.matmul(args[0], args[1], spec.dtype)
        if op == "full":
            out = xp.empty(spec.shape, spec.dtype)
            out[...] = args[0]
            return out
        if op == "rand":
            return rng.uniform(xp, args[0], spec.shape, spec.dtype)
        if op == "randn":
            return rng.normal(xp, args[0], spec.shape, spec.dtype)
        if op == "take":  # its indices were checked on the host when staged (capture.host_checks)
            return xp.take(args[0], wide_indices(args[1]), axis=step.attrs["axis"])
        return self._c.backend.op_table[op](xp, args, step)

    def _body(self, stream_ptr: int, staging: _Staging, part: int, sizing: bool, head: bool = True) -> None:
        """Part `part`'s work (see `_parts`), reading `staging`'s tables: run for real (`sizing`,
        the sizing run) or captured; without its head (`head` false: the part before it, in the
        same graph, copied its rows). The values live on from one part to the next; the last part
        drops them."""
        xp, layout = self._c.xp, self._layout
        runtime = xp.cuda.runtime
        first, end, lo, hi = self._parts[part]
        head_at, head_end = self._heads[part] if head else (0, 0)
        if head_end > head_at:  # this staging buffer's tables and slots, as they are at launch
            words = (
                np.uint64(staging.ptr + head_at),
                np.uint64(self._dev_ptr + head_at),
                np.uint64((head_end - head_at) // 8),
            )
            self._c.copy_words((1,), (_THREADS,), words)
        if part == 0:
            if self._n_inputs:
                table = xp.ndarray((self._n_inputs, 3), np.uint64, memptr=self._dev_mem + layout.inputs_at)
                self._c.copy_kernel((self._in_grid, self._n_inputs), (_THREADS,), (table,))
            self._values = [None] * len(self.plan.specs)
            self._values[: self._n_inputs] = self._fixed
        values = self._values
        into_ops = self._c.backend.into_table
        steps = self.plan.steps
        for step, how in zip(steps[first:end], self._args[first:end]):
            args = [self._slot_arrays[k] if slot else values[k] for slot, k in how]
            # The plan's in-place reuse, checked as the eager run loop checks it, so the arena's
            # high point is the eager run's.
            buf = None
            if step.into is not None and (step.op == FUSED or step.op in into_ops):
                buf = exclusive_buffer(values, step.into, step.inputs.count(step.into))
            out = xp.asarray(self._run_step(step, args, buf))
            del args, buf
            if sizing and (
                out.dtype != np.dtype(step.out_spec.dtype) or tuple(out.shape) != step.out_spec.shape
            ):
                raise cap.CaptureRefused(f"{step.label} gave {out.dtype} {tuple(out.shape)} when captured")
            values[step.out] = out
            del out
            for v in step.free:
                values[v] = None
        if part == len(self._parts) - 1:
            self._values = []  # this part's sources below are the last references
        if hi == lo:
            return
        rows = self._row_values[lo:hi]
        contiguous: dict[int, Any] = {}
        for v in rows:
            if v not in contiguous:
                contiguous[v] = xp.ascontiguousarray(values[v])
        sources = [contiguous[v] for v in rows]
        del values, contiguous
        for row, a in zip(staging.out_table[lo:hi], sources):
            row[0] = a.data.ptr
        at = layout.outputs_at + 24 * lo
        if sizing:  # the sources became known after the head's copy; a capture's stay fixed
            runtime.memcpyAsync(
                self._dev_ptr + at,
                staging.ptr + at,
                24 * (hi - lo),
                runtime.memcpyHostToDevice,
                stream_ptr,
            )
        table = xp.ndarray((hi - lo, 3), np.uint64, memptr=self._dev_mem + at)
        grid = _grid([self.plan.specs[v].nbytes for v in rows])
        self._c.copy_kernel((grid, hi - lo), (_THREADS,), (table,))

    def launch(self, stream: Any) -> None:
        """Launch the graphs of the last call alone, with what it staged (a bench's look at the
        GPU time)."""
        for graph in self._graphs[self._staged]:
            graph.launch(stream)

    @property
    def graphs(self) -> int:
        """How many graphs a replay launches: 1, or 2 where an early output splits the plan and
        the driver cannot record its event inside one graph."""
        return len(self._graphs[0]) if self._graphs else 0

    @property
    def split(self) -> bool:
        """Whether its early outputs are readable before the rest of a replay has run."""
        return self._split is not None

    # -- capture and replay ------------------------------------------------------------------------

    def capture(self, inputs: Sequence[Any], bindings: Sequence[Scalar]) -> list[Any]:
        """Run the body for this call (sizing the arena), then capture it; this call's outputs."""
        c = self._c
        xp = c.xp
        call = self._stage(inputs, bindings)
        current = xp.cuda.get_current_stream()
        sizing = cap.ArenaLayout()
        try:
            with xp.cuda.using_allocator(self._allocator(sizing, None)):
                c.gemm.bind(current.ptr)
                self._send(call, current.ptr)
                for part in range(len(self._parts)):
                    self._body(current.ptr, call.staging, part, True)
        except cap.CaptureRefused:
            raise
        except Exception as e:  # the eager path runs it instead and, if the plan is at fault, says why
            raise cap.CaptureRefused(f"running a plan for capture failed: {type(e).__name__}: {e}") from e
        current.synchronize()  # the sizing run has read the staging buffer we now change
        self._copied = call.copied
        results = call.results
        del call
        try:
            self._arena = c.pool.malloc(max(cap.ALIGN, sizing.high_water))
        except xp.cuda.memory.OutOfMemoryError as e:
            raise cap.CaptureRefused(f"no device memory for a {sizing.high_water}-byte arena", results) from e
        stream = c.stream
        # A split plan as one graph that records its buffer's `made` event after the early
        # outputs (one launch and no event to record a replay), else as two graphs.
        record = c.record_node if self._split is not None else None
        try:
            with stream:
                c.gemm.bind(stream.ptr)
                try:
                    variants = [self._capture(stream, s, sizing.high_water, record) for s in self._staging]
                except Exception as e:
                    if record is None:
                        raise
                    reason = f"{type(e).__name__}: {e}"
                    if reason not in _LOGGED:
                        _LOGGED.add(reason)
                        log.info("a split plan is captured as two graphs: %s", reason)
                    self._values = []
                    variants = [self._capture(stream, s, sizing.high_water, None) for s in self._staging]
        except BaseException as e:
            self._values = []
            self._arena = None
            raise cap.CaptureRefused(f"capturing a plan failed: {type(e).__name__}: {e}", results) from e
        for graphs in variants:
            for graph in graphs:
                graph.upload(current)
        self._graphs = variants
        self._execs = [tuple(int(g.graphExec) for g in graphs) for graphs in variants]
        return results

    def _capture(
        self, stream: Any, staging: _Staging, arena_bytes: int, record: Callable[[int, int], None] | None
    ) -> list[Any]:
        """The graphs of `staging`'s replays, captured on `stream`: one per part, or (a split plan,
        given `record`: Capturer.record_node) one for both, recording `staging.made` between them."""
        arena = cap.ArenaLayout(limit=arena_bytes)
        graphs = []
        with self._xp.cuda.using_allocator(self._allocator(arena, self._arena)):
            for part in range(1 if record is not None else len(self._parts)):
                stream.begin_capture()
                try:
                    self._body(stream.ptr, staging, part, False)
                    if record is not None:
                        record(staging.made_ptr, stream.ptr)
                        self._body(stream.ptr, staging, 1, False, head=False)
                except BaseException:
                    # An invalidated capture ends in an error too; the first one is the one that matters.
                    with contextlib.suppress(Exception):
                        stream.end_capture()
                    raise
                graphs.append(stream.end_capture())
        return graphs

    def _allocator(self, layout: cap.ArenaLayout, arena: Any) -> Callable[[int], Any]:
        """A CuPy allocator placing blocks by `layout`: in `arena`, or (arena None: the sizing run)
        in memory from the pool, with the layout only counting."""
        memory = self._c.xp.cuda.memory
        pool, device = self._c.pool, self._c.device_id

        def alloc(nbytes: int) -> Any:
            offset = layout.alloc(nbytes)
            if arena is None:
                real = pool.malloc(nbytes)
                block = _Block(layout, offset, real)
                ptr = real.ptr
            else:
                block = _Block(layout, offset, None)
                ptr = arena.ptr + offset
            return memory.MemoryPointer(memory.UnownedMemory(ptr, nbytes, block, device), 0)

        return alloc

    def replay(self, inputs: Sequence[Any], bindings: Sequence[Scalar]) -> list[Any]:
        """This call's outputs, computed by one launch of the graph (or two, where it is split)."""
        if self._get_device() == self._device_id:  # as on a worker's threads: nothing to switch
            return self._replay(inputs, bindings)
        with self._c.xp.cuda.Device(self._device_id):
            return self._replay(inputs, bindings)

    def _replay(self, inputs: Sequence[Any], bindings: Sequence[Scalar]) -> list[Any]:
        xp = self._xp
        try:
            execs = self._execs[self._turn]
            two = len(execs) > 1
            call = self._stage(inputs, bindings, not two)
            stream_ptr: int = self._current_stream().ptr
            self._send(call, stream_ptr)
            self._graph_launch(execs[0], stream_ptr)
            if self._early_results:  # a split plan: the graph (or the host) records `made`
                staging = call.staging
                if two:
                    self._record(staging.made_ptr, stream_ptr)
                    try:
                        # The rest of the outputs; the second graph's head copies their rows.
                        self._make_outputs(call, self._n_early, len(self._out_specs))
                        self._results(call)
                    except BaseException:
                        self._sent(call, stream_ptr)  # the first graph reads this staging buffer
                        raise
                mark, results, uses, made = (
                    self._c.backend.mark_ready,
                    call.results,
                    staging.uses,
                    staging.made,
                )
                for k, j in self._early_results:
                    mark(results[k], made, _EarlyCopy(staging, j, uses).read)
                if two:
                    self._graph_launch(execs[1], stream_ptr)
            self._sent(call, stream_ptr)
        except cap.StagingError:
            raise  # nothing was launched: the fixed buffers hold what they held
        except ExecutionError:
            self._copied = [None] * self._n_inputs
            raise
        except xp.cuda.memory.OutOfMemoryError as e:
            self._copied = [None] * self._n_inputs
            raise OutOfMemory(f"captured graph: out of memory for its outputs: {e}") from e
        except Exception as e:
            self._copied = [None] * self._n_inputs
            raise ExecutionError(f"captured graph failed: {type(e).__name__}: {e}") from e
        # The pool reuses `call.keep`'s memory only for work queued after the launch.
        return call.results

    def free(self) -> None:
        """Give everything back (after the last launches have read their staging buffers)."""
        for staging in self._staging:
            staging.done.synchronize()
            staging.held = []
            staging.templates = []
        self._graphs = []
        self._execs = []
        self._arena = None
        self._fixed = []
        self._slot_arrays = []


class _EarlyCopy:
    """The host copy one launch's first graph wrote of an early output, in its staging buffer:
    `read()` (once the launch's `made` event has passed) gives a copy of it, or None once a later
    call has been staged in that buffer (its launch overwrites the copy)."""

    __slots__ = ("_index", "_staging", "_uses")

    def __init__(self, staging: _Staging, index: int, uses: int) -> None:
        self._staging = staging
        self._index = index
        self._uses = uses

    def read(self) -> np.ndarray | None:
        staging = self._staging
        if staging.uses != self._uses:
            return None
        host = staging.early_views[self._index].copy()
        return host if staging.uses == self._uses else None  # staged again meanwhile: maybe torn


class _Call:
    """One staged call: its staging buffer, the host inputs to copy with the DMA engine
    (destination, source, bytes), host arrays its launch reads, arrays to hold until the launch
    is queued, and its results."""

    __slots__ = ("copied", "direct", "held", "inputs", "keep", "made", "results", "staging")

    def __init__(self, staging: _Staging) -> None:
        self.staging = staging
        self.copied: list[weakref.ref[Any] | None] = []  # what each fixed buffer holds once it has run
        self.direct: list[tuple[int, int, int]] = []
        self.held: list[Any] = []
        self.keep: list[Any] = []
        self.inputs: Sequence[Any] = ()  # until the results are made from them and `made`
        self.made: list[Any] = []  # the node outputs' arrays, in `_node_outputs` order
        self.results: list[Any] = []


__all__ = ["CapturedPlan", "Capturer", "capturer_for"]
