"""The worker's device: one backend and the one thread that runs all of its work, in order.

Everything that touches backend arrays (uploads, graph runs, reads, frees) runs on this thread,
never on the event loop, so a long graph never stalls the sessions' I/O. Work from all sessions
shares the thread's FIFO queue, which also keeps each session's work in the order it arrived.
The one exception is `run_here_if_idle`: work the caller has bounded as tiny may run in the
caller's thread while nothing is queued or running here, under the same lock, so it is still
serialized with everything else and still in order (docs/internals.md section 6, "inline").
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from emberlink.errors import ConfigError, DeviceError

T = TypeVar("T")
log = logging.getLogger("emberlink.server")

_DEVICE = re.compile(r"^(cpu|cuda:(\d{1,3}))$")


def parse_device(spec: str) -> tuple[str, int]:
    """`cpu` or `cuda:N` as (kind, index); ConfigError otherwise."""
    m = _DEVICE.match(spec)
    if m is None:
        raise ConfigError(f"--device must be cpu or cuda:N, got {spec!r}")
    return ("cpu", 0) if m.group(1) == "cpu" else ("cuda", int(m.group(2)))


def make_backend(spec: str) -> Any:
    """The graph_replay backend for a device spec: NumPy for cpu, CuPy for cuda:N."""
    kind, index = parse_device(spec)
    if kind == "cpu":
        from emberlink.graph_replay.numpy_backend import NumpyBackend

        return NumpyBackend()
    try:
        import cupy
    except ImportError as e:
        raise DeviceError(f"--device {spec} needs CuPy: pip install 'emberlink[cuda13]' or '[cuda12]'") from e
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError without a driver or a GPU
        raise DeviceError(f"--device {spec}: no usable CUDA GPU: {e}") from e
    if not 0 <= index < count:
        raise DeviceError(f"--device {spec}: this machine has {count} CUDA GPU(s)")
    from emberlink.graph_replay.cupy_backend import CupyBackend

    return CupyBackend(index)


class DeviceThread:
    """A backend plus the single thread that runs everything on it, in the order it was posted."""

    def __init__(self, spec: str, backend: Any | None = None) -> None:
        self.spec = spec
        self._kind, self._index = parse_device(spec)
        self.backend = backend if backend is not None else make_backend(spec)
        # A bare queue and thread rather than a ThreadPoolExecutor: the hot path (`post`) makes
        # no Future, and the thread is named after the device it serves.
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        # Held while work runs (here, or in a caller through run_here_if_idle); `_unfinished`
        # counts posted items not yet finished, so "idle" means nothing queued and nothing running.
        self._busy = threading.Lock()
        self._count_lock = threading.Lock()
        self._unfinished = 0
        self._thread = threading.Thread(target=self._serve, name=f"emberlink-{spec}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        if self._kind == "cuda":
            import cupy

            cupy.cuda.Device(self._index).use()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            with self._busy:
                try:
                    fn(*args)
                except BaseException:  # a bug in posted work must not stop the device for everyone
                    log.exception("device %s: posted work failed", self.spec)
                with self._count_lock:
                    self._unfinished -= 1
            # An idle thread must not keep the last item's arguments (a batch's uploads) alive.
            del item, fn, args

    def queued(self) -> int:
        """Work items posted and not started yet (the worker's presence reports it as load)."""
        return self._queue.qsize()

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue fn(*args) behind all earlier work; its result is dropped, its exception logged."""
        with self._count_lock:
            self._unfinished += 1
        self._queue.put((fn, args))

    def run_here_if_idle(self, fn: Callable[..., bool], *args: Any) -> bool:
        """fn(*args) in the calling thread if no posted work is queued or running, else False.

        While fn runs, posted work waits, so fn is serialized with the device thread's work and
        follows everything posted before it. fn returns whether it did the work (it may decline,
        e.g. when the work is not tiny after all); its exceptions propagate to the caller.
        """
        if not self._busy.acquire(blocking=False):
            return False
        try:
            return not self._unfinished and fn(*args)
        finally:
            self._busy.release()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue fn(*args) behind all earlier work; a concurrent future of its result."""
        fut: Future[T] = Future()

        def call() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, as a pool would
                fut.set_exception(e)

        self.post(call)
        return fut

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Queue fn(*args) and await its result from the event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def shutdown(self) -> None:
        """Finish the queued work and stop the thread. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
