"""The Backend interface and the one run loop every backend shares; no op semantics here, no I/O.

The loop walks a compiled plan: it looks each op up in the backend's explicit table, runs it
(writing into a dying input's buffer where the plan allows and the buffer is provably nobody
else's), checks the result against the inferred spec, and drops each value after its last use so
memory follows the plan's live set. Every failure leaves as `ExecutionError` (or `OutOfMemory`) naming
the op and node; nothing else escapes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias

import numpy as np

from emberlink.errors import ExecutionError, OutOfMemory
from emberlink.graph_replay.ir import DTYPES, Scalar, TensorSpec
from emberlink.graph_replay.plan import Plan, Step

Array: TypeAlias = Any
"""A backend's array: `numpy.ndarray` or `cupy.ndarray`."""

OpFn: TypeAlias = Callable[[Any, Sequence[Any], Step], Array]
"""An op's implementation: `(xp, args, step) -> array`. Args are arrays, or Python scalars for bindings."""

IntoFn: TypeAlias = Callable[[Any, Sequence[Any], Step, Any], Array]
"""An op written into an existing buffer: `(xp, args, step, out) -> out`; same values as its OpFn."""


class HostCopy(Protocol):
    """A copy to host memory under way (`Backend.to_numpy_async`); a client's ReadFuture."""

    def result(self, timeout: float | None = None) -> Any: ...
    def done(self) -> bool: ...


class Ready:
    """A HostCopy that is already complete."""

    __slots__ = ("_array",)

    def __init__(self, array: Any) -> None:
        self._array = array

    def result(self, timeout: float | None = None) -> Any:
        return self._array

    def done(self) -> bool:
        return True


class Backend(Protocol):
    """What an executor or the worker needs from a device (docs/internals.md section 4).

    A class implementing it is registered for a device kind in graph_replay/backends.py.
    """

    name: str

    @property
    def runs_inline(self) -> bool:
        """Whether tiny work may run on whichever thread asks (host arrays, no device context to
        bind): the worker then applies light batches on its event loop (docs/internals.md section 6)."""
        ...

    def bind_thread(self) -> None:
        """Make the calling thread use this backend's device; the worker's device thread calls it
        once before any work. A no-op where there is no per-thread device context."""
        ...

    def free_bytes(self) -> int | None:
        """Bytes still free where this backend allocates; None when that is the host's memory,
        whose available bytes the worker reads itself."""
        ...

    def host_buffer(self, nbytes: int) -> Any:
        """`nbytes` of host memory (a uint8 NumPy array) that this device copies from fastest:
        page-locked memory on a GPU, which a worker decrypts uploads into; None where ordinary
        memory serves as well. Callable from any thread."""
        ...

    def from_numpy(self, a: Any) -> Array: ...
    def to_numpy(self, a: Array) -> Any: ...

    def to_numpy_async(self, a: Array) -> HostCopy:
        """Start copying `a` to a new host array of the caller's own (not `a` itself, even where
        `a` is a host array); its `result()` waits for the copy, which runs after the work
        queued so far."""
        ...

    def run(self, plan: Plan, inputs: Sequence[Array], bindings: Sequence[Scalar]) -> list[Array]: ...
    def nbytes(self, a: Array) -> int: ...
    def memory_stats(self) -> dict[str, int]: ...
    def reset_peak(self) -> None: ...
    def synchronize(self) -> None: ...


_NP_DTYPES: dict[str, Any] = {name: np.dtype(name) for name in DTYPES}
"""Dtype objects by name: comparing `a.dtype != _NP_DTYPES[name]` costs ~0.1 µs, `str(a.dtype)`
~2.5 µs in NumPy 2, and the run loop checks every input and result of every step."""


def check_bindings(plan: Plan, bindings: Sequence[Scalar]) -> list[Scalar]:
    """Bindings as the ops take them: exactly the graph's kinds (an int is accepted for a float)."""
    kinds = plan.graph.bindings
    if len(bindings) != len(kinds):
        raise ExecutionError(f"graph takes {len(kinds)} bindings, got {len(bindings)}")
    out: list[Scalar] = []
    for j, (kind, value) in enumerate(zip(kinds, bindings)):
        t = type(value)
        if (kind, t) in (("bool", bool), ("int", int)):
            out.append(value)
        elif kind == "float" and t in (float, int):
            out.append(float(value))
        else:
            raise ExecutionError(f"binding {j} must be a Python {kind}, got {t.__name__} {value!r}")
    return out


