"""What a Tensor refers to: a buffer or pending node on a device (Value), or host data (HostValue).

These sit below both tensor.py and device.py: a Value only needs its device to take back its
buffer id when it dies (`Holder`), so nothing here knows Tensors or Devices. No recording here.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from emberlink.client.future import ArrayFuture
from emberlink.errors import DeviceError

Spec = tuple[str, tuple[int, ...]]


class Holder(Protocol):
    """What a Value needs of its device: whether it is closed, and where dead buffer ids go."""

    _closed: bool
    _dropped: list[int]


class Value:
    """What a Tensor refers to: a buffer on the device (`buf`) or a pending node (`node`)."""

    __slots__ = ("__weakref__", "buf", "dev", "node", "spec")

    def __init__(self, dev: Any, buf: int | None, node: int | None, spec: Spec) -> None:
        self.dev = dev
        self.buf = buf
        self.node = node
        self.spec = spec

    def __del__(self) -> None:
        # Refcounting makes this run as soon as the last Tensor (or saved-for-backward reference)
        # goes; the id is sent to the executor at the next flush, after the work that may use it.
        buf = self.buf
        if buf is not None:
            dev: Holder = self.dev
            if not dev._closed:
                dev._dropped.append(buf)


class _Unplaced:
    """Stands where a Device would for HostValues: reading works, recording ops does not."""

    name = "unplaced"
    _closed = False

    def __str__(self) -> str:
        return self.name

    def _record(self, op: str, *args: Any) -> Value:
        raise DeviceError(f"{op}: a parameter is not on a device yet; call module.to(device) first")

    def _read(self, v: HostValue) -> np.ndarray:
        return v.array.copy()

    def _read_async(self, v: HostValue) -> ArrayFuture:
        done: Future[np.ndarray] = Future()
        done.set_result(v.array.copy())
        return ArrayFuture(done, v.spec[1])


UNPLACED = _Unplaced()


class HostValue(Value):
    """The value of a Parameter made before `Module.to(device)`: a host NumPy array, no ops."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        super().__init__(UNPLACED, None, None, (array.dtype.name, array.shape))
        self.array = array


__all__ = ["UNPLACED", "Holder", "HostValue", "Spec", "Value"]
