"""The seam between a Device and where its graphs run (docs/internals.md section 4); no logic here.

A Device records ops, and at a flush hands one `(Graph, gid, Call)` to its executor. Buffer ids
are the client's: uploads and each flush's outputs take them from one counter per device, so no
op ever waits for the executor to name a result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict

import numpy as np

from emberlink.graph_replay.ir import Graph, Scalar


@dataclass(frozen=True, slots=True)
class Call:
    """One run of a graph: its input buffers (slot order), binding values, and output buffer ids."""

    inputs: tuple[int, ...]
    bindings: tuple[Scalar, ...]
    outputs: tuple[int, ...]


class _CommonStats(TypedDict):
    """The counters every executor reports."""

    bytes_sent: int
    bytes_received: int
    round_trips: int
    bytes_uploaded: int
    graphs_registered: int
    graph_replays: int


# Optional keys by totality, not NotRequired: under `from __future__ import annotations` Python
# 3.11 counts a NotRequired key as required at run time.
class ExecutorStats(_CommonStats, total=False):
    """An executor's counters: the common ones and its kind's own (tests/server/test_remote_device.py
    checks that a local and a remote device report only these keys, each of its type)."""

    backend: str  # local: the backend's name
    captured_replays: int  # local: replays run as one captured CUDA graph
    tensors: int  # local: buffers held
    path: str  # remote: the connection's path ("grpc", "relay", "memory", ...)
    worker: str  # remote: the worker's node id
    batches_sent: int
    batches_resent: int
    batches_repeated: int
    graph_cache_misses: int
    resumes: int  # remote: times the session was resumed on a new link (client/reconnect.py)
    resume_ms: int  # remote: how long the last resume took


class DeviceStats(ExecutorStats):
    """What `Device.stats()` returns: its executor's counters and the client's own."""

    graphs_built: int
    graph_memo_hits: int
    flushes: int
    outputs_kept: int
    nodes_recorded: int
    pending_nodes: int
    jit_replays: int


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

    def read(self, buf: int, wait: bool = False, after_sent: Callable[[], None] | None = None) -> ReadFuture:
        """The array in `buf`, as a future; the array returned is the caller's to keep. `wait`: the
        caller waits for it at once (a remote executor may then do the round trip on its thread).
        `after_sent`: called once, on this thread, when the read is on its way and before anything
        waits for it (work that overlaps the read: the host DataLoader's next batch)."""
        ...

    def drop(self, bufs: Sequence[int]) -> None:
        """Forget these buffers (unknown ids are ignored)."""

    def send(self) -> None:
        """Start the work handed over so far on its way, without waiting (a remote executor sends its
        pending batch now instead of with the next read or sync; a local one has nothing pending)."""

    def sync(self) -> None:
        """Wait for all work so far; raise the first failure since the previous sync."""

    def stats(self) -> ExecutorStats:
        """Counters: bytes_sent, bytes_received, round_trips, graphs_registered, graph_replays, ..."""
        ...

    def memory_stats(self) -> dict[str, int]:
        """in_use_bytes, peak_bytes, pool_bytes of the device that holds the buffers."""
        ...

    def close(self) -> None:
        """Release every buffer and the connection, if any. Idempotent."""
