"""The worker's device: one backend, the one thread that runs all of its work, and what the device
can hold; the thread is the only place backend work runs.

Everything that touches backend arrays (uploads, graph runs, reads, frees) runs on this thread,
never on the event loop, so a long graph never stalls the sessions' I/O. Work comes in lanes, one
per session (`lane()`), plus the worker's own (`post`, `submit`): a lane's items run in the order
they were posted, and lanes with work take turns, one item each, so one session's long queue
cannot starve another's. An item that returns `AGAIN` is not finished (a batch applied in several
turns, server/runner.py): it stays first in its lane, and its lane goes to the back of the turn.

The one exception to "only on this thread" is `run_here_if_idle`: work the caller has bounded as
tiny may run in the caller's thread while nothing is queued or running here, under the same lock,
so it is still serialized with everything else and still in order (docs/internals.md section 6).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from emberlink.graph_replay.backend import Backend
from emberlink.graph_replay.backends import create_backend, parse_device
from emberlink.server.limits import DeviceCapacity

T = TypeVar("T")
log = logging.getLogger("emberlink.server")

_Item = tuple[Callable[..., Any], tuple[Any, ...]]


class Turn(enum.Enum):
    AGAIN = "again"


AGAIN = Turn.AGAIN
"""What a lane's work item returns when it is not finished: run it again on its lane's next turn."""


class Lane:
    """One session's (or the worker's) ordered work on the device. Post with `post`/`submit`/`run`."""

    __slots__ = ("_device", "items", "name", "scheduled")

    def __init__(self, device: DeviceThread, name: str) -> None:
        self._device = device
        self.items: deque[_Item] = deque()
        self.scheduled = False  # in the device's turn order
        self.name = name

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue fn(*args) behind this lane's earlier work; its result is dropped, its exception logged.
        fn returning AGAIN means "not finished": it is called again on this lane's next turn."""
        self._device._post(self, fn, args)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue fn(*args) behind this lane's earlier work; a concurrent future of its result."""
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
        """Queue fn(*args) on this lane and await its result from the event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args))


class DeviceThread:
    """A backend plus the single thread that runs everything on it, lanes taking turns."""

    def __init__(self, spec: str, backend: Backend | None = None) -> None:
        """The device of device string `spec` (graph_replay/backends.py), on `backend` if given,
        else on a new backend of its kind; ConfigError or DeviceError when there is none."""
        device = parse_device(spec)
        self.spec = str(device)
        self.backend: Backend = backend if backend is not None else create_backend(device)
        # One token per runnable item (a bare SimpleQueue: the hot path makes no Future); lanes
        # with work wait their turn in `_ready`.
        self._tokens: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ready: deque[Lane] = deque()
        # Held while work runs (here, or in a caller through run_here_if_idle); `_unfinished`
        # counts posted items not yet finished, so "idle" means nothing queued and nothing running.
        self._busy = threading.Lock()
        self._unfinished = 0
        self._own = Lane(self, "worker")
        self._thread = threading.Thread(target=self._serve, name=f"emberlink-{self.spec}", daemon=True)
        self._thread.start()

    def lane(self, name: str) -> Lane:
        """A new lane (one per session)."""
        return Lane(self, name)

    def _post(self, lane: Lane, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        with self._lock:
            lane.items.append((fn, args))
            self._unfinished += 1
            if not lane.scheduled:
                lane.scheduled = True
                self._ready.append(lane)
        self._tokens.put(True)

    def _serve(self) -> None:
        self.backend.bind_thread()
        while True:
            if not self._tokens.get():  # shutdown: after everything queued before it
                with self._lock:
                    if not self._unfinished:
                        return
                self._tokens.put(False)
                continue
            with self._lock:
                lane = self._ready.popleft()
                fn, args = lane.items[0]
            with self._busy:
                try:
                    again = fn(*args) is AGAIN
                except BaseException:  # a bug in posted work must not stop the device for everyone
                    log.exception("device %s: work of %s failed", self.spec, lane.name)
                    again = False
            with self._lock:
                if not again:
                    lane.items.popleft()
                    self._unfinished -= 1
                if lane.items:
                    self._ready.append(lane)
                else:
                    lane.scheduled = False
            if again:
                self._tokens.put(True)
            # An idle thread must not keep the last item's arguments (a batch's uploads) alive.
            del fn, args, lane

    def queued(self) -> int:
        """Work items posted and not finished yet (the worker's presence reports it as load)."""
        return self._unfinished

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue fn(*args) on the worker's own lane; its result is dropped, its exception logged."""
        self._own.post(fn, *args)

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
        """Queue fn(*args) on the worker's own lane; a concurrent future of its result."""
        return self._own.submit(fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Queue fn(*args) on the worker's own lane and await its result from the event loop."""
        return await self._own.run(fn, *args)

    def capacity(self) -> DeviceCapacity:
        """The memory and parallel units the worker's default limits scale with."""
        return device_capacity(self.spec)

    def shutdown(self) -> None:
        """Finish the queued work and stop the thread. Idempotent."""
        if self._thread.is_alive():
            self._tokens.put(False)
            self._thread.join()


def device_capacity(spec: str) -> DeviceCapacity:
    """Memory and parallel units of device `spec`: a GPU's total memory and streaming
    multiprocessors, or the host's memory (its cgroup's limit, if lower) and usable cores."""
    device = parse_device(spec)
    if device.kind == "cuda":
        import cupy

        with cupy.cuda.Device(device.index) as gpu:
            _free, total = gpu.mem_info
            units = int(gpu.attributes["MultiProcessorCount"])
        return DeviceCapacity("cuda", int(total), units)
    return DeviceCapacity("cpu", host_memory(), len(os.sched_getaffinity(0)))


def host_memory() -> int:
    """The host memory this process may use: MemTotal, or its cgroup's memory limit if lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


__all__ = ["AGAIN", "DeviceThread", "Lane", "Turn", "device_capacity", "host_memory"]
