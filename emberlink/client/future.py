"""ArrayFuture: a read on its way to this process (`Tensor.read_async()`); no device work or I/O here."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from emberlink.client.executor import ReadFuture

Scalar = bool | int | float


class ArrayFuture:
    """The data of a tensor, on its way here: what `Tensor.read_async()` returns.

    - `result(timeout=None)`: waits, then returns the data as a NumPy array (what `numpy()` would
      have returned; the same array on every call, the caller's to keep).
    - `done()`: whether the data (or a failure) has arrived; never waits.
    - `item(timeout=None)`: the value of a one-element tensor as a Python scalar (what `item()`
      would have returned), so `float(fut.item())` logs a loss.

    A failure is raised by `result()` and `item()` with the type a blocking read raises for it: an
    `ExecutionError` from the run that computed the tensor, `WorkerLost` when the session ended
    before the data came back, and so on. A `timeout` that runs out raises `TimeoutError` and
    leaves the read in flight: ask again later.
    """

    __slots__ = ("_inner", "_shape")

    def __init__(self, inner: ReadFuture, shape: tuple[int, ...]) -> None:
        self._inner = inner
        self._shape = shape

    @classmethod
    def failed(cls, error: BaseException, shape: tuple[int, ...]) -> ArrayFuture:
        """A future that already holds `error` (a read that could not even be sent)."""
        inner: Future[np.ndarray] = Future()
        inner.set_exception(error)
        return cls(inner, shape)

    def result(self, timeout: float | None = None) -> np.ndarray:
        return self._inner.result(timeout)

    def done(self) -> bool:
        return self._inner.done()

    def item(self, timeout: float | None = None) -> Scalar:
        size = 1
        for d in self._shape:
            size *= d
        if size != 1:
            raise ValueError(f"item() needs a tensor with one element, got shape {self._shape}")
        value: Scalar = self.result(timeout).item()
        return value

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"ArrayFuture(shape={self._shape}, {state})"
