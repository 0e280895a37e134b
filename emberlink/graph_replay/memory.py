"""Byte accounting of a backend's arrays: exact for live host arrays (`MemoryMeter`), and an upper
bound, from specs alone, on what a plan allocates while it runs (`plan_peak_bytes`); no I/O.

NumPy has no memory pool to ask, so the NumPy backend registers every array it makes or is
handed (uploads, plan inputs, every step's result, outputs) with a `MemoryMeter`. The meter
counts each array's *buffer* once (a view counts as the array that owns its memory) and
uncounts it when that buffer is garbage (a weak-reference callback), so `in_use` is exactly the
bytes of the backend's arrays that are still alive, whoever holds them: a session's tensor store,
the run loop's live values, a result waiting to be sent. `peak` is the high point of `in_use`,
sampled every time an array is registered, i.e. after every step of a run, before its frees.

Not counted: temporaries inside one op (an op's own scratch arrays), and memory that is not an
array (Python objects, the allocator's own caches).

A run repeats: which steps make a new buffer and which write into one or view one is decided by
the plan, the ops and the inputs' layouts (strides), never by values. So the NumPy backend counts
every step of a plan's first run with given input strides, keeps how far `in_use` rose above its
start (`start_rise`/`end_rise`), and for later runs with those strides records that high point at
once (`add_rise`) and counts no step (a weak reference per new buffer and a call per step cost
~50 µs of a ~3 ms MLP step on the 2-core machine). The figure is the same, exactly so unless another
thread allocated during the measured run (then it is higher). One run is measured at a time; a run
that starts meanwhile counts its steps without keeping its rise. While a run that is not counted
step by step is under way, its intermediates show in `peak`, not in `in_use`.

Thread-safe: arrays may die on any thread. A dying array's callback only appends to a deque and
pops a dict entry (both atomic in CPython); counters change under a lock the callbacks never take.

`plan_peak_bytes` is what the worker reserves against a session's quota before a plan runs, so it
must not be below what the run really takes (inputs apart, which the session holds already). It
follows buffers, not values: a view (`permute_dims`, `broadcast_to`, `expand_dims`, `getitem`)
has no bytes of its own but keeps its base's buffer alive until its own last use; `reshape` and
`squeeze` may copy, so they count both ways. A buffer lives from the step that makes it to the
last use of any value in it, or to the end if an output lives in it. On top of the live buffers,
each step counts its result and its scratch: operands cast to the step's operand dtype, and the
temporaries its implementation makes (numpy_backend.py), by op (`SCRATCH`; an op missing there
counts two temporaries of its largest operand or result), and NumPy's iterator buffers. At the end, outputs that are views of a
larger buffer are copied (`backend._compact`).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from emberlink.graph_replay import ops
from emberlink.graph_replay.ir import ITEMSIZE, TensorSpec
from emberlink.graph_replay.plan import FUSED, Plan, Step


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
        self._most = 0  # most entries `_live` has held since it was last built
        self._died: deque[int] = deque()
        self._in_use = 0
        self._peak = 0
        self._top: int | None = None  # in_use's high point since `start_rise` (None: not measuring)
        # One bound method for every buffer's weak reference, not one made per `track` (64 bytes
        # each, held as long as the buffer lives: a session holding many small arrays held as many).
        self._on_death: Callable[[_Tracked], None] = self._gone

    def _gone(self, ref: _Tracked) -> None:
        # Runs before the buffer's memory is released, so no new array can have taken its id yet.
        if self._live.get(ref.key) is ref:
            self._live.pop(ref.key, None)
        self._died.append(ref.nbytes)

    def _settle(self) -> None:
        died = self._died
        while died:
            self._in_use -= died.popleft()
        live = len(self._live)
        if live * 8 < self._most and self._most > 4096:
            # A dict keeps its table after its entries go: once most have, it is built anew (live
            # buffers only), so a session that once held many small arrays leaves no large table.
            self._live = {k: r for k, r in self._live.items() if r() is not None}
            self._most = live
        if live > self._most:  # noqa: PLR1730 - no max() call: several times a step
            self._most = live

    def track(self, a: Any) -> None:
        """Count `a`'s buffer (once, however many arrays share it) until it is garbage."""
        root = a if a.base is None else owner(a)
        key = id(root)
        if key in self._live:  # counted already (a replay's inputs, its step results as outputs)
            return
        with self._lock:
            self._settle()
            known = self._live.get(key)
            if known is None or known() is not root:  # absent, or a dead buffer's id reused
                ref = _Tracked(root, self._on_death)
                ref.key = key
                ref.nbytes = int(root.nbytes)
                self._live[key] = ref
                self._in_use += ref.nbytes
            if self._in_use > self._peak:  # noqa: PLR1730 - no max() call: several times a step
                self._peak = self._in_use
            top = self._top
            if top is not None and self._in_use > top:
                self._top = self._in_use

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

    def start_rise(self) -> int | None:
        """Start measuring how far `in_use` rises above what is in use now (sampled as `peak` is);
        pass the result to `end_rise`. None if a measurement is under way already (one at a time:
        a run then simply counts its steps). `peak` and `reset_peak` are unaffected."""
        with self._lock:
            self._settle()
            if self._top is not None:
                return None
            self._top = self._in_use
            return self._in_use

    def end_rise(self, start: int) -> int:
        """How far `in_use` rose above `start` (from `start_rise`) since then (bytes, at least 0)."""
        with self._lock:
            self._settle()
            top = max(self._top if self._top is not None else 0, self._in_use)
            self._top = None
        return max(top - start, 0)

    def add_rise(self, rise: int) -> None:
        """Record a high point `rise` bytes above what is in use now (a run measured before)."""
        with self._lock:
            self._settle()
            self._peak = max(self._peak, self._in_use + rise)


