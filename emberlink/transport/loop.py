"""The event-loop thread that runs sessions' I/O in this process (a client's remote devices, an
in-process worker); no protocol logic here.

One loop serves every remote device of the process: user threads hand it work with
`call_soon_threadsafe` and block only on futures. It is started on first use and never closed:
grpc.aio keeps callbacks registered on every loop it has served, and a closed loop makes them
fail ("Event loop is closed"), so a loop that carried gRPC is stopped at most, never closed.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from emberlink.transport.malloc import tune_malloc_unless_disabled

T = TypeVar("T")

UVLOOP_ENV = "EMBERLINK_UVLOOP"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop (a dependency except on Windows) unless EMBERLINK_UVLOOP is 0;
    asyncio's otherwise. Measured here: a raw TCP round trip of 64 bytes ~12 µs on uvloop against
    ~20 µs on asyncio's loop, and grpc.aio a little faster on it too (bench/remote_step.py)."""
    if os.environ.get(UVLOOP_ENV, "1") != "0":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            fast: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return fast
    return asyncio.new_event_loop()


class LoopThread:
    """An asyncio event loop running forever in one daemon thread."""

    def __init__(self, name: str = "emberlink-io") -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule a coroutine on the loop; a concurrent future of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for it (never from the loop's own thread)."""
        return self.submit(coro).result(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop the loop and its thread; the loop is left unclosed (see the module docstring)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()


_worker_here = False


def host_worker() -> None:
    """Note that a worker serves from this process (an in-process one, on a loop thread)."""
    global _worker_here
    _worker_here = True


def worker_here() -> bool:
    """Whether a worker has served from this process: its client threads then share the GIL with
    it, and must not spin while they wait for it (settings.spin_seconds)."""
    return _worker_here


_shared: LoopThread | None = None
_shared_lock = threading.Lock()


def io_loop() -> LoopThread:
    """The process's loop thread for remote sessions, started on first use.

    Before the first start, glibc's malloc is tuned for bulk transfers (transport/malloc.py; set
    EMBERLINK_TUNE_MALLOC=0 to keep the defaults): it must happen before this thread allocates, so
    that the thread shares the main heap instead of getting an arena of its own."""
    global _shared
    with _shared_lock:
        if _shared is None:
            tune_malloc_unless_disabled()
        if _shared is None or not _shared.alive:
            _shared = LoopThread()
        return _shared
