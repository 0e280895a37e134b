"""The attr allow-list and the exact-type checks of attr values; no inference, no arrays.

Exact types: `int` never accepts `bool`, tuples are tuples, ints fit in int64 (so every graph can
be encoded), floats are finite. Value kinds (`shape`, `axis`, `axis_int`, ...) are what an op
declares for each of its attrs in `ops.OPS`.
"""

from __future__ import annotations

import math
from typing import cast

from emberlink.errors import DTypeError, ShapeError
from emberlink.graph_replay.ir import MAX_RANK, AttrValue, Key
from emberlink.protocol.dtypes import DTYPES, FLOAT_DTYPES

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

REDUCTIONS: tuple[str, ...] = ("mean", "none", "sum")

ATTR_KINDS: dict[str, tuple[str, ...]] = {
    "shape": ("shape",),
    "axis": ("axis", "axis_int", "axis_opt", "axis_tuple"),
    "axes": ("axes",),
    "keepdims": ("bool",),
    "dtype": ("dtype", "float_dtype"),
    "key": ("key",),
    "start": ("number",),
    "stop": ("number",),
    "step": ("number",),
    "n": ("count",),
    "m": ("count",),
    "k": ("int",),
    "num_classes": ("count",),
    "reduction": ("reduction",),
    "size": ("count",),
    "kernel_size": ("pos_pair",),
    "dilation": ("pos_pair",),
    "stride": ("pos_pair",),
    "padding": ("pair",),
    "output_size": ("pair",),
}
"""The attr allow-list: each name and the value kinds ops may declare it with."""


def _is_int(v: object) -> bool:
    return type(v) is int and _INT64_MIN <= v <= _INT64_MAX


def _is_int_tuple(v: object) -> bool:
    return type(v) is tuple and len(v) <= MAX_RANK and all(_is_int(d) for d in v)


def _check_key(op: str, v: object) -> Key:
    if type(v) is not tuple or len(v) > MAX_RANK:
        raise DTypeError(f"{op}: key must be a tuple of at most {MAX_RANK} items, got {v!r}")
    for item in v:
        if type(item) is not tuple or not item or type(item[0]) is not str:
            raise DTypeError(f"{op}: key item must be a tuple starting with 's', 'i' or 'n', got {item!r}")
        tag, args = item[0], item[1:]
        want = {"s": 3, "i": 1, "n": 0}.get(tag)
        if want is None or len(args) != want or not all(_is_int(x) for x in args):
            raise DTypeError(f"{op}: malformed key item {item!r}")
        if any(x < 0 for x in args) or (tag == "s" and args[2] < 1):
            raise ShapeError(f"{op}: key item {item!r} is not normalized (bounds >= 0, step >= 1)")
    return cast(Key, v)


def check_attr_value(op: str, name: str, kind: str, v: object) -> AttrValue:
    bad = f"{op}: attr {name!r} must be"
    if kind == "shape":
        if not _is_int_tuple(v) or any(d < 0 for d in cast(tuple[int, ...], v)):
            raise DTypeError(f"{bad} a tuple of at most {MAX_RANK} non-negative ints, got {v!r}")
    elif kind in ("axis_tuple", "axes"):
        if not _is_int_tuple(v):
            raise DTypeError(f"{bad} a tuple of ints, got {v!r}")
    elif kind == "axis":
        if not (v is None or _is_int(v) or _is_int_tuple(v)):
            raise DTypeError(f"{bad} an int, a tuple of ints or None, got {v!r}")
    elif kind == "axis_opt":
        if not (v is None or _is_int(v)):
            raise DTypeError(f"{bad} an int or None, got {v!r}")
    elif kind in ("axis_int", "int"):
        if not _is_int(v):
            raise DTypeError(f"{bad} an int, got {v!r}")
    elif kind == "count":
        if not _is_int(v) or cast(int, v) < 0:
            raise DTypeError(f"{bad} a non-negative int, got {v!r}")
    elif kind in ("pair", "pos_pair"):
        least = 1 if kind == "pos_pair" else 0
        if type(v) is not tuple or len(v) != 2 or not all(_is_int(d) and d >= least for d in v):
            raise DTypeError(f"{bad} a tuple of two ints >= {least}, got {v!r}")
    elif kind == "bool":
        if type(v) is not bool:
            raise DTypeError(f"{bad} a bool, got {v!r}")
    elif kind in ("dtype", "float_dtype"):
        allowed = DTYPES if kind == "dtype" else FLOAT_DTYPES
        if type(v) is not str or v not in allowed:
            raise DTypeError(f"{bad} one of {allowed}, got {v!r}")
    elif kind == "number":
        if not (_is_int(v) or (type(v) is float and math.isfinite(v))):
            raise DTypeError(f"{bad} an int or a finite float, got {v!r}")
    elif kind == "reduction":
        if type(v) is not str or v not in REDUCTIONS:
            raise DTypeError(f"{bad} one of {REDUCTIONS}, got {v!r}")
    elif kind == "key":
        return _check_key(op, v)
    else:  # pragma: no cover - the table below uses only the kinds above
        raise AssertionError(kind)
    return cast(AttrValue, v)


__all__ = ["ATTR_KINDS", "REDUCTIONS", "check_attr_value"]