PURE_VIEW_OPS = frozenset({"permute_dims", "broadcast_to", "expand_dims", "getitem"})
"""Ops whose result is always a view of their first input (no bytes of its own)."""
MAYBE_VIEW_OPS = frozenset({"reshape", "squeeze"})
"""Ops whose result is a view when the layout allows, else a copy."""

_WIDE = 8  # bytes of the widest element a temporary may have (int64, float64, uint64)


def _wide(spec: TensorSpec) -> int:
    """Bytes of an element of `spec`'s dtype as float work widens it (float16 to float32)."""
    return 8 if ITEMSIZE[spec.dtype] == 8 else 4


def _half(spec: TensorSpec) -> int:
    """Bytes of a widened copy of a float16 operand (none for any other dtype)."""
    return spec.size * 4 if spec.dtype == "float16" else 0


def _out(factor: float) -> Callable[[Step], int]:
    """`factor` result-sized temporaries of 8-byte elements."""
    return lambda step: int(factor * step.out_spec.size * _WIDE)


def _none(step: Step) -> int:
    return 0


def _float_chain(step: Step) -> int:
    """softmax, log_softmax, cross_entropy, sigmoid: the widened operand, then two live temporaries
    of its size at a time (e.g. `shifted` and `exp(shifted)`)."""
    x = step.in_specs[0]
    return _half(x) + 2 * x.size * _wide(step.out_spec) + _half(step.out_spec)


def _matmul(step: Step) -> int:
    """float16 operands and product are widened to float32; other dtypes need nothing more."""
    if step.out_spec.dtype != "float16":
        return 0
    return sum(_half(s) for s in step.in_specs) + _half(step.out_spec)


SCRATCH: dict[str, Callable[[Step], int]] = {
    **{op: _none for op in (*ops.names("unary"), *ops.names("binary"), "where", "astype")},
    **{op: _none for op in ("zeros", "ones", "full", "eye", "concat", "stack", "getitem_grad")},
    **{op: _float_chain for op in ("sigmoid", "softmax", "log_softmax", "cross_entropy")},
    "arange": _out(3),  # the int64/float64 base, base * step, + start, then the cast
    "rand": _out(4),  # splitmix64's uint64 words and their float64 scaling
    "randn": _out(8),  # twice the words, two uniforms, the radius and the angle
    "matmul": _matmul,
    "one_hot": lambda step: step.in_specs[0].size * _WIDE + step.out_spec.size,  # wide labels, the test
    "take": lambda step: 2 * step.in_specs[1].size * _WIDE,  # widened indices, the bounds check
    "scatter_add": lambda step: step.in_specs[1].size * _WIDE,  # widened indices
    **{op: _out(1) for op in ("sum", "mean", "prod", "max", "min", "argmax", "argmin")},  # the cast
}
"""Bytes of the temporaries each op's implementation makes and frees while it runs, beyond its
result and its operand casts (numpy_backend.py; CuPy's are the same or fewer)."""


