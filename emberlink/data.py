"""DataLoader: a data set's batches as tensors on a device, sent ahead or gathered there; no ops of its own.

PyTorch's `DataLoader` over a `TensorDataset`, with the device named, in one of two ways:

- Host data (`resident=False`, the default): each batch is cut from the NumPy arrays here and
  uploaded. The upload of batch k+1 is made, and sent on its way, right after step k's first read
  is sent and before that read waits (double buffering), or when batch k+1 is asked for if step k
  reads nothing: on a remote device its bytes are sealed here and opened on the worker while
  step k runs there and its answer travels back, and on the wire they come after step k's work,
  never before it. (Sent when batch k is handed out, as this loader first did, they went ahead
  of step k: the worker opened them before it could start the step.) Over the raw tcp link the
  thread that reads step k's loss writes step k, then seals and writes batch k+1 itself, then
  reads the answer (client/session.py's `request_direct`, `send_owned`), with no hand-off to the
  I/O thread and back. A cheap jitted step fed 128x784 float32 batches, a cpu worker over tcp,
  client and worker on a core each, 1000 steps, medians of 5, the tree before this and after it
  alternated twice (with the other changes of the same version: the upload batch's ack riding
  on the step's reply, the step still a Repeat): 857-864 -> 621-629 µs a step, the client's I/O
  thread 318-334 -> 0 µs of CPU a step.
- Resident data (`resident=True`): the arrays are uploaded once, when the loader is made, and a
  batch is `data.take(idx, axis=0)` on the device, so per batch only `idx` (batch_size int32
  indices; int64 past 2**31 rows) travels. The index is a tensor on purpose: a slice's bounds are
  attributes of the op, so `data[start:stop]` would be a new graph every batch, while an index
  tensor of one shape keeps every step the same graph. A batch is gathered when it is asked for:
  its take is recorded (with `Device._record`, as `Tensor.take` records it, minus the autograd
  and inference a batch does not need), not run, so it joins the graph of the step that uses it,
  in the batch that step goes in (one batch a step on the wire, a Repeat of the one before). An
  eager step records its ops after it, into one graph; an `emberlink.jit` step whose arguments
  are the pending batch folds the take into its replayed graph (client/jit.py: traced once with
  the pending take, replayed in its place), so a jitted step is one Execute, as on batches
  uploaded beforehand, where it was two (this loader used to run the take as one replay of its
  own jitted gather, and the step as another; a GPU worker spends ~50-60 µs of CPU on each).
  The batch tensors come out of that graph too, valid as after any flush. Measured on the
  2-core machine (`bench/remote_step.py --loader 7 --cpus split`, a jitted MLP over tcp, client
  and worker on a core each, NumPy worker; each tree's resident row minus its uploaded row,
  medians of 7 interleaved blocks of 1000 steps, the tree before and after alternated 4 times):
  784-64-10 +58, +84, +76, +101 -> +74, +59, +34, +51 µs (uploaded ~1210-1285 µs); 64-32-10
  +60, +97, +80, +57 -> +59, +60, +22, +34 µs (uploaded ~800-845 µs); Executes sent a step 2.0
  -> 1.0. The client's part (`next()`, the call and the read, over an executor that runs nothing,
  784-64-10, the trees alternated 3 times) is unchanged: resident minus uploaded 15-17 µs
  before and after (resident 26-29 -> 25-27 µs; uploaded 11-12 -> 10: jit's signature of two
  tensors got its fast path). What is left of the gap is that `next()` (the index's upload, the
  takes recorded) and the worker's share: the index's Upload, the gather's own work (13 µs on
  NumPy at 128x784 float32) and the batch's two outputs, stored and then dropped.
  Against the same step written by hand (`X.take(idx, axis=0)` inside the jitted function, the
  index uploaded each step: `bench/remote_step.py --loader`'s second row) what the loader adds
  is its bookkeeping and the batch's two outputs: one Upload, one Execute, one Drop and one
  read a step on both (the loader's step sent the buffers it let go as a Drop of their own
  before each batch until it flushed only pending work); on the client alone
  (`bench/remote_step.py --loader-client 9`, 784-64-10, an executor that runs nothing, the
  trees alternated 5 times) the hand-written step costs 8.5-9.3 µs, the loader's 18.8-19.3
  before the folded call's lookup compared lists (client/jit.py, `_Hot`) and 16.6-18.5 after:
  the two takes recorded, the batch's Tensors, the fold's checks, and the two outputs' Values
  and drops (the hand-written step returning its x and y too costs 12.2-14.4).
  Tried and measured slower here: gathering batch k+1 in a batch of its own right after step
  k's read is sent, as host data goes (the two batches alternate, so neither is a Repeat, and a
  batch costs each side ~60 µs: 849 -> 862-944 µs at 784-16-10, 650 -> 764 at 16-16-10).
  Gathering it inside step k's read, after the step and before the read, was tried too and
  measured slower (the loader before this -> in the read: 1126 -> 1159 µs at 784-64-10 and
  722 -> 742 at 64-32-10 on the 2-core machine), so batches are gathered when asked for.

Each batch handed out also flushes what the device has recorded (a step boundary), so a loop
that does not read every step still runs one graph a step, not a run of steps cut at random.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, overload

import numpy as np

from emberlink.client.tensor import Tensor
from emberlink.client.value import Value
from emberlink.errors import ShapeError

if TYPE_CHECKING:
    from emberlink.client.device import Device

Batch = TypeVar("Batch", Tensor, tuple[Tensor, ...])
_AXIS0 = (("axis", 0),)  # the attrs of a take along axis 0, as Tensor.take gives them
T = TypeVar("T")


class DataLoader(Generic[Batch]):
    """Batches of `arrays` as tensors on `device`.

    `arrays` is one NumPy array (batches are Tensors) or a sequence of them with the same first
    dimension (batches are tuples of Tensors, in that order), as with a `TensorDataset`. Batches
    take `batch_size` rows along axis 0; the last one is smaller unless `drop_last`. With
    `shuffle`, every epoch (every `iter()`) draws the next permutation from
    `numpy.random.default_rng(seed)`: epoch e takes rows in the order of the e-th
    `rng.permutation(len(arrays[0]))`, on every device, so a run can be reproduced exactly.
    `resident=True` uploads the arrays once and gathers each batch on the device (see the module
    docstring); `len(loader)` is the number of batches in an epoch.
    """

    @overload
    def __init__(
        self: DataLoader[Tensor],
        arrays: np.ndarray,
        batch_size: int = 1,
        shuffle: bool = False,
        *,
        device: Device,
        resident: bool = False,
        seed: int | None = None,
        drop_last: bool = False,
    ) -> None: ...

    @overload
    def __init__(
        self: DataLoader[tuple[Tensor, ...]],
        arrays: Sequence[np.ndarray],
        batch_size: int = 1,
        shuffle: bool = False,
        *,
        device: Device,
        resident: bool = False,
        seed: int | None = None,
        drop_last: bool = False,
    ) -> None: ...

    def __init__(
        self,
        arrays: np.ndarray | Sequence[np.ndarray],
        batch_size: int = 1,
        shuffle: bool = False,
        *,
        device: Device,
        resident: bool = False,
        seed: int | None = None,
        drop_last: bool = False,
    ) -> None:
        self._single = isinstance(arrays, np.ndarray)
        self.arrays = _check_arrays((arrays,) if isinstance(arrays, np.ndarray) else arrays)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.device = device
        self.resident = bool(resident)
        self._rng = np.random.default_rng(seed)
        self._rows = len(self.arrays[0])
        self._index_dtype = np.int32 if self._rows <= np.iinfo(np.int32).max else np.int64
        self._in_order: np.ndarray | None = None  # rows 0, 1, ... as index values, once iterated in order
        # Uploaded once: every epoch gathers from these (they live as long as the loader).
        self._data = tuple(device.tensor(a) for a in self.arrays) if self.resident else ()
        # What a batch's takes are recorded from: each array's value, dtype and row shape.
        self._takes: tuple[tuple[Value, str, tuple[int, ...]], ...] = tuple(
            (t._v, t._v.spec[0], t._v.spec[1][1:]) for t in self._data
        )

    def __len__(self) -> int:
        full, rest = divmod(self._rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[Batch]:
        bounds = [(k * self.batch_size, min((k + 1) * self.batch_size, self._rows)) for k in range(len(self))]
        order = self._rng.permutation(self._rows) if self.shuffle else None
        if self.resident:
            return self._gathered(order, bounds)
        return self._uploaded(order, bounds)

    def _gathered(self, order: np.ndarray | None, bounds: list[tuple[int, int]]) -> Iterator[Batch]:
        if not bounds:
            return
        device = self.device
        # The epoch's rows as index values, made once (in order: once for the loader), read-only:
        # a batch's index is a slice of them, uploaded as it lies (`_gather`).
        if order is not None:
            rows = order.astype(self._index_dtype)
            rows.flags.writeable = False
        elif self._in_order is not None:
            rows = self._in_order
        else:
            rows = self._in_order = np.arange(self._rows, dtype=self._index_dtype)
            rows.flags.writeable = False
        for bound in bounds:
            # The step before this batch is its own graph. Buffers dropped since (the last batch,
            # the last loss) are not sent on their own: they go after the next step's work, so a
            # step sends one Drop, not two, and every step the same messages, an epoch's first
            # included (a batch of another form is no Repeat).
            device._flush_work()
            # Yielded as made, in no local: the loop never holds a batch the user has (measured:
            # holding each until the next one is asked for, so that it is dropped a step later,
            # cost ~40 µs a step on a NumPy worker with 128x64 batches).
            yield self._gather(rows, bound)
        device._flush_work()

    def _gather(self, rows: np.ndarray, bound: tuple[int, int]) -> Batch:
        """The batch of `rows[start:stop]` (index values), its take recorded into the pending
        step (an eager step's graph, or folded into a jitted step's: client/jit.py). Its index
        tensor is dropped on return, so that every step's batch is the one before with ids
        shifted (a Repeat). The index is uploaded as the slice it is (`Device._upload`), not made
        and copied by `dev.tensor` each batch: `rows` is read-only, so whatever keeps the slice
        (an executor's pending batch, a local device's store) can never change it. Measured with
        a 300 µs sleep before each, interleaved (2-core machine): np.arange of a batch's index
        3.4 µs, a slice 2.0 µs; next() over an executor that runs nothing, 5.5 -> 4.5 µs hot
        with the copy and the Tensor left out."""
        start, stop = bound
        dev = self.device
        idx = dev._upload(rows[start:stop])
        # `data.take(idx, axis=0)` recorded as Tensor.take records it, without what a batch needs
        # none of: autograd, shape inference, the jit trace's hooks (a loader is not iterated
        # inside a jitted function: its flushes are refused there).
        n = (stop - start,)
        parts = []
        for v, dtype, row in self._takes:
            parts.append(Tensor(dev._record("take", (v, idx), _AXIS0, (dtype, n + row))))
        return self._pack(tuple(parts))

    def _uploaded(self, order: np.ndarray | None, bounds: list[tuple[int, int]]) -> Iterator[Batch]:
        if not bounds:
            return
        device = self.device
        current = self._upload(order, bounds[0])
        # Private seams on purpose: the loader is the only caller that sends uploads before a
        # read asks for them (`_executor.send`) and works while a read is on its way
        # (`_after_read_sent`).
        device._executor.send()
        ahead: _Ahead[Batch] | None = None
        try:
            for following in bounds[1:]:
                ahead = _Ahead(functools.partial(self._send_ahead, order, following))
                device._after_read_sent.append(ahead.run)
                yield current
                device.flush()  # the step before the next batch is its own graph
                current = ahead.take()
            device.flush()
            yield current
        finally:
            if ahead is not None and ahead.run in device._after_read_sent:  # the loop was left
                device._after_read_sent.remove(ahead.run)

    def _send_ahead(self, order: np.ndarray | None, bound: tuple[int, int]) -> Batch:
        batch = self._upload(order, bound)
        self.device._executor.send()
        return batch

    def _upload(self, order: np.ndarray | None, bound: tuple[int, int]) -> Batch:
        start, stop = bound
        if order is None:
            parts = tuple(self.device.tensor(a[start:stop]) for a in self.arrays)
        else:
            rows = order[start:stop]
            parts = tuple(self.device.tensor(a[rows]) for a in self.arrays)
        return self._pack(parts)

    def _pack(self, parts: tuple[Tensor, ...]) -> Batch:
        packed: Any = parts[0] if self._single else parts
        return cast(Batch, packed)

    def __repr__(self) -> str:
        kind = "resident" if self.resident else "host"
        return (
            f"DataLoader({len(self.arrays)} arrays of {self._rows} rows, batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, {kind}, device={self.device})"
        )


def _check_arrays(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    if isinstance(arrays, Tensor) or not isinstance(arrays, Sequence) or not arrays:
        raise TypeError("DataLoader takes a NumPy array or a non-empty sequence of NumPy arrays")
    out = []
    for i, a in enumerate(arrays):
        if not isinstance(a, np.ndarray):
            raise TypeError(
                f"DataLoader: array {i} is a {type(a).__name__}, not a NumPy array "
                "(the loader uploads host data itself; pass resident=True to keep it on the device)"
            )
        if a.ndim == 0:
            raise ShapeError(f"DataLoader: array {i} is 0-d; batches are taken along axis 0")
        out.append(a)
    rows = {len(a) for a in out}
    if len(rows) != 1:
        raise ShapeError(f"DataLoader: the arrays' first dimensions differ: {[len(a) for a in out]}")
    return tuple(out)


class _Ahead(Generic[T]):
    """The next host batch: made by `run` (right after a read is sent) or by `take`, once; a failure
    to make it is raised by `take`, where the batch is asked for, not inside somebody's read."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make: Callable[[], T] | None = make
        self._made: T | None = None
        self._error: Exception | None = None

    def run(self) -> None:
        make, self._make = self._make, None
        if make is not None:
            try:
                self._made = make()
            except Exception as e:  # noqa: BLE001 - raised again by take(), in the loader's loop
                self._error = e

    def take(self) -> T:
        """The thing made (kept no longer here: the loader's loop holds it only as long as the
        user's batch is current), or what making it raised."""
        self.run()
        if self._error is not None:
            raise self._error
        made, self._made = self._made, None
        return cast(T, made)
