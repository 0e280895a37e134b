"""The graph IR: specs, nodes, graphs and the dtype allow-list; plain values, no inference, no I/O.

Rules of this file (everything that defines what a graph *is* lives here):
- Every type here is an immutable value (frozen dataclasses of tuples), safe to share between
  threads and to hash.
- Value numbers: `[0, n_inputs)` are the input tensors, `[n_inputs, n_inputs + n_bindings)` the
  bindings (0-d weak scalars), then node `i` produces value `n_inputs + n_bindings + i`. Every node
  has exactly one output.
- Dtype names are NumPy's and come from `DTYPES` only (`protocol.dtypes`, their one home);
  binding kinds from `BINDING_KINDS` only.
- A `TensorSpec` checks itself when built (known dtype, rank <= `MAX_RANK`, dims are non-negative
  Python ints), so no malformed spec exists downstream.
- Node attrs are a tuple of `(name, value)` pairs sorted by name; `ops.check_attrs` builds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from emberlink.errors import DTypeError, ShapeError
from emberlink.protocol.dtypes import DTYPES, ITEMSIZE, KIND_OF_DTYPE
from emberlink.protocol.limits import MAX_RANK

BINDING_KINDS: tuple[str, ...] = ("bool", "int", "float")
"""Kinds of per-step scalars (bindings), in promotion order: bool < int < float."""


DEFAULT_DTYPE_OF_KIND: dict[str, str] = {"bool": "bool", "int": "int64", "float": "float32"}
"""The dtype a weak scalar takes when nothing stronger decides (e.g. `where(c, 1.0, 2.0)`)."""

KIND_RANK: dict[str, int] = {"bool": 0, "int": 1, "float": 2}

KeyItem = tuple[str] | tuple[str, int] | tuple[str, int, int, int]
"""One normalized getitem key item: `("s", start, stop, step)`, `("i", index)` or `("n",)`."""

Key = tuple[KeyItem, ...]

AttrValue = bool | int | float | str | None | tuple[int, ...] | Key
"""What an attr may hold; which of these each attr takes is in `ops.ATTR_KINDS`."""

Scalar = bool | int | float
"""A binding's value."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Dtype and shape of a value. `weak=True` marks a binding: dtype is then a kind, shape `()`."""

    dtype: str
    shape: tuple[int, ...]
    weak: bool = False

    def __post_init__(self) -> None:
        if self.weak:
            if self.dtype not in BINDING_KINDS:
                raise DTypeError(f"unknown binding kind {self.dtype!r}; expected one of {BINDING_KINDS}")
            if self.shape != ():
                raise ShapeError(f"a binding is a 0-d scalar, got shape {self.shape!r}")
            return
        if self.dtype not in ITEMSIZE:
            raise DTypeError(f"unknown dtype {self.dtype!r}; expected one of {DTYPES}")
        if type(self.shape) is not tuple or not all(type(d) is int and d >= 0 for d in self.shape):
            raise ShapeError(f"a shape is a tuple of non-negative ints, got {self.shape!r}")
        if len(self.shape) > MAX_RANK:
            raise ShapeError(f"rank {len(self.shape)} is over the limit of {MAX_RANK}: {self.shape!r}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def kind(self) -> str:
        """`"bool"`, `"int"` or `"float"`."""
        return self.dtype if self.weak else KIND_OF_DTYPE[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the array this spec describes (0 for a binding, which is a Python scalar)."""
        return 0 if self.weak else self.size * ITEMSIZE[self.dtype]

    def describe(self) -> str:
        """Short text for error messages: `float32 (3, 4)` or `float scalar`."""
        return f"{self.dtype} scalar" if self.weak else f"{self.dtype} {self.shape}"


def binding_spec(kind: str) -> TensorSpec:
    """The spec `ops.infer` takes for a binding input of this kind (`"bool" | "int" | "float"`)."""
    return TensorSpec(kind, (), weak=True)


def kind_of_scalar(value: object) -> str:
    """The binding kind of a Python scalar; anything else is a DTypeError."""
    if type(value) is bool:
        return "bool"
    if type(value) is int:
        return "int"
    if type(value) is float:
        return "float"
    raise DTypeError(f"a binding is a Python bool, int or float, got {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class Node:
    """One op application: `op` from the op table, value numbers in, attrs sorted by name."""

    op: str
    inputs: tuple[int, ...]
    attrs: tuple[tuple[str, AttrValue], ...] = ()


@dataclass(frozen=True, slots=True)
class Graph:
    """The canonical, content-addressed form of a flushed segment (docs/internals.md section 2)."""

    inputs: tuple[TensorSpec, ...]
    bindings: tuple[str, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]

    @property
    def first_node_value(self) -> int:
        """Value number of node 0's output."""
        return len(self.inputs) + len(self.bindings)

    def node_value(self, i: int) -> int:
        """Value number of node `i`'s output."""
        return len(self.inputs) + len(self.bindings) + i


__all__ = [
    "BINDING_KINDS",
    "DEFAULT_DTYPE_OF_KIND",
    "DTYPES",
    "ITEMSIZE",
    "KIND_OF_DTYPE",
    "KIND_RANK",
    "MAX_RANK",
    "AttrValue",
    "Graph",
    "Key",
    "KeyItem",
    "Node",
    "Scalar",
    "TensorSpec",
    "binding_spec",
    "kind_of_scalar",
]
