"""The seam between a Device and where its graphs run (docs/internals.md section 4); no logic here.

A Device records ops, and at a flush hands one `(Graph, gid, Call)` to its executor. Buffer ids
are the client's: uploads and each flush's outputs take them from one counter per device, so no
op ever waits for the executor to name a result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from emberlink.graph_replay.ir import Graph, Scalar


@dataclass(frozen=True, slots=True)
class Call:
    """One run of a graph: its input buffers (slot order), binding values, and output buffer ids."""

    inputs: tuple[int, ...]
    bindings: tuple[Scalar, ...]
    outputs: tuple[int, ...]


class ReadFuture(Protocol):
    def result(self, timeout: float | None = None) -> np.ndarray: ...

    def done(self) -> bool: ...


class Executor(Protocol):
    """Runs graphs on buffers it holds. Methods are called from the Device's thread, in order."""

    def upload(self, buf: int, array: np.ndarray) -> None:
        """Store `array` (the executor's now; the caller copied it) as buffer `buf`."""

    def execute(self, graph: Graph, gid: bytes, call: Call) -> None:
        """Run `graph` on `call.inputs` and store its outputs as `call.outputs`.

        A failure poisons the outputs: reading one raises the failure, and `sync` raises it once.
        """

    def read(self, buf: int) -> ReadFuture:
        """The array in `buf`, as a future; the array returned is the caller's to keep."""
        ...

    def drop(self, bufs: Sequence[int]) -> None:
        """Forget these buffers (unknown ids are ignored)."""

    def send(self) -> None:
        """Start the work handed over so far on its way, without waiting (a remote executor sends its
        pending batch now instead of with the next read or sync; a local one has nothing pending)."""

    def sync(self) -> None:
        """Wait for all work so far; raise the first failure since the previous sync."""

    def stats(self) -> dict[str, int | str]:
        """Counters: bytes_sent, bytes_received, round_trips, graphs_registered, graph_replays, ..."""
        ...

    def memory_stats(self) -> dict[str, int]:
        """in_use_bytes, peak_bytes, pool_bytes of the device that holds the buffers."""
        ...

    def close(self) -> None:
        """Release every buffer and the connection, if any. Idempotent."""
