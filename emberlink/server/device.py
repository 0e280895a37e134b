"""The worker's device: one backend and the one thread that runs all of its work, in order.

Everything that touches backend arrays (uploads, graph runs, reads, frees) runs on this thread,
never on the event loop, so a long graph never stalls the sessions' I/O. Work from all sessions
shares the thread's FIFO queue, which also keeps each session's work in the order it arrived.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from emberlink.errors import ConfigError, DeviceError

T = TypeVar("T")

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
    """A backend plus the single thread that runs everything on it."""

    def __init__(self, spec: str, backend: Any | None = None) -> None:
        self.spec = spec
        kind, index = parse_device(spec)
        self.backend = backend if backend is not None else make_backend(spec)
        init: Callable[[], None] | None = None
        if kind == "cuda":

            def init() -> None:
                import cupy

                cupy.cuda.Device(index).use()

        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"emberlink-{spec.replace(':', '')}", initializer=init
        )
        self._thread_ident: int | None = None
        self._pool.submit(self._note_thread).result()

    def _note_thread(self) -> None:
        self._thread_ident = threading.get_ident()

    def on_thread(self) -> bool:
        """Whether the caller is the device thread (for checks in tests and debug asserts)."""
        return threading.get_ident() == self._thread_ident

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue fn(*args) behind all earlier work; a concurrent future of its result."""
        return self._pool.submit(fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Queue fn(*args) and await its result from the event loop."""
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    def shutdown(self) -> None:
        """Finish the queued work and stop the thread."""
        self._pool.shutdown(wait=True)
