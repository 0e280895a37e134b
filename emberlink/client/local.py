"""LocalExecutor: runs a Device's graphs on a graph_replay backend in this process; no network.

Plans are compiled once per graph id and replayed after that. The store maps the client's buffer
ids to backend arrays. A read starts a copy to host memory and returns its future at once. A
failed run poisons its outputs with an ExecutionError naming the op; a graph reading a poisoned
buffer passes the same error on, as a worker does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from emberlink.client.executor import Call, ExecutorStats
from emberlink.errors import EmberlinkError, ExecutionError, UnknownTensor
from emberlink.graph_replay.backend import Backend, HostCopy
from emberlink.graph_replay.captured import HostUploads, open_captures
from emberlink.graph_replay.ir import Graph


class _Failed:
    """A ReadFuture of a read that failed before it started."""

    __slots__ = ("_error",)

    def __init__(self, error: EmberlinkError) -> None:
        self._error = error

    def result(self, timeout: float | None = None) -> np.ndarray:
        raise self._error

    def done(self) -> bool:
        return True


PINNED_UPLOAD_BYTES = 64 << 10
"""Uploads from this size on go to page-locked memory on a GPU (`host_array`); smaller ones are
copied into a captured graph's staging buffer, which is cheaper than a pinned block of their own."""


