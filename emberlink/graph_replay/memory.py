"""Exact byte accounting of host arrays a backend holds: each buffer counted once while alive; no I/O.

NumPy has no memory pool to ask, so the NumPy backend registers every array it makes or is
handed (uploads, plan inputs, every step's result, outputs) with a `MemoryMeter`. The meter
counts each array's *buffer* once (a view counts as the array that owns its memory) and
uncounts it when that buffer is garbage (a weak-reference callback), so `in_use` is exactly the
bytes of the backend's arrays that are still alive, whoever holds them: a session's tensor store,
the run loop's live values, a result waiting to be sent. `peak` is the high point of `in_use`,
sampled every time an array is registered, i.e. after every step of a run, before its frees.

Not counted: temporaries inside one op (an op's own scratch arrays), and memory that is not an
array (Python objects, the allocator's own caches).

Thread-safe: arrays may die on any thread. A dying array's callback only appends to a deque and
pops a dict entry (both atomic in CPython); counters change under a lock the callbacks never take.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any

import numpy as np


class _Tracked(weakref.ref):  # type: ignore[type-arg]
    __slots__ = ("key", "nbytes")
    key: int
    nbytes: int


def owner(a: Any) -> Any:
    """The array that owns `a`'s memory (`a` itself unless it is a view of another array)."""
    base = a.base
    while isinstance(base, np.ndarray):
        a, base = base, base.base
    return a


class MemoryMeter:
    """Bytes of live registered buffers (`in_use`) and their high point (`peak`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, _Tracked] = {}
        self._died: deque[int] = deque()
        self._in_use = 0
        self._peak = 0

    def _gone(self, ref: _Tracked) -> None:
        # Runs before the buffer's memory is released, so no new array can have taken its id yet.
        if self._live.get(ref.key) is ref:
            self._live.pop(ref.key, None)
        self._died.append(ref.nbytes)

    def _settle(self) -> None:
        died = self._died
        while died:
            self._in_use -= died.popleft()

    def track(self, a: Any) -> None:
        """Count `a`'s buffer (once, however many arrays share it) until it is garbage."""
        root = owner(a)
        key = id(root)
        if key in self._live:  # counted already (a replay's inputs, its step results as outputs)
            return
        with self._lock:
            self._settle()
            if key not in self._live:
                ref = _Tracked(root, self._gone)
                ref.key = key
                ref.nbytes = int(root.nbytes)
                self._live[key] = ref
                self._in_use += ref.nbytes
            self._peak = max(self._peak, self._in_use)

    @property
    def in_use(self) -> int:
        with self._lock:
            self._settle()
            return self._in_use

    @property
    def peak(self) -> int:
        with self._lock:
            self._settle()
            return max(self._peak, self._in_use)

    @property
    def buffers(self) -> int:
        """How many distinct buffers are counted now."""
        return len(self._live)

    def reset_peak(self) -> None:
        """Start measuring the high point afresh from what is in use now."""
        with self._lock:
            self._settle()
            self._peak = self._in_use


__all__ = ["MemoryMeter", "owner"]
