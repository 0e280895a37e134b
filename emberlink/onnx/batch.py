"""Which sizes grow with the batch: two recordings of one forward pass compared; no ONNX here.

emberlink records concrete shapes, so a dynamic batch is found by recording the forward pass at the
example batch `B`, at `2B` and at `3B`, and comparing: a size equal in all is static; one that
differs must be `scale * batch + offset` (a reshape to `(B * T, D)` gives `scale = T`), fitted to
the first two recordings and checked against the third. Everything else must be equal: the ops,
their order and inputs, the constants made inside the forward pass and the bindings' values. What
differs otherwise depends on the batch size in a way this export cannot say, and is refused with
the op that shows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from emberlink.errors import ExportError
from emberlink.graph_replay.ir import Scalar
from emberlink.onnx.trace import Program


@dataclass(frozen=True, slots=True)
class Affine:
    """A size that grows with the batch: `scale * batch + offset`."""

    scale: int
    offset: int

    def at(self, batch: int) -> int:
        return self.scale * batch + self.offset


Dim = int | Affine
"""A size: an int, or an Affine one where the batch is dynamic."""

Sym = object
"""An attr value in which some ints may be Affine."""


@dataclass
class Symbolic:
    """A program's sizes as the export sees them: each tensor value's dims, each step's attrs (by
    its output value id) and each binding's value, with an Affine wherever one follows the batch
    (a binding may: `x.sum() / x.shape[0]`)."""

    dims: dict[int, tuple[Dim, ...]]
    attrs: dict[int, dict[str, Sym]]
    scalars: dict[int, Scalar | Affine]


def static(program: Program) -> Symbolic:
    """Every size as recorded (a fixed batch)."""
    dims: dict[int, tuple[Dim, ...]] = {v: s.shape for v, s in program.specs.items() if not s.weak}
    return Symbolic(dims, {st.out: dict(st.attrs) for st in program.steps}, dict(program.scalars))


RECORDINGS = 3
"""Recordings compared, at `batch * (1, 2, ..., RECORDINGS)`: two fit a line, the third checks it (a
size such as T * T, of a sequence axis taken for the batch, passes through any two points)."""


def compare(programs: Sequence[Program], batches: Sequence[int]) -> Symbolic:
    """The sizes of `programs[0]`, symbolic where they follow the batch (`programs[i]` was recorded
    with batch `batches[i]`). ExportError where the recordings differ in anything else."""
    first = programs[0]
    at = ", ".join(map(str, batches))
    for p in programs[1:]:
        if len(p.steps) != len(first.steps) or (p.inputs, p.outputs) != (first.inputs, first.outputs):
            counts = ", ".join(str(len(q.steps)) for q in programs)
            raise _differ(f"{counts} ops at batches {at}")
    attrs: dict[int, dict[str, Sym]] = {}
    for steps in zip(*(p.steps for p in programs), strict=True):
        step = steps[0]
        for other in steps[1:]:
            if (other.out, other.op, other.inputs) != (step.out, step.op, step.inputs) or [
                n for n, _ in other.attrs
            ] != [n for n, _ in step.attrs]:
                raise _differ(
                    f"op {step.op} at batch {batches[0]} is {other.op} with other inputs at another"
                )
        attrs[step.out] = {
            name: _merge(step.op, [dict(s.attrs)[name] for s in steps], batches) for name, _ in step.attrs
        }
    _same_constants(programs)
    scalars: dict[int, Scalar | Affine] = {}
    for v, x in first.scalars.items():
        values = [p.scalars[v] for p in programs]
        if all(type(y) is int for y in values):
            scalars[v] = _dim("a Python int", cast(list[int], values), batches)
        elif all(type(y) is type(x) and (y == x or (y != y and x != x)) for y in values):  # noqa: PLR0124
            scalars[v] = x  # the same number (NaN counts as the same) at every batch
        else:
            users = sorted({st.op for st in first.steps if v in st.inputs})
            raise _differ(f"a Python number used by {', '.join(users)} is {values} at batches {at}")
    dims: dict[int, tuple[Dim, ...]] = {}
    for v, spec in first.specs.items():
        if spec.weak:
            continue
        specs = [p.specs[v] for p in programs]
        if any(s.dtype != spec.dtype or s.ndim != spec.ndim for s in specs):
            raise _differ(f"a value is {' / '.join(s.describe() for s in specs)} at batches {at}")
        dims[v] = tuple(_dim("a shape", list(sizes), batches) for sizes in zip(*(s.shape for s in specs)))
    return Symbolic(dims, attrs, scalars)


def _same_constants(programs: Sequence[Program]) -> None:
    first = programs[0]
    inputs = set(first.inputs)
    for p in programs[1:]:
        if p.arrays.keys() != first.arrays.keys():
            raise _differ("the forward pass uploads different constants")
        for v, x in first.arrays.items():
            y = p.arrays[v]
            if v not in inputs and (
                x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y, equal_nan=True)
            ):
                raise _differ(
                    f"a constant made inside the forward pass ({x.dtype} {x.shape}) depends on the batch size"
                )


def _dim(what: str, sizes: Sequence[int], batches: Sequence[int]) -> Dim:
    """The size `sizes[i]` at `batches[i]`: an int where it is the same at every batch, else the
    Affine through the first two points, which every other must lie on."""
    if all(d == sizes[0] for d in sizes):
        return sizes[0]
    scale, rest = divmod(sizes[1] - sizes[0], batches[1] - batches[0])
    line = Affine(scale, sizes[0] - scale * batches[0])
    if rest or any(line.at(b) != d for b, d in zip(batches, sizes, strict=True)):
        raise _differ(
            f"{what} is {', '.join(map(str, sizes))} at batches {', '.join(map(str, batches))}: "
            "not scale * batch + offset"
        )
    return line


def _merge(op: str, values: Sequence[object], batches: Sequence[int]) -> Sym:
    first = values[0]
    if all(type(x) is int for x in values):
        return _dim(f"{op}'s attr", cast(Sequence[int], values), batches)
    if all(type(x) is tuple and len(x) == len(first) for x in values):  # type: ignore[arg-type]
        return tuple(_merge(op, items, batches) for items in zip(*cast(Sequence[tuple[object, ...]], values)))
    if all(type(x) is type(first) and x == first for x in values):
        return first
    raise _differ(
        f"{op}'s attrs are {', '.join(map(repr, values))} at batches {', '.join(map(str, batches))}"
    )


def _differ(why: str) -> ExportError:
    return ExportError(
        f"the forward pass is not the same graph for every batch size ({why}); "
        "export with dynamic_batch=False for a fixed batch"
    )


def is_static(dims: Sequence[Dim]) -> bool:
    return all(type(d) is int for d in dims)


__all__ = ["RECORDINGS", "Affine", "Dim", "Sym", "Symbolic", "compare", "is_static", "static"]
