"""Messages compared by their wire meaning: `canon` as nested tuples, `same` for two of them."""

from __future__ import annotations

import dataclasses


def canon(x: object) -> object:
    """x as nested tuples in which 1, 1.0 and True differ and floats compare bit for bit (not ==:
    a NaN binding is never equal to itself). A str subclass counts as its plain string: a StrEnum
    error code travels, and comes back, as one."""
    if isinstance(x, float):
        return ("float", x.hex())
    if isinstance(x, bool | int | bytes):
        return (type(x).__name__, x)
    if isinstance(x, str):
        return ("str", str(x))
    if isinstance(x, tuple | list):
        return tuple(canon(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, canon(v)) for k, v in x.items())
    if x is None:
        return None
    return (type(x).__name__, *(canon(getattr(x, f.name)) for f in dataclasses.fields(x)))  # type: ignore[arg-type]


def same(a: object, b: object) -> bool:
    return canon(a) == canon(b)
