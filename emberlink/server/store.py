"""A session's tensor store and byte quotas: ids to arrays, ids to failures, bytes held; no I/O, no
backend calls.

The store is touched only by the device thread. Quotas are shared with the event loop (uploads
are reserved on arrival, replies released once sent) and with whichever thread drops the last
reference to an array whose charge outlived its id, so they are guarded by locks.

Rules:
- A quota counts bytes against its limit and, when it has one, against its parent's (a session's
  quota against the worker's budget): `reserve` takes from both or from neither.
- A stored array is charged once, for as long as the store holds it, and after that for as long
  as anything else still holds it (a reply waiting to be sent): dropping an id whose array is
  referenced elsewhere moves its charge onto the array, released when the array is garbage
  (`weakref.finalize`), so the quota follows the memory, not the ids. A host copy made for a
  reply is charged the same way (`keep_charged`).
- Every id the store holds is charged ID_BYTES besides its array's bytes (its entry, its Python
  and NumPy objects): a zero-byte tensor is not free, so a flood of them is bounded too. A
  poisoned id is charged ID_BYTES while it stands for a failure; a session whose quota (or the
  worker's budget) has no room for one more breaks the protocol (ProtocolError): it keeps failed
  ids it should have dropped.
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from emberlink.errors import ErrorCode, ProtocolError

ID_BYTES = 256
"""What the store charges for each id it holds, besides an array's bytes: measured, a stored
one-element tensor costs the worker about 250 bytes of objects (array, entry, dict slot)."""
FAILURE_SLACK = 64 << 10
"""How far past its limit a quota may go to remember failed ids (an Execute refused for want of
room still poisons its outputs); past that, the session is refused."""


@dataclass(frozen=True, slots=True)
class Failure:
    """Why an id holds no value: the wire code and message of the error that produced it."""

    code: str
    message: str


class Quota:
    """Bytes held against a limit (None: no limit of its own), and against the parent's.

    Every change is also applied to `parent` (the worker's total over all sessions), if given, so
    the worker's in-use and peak figures are exact rather than sampled. `code` and `label` name
    this quota in a refusal: `quota` / "the session quota", or `out_of_memory` / the worker's budget.
    """

    def __init__(
        self,
        limit: int | None,
        parent: Quota | None = None,
        *,
        code: str = ErrorCode.QUOTA,
        label: str = "the session quota",
    ) -> None:
        self.limit = limit
        self.parent = parent
        self.code = code
        self.label = label
        # One lock for a whole tree of quotas: a change takes it once, however deep the chain.
        self._lock: threading.Lock = parent._lock if parent is not None else threading.Lock()
        # This quota and its parents, nearest first: walked on every change (several a step).
        self._chain: tuple[Quota, ...] = (self, *(parent._chain if parent is not None else ()))
        self.used = 0
        self.peak = 0

    def reserve(self, nbytes: int, slack: int = 0) -> bool:
        """Take nbytes if they fit here and in every parent (each limit stretched by `slack`);
        False (taking nothing) otherwise."""
        chain = self._chain
        with self._lock:
            for quota in chain:
                if quota.limit is not None and quota.used + nbytes > quota.limit + slack:
                    return False
            for quota in chain:  # (as `_add`, written out: several reservations a step)
                used = quota.used = quota.used + nbytes
                if used > quota.peak:  # noqa: PLR1730 - no max() call: this runs several times a step
                    quota.peak = used
        return True

    def charge(self, nbytes: int) -> None:
        """Take nbytes without checking any limit (the caller reserved room before computing them)."""
        with self._lock:
            self._add(nbytes)

    def release(self, nbytes: int) -> None:
        if nbytes < 0:
            self.charge(-nbytes)
            return
        with self._lock:  # (only lowers `used`: no peak to follow)
            for quota in self._chain:
                quota.used -= nbytes

    def _add(self, nbytes: int) -> None:
        for quota in self._chain:
            used = quota.used = quota.used + nbytes
            if used > quota.peak:  # noqa: PLR1730 - no max() call: this runs several times a step
                quota.peak = used

    def refusal(self, nbytes: int, what: str) -> Failure:
        """Why `reserve(nbytes)` for `what` failed: this quota's limit, or the first parent's it
        would pass, e.g. "upload 3: storing 1600 more bytes would pass the session quota of 1000
        bytes (800 in use)"."""
        quota: Quota | None = self
        while quota is not None:
            if quota.limit is not None and quota.used + nbytes > quota.limit:
                return Failure(
                    quota.code,
                    f"{what}: storing {nbytes} more bytes would pass {quota.label} of {quota.limit} "
                    f"bytes ({quota.used} in use)",
                )
            quota = quota.parent
        # Room again by now (another session freed some): say so rather than blame a limit.
        return Failure(self.code, f"{what}: {nbytes} more bytes did not fit {self.label} at the time")


class Hold:
    """Bytes a reply waiting to be sent keeps charged; `release` (idempotent, any thread) frees them."""

    __slots__ = ("_nbytes", "_quota")

    def __init__(self, quota: Quota, nbytes: int) -> None:
        self._quota: Quota | None = quota
        self._nbytes = nbytes

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def release(self) -> None:
        quota, self._quota = self._quota, None
        if quota is not None:
            quota.release(self._nbytes)


_Entry = tuple[Any, int]
"""A stored array and its size; it is charged `size + ID_BYTES`. The size alone, not the charge,
is kept: a tiny tensor's size is one of the interpreter's shared small ints, its charge would be
one more object per id (a session holding many tiny tensors leaves that much more memory
fragmented after it ends). A tuple, not an object with slots: several are made a step, and a
tuple costs no `__init__` call."""


def _references_when_alone() -> int:
    """What `sys.getrefcount` reports in `TensorStore._forget` for an array nothing else holds:
    measured, not assumed, so the interpreter's counting conventions cancel out."""
    entries: dict[int, _Entry] = {0: (object(), 0)}
    entry = entries.pop(0)
    array = entry[0]
    return sys.getrefcount(array)


_ALONE = _references_when_alone()


def keep_charged(quota: Quota, array: Any, nbytes: int) -> None:
    """Keep `nbytes` charged to `quota` until `array` is garbage (released on any thread); at once
    if the array cannot be weakly referenced."""
    try:
        weakref.finalize(array, quota.release, nbytes)
    except TypeError:
        quota.release(nbytes)


class TensorStore:
    """Client-assigned tensor ids to backend arrays, with each array's size charged to the quota."""

    def __init__(self, quota: Quota, max_ids: int | None = None) -> None:
        self.quota = quota
        self.max_ids = max_ids  # ids held at once, stored and failed (--max-session-tensors)
        self._entries: dict[int, _Entry] = {}
        self._failures: dict[int, Failure] = {}

    def _room(self, new: int) -> None:
        """ProtocolError if `new` more ids would pass `max_ids` (the session then ends)."""
        held = len(self._entries) + len(self._failures)
        if self.max_ids is not None and held + new > self.max_ids:
            raise ProtocolError(
                f"the session would hold {held + new} tensor ids, more than the {self.max_ids} this "
                f"worker allows one session (--max-session-tensors): free tensors you no longer need, "
                f"or ask for a worker started with a higher limit"
            )

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(size + ID_BYTES for _, size in self._entries.values())

    def put(self, tid: int, array: Any, nbytes: int, *, charged: bool, dropped: bool = False) -> None:
        """Store an array (replacing tid); `charged`: nbytes + ID_BYTES were reserved already, else
        charge them now; `dropped`: tid was just dropped (nothing to forget).

        Charging here never refuses: callers check room with `Quota.reserve` before they compute.
        """
        if not dropped:
            self._forget(tid)
        try:
            self._room(1)
        except ProtocolError:
            if charged:  # what the caller reserved for it goes back: nothing outlives the session
                self.quota.release(nbytes + ID_BYTES)
            raise
        if not charged:
            self.quota.charge(nbytes + ID_BYTES)
        self._entries[tid] = (array, nbytes)

    def put_many(self, tids: Any, arrays: Any, sizes: list[int], *, reserved: int = 0) -> None:
        """`put(tid, array, size, charged=False)` for each, with one change to the quota, of which
        `reserved` bytes were reserved already (an Execute's outputs: the reservation of its plan's
        peak becomes its outputs' charge, the rest is released)."""
        entries, failures = self._entries, self._failures
        # Counted exactly only when the outputs could pass the limit (the per-step path stays cheap).
        if self.max_ids is not None and len(entries) + len(failures) + len(tids) > self.max_ids:
            try:
                self._room(sum(1 for tid in tids if tid not in entries and tid not in failures))
            except ProtocolError:
                self.quota.release(reserved)
                raise
        total = 0
        for tid, array, size in zip(tids, arrays, sizes, strict=True):
            if tid in entries or (failures and tid in failures):
                self._forget(tid)
            entries[tid] = (array, size)
            total += size + ID_BYTES
        delta = total - reserved
        if delta > 0:
            self.quota.charge(delta)
        elif delta < 0:
            self.quota.release(-delta)

    def poison(self, tid: int, failure: Failure) -> None:
        """Make tid stand for a failure; whatever it held is freed. ProtocolError when the session
        has no room left to remember one more failure, or holds `max_ids` ids."""
        self._forget(tid)
        self._room(1)
        if not self.quota.reserve(ID_BYTES, FAILURE_SLACK):
            raise ProtocolError(
                f"the session holds {len(self._failures)} failed tensor ids and has no room for more: "
                f"{self.quota.refusal(ID_BYTES, f'poisoning tensor {tid}').message}"
            )
        self._failures[tid] = failure

    def get(self, tid: int) -> Any:
        """The array of tid; raises LookupError carrying a Failure if it failed or is unknown."""
        try:
            return self._entries[tid][0]
        except KeyError:
            raise LookupError(self.failure_of(tid)) from None

    def get_many(self, tids: Any) -> list[Any]:
        """`get` of each, in order (one call for an Execute's inputs); LookupError carrying the
        Failure of the first that has no value."""
        entries = self._entries
        try:
            return [entries[tid][0] for tid in tids]
        except KeyError as e:
            raise LookupError(self.failure_of(e.args[0])) from None

    def peek(self, tid: int) -> Any:
        """The array of tid, or None if it failed or is unknown (no exception: for checks on the
        per-step path, where most ids asked about are made by the batch being checked)."""
        entry = self._entries.get(tid)
        return None if entry is None else entry[0]

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

    def drop_many(self, tids: Any, later: list[Any] | None = None) -> None:
        """`drop` each (an unknown id is ignored). `later`: the arrays this frees are appended to it
        instead of being freed here (their charge is released all the same), for the caller to
        let go of once it is done with what is urgent (a step's reply)."""
        entries, failures, quota = self._entries, self._failures, self.quota
        freed = 0  # released once for the whole Drop: one lock, not one per id
        for tid in tids:
            if failures and failures.pop(tid, None) is not None:
                freed += ID_BYTES
            entry = entries.pop(tid, None)
            if entry is None:
                continue
            array, size = entry  # the same references as in `_forget`, so _ALONE holds here too
            if sys.getrefcount(array) > _ALONE:  # a reply waiting to be sent still holds it
                keep_charged(quota, array, size + ID_BYTES)
            else:
                freed += size + ID_BYTES
                if later is not None:
                    later.append(array)
        if freed:
            quota.release(freed)

    def clear(self) -> None:
        for tid in [*self._entries, *self._failures]:
            self._forget(tid)

    def _forget(self, tid: int) -> None:
        if self._failures.pop(tid, None) is not None:
            self.quota.release(ID_BYTES)
        entry = self._entries.pop(tid, None)
        if entry is None:
            return
        array, size = entry
        if sys.getrefcount(array) > _ALONE:  # a reply waiting to be sent still holds it
            keep_charged(self.quota, array, size + ID_BYTES)
        else:
            self.quota.release(size + ID_BYTES)


__all__ = ["ID_BYTES", "Failure", "Hold", "Quota", "TensorStore", "keep_charged"]
