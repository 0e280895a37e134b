"""Which sizes grow with the batch: two recordings of one forward pass compared; no ONNX here.

emberlink records concrete shapes, so a dynamic batch is found by recording the forward pass twice,
with the example batch `B` and with `2B`, and comparing: a size equal in both is static; one that
differs is taken as `scale * batch + offset`, fitted to the two recordings (a reshape to `(B * T, D)`
gives `scale = T`). Everything else must be equal: the ops, their order and inputs, the constants
made inside the forward pass and the bindings' values. What differs otherwise depends on the batch
size in a way ONNX cannot say, and is refused with the op that shows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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


def compare(a: Program, b: Program, batch: int) -> Symbolic:
    """`a` recorded with batch `batch`, `b` with `2 * batch`: the sizes of `a`, symbolic where they
    follow the batch. ExportError where the two differ in anything else."""
    if len(a.steps) != len(b.steps) or a.outputs != b.outputs or a.inputs != b.inputs:
        raise _differ(f"{len(a.steps)} ops at batch {batch}, {len(b.steps)} at batch {2 * batch}")
    attrs: dict[int, dict[str, Sym]] = {}
    for sa, sb in zip(a.steps, b.steps, strict=True):
        if (sa.out, sa.op, sa.inputs) != (sb.out, sb.op, sb.inputs) or [n for n, _ in sa.attrs] != [
            n for n, _ in sb.attrs
        ]:
            raise _differ(f"op {sa.op} at batch {batch} is {sb.op} with other inputs at batch {2 * batch}")
        attrs[sa.out] = {
            n: _merge(sa.op, x, y, batch) for (n, x), (_, y) in zip(sa.attrs, sb.attrs, strict=True)
        }
    _same_constants(a, b)
    scalars: dict[int, Scalar | Affine] = {}
    for v, x in a.scalars.items():
        y = b.scalars[v]
        if type(x) is int and type(y) is int:
            scalars[v] = _dim("a Python int", x, y, batch)
        elif type(x) is type(y) and (x == y or x != x and y != y):  # noqa: PLR0124 - NaN equals NaN here
            scalars[v] = x
        else:
            users = sorted({st.op for st in a.steps if v in st.inputs})
            raise _differ(
                f"a Python number used by {', '.join(users)} is {x!r} at batch {batch}, {y!r} at {2 * batch}"
            )
    dims: dict[int, tuple[Dim, ...]] = {}
    for v, sa_ in a.specs.items():
        sb_ = b.specs[v]
        if sa_.weak:
            continue
        if sa_.dtype != sb_.dtype or sa_.ndim != sb_.ndim:
            raise _differ(f"a value is {sa_.describe()} at batch {batch} and {sb_.describe()} at {2 * batch}")
        dims[v] = tuple(_dim("a shape", x, y, batch) for x, y in zip(sa_.shape, sb_.shape, strict=True))
    return Symbolic(dims, attrs, scalars)


def _same_constants(a: Program, b: Program) -> None:
    inputs = set(a.inputs)
    if a.arrays.keys() != b.arrays.keys():
        raise _differ("the forward pass uploads different constants")
    for v, x in a.arrays.items():
        y = b.arrays[v]
        if v not in inputs and (
            x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y, equal_nan=True)
        ):
            raise _differ(
                f"a constant made inside the forward pass ({x.dtype} {x.shape}) depends on the batch size"
            )


def _dim(what: str, x: int, y: int, batch: int) -> Dim:
    if x == y:
        return x
    scale, rest = divmod(y - x, batch)
    if rest:
        raise _differ(
            f"{what} is {x} at batch {batch} and {y} at batch {2 * batch}, not a multiple of the batch"
        )
    return Affine(scale, x - scale * batch)


def _merge(op: str, x: object, y: object, batch: int) -> Sym:
    if type(x) is int and type(y) is int:
        return _dim(f"{op}'s attr", x, y, batch)
    if type(x) is tuple and type(y) is tuple and len(x) == len(y):
        return tuple(_merge(op, p, q, batch) for p, q in zip(x, y, strict=True))
    if type(x) is type(y) and x == y:
        return x
    raise _differ(f"{op}'s attrs are {x!r} at batch {batch} and {y!r} at batch {2 * batch}")


def _differ(why: str) -> ExportError:
    return ExportError(
        f"the forward pass is not the same graph for every batch size ({why}); "
        "export with dynamic_batch=False for a fixed batch"
    )


def as_ints(value: Sym) -> tuple[Dim, ...]:
    """An attr that is a tuple of sizes (a shape, a key item's numbers)."""
    assert isinstance(value, tuple)
    return value


def concrete(value: Sym, batch: int) -> object:
    """`value` with every Affine at `batch`."""
    if isinstance(value, Affine):
        return value.at(batch)
    if isinstance(value, tuple):
        return tuple(concrete(x, batch) for x in value)
    return value


def is_static(dims: Mapping[int, Dim] | tuple[Dim, ...]) -> bool:
    values = dims.values() if isinstance(dims, Mapping) else dims
    return all(type(d) is int for d in values)


__all__ = ["Affine", "Dim", "Sym", "Symbolic", "as_ints", "compare", "concrete", "is_static", "static"]
