"""How the dtype names a user may pass (NumPy spellings, Python types) map onto `protocol.dtypes`;
no device work here."""

from __future__ import annotations

from typing import Any

import numpy as np

from emberlink.errors import DTypeError
from emberlink.protocol.dtypes import DTYPES

# The dtype a creation function uses when none is given: float32, as on a GPU framework.
DEFAULT_FLOAT = "float32"
DEFAULT_INT = "int64"


def dtype_name(dtype: Any) -> str:
    """Normalize "float32", np.float32, np.dtype("float32") or a Python type to a dtype name."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    if dtype is float:
        return DEFAULT_FLOAT
    if dtype is int:
        return DEFAULT_INT
    if dtype is bool:
        return "bool"
    try:
        name: str = np.dtype(dtype).name
    except TypeError as e:
        raise DTypeError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}") from e
    if name not in DTYPES:
        raise DTypeError(f"dtype {name} is not supported; expected one of {', '.join(DTYPES)}")
    return name


def scalar_dtype(value: bool | float) -> str:
    """The dtype a Python scalar gets when it becomes a tensor of its own (torch's defaults)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return DEFAULT_INT
    return DEFAULT_FLOAT
