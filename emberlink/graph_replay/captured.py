"""Which plans of one owner (a worker session, a local device) run as captured CUDA graphs; no CuPy.

Rules (everything that decides between the eager path and a captured graph lives here):
- The eager path (`backend.run`) is the reference and the fallback. A plan's first run is always
  eager: it validates the plan and warms CuPy's kernel caches. Its second run captures it (see
  cuda_graph.py); every later run replays the capture with one launch.
- A plan is never captured when capture cannot serve: `EMBERLINK_CAPTURE=0`, a backend other than
  CuPy, nvmath-python missing (`open_captures` then returns None), an op a graph cannot hold
  (capture.refusal), a capture that fails, or one its owner does not admit (session memory, the
  client's graph-cache budget). It then runs eagerly, as before; each reason is logged once per
  process.
- A call whose bindings cannot be staged (capture.StagingError) runs eagerly, so it fails as the
  eager ops fail; the capture stays.
- Inputs may be host (NumPy) arrays where `takes_host(plan)` says so: the plan is about to be
  captured or replayed, and a capture copies host inputs into its pinned staging buffer, the
  upload being one node of the graph. An owner keeps an uploaded batch in host memory and uploads
  it itself for a plan that runs eagerly, or once a second replay reads it (data uploaded once and
  used on many steps); if a run falls back to the eager path after all, its host inputs are
  uploaded first.
- A capture lives as long as its plan and its owner: when the plan is dropped (graph-cache
  eviction) or the owner closes (session end), its memory is freed and `release` is told.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from emberlink.errors import EmberlinkError
from emberlink.graph_replay.capture import CaptureRefused, StagingError, host_checks, refusal
from emberlink.graph_replay.ir import Scalar
from emberlink.graph_replay.plan import Plan

log = logging.getLogger("emberlink.capture")

CAPTURE_ENV = "EMBERLINK_CAPTURE"
"""Set to 0 to run every plan eagerly (to compare against, or to rule capture out)."""

_LOGGED: set[str] = set()
_LOGGED_LOCK = threading.Lock()


def log_once(reason: str, level: int = logging.INFO) -> None:
    """Log why plans run eagerly, once per reason per process."""
    with _LOGGED_LOCK:
        if reason in _LOGGED:
            return
        _LOGGED.add(reason)
    log.log(level, "plans run eagerly, without CUDA graphs: %s", reason)


class Captured(Protocol):
    """A plan captured for replay (cuda_graph.CapturedPlan)."""

    @property
    def nbytes(self) -> int: ...

    def replay(self, inputs: Sequence[Any], bindings: Sequence[Scalar]) -> list[Any]: ...
    def free(self) -> None: ...


CaptureFn = Callable[[Plan, Sequence[Any], Sequence[Scalar]], tuple[Captured, list[Any]]]
"""Capture a plan while running it once: `(captured, this call's outputs)`; CaptureRefused if not."""

Admit = Callable[[bytes | None, Plan, int], bool]
"""`admit(key, plan, nbytes)`: may a capture of `nbytes` be kept (and charged)?"""

Release = Callable[[bytes | None, Plan | None, int], None]
"""`release(key, plan or None if it is gone, nbytes)`: a kept capture was freed."""


class _State(enum.Enum):
    WARM = "warm"  # ran eagerly once; the next run captures
    CAPTURED = "captured"
    EAGER = "eager"  # capture cannot serve this plan


@dataclass(eq=False, slots=True)
class _Entry:
    ref: weakref.ref[Plan]
    state: _State
    key: bytes | None = None
    captured: Captured | None = None
    checked: frozenset[int] = frozenset()  # the inputs whose indices a replay checks on the host


def _checked_inputs(plan: Plan) -> frozenset[int]:
    """The inputs of `plan` whose indices a replay checks on the host (capture.host_checks)."""
    return frozenset(c.input for c in host_checks(plan))


class HostUploads:
    """Where uploads still in host memory go when captured replays read them, for one owner (a
    worker's session, a local device): its first replay copies an upload in as a node of the
    graph (a host batch, read once, is never copied to the device by itself); the second replay
    that reads it moves it to the device for good, so data uploaded once and used on many steps
    (batches uploaded beforehand, as PyTorch keeps resident data) is not copied over again every
    step. Inputs a replay checks on the host (`Captures.host_checked`: a take's indices) stay in
    host memory: moved, every later replay of their plan would run eagerly (on the H200, a small
    MLP step taking its batch with indices uploaded once ran 2.7 ms a step, against 0.39 ms with
    the indices uploaded each step). The owner says when an id gets a new value or goes
    (`forget`)."""

    __slots__ = ("_read_once",)

    def __init__(self) -> None:
        self._read_once: set[int] = set()  # ids of uploads one replay has read

    def place(
        self,
        ids: Sequence[int],
        inputs: list[Any],
        checked: frozenset[int],
        to_device: Callable[[int, np.ndarray], Any],
    ) -> list[Any]:
        """A captured replay's `inputs` (changed in place, and returned): each host array that a
        replay read before and that is not in `checked` replaced by `to_device(id, array)`, which
        also stores the device copy under its id."""
        seen = self._read_once
        for k, (i, a) in enumerate(zip(ids, inputs, strict=True)):
            if type(a) is np.ndarray and k not in checked:
                if i not in seen:
                    seen.add(i)
                    continue
                seen.discard(i)
                inputs[k] = to_device(i, a)
        return inputs

    def prepare(
        self,
        captures: Captures,
        plan: Plan,
        ids: Sequence[int],
        inputs: list[Any],
        to_device: Callable[[int, np.ndarray], Any],
        copy: Callable[[np.ndarray], Any],
    ) -> list[Any]:
        """The `inputs` of a run of `plan` through `captures` (changed in place, and returned): by
        `place` where the run captures or replays the plan, by `eager` where it runs eagerly."""
        checked = captures.host_checked(plan)
        if captures.takes_host(plan):
            return self.place(ids, inputs, checked, to_device)
        return self.eager(ids, inputs, checked, to_device, copy)

    def eager(
        self,
        ids: Sequence[int],
        inputs: list[Any],
        checked: frozenset[int],
        to_device: Callable[[int, np.ndarray], Any],
        copy: Callable[[np.ndarray], Any],
    ) -> list[Any]:
        """An eager run's `inputs` (changed in place, and returned), all on the device: each host
        array moved there for good by `to_device(id, array)`, but those in `checked` (indices
        that the plan's replays check on the host), which this run gets a copy of (`copy`) while
        the id keeps its host array."""
        for k, (i, a) in enumerate(zip(ids, inputs, strict=True)):
            if isinstance(a, np.ndarray):
                inputs[k] = copy(a) if k in checked else to_device(i, a)
        return inputs

    def forget(self, ids: Iterable[int]) -> None:
        """`ids` were dropped or given new values: no replay has read what they hold now."""
        if self._read_once:
            self._read_once.difference_update(ids)


class Captures:
    """The captured plans of one owner, run through `run` in place of `backend.run`."""

    def __init__(
        self,
        backend: Any,
        capture: CaptureFn,
        *,
        admit: Admit | None = None,
        release: Release | None = None,
    ) -> None:
        self._backend = backend
        self._capture = capture
        self._admit = admit
        self._release = release
        self._entries: dict[int, _Entry] = {}  # id(plan) -> entry, dropped when the plan is
        self._lock = threading.Lock()
        self.replays = 0

    def run(
        self, plan: Plan, inputs: Sequence[Any], bindings: Sequence[Scalar], key: bytes | None = None
    ) -> list[Any]:
        """`backend.run(plan, inputs, bindings)`, through a captured graph where one serves.
        `key` names the plan to `admit` and `release` (the graph id on a worker)."""
        entry = self._entries.get(id(plan))
        if entry is None or entry.ref() is not plan:
            outs = self._eager(plan, inputs, bindings)
            self._first_run(plan)
            return outs
        if entry.captured is not None:
            try:
                outs = entry.captured.replay(inputs, bindings)
            except StagingError:
                return self._eager(plan, inputs, bindings)
            self.replays += 1
            return outs
        if entry.state is _State.EAGER:
            return self._eager(plan, inputs, bindings)
        return self._try_capture(entry, plan, inputs, bindings, key)

    def takes_host(self, plan: Plan) -> bool:
        """Whether `run(plan, ...)` is best given uploaded batches as the host arrays they arrived
        as: the run captures or replays the plan, so they reach the device as part of the graph."""
        entry = self._entries.get(id(plan))
        return entry is not None and entry.ref() is plan and entry.state is not _State.EAGER

    def host_checked(self, plan: Plan) -> frozenset[int]:
        """The inputs of `plan` whose indices a replay checks on the host (a `take`'s indices that
        are an input): they must reach a replay as host arrays, or it runs eagerly."""
        entry = self._entries.get(id(plan))
        if entry is None or entry.ref() is not plan:  # its first run: captured from the next one on
            return _checked_inputs(plan)
        return entry.checked

    def _eager(self, plan: Plan, inputs: Sequence[Any], bindings: Sequence[Scalar]) -> list[Any]:
        if self._backend.name != "numpy" and any(isinstance(a, np.ndarray) for a in inputs):
            inputs = [self._backend.from_numpy(a) if isinstance(a, np.ndarray) else a for a in inputs]
        return list(self._backend.run(plan, inputs, bindings))

    def _first_run(self, plan: Plan) -> None:
        reason = refusal(self._backend.plan_for(plan)) if plan.steps else "nothing to capture"
        if reason is not None and plan.steps:
            log_once(reason)
        state = _State.WARM if reason is None else _State.EAGER
        checked = _checked_inputs(plan) if reason is None else frozenset()
        pid = id(plan)
        ref = weakref.ref(plan, lambda _: self._forget(pid))
        with self._lock:
            self._entries[pid] = _Entry(ref, state, checked=checked)

    def _try_capture(
        self, entry: _Entry, plan: Plan, inputs: Sequence[Any], bindings: Sequence[Scalar], key: bytes | None
    ) -> list[Any]:
        try:
            captured, outs = self._capture(plan, inputs, bindings)
        except StagingError:
            return self._eager(plan, inputs, bindings)
        except CaptureRefused as e:
            log_once(str(e))
            entry.state = _State.EAGER
            return e.outputs if e.outputs is not None else self._eager(plan, inputs, bindings)
        except EmberlinkError:
            raise  # the call's own error (inputs that do not match the graph), as the eager path raises it
        except Exception as e:  # noqa: BLE001 - any failure to capture means: run it eagerly
            log_once(f"capturing a plan failed: {type(e).__name__}: {e}")
            entry.state = _State.EAGER
            return self._eager(plan, inputs, bindings)
        if self._admit is not None and not self._admit(key, plan, captured.nbytes):
            captured.free()
            log_once("a captured graph did not fit the session's memory or the client's graph-cache budget")
            entry.state = _State.EAGER
            return outs
        entry.captured, entry.key, entry.state = captured, key, _State.CAPTURED
        return outs

    def _forget(self, pid: int) -> None:
        """The plan is gone (evicted): free its capture."""
        with self._lock:
            entry = self._entries.pop(pid, None)
        if entry is not None and entry.captured is not None:
            self._free(entry, None)

    def _free(self, entry: _Entry, plan: Plan | None) -> None:
        captured, entry.captured = entry.captured, None
        if captured is None:
            return
        nbytes = captured.nbytes  # what was admitted: a freed capture holds nothing
        captured.free()
        if self._release is not None:
            self._release(entry.key, plan, nbytes)

    def captured(self, plan: Plan) -> bool:
        """Whether `plan` now runs as a captured graph."""
        entry = self._entries.get(id(plan))
        return entry is not None and entry.ref() is plan and entry.captured is not None

    @property
    def nbytes(self) -> int:
        """Memory the captured graphs hold (arenas, staging, fixed input buffers)."""
        return sum(e.captured.nbytes for e in list(self._entries.values()) if e.captured is not None)

    def close(self) -> None:
        """Free every capture (the owner is done); plans run through `run` after this capture again."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            self._free(entry, entry.ref())


class _LazyCapturer:
    """cuda_graph.capturer_for(backend), made at the first capture (on the thread that runs plans,
    not the one that opens the owner: importing nvmath-python and creating cuBLAS take a while)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._capture: CaptureFn | None = None
        self._failure: str | None = None

    def __call__(
        self, plan: Plan, inputs: Sequence[Any], bindings: Sequence[Scalar]
    ) -> tuple[Captured, list[Any]]:
        if self._capture is None:
            if self._failure is not None:
                raise CaptureRefused(self._failure)
            try:
                from emberlink.graph_replay.cuda_graph import capturer_for

                self._capture = capturer_for(self._backend)
            except Exception as e:  # a cuBLAS that does not load, a driver without graphs
                self._failure = f"CUDA graph capture is unavailable: {type(e).__name__}: {e}"
                raise CaptureRefused(self._failure) from e
        return self._capture(plan, inputs, bindings)


def _nvmath_missing() -> str | None:
    try:
        found = importlib.util.find_spec("nvmath")
    except (ImportError, ValueError) as e:  # ValueError: a module set to None in sys.modules
        return str(e) or "nvmath"
    return None if found is not None else "No module named 'nvmath'"


def open_captures(
    backend: Any, *, admit: Admit | None = None, release: Release | None = None
) -> Captures | None:
    """Captures for an owner of `backend`, or None (logged once) when capture cannot serve it."""
    if os.environ.get(CAPTURE_ENV, "1") == "0":
        log_once(f"{CAPTURE_ENV}=0 turns capture off", logging.DEBUG)
        return None
    name = getattr(backend, "name", None)
    if name != "cupy":
        log_once(f"capture needs the CuPy backend; this one is {name}", logging.DEBUG)
        return None
    missing = _nvmath_missing()
    if missing is not None:
        log_once(f"nvmath-python is missing ({missing}): pip install 'emberlink[cuda13]' (or [cuda12])")
        return None
    return Captures(backend, _LazyCapturer(backend), admit=admit, release=release)


__all__ = [
    "CAPTURE_ENV",
    "Admit",
    "CaptureFn",
    "Captured",
    "Captures",
    "Release",
    "log_once",
    "open_captures",
]
