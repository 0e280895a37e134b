"""The CuPy backend: the reference op table run on a CUDA GPU; imports CuPy only when constructed.

It reuses numpy_backend's definitions with `xp = cupy` and replaces only what CuPy lacks
(`scatter_add` works around the dtypes CUDA atomics lack) and, with `fast=True` (the default),
what a measurement asked for: `unfold`, `fold`, `softmax` and `log_softmax` run as one kernel
each (cupy_kernels.py), and float `matmul` goes through cuBLAS from nvmath-python when it is
installed, as captured plans do (nvmath_matmul.py), reading transposed and strided operands in
place where CuPy's matmul copies every batched operand that is not contiguous. `fast=False`
runs the reference for all of them, e.g. to compare against. The CuPy tests compare it op by op
with the NumPy reference on the same case table.

Each plan is run as a variant compiled once, the first time the backend sees it, and kept beside
it for as long as it lives: runs of elementwise steps whose inner values die inside the run become
one `cupy.ElementwiseKernel` each (fusion.py writes the source; identical chains share a kernel),
and elementwise results, fused or not, are written into a dying input's buffer where the plan
allows (plan.py). `fuse=False` or `reuse=False` turn either off, e.g. to compare against.

With `fast=True`, a large float32 elementwise step (fused or a single op) whose arrays are all
contiguous, of the output's shape or a row broadcast over it, runs four values a thread
(vector.py, `_Vectors`); measured there against CuPy's one value a thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from emberlink.errors import DeviceError, DTypeError
from emberlink.graph_replay import fusion, nvmath_matmul, vector
from emberlink.graph_replay.backend import Array, HostCopy, IntoFn, OpFn, Ready, run_plan
from emberlink.graph_replay.cupy_kernels import Kernels
from emberlink.graph_replay.ir import KIND_OF_DTYPE, Scalar, TensorSpec
from emberlink.graph_replay.numpy_backend import (
    INTO_TABLE,
    OP_TABLE,
    host_scalar,
    scatter_index,
    wide_indices,
)
from emberlink.graph_replay.plan import FUSED, Plan, Step, derive_plan, run_chain
from emberlink.protocol.dtypes import DTYPES

log = logging.getLogger(__name__)

_INSTALL_HINT = "pip install 'emberlink[cuda13]' (CUDA 13) or 'emberlink[cuda12]' (CUDA 12)"


def _import_cupy() -> Any:
    """The cupy module, or DeviceError saying what is missing."""
    try:
        import cupy
    except ImportError as e:
        raise DeviceError(f"CuPy is not installed or failed to import ({e}); {_INSTALL_HINT}") from e
    return cupy


def _scatter_add(xp: Any, args: Sequence[Any], step: Step) -> Array:
    """`cupy.add.at` on CUDA atomics: float16 accumulates in float32; int64, int16, int8 and uint8
    add as uint64 (int64's bits; CUDA has no signed 64-bit, 8- or 16-bit atomic add), then wrap to
    their dtype as NumPy's `add.at` does."""
    g, indices = args[0], wide_indices(args[1])
    dtype = step.out_spec.dtype
    index = scatter_index(step, indices)
    if KIND_OF_DTYPE[dtype] == "int" and dtype != "int32":
        out = xp.zeros(step.out_spec.shape, dtype=np.uint64)
        xp.add.at(out, index, g.astype(np.int64, copy=False).view(np.uint64))
        return out.view(np.int64).astype(dtype, copy=False)
    acc = "float32" if dtype == "float16" else dtype
    out = xp.zeros(step.out_spec.shape, dtype=acc)
    xp.add.at(out, index, g.astype(acc, copy=False))
    return out.astype(dtype, copy=False)


class _EagerMatmul:
    """Float matmuls of eager runs through nvmath-python's cuBLAS (bound to the current stream at
    each call), integer ones and all of them without nvmath-python through the reference. The
    handle and workspace are made on the first float matmul; a failure to make them is logged
    once and the reference serves from then on."""

    def __init__(self, xp: Any) -> None:
        self._xp = xp
        self._gemm: Any = None
        self._failed = False

    def __call__(self, xp: Any, args: Sequence[Any], step: Step) -> Array:
        dtype = step.out_spec.dtype
        gemm = self._gemm if dtype in nvmath_matmul.FLOAT_DTYPES else None
        if gemm is None and dtype in nvmath_matmul.FLOAT_DTYPES and not self._failed:
            gemm = self._make()
        if gemm is None:
            return OP_TABLE["matmul"](xp, args, step)
        gemm.bind(xp.cuda.get_current_stream().ptr)
        return gemm.matmul(args[0], args[1], dtype)

    def _make(self) -> Any:
        try:
            self._gemm = nvmath_matmul.Gemm(self._xp, nvmath_matmul.load())
        except Exception as e:  # noqa: BLE001 - ImportError without nvmath-python, or CUDA's, making the handle
            self._failed = True
            log.info("eager float matmuls run through CuPy's own matmul: %s: %s", type(e).__name__, e)
        return self._gemm


def _compile_error_type() -> type[BaseException]:
    """CuPy's error for a kernel CUDA will not compile (a type nothing raises, if CuPy lacks it)."""
    try:
        from cupy.cuda.compiler import CompileException
    except ImportError:

        class _NeverRaised(Exception):
            pass

        return _NeverRaised
    error: type[BaseException] = CompileException
    return error


class _Vectors:
    """The vector.py kernels one backend has compiled, by source and layout, and their launches."""

    __slots__ = ("_compile_error", "_cp", "_float32", "_functions", "_ndarray")

    def __init__(self, cp: Any, compile_error: type[BaseException]) -> None:
        self._cp = cp
        self._compile_error = compile_error
        self._functions: dict[tuple[str, str, str, str], Any] = {}
        self._ndarray = cp.ndarray
        self._float32 = np.dtype(np.float32)

    def __call__(
        self, source: fusion.KernelSource, call: Sequence[Any], shape: tuple[int, ...], out: Any
    ) -> Any:
        """`source` on its kernel arguments `call`, four values a thread, into `out` (None: a new
        array of `shape`); None where vector.layout refuses the call (the caller runs it as before)."""
        ndarray, f32 = self._ndarray, self._float32
        described: list[tuple[tuple[int, ...], bool, int] | None] = []
        for a in call:
            if isinstance(a, ndarray):
                if a.dtype != f32:
                    return None
                described.append((a.shape, a._c_contiguous, a.data.ptr))
            else:
                described.append(None)
        if out is not None and (
            out.dtype != f32 or out.shape != shape or not out._c_contiguous or out.data.ptr % vector.ALIGN
        ):
            return None
        letters = vector.layout(shape, described)
        if letters is None:
            return None
        function = self._function(source, letters)
        if function is None:
            return None
        if out is None:
            out = self._cp.empty(shape, np.float32)
        n4 = out.size // 4
        args: list[Any] = [a if isinstance(a, ndarray) else np.float32(a) for a in call]
        args += [out, np.int64(n4)]
        args += [np.int64(a.size // 4) for a, letter in zip(call, letters) if letter == vector.PERIOD]
        function((min(-(-n4 // 256), 8192),), (256,), tuple(args))
        return out

    def _function(self, source: fusion.KernelSource, letters: str) -> Any:
        key = (source.in_params, source.out_params, source.body, letters)
        if key in self._functions:
            return self._functions[key]
        function = self._cp.RawKernel(
            vector.kernel_code(source, letters), vector.kernel_name(source, letters)
        )
        try:
            function.compile()  # now, not at its first launch (which may be inside a capture)
        except self._compile_error as e:
            log.warning("CUDA did not compile the vector kernel of %s; it runs as before: %s", source.name, e)
            function = None
        self._functions[key] = function
        return function


class _FusedKernel:
    """A compiled chain: the ElementwiseKernel and how the fused step's args map onto it.

    Should CUDA refuse to compile a generated kernel, the chain runs member by member with the
    backend's own ops instead (same values, just unfused) and a warning is logged once; `broken`
    then holds the compiler's error (the GPU tests check it stays None). A large float32 call
    runs as a vector kernel where its layout allows (`vectors`, None on `fast=False`).
    """

    __slots__ = ("broken", "compile_error", "kernel", "source", "table", "vectors")

    def __init__(
        self,
        kernel: Any,
        source: fusion.KernelSource,
        table: dict[str, OpFn],
        compile_error: type[BaseException],
        vectors: _Vectors | None = None,
    ) -> None:
        self.kernel = kernel
        self.source = source
        self.table = table
        self.compile_error = compile_error
        self.broken: BaseException | None = None
        self.vectors = vectors if vectors is not None and vector.float32_only(source) else None

    def launch(self, call: Sequence[Any], spec: TensorSpec, out: Any = None) -> Any:
        """The kernel on its arguments `call` (the ElementwiseKernel's, in order): as a vector
        kernel where it can, else the ElementwiseKernel; into `out` where given."""
        if self.vectors is not None and spec.nbytes >= vector.MIN_BYTES:
            done = self.vectors(self.source, call, spec.shape, out)
            if done is not None:
                return done
        return self.kernel(*call) if out is None else self.kernel(*call, out)

    def __call__(self, xp: Any, step: Step, args: Sequence[Any], out: Any = None) -> Array:
        if self.broken is None:
            call = fusion.call_args(self.source, args, host_scalar)
            try:
                return self.launch(call, step.out_spec, out)
            except self.compile_error as e:
                self.broken = e
                log.warning(
                    "CUDA did not compile the fused kernel of %s; running it unfused: %s", step.label, e
                )
        result = run_chain(xp, self.table, step, args)
        if out is None:
            return result
        out[...] = result
        return out


class _VectorOp:
    """A fusable op's table entries on CuPy (`fast=True`): a large float32 step whose layout
    allows runs as a vector kernel of its own expression (a chain of one), anything else through
    the reference's entry as before."""

    __slots__ = ("_cp", "_into", "_plain", "_sources", "_vectors")

    def __init__(self, cp: Any, plain: OpFn, into: IntoFn | None, vectors: _Vectors) -> None:
        self._cp = cp
        self._plain = plain
        self._into = into
        self._vectors = vectors
        self._sources: dict[tuple[Any, ...], fusion.KernelSource | None] = {}

    def _source(self, step: Step) -> fusion.KernelSource | None:
        key = (
            step.op,
            step.operand_dtype,
            step.out_spec.dtype,
            tuple((s.dtype, s.weak) for s in step.in_specs),
            tuple(step.inputs.index(v) for v in step.inputs),
        )
        if key not in self._sources:
            source = None
            if fusion.fusable(step):
                source = fusion.kernel_source(dataclasses.replace(step, chain=(step,)))
                if not vector.float32_only(source):
                    source = None
            self._sources[key] = source
        return self._sources[key]

    def _vector(self, args: Sequence[Any], step: Step, out: Any) -> Any:
        spec = step.out_spec
        if spec.nbytes < vector.MIN_BYTES or spec.dtype != "float32":
            return None
        source = self._source(step)
        if source is None:
            return None
        ndarray = self._cp.ndarray
        call = [
            args[i] if dtype is None or isinstance(args[i], ndarray) else host_scalar(args[i], dtype)
            for i, dtype in source.params
        ]
        return self._vectors(source, call, spec.shape, out)

    def __call__(self, xp: Any, args: Sequence[Any], step: Step) -> Array:
        done = self._vector(args, step, None)
        return self._plain(xp, args, step) if done is None else done

    def into(self, xp: Any, args: Sequence[Any], step: Step, out: Any) -> Array:
        assert self._into is not None
        done = self._vector(args, step, out)
        return self._into(xp, args, step, out) if done is None else done


def _fused(xp: Any, args: Sequence[Any], step: Step) -> Array:
    return step.kernel(xp, step, args)


def _fused_into(xp: Any, args: Sequence[Any], step: Step, out: Any) -> Array:
    return step.kernel(xp, step, args, out)


PINNED_UNIT = 64 << 10
ASYNC_READ_BYTES = 1 << 20


def _wait(event: Any, timeout: float | None) -> None:
    """Until `event` has passed; TimeoutError after `timeout` seconds (None: no limit)."""
    if timeout is None:
        event.synchronize()
        return
    deadline = time.monotonic() + timeout
    while not event.done:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the copy to host memory did not finish within {timeout} s")
        time.sleep(1e-4)


class _Download:
    """A device-to-host copy into pinned memory, done when its event is."""

    __slots__ = ("_done", "_host")

    def __init__(self, host: np.ndarray, done: Any) -> None:
        self._host = host
        self._done = done

    def result(self, timeout: float | None = None) -> np.ndarray:
        _wait(self._done, timeout)
        return self._host

    def done(self) -> bool:
        return bool(self._done.done)


HostRead = Callable[[], np.ndarray | None]
"""A host copy of an array that its maker wrote to host memory itself (`mark_ready`): a new
NumPy array, or None once that copy is gone (then the array is copied from the device)."""


class _EarlyRead:
    """A read of an array with a host copy (`mark_ready`): done when the copy is written."""

    __slots__ = ("_array", "_backend", "_host", "_made", "_read")

    def __init__(self, backend: CupyBackend, a: Array, made: Any, read: HostRead) -> None:
        self._backend = backend
        self._array: Array = a
        self._made = made
        self._read = read
        self._host: np.ndarray | None = None

    def result(self, timeout: float | None = None) -> np.ndarray:
        if self._host is None:
            _wait(self._made, timeout)
            host = self._read()
            self._host = host if host is not None else self._backend.to_numpy(self._array)
            self._array = None
        return self._host

    def done(self) -> bool:
        return self._host is not None or bool(self._made.done)


class _Marked(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to an array a replay made early (`mark_ready`), with its id, the event
    after which its value is final and its host copy: one object a mark, no closure."""

    __slots__ = ("event", "host", "key")
    event: Any
    host: HostRead | None
    key: int


class CupyBackend:
    """Runs plans on one CUDA GPU. Memory figures come from CuPy's default memory pool."""

    name = "cupy"
    runs_inline = False

    def __init__(self, device: int = 0, *, fuse: bool = True, reuse: bool = True, fast: bool = True) -> None:
        cupy = _import_cupy()
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # CUDARuntimeError: no driver, no device
            raise DeviceError(f"CuPy is installed but no CUDA GPU or driver is usable: {e}") from e
        if count == 0:
            raise DeviceError("CuPy is installed but no CUDA GPU is visible (CUDA_VISIBLE_DEVICES?)")
        if not 0 <= device < count:
            raise DeviceError(f"no CUDA device {device}: this machine has {count}")
        self._cp = cupy
        self._device = cupy.cuda.Device(device)
        self._pool = cupy.get_default_memory_pool()
        self._peak = 0
        self.fuse = fuse
        self.reuse = reuse
        self.fast = fast
        self._compile_error = _compile_error_type()
        self.kernels = Kernels(cupy, self._compile_error)
        self._table: dict[str, OpFn] = {**OP_TABLE, "scatter_add": _scatter_add, FUSED: _fused}
        if fast:
            self._table.update(self.kernels.table())
            self._table["matmul"] = _EagerMatmul(cupy)
        self._into: dict[str, IntoFn] = {**INTO_TABLE, FUSED: _fused_into}
        self._vectors = _Vectors(cupy, self._compile_error) if fast else None
        if self._vectors is not None:
            for op in fusion.FUSABLE_OPS:
                if op in self._table:
                    entry = _VectorOp(cupy, self._table[op], self._into.get(op), self._vectors)
                    self._table[op] = entry
                    if op in self._into:
                        self._into[op] = entry.into
        self._oom: tuple[type[BaseException], ...] = (MemoryError, cupy.cuda.memory.OutOfMemoryError)
        self._variants: weakref.WeakKeyDictionary[Plan, Plan] = weakref.WeakKeyDictionary()
        self._kernels: dict[tuple[str, str, str], Any] = {}
        # id(array) -> a weak reference to it with the event after which its value is final and
        # its host copy or None: arrays a captured replay made before the rest of its work
        # (`mark_ready`), each forgotten when it goes (by one bound method, made once).
        ready: dict[int, _Marked] = {}

        def forget(ref: _Marked) -> None:  # (not a bound method: the backend would be in a cycle)
            if ready.get(ref.key) is ref:
                ready.pop(ref.key, None)

        self._ready = ready
        self._forget_ready: Callable[[_Marked], None] = forget
        self._side: Any = None

    # -- fusion -------------------------------------------------------------------------------------

    def fusable(self, step: Step) -> bool:
        return fusion.fusable(step)

    def build(self, step: Step) -> _FusedKernel:
        """The kernel of a fused step; chains with the same source share one (CuPy compiles it once)."""
        source = fusion.kernel_source(step)
        key = (source.in_params, source.out_params, source.body)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._cp.ElementwiseKernel(source.in_params, source.out_params, source.body, source.name)
            self._kernels[key] = kernel
        return _FusedKernel(kernel, source, self._table, self._compile_error, self._vectors)

    def plan_for(self, plan: Plan) -> Plan:
        """The variant of `plan` this backend runs (fused and reusing as configured), compiled once."""
        if not self.fuse and plan.reuse == self.reuse and not plan.keep_intermediates:
            return plan
        variant = self._variants.get(plan)
        if variant is None:
            try:
                variant = derive_plan(
                    plan, keep_intermediates=False, reuse=self.reuse, fusion=self if self.fuse else None
                )
            except (ValueError, TypeError, KeyError) as e:  # a kernel that cannot be built: run unfused
                log.warning("fusing a plan failed (%s: %s); running it unfused", type(e).__name__, e)
                variant = derive_plan(plan, keep_intermediates=False, reuse=self.reuse)
            self._variants[plan] = variant
        return variant

    # -- what graph capture (cuda_graph.py) builds on ---------------------------------------------------

    @property
    def xp(self) -> Any:
        """The cupy module."""
        return self._cp

    @property
    def pool(self) -> Any:
        """CuPy's memory pool, which `memory_stats` reports (captured graphs allocate from it too)."""
        return self._pool

    @property
    def device_id(self) -> int:
        return int(self._device.id)

    @property
    def op_table(self) -> dict[str, OpFn]:
        """Op name -> implementation, as `run` uses it."""
        return self._table

    @property
    def into_table(self) -> dict[str, IntoFn]:
        """Op name -> implementation writing into a dying input's buffer (`Step.into`)."""
        return self._into

    # -- Backend ------------------------------------------------------------------------------------

    def _sample(self, value: Any = None) -> None:
        self._peak = max(self._peak, int(self._pool.used_bytes()))

    def from_numpy(self, a: Any) -> Array:
        if str(a.dtype) not in DTYPES:
            raise DTypeError(f"dtype {a.dtype} is not one of {DTYPES}")
        with self._device:
            out = self._cp.asarray(a)
        self._sample()
        return out

    def mark_ready(self, a: Array, event: Any, host: HostRead | None = None) -> None:
        """`a`'s value is final once `event` (recorded on the current stream) has passed, though
        more work is queued after it: reads of `a` wait for that event only (cuda_graph.py's
        early outputs), then take `host()`, a copy its maker wrote to host memory, where given
        and still there. Forgotten when `a` goes."""
        ref = _Marked(a, self._forget_ready)
        ref.event, ref.host, ref.key = event, host, id(a)
        self._ready[ref.key] = ref

    def _ready_entry(self, a: Array) -> tuple[Any, HostRead | None] | None:
        """(the event after which `a` is final, its host copy or None), if a replay marked it."""
        entry = self._ready.get(id(a))
        if entry is None or entry() is not a:
            return None
        return entry.event, entry.host

    def _side_stream(self) -> Any:
        """The stream early reads copy on, beside the work still queued on the current one."""
        if self._side is None:
            self._side = self._cp.cuda.Stream(non_blocking=True)
        return self._side

    def to_numpy(self, a: Array) -> Any:
        entry = self._ready_entry(a) if self._ready else None
        if entry is None:
            with self._device:
                return self._cp.asnumpy(a)
        made, host = entry
        made.synchronize()  # a is final
        if host is not None:
            copied = host()
            if copied is not None:
                return copied
        with self._device:  # copy it beside the rest of its graph's work
            return self._cp.asnumpy(a, stream=self._side_stream())

    def to_numpy_async(self, a: Array) -> HostCopy:
        """A copy into pinned memory queued on the current stream (up to ASYNC_READ_BYTES; larger
        arrays are copied at once, so that they do not hold page-locked memory). An array marked
        ready (`mark_ready`) is copied on a side stream as soon as its event has passed, and work
        queued later on the current stream waits for that copy (it may reuse the array's memory);
        one with a host copy is read from that once its event has passed, with nothing queued."""
        if isinstance(a, np.ndarray):  # an upload still in host memory
            return Ready(np.array(a, copy=True))
        entry = self._ready_entry(a) if self._ready else None
        if entry is not None and entry[1] is not None:
            return _EarlyRead(self, a, entry[0], entry[1])
        if a.nbytes > ASYNC_READ_BYTES:
            return Ready(self.to_numpy(a))
        cp = self._cp
        with self._device:
            out = cp.cuda.alloc_pinned_memory(max(a.nbytes, 1))
            host = np.frombuffer(out, a.dtype, a.size).reshape(a.shape)
            done = cp.cuda.Event(block=False, disable_timing=True)
            made = None if entry is None else entry[0]
            if made is None:
                cp.asnumpy(a, out=host, blocking=False)
                done.record()
            else:
                side = self._side_stream()
                side.wait_event(made)
                cp.asnumpy(a, out=host, blocking=False, stream=side)
                done.record(side)
                cp.cuda.get_current_stream().wait_event(done)
        return _Download(host, done)

    def run(self, plan: Plan, inputs: Sequence[Array], bindings: Sequence[Scalar]) -> list[Array]:
        with self._device:
            return run_plan(
                self.plan_for(plan),
                inputs,
                bindings,
                xp=self._cp,
                table=self._table,
                into_table=self._into,
                oom_errors=self._oom,
                after_step=self._sample,
            )

    def nbytes(self, a: Array) -> int:
        return int(a.nbytes)

    def memory_stats(self) -> dict[str, int]:
        self._sample()
        return {
            "in_use_bytes": int(self._pool.used_bytes()),
            "peak_bytes": self._peak,
            "pool_bytes": int(self._pool.total_bytes()),
        }

    def reset_peak(self) -> None:
        """Make `peak_bytes` measure from now (it starts at what the pool has in use now)."""
        self._peak = int(self._pool.used_bytes())

    def synchronize(self) -> None:
        self._device.synchronize()

    def bind_thread(self) -> None:
        self._device.use()

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """Page-locked memory from CuPy's pinned pool, which the DMA engine reads in place. Sizes
        are rounded up to PINNED_UNIT so that a step's buffers, whose sizes vary by a few bytes,
        come back from the pool rather than from new (slow) page-locked allocations."""
        size = -(-max(nbytes, 1) // PINNED_UNIT) * PINNED_UNIT
        with self._device:
            memory = self._cp.cuda.alloc_pinned_memory(size)
        return np.frombuffer(memory, np.uint8, nbytes)

    def free_bytes(self) -> int:
        with self._device:
            free, _total = self._cp.cuda.runtime.memGetInfo()
        return int(free)


__all__ = ["CupyBackend"]