ITERATOR_BUFFER_BYTES = 256 << 10
"""Added to every step's scratch: NumPy's buffered iterators (reductions, casts) allocate buffers
of 8192 elements per operand; 256 KiB covers a few operands of 8-byte elements with room to spare."""


def _default_scratch(step: Step) -> int:
    """An op missing from SCRATCH: two temporaries the size of its largest operand or result."""
    largest = max((s.size for s in (*step.in_specs, step.out_spec) if not s.weak), default=0)
    return 2 * largest * _WIDE


def plan_peak_bytes(plan: Plan) -> int:
    """An upper bound on the bytes a run of `plan` allocates at its high point, inputs apart (see
    the module docstring): what the worker reserves before running it."""
    specs = plan.specs
    first = plan.graph.first_node_value
    steps = plan.steps
    held = _buffers_held(steps, first)
    kept = {b for v in plan.outputs for b in held.get(v, ())}
    last: dict[int, int] = {}  # buffer -> index of the last step that reads a value living in it
    for i, step in enumerate(steps):
        for v in step.inputs:
            for b in held.get(v, ()):
                last[b] = i
    dies_after: dict[int, list[int]] = {}
    for b, i in last.items():
        if b not in kept:
            dies_after.setdefault(i, []).append(b)
    live = peak = 0
    for i, step in enumerate(steps):
        made = _made(step, specs)
        live += made
        peak = max(peak, live + _scratch(step, specs))
        for b in dies_after.get(i, ()):
            live -= specs[b].nbytes
        if step.out not in last and step.out not in kept:
            live -= made  # a result nobody reads (the plan drops such nodes; kept for safety)
    copies = sum(specs[v].nbytes for v in set(plan.outputs) if v >= first and held.get(v, (v,)) != (v,))
    return max(peak, live + copies)


def _buffers_held(steps: Sequence[Step], first: int) -> dict[int, tuple[int, ...]]:
    """Value number -> the buffers (named by the value that made each) that it keeps alive; inputs
    and bindings hold none of the plan's."""
    held: dict[int, tuple[int, ...]] = {}
    for s in steps:
        base = held.get(s.inputs[0], ()) if s.inputs and s.inputs[0] >= first else ()
        if s.op in PURE_VIEW_OPS:
            held[s.out] = base
        elif s.op in MAYBE_VIEW_OPS:
            held[s.out] = (*base, s.out)
        elif s.into is not None:
            held[s.out] = held.get(s.into, (s.into,))
        else:
            held[s.out] = (s.out,)
    return held


def _made(step: Step, specs: Sequence[TensorSpec]) -> int:
    """Bytes of the new buffer a step makes (none for a view or a result written into a dying input)."""
    if step.op in PURE_VIEW_OPS or step.into is not None:
        return 0
    return specs[step.out].nbytes


def _scratch(step: Step, specs: Sequence[TensorSpec]) -> int:
    """Bytes a step allocates and frees while it runs: operand casts and its op's temporaries."""
    if step.op in PURE_VIEW_OPS or step.op in MAYBE_VIEW_OPS:
        return 0
    if step.op == FUSED:
        return sum(_scratch(member, specs) for member in step.chain)
    total = 0
    cast = step.operand_dtype
    if cast is not None:
        for spec in step.in_specs:
            if not spec.weak and spec.dtype != cast:
                total += spec.size * ITEMSIZE[cast]
    return total + SCRATCH.get(step.op, _default_scratch)(step) + ITERATOR_BUFFER_BYTES


__all__ = ["SCRATCH", "MemoryMeter", "owner", "plan_peak_bytes"]
