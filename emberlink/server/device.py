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
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from emberlink.graph_replay.backend import Backend
from emberlink.graph_replay.backends import create_backend, parse_device

T = TypeVar("T")
log = logging.getLogger("emberlink.server")


class DeviceThread:
    """A backend plus the single thread that runs everything on it, in the order it was posted."""

    def __init__(self, spec: str, backend: Backend | None = None) -> None:
        """The device of device string `spec` (graph_replay/backends.py), on `backend` if given,
        else on a new backend of its kind; ConfigError or DeviceError when there is none."""
        device = parse_device(spec)
        self.spec = str(device)
        self.backend: Backend = backend if backend is not None else create_backend(device)
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
        self._thread = threading.Thread(target=self._serve, name=f"emberlink-{self.spec}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.backend.bind_thread()
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
