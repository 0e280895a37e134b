"""The dtype allow-list: names, item sizes, kinds and wire codes; plain data, no NumPy, no I/O.

This is the one home of the dtype list. It sits in `protocol` because the message codec needs it
and `protocol` may import nothing of the project but `errors`; `graph_replay` (specs, attrs,
promotion, backends) and `client` (dtype names a user may pass) import it from here.

A dtype's wire code is its index in `DTYPES` plus one, so a new dtype is appended: an old code
never changes meaning.
"""

from __future__ import annotations

from typing import Final

DTYPES: Final[tuple[str, ...]] = (
    "bool", "int32", "int64", "float16", "float32", "float64", "uint8", "int8", "int16"
)  # fmt: skip
"""The dtype allow-list, NumPy names, in wire-code order."""

ITEMSIZE: Final[dict[str, int]] = {
    "bool": 1,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
}

KIND_OF_DTYPE: Final[dict[str, str]] = {
    "bool": "bool",
    "int32": "int",
    "int64": "int",
    "float16": "float",
    "float32": "float",
    "float64": "float",
    "uint8": "int",
    "int8": "int",
    "int16": "int",
}
"""Each dtype's kind: `"bool"`, `"int"` or `"float"` (the promotion rules work by kind)."""

FLOAT_DTYPES: Final[tuple[str, ...]] = tuple(d for d in DTYPES if KIND_OF_DTYPE[d] == "float")
INT_DTYPES: Final[tuple[str, ...]] = tuple(d for d in DTYPES if KIND_OF_DTYPE[d] == "int")

WIRE_CODE: Final[dict[str, int]] = {name: i + 1 for i, name in enumerate(DTYPES)}
"""Dtype name -> the small int it travels as."""

__all__ = ["DTYPES", "FLOAT_DTYPES", "INT_DTYPES", "ITEMSIZE", "KIND_OF_DTYPE", "WIRE_CODE"]
