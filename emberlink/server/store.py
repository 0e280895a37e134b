"""A session's tensor store and byte quota: ids to arrays, ids to failures; no I/O, no backend calls.

The store is touched only by the device thread. The quota is shared with the event loop, which
reserves the bytes of an upload before preallocating its buffer, so it is guarded by a lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from emberlink.errors import ErrorCode


@dataclass(frozen=True, slots=True)
class Failure:
    """Why an id holds no value: the wire code and message of the error that produced it."""

    code: str
    message: str


class Quota:
    """Bytes a session holds or has reserved for uploads in flight, against a limit (None: no limit).

    Every change is also applied to `parent` (the worker's total over all sessions), if given, so
    the worker's in-use and peak figures are exact rather than sampled.
    """

    def __init__(self, limit: int | None, parent: Quota | None = None) -> None:
        self.limit = limit
        self.parent = parent
        self._lock = threading.Lock()
        self.used = 0
        self.peak = 0

    def reserve(self, nbytes: int) -> bool:
        """Take nbytes if they fit; False (taking nothing) if they would pass the limit."""
        with self._lock:
            if self.limit is not None and self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            self.peak = max(self.peak, self.used)
        if self.parent is not None:
            self.parent.charge(nbytes)
        return True

    def charge(self, nbytes: int) -> None:
        """Take nbytes without checking the limit (the caller checked before computing them)."""
        with self._lock:
            self.used += nbytes
            self.peak = max(self.peak, self.used)
        if self.parent is not None:
            self.parent.charge(nbytes)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
        if self.parent is not None:
            self.parent.release(nbytes)

    def describe_refusal(self, nbytes: int) -> str:
        return (
            f"storing {nbytes} more bytes would pass the session quota of {self.limit} bytes "
            f"({self.used} in use)"
        )


class TensorStore:
    """Client-assigned tensor ids to backend arrays, with each id's size charged to the quota."""

    def __init__(self, quota: Quota) -> None:
        self.quota = quota
        self._arrays: dict[int, Any] = {}
        self._sizes: dict[int, int] = {}
        self._failures: dict[int, Failure] = {}

    def __len__(self) -> int:
        return len(self._arrays)

    @property
    def nbytes(self) -> int:
        return sum(self._sizes.values())

    def put(self, tid: int, array: Any, nbytes: int, *, charged: bool) -> None:
        """Store an array (replacing tid); `charged`: its bytes were reserved already, else charge them now.

        Charging here never refuses: callers check room with `Quota.reserve` before they compute.
        """
        self._forget(tid)
        if not charged:
            self.quota.charge(nbytes)
        self._arrays[tid] = array
        self._sizes[tid] = nbytes

    def put_many(self, tids: Any, arrays: Any, sizes: list[int], *, reserved: int = 0) -> None:
        """`put(tid, array, size, charged=False)` for each, with one change to the quota, of which
        `reserved` bytes were reserved already (an Execute's outputs: a step's many results cost
        one quota update, not two locked updates per result and its parent's)."""
        store, sized, failures = self._arrays, self._sizes, self._failures
        freed = 0
        for tid, array, size in zip(tids, arrays, sizes, strict=True):
            if failures:
                failures.pop(tid, None)
            old = sized.pop(tid, None)
            if old is not None:
                freed += old
            store[tid] = array
            sized[tid] = size
        delta = sum(sizes) - freed - reserved
        if delta > 0:
            self.quota.charge(delta)
        elif delta < 0:
            self.quota.release(-delta)

    def poison(self, tid: int, failure: Failure) -> None:
        """Make tid stand for a failure; whatever it held is freed."""
        self._forget(tid)
        self._failures[tid] = failure

    def get(self, tid: int) -> Any:
        """The array of tid; raises LookupError carrying a Failure if it failed or is unknown."""
        try:
            return self._arrays[tid]
        except KeyError:
            raise LookupError(self.failure_of(tid)) from None

    def failure_of(self, tid: int) -> Failure:
        failure = self._failures.get(tid)
        if failure is not None:
            return failure
        return Failure(
            ErrorCode.UNKNOWN_TENSOR, f"tensor {tid} is not on the worker (never uploaded, or dropped)"
        )

    def drop(self, tid: int) -> None:
        """Free tid; an unknown id is ignored (drops are idempotent on resend)."""
        self._forget(tid)

    def drop_many(self, tids: Any) -> None:
        """`drop` each, with one change to the quota."""
        store, sized, failures = self._arrays, self._sizes, self._failures
        freed = 0
        for tid in tids:
            if failures:
                failures.pop(tid, None)
            store.pop(tid, None)
            size = sized.pop(tid, None)
            if size is not None:
                freed += size
        if freed:
            self.quota.release(freed)

    def clear(self) -> None:
        for tid in list(self._sizes):
            self._forget(tid)
        self._failures.clear()

    def _forget(self, tid: int) -> None:
        self._failures.pop(tid, None)
        self._arrays.pop(tid, None)
        size = self._sizes.pop(tid, None)
        if size is not None:
            self.quota.release(size)