def check_inputs(plan: Plan, inputs: Sequence[Array]) -> None:
    """Inputs must match the graph's specs exactly (count, dtype, shape)."""
    specs = plan.graph.inputs
    if len(inputs) != len(specs):
        raise ExecutionError(f"graph takes {len(specs)} inputs, got {len(inputs)}")
    for i, (spec, a) in enumerate(zip(specs, inputs)):
        if a.dtype != _NP_DTYPES[spec.dtype] or tuple(a.shape) != spec.shape:
            raise ExecutionError(
                f"input {i} is {a.dtype} {tuple(a.shape)}, the graph wants {spec.describe()}"
            )


def _check_result(step: Step, out: Array) -> None:
    spec: TensorSpec = step.out_spec
    if out.dtype != _NP_DTYPES[spec.dtype] or tuple(out.shape) != spec.shape:
        raise ExecutionError(
            f"{step.label} (node {step.node}): internal error: produced {out.dtype} {tuple(out.shape)}, "
            f"inference says {spec.describe()}"
        )


def _compact(a: Array) -> Array:
    """A view that keeps a larger base alive is copied, so freed intermediates really go."""
    base = a.base
    if base is not None and base.nbytes > a.nbytes:
        return a.copy()
    return a


def _references(values: list[Any], v: int) -> int:
    return sys.getrefcount(values[v])


_ALONE = _references([object()], 0)
"""What `_references` reports for an object only a list slot holds. Measured, not assumed, so the
interpreter's own counting conventions (which differ across Python versions) cancel out."""


def _exclusive(values: list[Any], v: int, uses: int) -> Any:
    """values[v] if the run may overwrite it: it owns its memory, is contiguous and writeable, and
    nothing refers to it but the run loop (a view of it would hold a reference to it)."""
    buf = values[v]
    if buf.base is not None or not buf.flags.c_contiguous or not getattr(buf.flags, "writeable", True):
        return None
    # Expected holders: values[v], `uses` slots of the step's argument list, and `buf` here. Any
    # other holder means someone could see the overwrite.
    if _references(values, v) != _ALONE + uses + 1:
        return None
    return buf


def run_plan(
    plan: Plan,
    inputs: Sequence[Array],
    bindings: Sequence[Scalar],
    *,
    xp: Any,
    table: Mapping[str, OpFn],
    into_table: Mapping[str, IntoFn] | None = None,
    oom_errors: tuple[type[BaseException], ...] = (MemoryError,),
    after_step: Callable[[Array], None] | None = None,
) -> list[Array]:
    """Run `plan` with the ops of `table` on array module `xp`; returns the outputs in order.

    A step the plan lets write into a dying input (`Step.into`) does so through `into_table`
    when the backend has the op there and the buffer is still exclusively the run's; otherwise it
    allocates as usual. Either way the result is the same. `after_step(result)` is called once a
    step's result exists and before its frees (the live set's high point), e.g. to count memory.
    """
    check_inputs(plan, inputs)
    values: list[Any] = [None] * len(plan.specs)
    values[: len(inputs)] = inputs
    values[len(inputs) : len(inputs) + len(bindings)] = check_bindings(plan, bindings)
    for step in plan.steps:
        fn = table.get(step.op)
        if fn is None:
            raise ExecutionError(f"{step.label} (node {step.node}): this backend has no such op")
        args = [values[v] for v in step.inputs]
        into = step.into
        into_fn = None if into is None or into_table is None else into_table.get(step.op)
        buf = None if into_fn is None else _exclusive(values, into, step.inputs.count(into))  # type: ignore[arg-type]
        try:
            if buf is None:
                out = xp.asarray(fn(xp, args, step))
            else:
                out = into_fn(xp, args, step, buf)  # type: ignore[misc]
        except oom_errors as e:
            raise OutOfMemory(f"{step.label} (node {step.node}): out of memory: {e}") from e
        except ExecutionError:
            raise
        except Exception as e:
            raise ExecutionError(f"{step.label} (node {step.node}) failed: {type(e).__name__}: {e}") from e
        del args, buf
        _check_result(step, out)
        values[step.out] = out
        if after_step is not None:
            after_step(out)
        del out  # so the next step may find this result exclusively the run's
        for v in step.free:
            values[v] = None
    return [_compact(values[v]) for v in plan.outputs]


__all__ = [
    "Array",
    "Backend",
    "HostCopy",
    "IntoFn",
    "OpFn",
    "Ready",
    "check_bindings",
    "check_inputs",
    "run_plan",
]