class LocalExecutor:
    """The Executor of `Device.cpu()` and `Device.cuda(n)` (docs/internals.md section 4)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._store: dict[int, Any] = {}
        self._poisoned: dict[int, ExecutionError] = {}
        self._plans: dict[bytes, Any] = {}
        self._first_failure: ExecutionError | None = None
        self._in_use = 0
        self._peak = 0
        self._replays = 0
        self._uploaded = 0
        self._closed = False
        # Device.cuda: plans replayed as captured CUDA graphs where capture serves (None if not).
        self._captures = open_captures(backend)
        self._host_uploads = HostUploads()  # uploads in host memory that captured replays read

    def _put(self, buf: int, array: Any) -> None:
        old = self._store.get(buf)
        if old is not None:
            self._in_use -= self._backend.nbytes(old)
        self._store[buf] = array
        self._in_use += self._backend.nbytes(array)
        self._peak = max(self._peak, self._in_use)

    def host_array(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray | None:
        """Page-locked host memory for an upload of `shape` and `dtype` (Device.tensor copies the
        batch into it), or None where that does not pay: no captured graphs (their DMA reads such
        an upload where it lies, with no second copy on the host), a small or non-native array."""
        if self._captures is None or not dtype.isnative:
            return None
        nbytes = dtype.itemsize * math.prod(shape)
        if nbytes < PINNED_UPLOAD_BYTES:
            return None
        host = self._backend.host_buffer(nbytes)
        if host is None:  # a backend without page-locked memory
            return None
        result: np.ndarray = host.view(dtype).reshape(shape)
        return result

    def upload(self, buf: int, array: np.ndarray) -> None:
        self._uploaded += array.nbytes
        self._poisoned.pop(buf, None)
        self._host_uploads.forget((buf,))
        # With captures, an upload stays in host memory until a plan uses it: a captured graph
        # copies it to the device itself (one node of the graph); `HostUploads.eager` the rest,
        # and `HostUploads.place` an upload a second replay reads.
        self._put(buf, array if self._captures is not None else self._backend.from_numpy(array))

    def execute(self, graph: Graph, gid: bytes, call: Call) -> None:
        plan = self._plans.get(gid)
        if plan is None:
            from emberlink.graph_replay.plan import compile_plan

            plan = self._plans[gid] = compile_plan(graph)
        else:
            self._replays += 1
        store = self._store
        try:
            inputs = [store[b] for b in call.inputs]
        except KeyError:
            self._poison(call, self._input_failure(call.inputs))
            return
        try:
            if self._captures is not None:
                inputs = self._host_uploads.prepare(
                    self._captures, plan, call.inputs, inputs, self._to_device, self._backend.from_numpy
                )
                outs = self._captures.run(plan, inputs, call.bindings)
            else:
                outs = self._backend.run(plan, inputs, call.bindings)
        except ExecutionError as e:  # run_plan turns every op failure into one, naming the op
            self._poison(call, e)
            return
        except EmberlinkError as e:
            self._poison(call, ExecutionError(str(e)))
            return
        # `_put` for each output, inlined (a replay stores one output per updated parameter).
        poisoned, nbytes = self._poisoned, self._backend.nbytes
        in_use, peak = self._in_use, self._peak
        for buf, array in zip(call.outputs, outs, strict=True):
            if poisoned:
                poisoned.pop(buf, None)
            old = store.get(buf)
            if old is not None:
                in_use -= nbytes(old)
            store[buf] = array
            in_use += nbytes(array)
            if in_use > peak:  # noqa: PLR1730 - no max() call: once per output of every replay
                peak = in_use
        self._in_use, self._peak = in_use, peak

    def _to_device(self, buf: int, a: np.ndarray) -> Any:
        """Upload `buf`'s host array to the device; the store keeps the device copy from now on."""
        moved = self._backend.from_numpy(a)
        self._put(buf, moved)
        return moved

    def _input_failure(self, bufs: Sequence[int]) -> ExecutionError:
        for b in bufs:
            if b in self._poisoned:
                return self._poisoned[b]
            if b not in self._store:
                return ExecutionError(f"input buffer {b} is not on this device (dropped or never stored)")
        raise AssertionError("unreachable: every input is stored")

    def _poison(self, call: Call, error: ExecutionError) -> None:
        for buf in call.outputs:
            old = self._store.pop(buf, None)
            if old is not None:
                self._in_use -= self._backend.nbytes(old)
            self._poisoned[buf] = error
        if self._first_failure is None:
            self._first_failure = error

    def read(
        self, buf: int, wait: bool = False, after_sent: Callable[[], None] | None = None
    ) -> HostCopy | _Failed:
        """The copy to host memory starts now; on a GPU it runs after the work queued so far, and
        only `result()` waits for it (so `read_async` lets the next step's work go on meanwhile)."""
        out = self._read(buf)
        if after_sent is not None:
            after_sent()
        return out

    def _read(self, buf: int) -> HostCopy | _Failed:
        array = self._store.get(buf)
        if array is None:
            error = self._poisoned.get(buf)
            if error is None:
                return _Failed(UnknownTensor(f"buffer {buf} is not on this device"))
            return _Failed(error)
        return self._backend.to_numpy_async(array)

    def drop(self, bufs: Sequence[int]) -> None:
        self._host_uploads.forget(bufs)
        store, poisoned, nbytes = self._store, self._poisoned, self._backend.nbytes
        for b in bufs:
            array = store.pop(b, None)
            if array is not None:
                self._in_use -= nbytes(array)
            else:
                poisoned.pop(b, None)

    def send(self) -> None:
        pass  # every call ran when it was made: nothing waits to be sent

    def sync(self) -> None:
        self._backend.synchronize()
        failure, self._first_failure = self._first_failure, None
        if failure is not None:
            raise failure

    def stats(self) -> ExecutorStats:
        return {
            "backend": self._backend.name,
            "bytes_sent": 0,
            "bytes_received": 0,
            "round_trips": 0,
            "bytes_uploaded": self._uploaded,
            "graphs_registered": len(self._plans),
            "graph_replays": self._replays,
            "captured_replays": self._captures.replays if self._captures is not None else 0,
            "tensors": len(self._store),
        }

    def memory_stats(self) -> dict[str, int]:
        backend = dict(self._backend.memory_stats())
        return {
            "in_use_bytes": max(self._in_use, backend.get("in_use_bytes", 0)),
            "peak_bytes": max(self._peak, backend.get("peak_bytes", 0)),
            "pool_bytes": backend.get("pool_bytes", 0),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._store.clear()
        self._poisoned.clear()
        self._plans.clear()
        if self._captures is not None:
            self._captures.close()
        self._in_use = 0
