"""Device: records ops into a pending segment and flushes it to an executor as one graph.

The recording path is the hot path of every training step, so it is plain lists and tuples:
`_record` appends `(op, refs, attrs)` and a weak reference to the new Value. A flush
(a read, `sync()`, or `MAX_PENDING` nodes) makes the segment's outputs exactly the pending
Values still alive (held by a Tensor, or saved for a backward pass); everything else is an
intermediate the executor frees after its last use. The segment's key (entries, input specs,
binding kinds, outputs) is looked up in a memo, so a repeated step reuses its Graph and graph id
without rebuilding, re-encoding or re-hashing anything.

Not thread-safe: use a Device from one thread.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Self

import numpy as np

from emberlink.client import segment
from emberlink.client import tensor as _tensor
from emberlink.client.dtypes import DEFAULT_FLOAT, DEFAULT_INT, dtype_name, scalar_dtype
from emberlink.client.executor import Call, DeviceStats, Executor
from emberlink.client.future import ArrayFuture
from emberlink.client.tensor import Scalar, Tensor, TensorDevice, create, norm_shape, scalar
from emberlink.client.value import Spec, Value
from emberlink.errors import DeviceError, DTypeError, RemoteError, ShapeError
from emberlink.graph_replay import canonical
from emberlink.graph_replay.backends import DeviceSpec, create_backend, parse_device
from emberlink.graph_replay.ir import Graph
from emberlink.protocol.dtypes import DTYPES, FLOAT_DTYPES

MAX_PENDING = 4096
"""Nodes recorded before a flush happens by itself."""

MAX_DROPS = 1024
"""Freed buffer ids collected before they are sent to the executor without waiting for a flush."""

_NATIVE = {np.dtype(name): name for name in DTYPES}

MEMO_LIMIT = 512
"""Segments whose graphs a Device remembers (oldest forgotten first)."""


class _Memo:
    __slots__ = ("binding_slots", "gid", "graph", "input_slots")

    def __init__(self, built: segment.Built, gid: bytes) -> None:
        self.graph: Graph = built.graph
        self.gid = gid
        self.input_slots = built.input_slots
        self.binding_slots = built.binding_slots


class Device:
    """Where tensors live and ops run: `Device.cpu()`, `Device.cuda(0)` or `Device.remote(ticket)`.

    A Device is a context manager; leaving it (or `close()`) frees everything it holds, and any op
    on it afterwards raises DeviceError.
    """

    def __init__(self, executor: Executor, name: str) -> None:
        """A device over `executor` (for executor authors; users call cpu(), cuda() or remote())."""
        self._executor = executor
        # An executor may offer host memory an upload is best copied into (LocalExecutor on a GPU:
        # page-locked memory, which a captured graph's DMA reads in place); optional.
        self._host_array: Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray | None] | None = getattr(
            executor, "host_array", None
        )
        self.name = name
        self._closed = False
        self._next_buf = 1
        self._dropped: list[int] = []
        self._memo: dict[tuple[Any, ...], _Memo] = {}
        self._graphs_built = 0
        self._memo_hits = 0
        self._flushes = 0
        self._outputs_kept = 0
        self._nodes_recorded = 0
        # emberlink.jit (client/trace.py): the trace that takes the next segment's graph; replays.
        self._jit_sink: Callable[[_Memo, Call, list[Value]], Call] | None = None
        self._jit_replays = 0
        # One-shot callables run on the reading thread right after a read is sent and before it
        # waits (emberlink.data's host loader uploads the next batch there: its bytes are sealed
        # and sent while this step runs, behind the step's own work on the wire).
        self._after_read_sent: list[Callable[[], None]] = []
        self._new_segment()

    # -- constructors -----------------------------------------------------------------------------

    @classmethod
    def cpu(cls) -> Device:
        """This process's CPU, through the NumPy backend."""
        return cls._local(DeviceSpec("cpu"))

    @classmethod
    def cuda(cls, index: int = 0) -> Device:
        """GPU `index` of this machine, through CuPy (`pip install 'emberlink[cuda13]'` or `[cuda12]`)."""
        return cls._local(DeviceSpec("cuda", index))

    @classmethod
    def local(cls, device: str = "cpu") -> Device:
        """A device of this machine named by a device string: `cpu`, `cuda`, `cuda:1`, or a kind
        registered in graph_replay/backends.py. ConfigError for an unknown kind."""
        return cls._local(parse_device(device))

    @classmethod
    def _local(cls, device: DeviceSpec) -> Device:
        from emberlink.client.local import LocalExecutor

        return cls(LocalExecutor(create_backend(device)), str(device))

    @classmethod
    def remote(
        cls,
        address: str,
        *,
        key: str | None = None,
        timeout: float = 30.0,
        resume_window: float | None = None,
    ) -> Device:
        """A worker's device: `address` is a ticket (`emberlink://...`) or `nats://host:port`.

        `key` is the client's key file (default `$EMBERLINK_KEY`, else
        `~/.config/emberlink/client.key`, created on first use). When the link drops, the session
        is resumed on a new one (any path) for `resume_window` seconds (default
        `$EMBERLINK_RESUME_WINDOW`, else 30; at most the worker's `--resume-window`; 0: never), with
        every tensor intact; after that, calls raise `WorkerLost`.
        """
        from emberlink.client.address import open_remote  # the remote stack loads on first use only

        executor = open_remote(address, key=key, timeout=timeout, resume_window=resume_window)
        return cls(executor, f"remote({address})")

    # -- lifetime ---------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"Device({self.name}{', closed' if self._closed else ''})"

    def __str__(self) -> str:
        return self.name

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free every buffer and release the executor; pending work is discarded. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._new_segment()
        self._dropped = []
        self._memo.clear()
        self._executor.close()

    def _check_open(self) -> None:
        if self._closed:
            raise DeviceError(f"device {self.name} is closed")

    # -- recording --------------------------------------------------------------------------------

    def _new_segment(self) -> None:
        self._entries: list[segment.Entry] = []
        self._weak: list[weakref.ref[Value]] = []
        self._in_bufs: list[int] = []
        self._in_slot: dict[int, int] = {}
        self._in_specs: list[Spec] = []
        self._bind_vals: list[Scalar] = []
        self._bind_kinds: list[str] = []

    def _record(self, op: str, ins: Sequence[Value | Scalar], attrs: tuple[Any, ...], spec: Spec) -> Value:
        """Append one node; `ins` are Values on this device or exact Python scalars."""
        if self._closed:
            raise DeviceError(f"{op}: device {self.name} is closed")
        refs = []
        for x in ins:
            if type(x) is Value:
                n = x.node
                if n is None:
                    buf = x.buf
                    s = self._in_slot.get(buf)  # type: ignore[arg-type]
                    if s is None:
                        s = len(self._in_bufs)
                        self._in_slot[buf] = s  # type: ignore[index]
                        self._in_bufs.append(buf)  # type: ignore[arg-type]
                        self._in_specs.append(x.spec)
                    refs.append(-1 - 2 * s)
                else:
                    refs.append(n)
            else:
                b = len(self._bind_vals)
                self._bind_vals.append(x)  # type: ignore[arg-type]
                self._bind_kinds.append("bool" if x is True or x is False else type(x).__name__)
                refs.append(-2 - 2 * b)
        entries = self._entries
        index = len(entries)
        entries.append((op, tuple(refs), attrs))
        v = Value(self, None, index, spec)
        self._weak.append(weakref.ref(v))
        if index + 1 >= MAX_PENDING or len(self._dropped) >= MAX_DROPS:
            self._flush_by_size()
        return v

    def _flush_by_size(self) -> None:
        trace = _tensor.JIT_TRACE
        if trace is None or not trace.holds_this_thread():  # emberlink.jit: a trace is one segment
            self.flush()

    def flush(self) -> None:
        """Send the pending segment to the executor (no wait); reads and `sync()` call this."""
        self._flush_work()
        self._send_drops()

    def _flush_work(self) -> None:
        """`flush` less the drops, which wait for the next work (emberlink.data's resident loader
        marks a step's end with this: a Drop of their own would be one more message a step)."""
        self._check_open()
        if _tensor.JIT_TRACE is not None:  # emberlink.jit refuses a flush inside a jitted function
            _tensor.JIT_TRACE.refuse(self, "flush or sync")
        if self._entries:
            self._send_segment()

    def _send_segment(self) -> None:
        entries, in_bufs, bind_vals = self._entries, self._in_bufs, self._bind_vals
        outputs: list[int] = []
        values: list[Value] = []
        for i, ref in enumerate(self._weak):
            v = ref()
            if v is not None:
                outputs.append(i)
                values.append(v)
        key = (tuple(entries), tuple(self._in_specs), tuple(self._bind_kinds), tuple(outputs))
        self._nodes_recorded += len(entries)
        self._new_segment()
        if not outputs:  # nothing recorded is still wanted
            return
        memo = self._memo.get(key)
        if memo is None:
            memo = self._build(key)
        else:
            self._memo_hits += 1
        base = self._next_buf
        self._next_buf = base + len(values)
        for j, v in enumerate(values):
            v.node = None
            v.buf = base + j
        slots = memo.input_slots
        inputs = tuple(in_bufs) if slots is None else tuple(in_bufs[s] for s in slots)
        slots = memo.binding_slots
        bindings = tuple(bind_vals) if slots is None else tuple(bind_vals[b] for b in slots)
        self._flushes += 1
        self._outputs_kept += len(values)
        call = Call(inputs, bindings, tuple(range(base, base + len(values))))
        if self._jit_sink is not None:  # emberlink.jit's trace keeps this graph (client/trace.py)
            call = self._jit_sink(memo, call, values)
        self._executor.execute(memo.graph, memo.gid, call)

    def _build(self, key: tuple[Any, ...]) -> _Memo:
        entries, in_specs, bind_kinds, outputs = key
        built = segment.build_graph(entries, in_specs, bind_kinds, outputs)
        memo = _Memo(built, canonical.graph_id(canonical.encode_graph(built.graph)))
        if len(self._memo) >= MEMO_LIMIT:
            del self._memo[next(iter(self._memo))]
        self._memo[key] = memo
        self._graphs_built += 1
        return memo

    def _send_drops(self) -> None:
        if self._dropped:
            dropped, self._dropped = self._dropped, []
            self._executor.drop(dropped)

    def _upload(self, array: np.ndarray) -> Value:
        """Store `array` (C-ordered, owned by us) as a new buffer."""
        self._check_open()
        name = _NATIVE.get(array.dtype)
        if name is None:
            name = array.dtype.name
            if name not in _NATIVE.values():
                raise DTypeError(f"dtype {name} is not supported; pass dtype= (e.g. 'float32' or 'int64')")
            array = array.astype(name)  # e.g. big-endian data: native byte order
        if len(self._dropped) >= MAX_DROPS:
            self._flush_by_size()
        buf = self._next_buf
        self._next_buf = buf + 1
        self._executor.upload(buf, array)
        return Value(self, buf, None, (name, array.shape))

    def _read(self, v: Value) -> np.ndarray:
        self._check_open()
        if _tensor.JIT_TRACE is not None:  # emberlink.jit refuses a read inside a jitted function
            _tensor.JIT_TRACE.refuse(self, "read")
        if v.node is not None:
            self.flush()
        # Work queued for while the read is on its way (the DataLoader's next batch) runs on this
        # thread right after the read is sent; over the raw tcp link, where this thread may do the
        # round trip itself, it runs while the thread owns the link, whose batches go from there.
        then = self._run_after_read_sent if self._after_read_sent else None
        return self._executor.read(v.buf, wait=True, after_sent=then).result()  # type: ignore[arg-type]

    def _run_after_read_sent(self) -> None:
        calls, self._after_read_sent = self._after_read_sent, []
        for call in calls:
            call()

    def _read_async(self, v: Value) -> ArrayFuture:
        """`_read` without the wait: the pending work and the read are sent before this returns. A
        failure to send them (the session is over) is the future's to raise, as a read's would be."""
        self._check_open()
        try:
            if v.node is not None:
                self.flush()
            fut = ArrayFuture(self._executor.read(v.buf), v.spec[1])  # type: ignore[arg-type]
        except RemoteError as e:
            return ArrayFuture.failed(e, v.spec[1])
        if self._after_read_sent:
            self._run_after_read_sent()
        return fut

    def sync(self) -> None:
        """Run everything recorded so far and wait; raises the first failure since the last sync."""
        self.flush()
        self._executor.sync()

    def stats(self) -> DeviceStats:
        """Counters: the executor's (bytes_sent, bytes_received, round_trips, graphs_registered,
        graph_replays, ...) and this client's: graphs_built (segments whose graph was new),
        graph_memo_hits (segments that reused one), flushes (graphs sent), outputs_kept (values
        materialized by flushes), nodes_recorded (flushed so far), pending_nodes, and jit_replays
        (calls of `emberlink.jit` functions that replayed a trace: no recording, no flush).
        """
        return {
            **self._executor.stats(),
            "graphs_built": self._graphs_built,
            "graph_memo_hits": self._memo_hits,
            "flushes": self._flushes,
            "outputs_kept": self._outputs_kept,
            "nodes_recorded": self._nodes_recorded,
            "pending_nodes": len(self._entries),
            "jit_replays": self._jit_replays,
        }

    def memory_stats(self) -> dict[str, int]:
        """in_use_bytes, peak_bytes and pool_bytes of the memory holding this device's tensors, with
        everything recorded so far applied: ops still pending and tensors already dropped count."""
        self.flush()
        return dict(self._executor.memory_stats())

    # -- creation ---------------------------------------------------------------------------------

    def tensor(self, data: Any, dtype: Any = None) -> Tensor:
        """A tensor holding a copy of `data` (a NumPy array, nested lists, a scalar, or a Tensor).

        NumPy data keeps its dtype unless `dtype` is given; Python data follows torch's defaults
        (floats -> float32, ints -> int64, bools -> bool).
        """
        self._check_open()
        if isinstance(data, Tensor):
            if data.device is not self:
                data = data.to(self)
            alias: Tensor = data.detach() if dtype is None else data.astype(dtype).detach()
            return alias
        want = None if dtype is None else dtype_name(dtype)
        if type(data) is np.ndarray and want is None:  # the per-step batch: keep it cheap
            staged = None if self._host_array is None else self._host_array(data.shape, data.dtype)
            if staged is not None:
                np.copyto(staged, data)
                array = staged
            else:
                array = np.array(data, order="C", copy=True)
        else:
            try:
                array = np.array(data, dtype=want, order="C", copy=True)
            except (TypeError, ValueError) as e:
                raise DTypeError(f"cannot make a tensor from {type(data).__name__}: {e}") from e
            python_floats = want is None and isinstance(data, list | tuple | float)
            if python_floats and array.dtype == np.float64:
                array = array.astype(DEFAULT_FLOAT)  # Python data: torch's default float
        return Tensor(self._upload(array))

    def zeros(self, shape: Any, dtype: Any = DEFAULT_FLOAT) -> Tensor:
        return create(self, "zeros", (), (("dtype", dtype_name(dtype)), ("shape", _shape(shape))))

    def ones(self, shape: Any, dtype: Any = DEFAULT_FLOAT) -> Tensor:
        return create(self, "ones", (), (("dtype", dtype_name(dtype)), ("shape", _shape(shape))))

    def full(self, shape: Any, fill_value: Scalar, dtype: Any = None) -> Tensor:
        """A tensor of `fill_value` (a binding: changing it does not change the graph)."""
        value = scalar(fill_value)
        if value is None:
            raise TypeError(f"full: fill_value must be a Python scalar, got {type(fill_value).__name__}")
        name = scalar_dtype(value) if dtype is None else dtype_name(dtype)
        return create(self, "full", (value,), (("dtype", name), ("shape", _shape(shape))))

    def arange(self, start: float, stop: float | None = None, step: float = 1, dtype: Any = None) -> Tensor:
        """`arange(n)` or `arange(start, stop, step)`: int64 for int arguments, else float32."""
        if stop is None:
            start, stop = 0, start
        nums = [scalar(x) for x in (start, stop, step)]
        if any(x is None or isinstance(x, bool) for x in nums):
            raise TypeError(
                f"arange: start, stop and step must be numbers, got {start!r}, {stop!r}, {step!r}"
            )
        all_int = all(isinstance(x, int) for x in nums)
        name = (DEFAULT_INT if all_int else DEFAULT_FLOAT) if dtype is None else dtype_name(dtype)
        kind = int if all_int and name not in FLOAT_DTYPES else float
        a, b, c = (kind(x) for x in nums)  # type: ignore[arg-type]
        if kind is float and not all(math.isfinite(x) for x in (a, b, c)):
            raise ValueError("arange: start, stop and step must be finite")
        return create(self, "arange", (), (("dtype", name), ("start", a), ("step", c), ("stop", b)))

    def eye(self, n: int, m: int | None = None, k: int = 0, dtype: Any = DEFAULT_FLOAT) -> Tensor:
        """An n x m matrix with ones on diagonal k."""
        m = n if m is None else m
        if int(n) < 0 or int(m) < 0:
            raise ShapeError(f"eye: sizes must be non-negative, got n={n}, m={m}")
        attrs = (("dtype", dtype_name(dtype)), ("k", int(k)), ("m", int(m)), ("n", int(n)))
        return create(self, "eye", (), attrs)

    def rand(self, shape: Any, *, seed: int, dtype: Any = DEFAULT_FLOAT) -> Tensor:
        """Uniform [0, 1) numbers from a counter-based generator: the same `seed` gives the same
        numbers on every backend. `seed` is a binding, so a new seed per step keeps the graph."""
        return create(self, "rand", (_seed(seed),), (("dtype", dtype_name(dtype)), ("shape", _shape(shape))))

    def randn(self, shape: Any, *, seed: int, dtype: Any = DEFAULT_FLOAT) -> Tensor:
        """Standard normal numbers (Box-Muller over `rand`'s generator); see `rand`."""
        return create(self, "randn", (_seed(seed),), (("dtype", dtype_name(dtype)), ("shape", _shape(shape))))


_IS_A_TENSOR_DEVICE: type[TensorDevice] = Device
"""What tensor.py knows of a device (it cannot import this module) is what a Device is: mypy checks."""


def _shape(shape: Any) -> tuple[int, ...]:
    out = norm_shape(shape)
    if any(d < 0 for d in out):
        raise ShapeError(f"negative dimension in shape {out}")
    return out


def _seed(seed: Any) -> int:
    s = scalar(seed)
    if isinstance(s, bool) or not isinstance(s, int):  # an int, or emberlink.jit's traced int
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return s
