"""What a worker allows each session and itself: every governance limit, its default, and how the
defaults scale to the device; values only, no I/O.

The rules these limits serve (docs/internals.md section 6, "Governance"):
- Memory. A session's quota counts everything it holds: stored tensors, uploads being applied,
  a plan's peak bytes while it runs (reserved before it starts), and replies waiting to be sent
  (results and their host copies). The worker's budget (`max_worker_bytes`) counts every session's
  holdings plus `SESSION_BYTES` per open session; sessions, uploads and plans are admitted only
  if they fit, else refused with a clear error (never an out-of-memory crash).
- Work. A graph has at most `max_graph_nodes` nodes; a plan touches at most `max_plan_elements`
  elements and does at most `max_plan_flops` floating-point operations (graph_replay/work.py).
  The device runs sessions' batches in turns of at most `TURN_SECONDS` each.
- Clients. One client NodeId has at most `max_client_detached` sessions detached (waiting for a
  resume, each still holding its memory and `SESSION_BYTES` of the budget); when one more of its
  sessions detaches, its session detached longest ends (server/detached.py). A session is to be
  refused at admission when its client has `max_client_sessions` already
  (`ResumeRegistry.refusal`; server/session.py does not ask it yet).
- Replies. While a session has more than `max_reply_bytes` of replies waiting to be sent, the
  worker stops reading its frames; a session whose replies make no progress for `reply_timeout`
  seconds is ended.

`Limits` is what a worker is configured with (None: the default for its device);
`Limits.resolve` turns it into `WorkerLimits`, every value set. Protocol-level limits that the
client must also respect live in protocol/limits.py.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TypeVar

from emberlink.errors import ConfigError

T = TypeVar("T", int, float)

SESSION_BYTES = 1 << 20
"""Charged to the worker's budget for each open session (its buffers, template, counters)."""

WORKER_MEMORY_SHARE = 0.75
"""Default `max_worker_bytes`: this share of the device's memory (the host's on a CPU worker)."""

DEFAULT_MAX_GRAPH_NODES = 16_384
"""Most nodes of a registered graph. Compiling costs about 40 µs a node here, off the device
thread; an honest training step is a few thousand nodes."""

CPU_PLAN_ELEMENTS = 1 << 27
"""Default `max_plan_elements` on a CPU worker: NumPy runs one op on one core, so not scaled by
cores. Measured on the 2-core development machine, a plain elementwise op touches an element in
0.15-0.25 ns (slower ops count more, graph_replay/work.COST), so a plan at this limit holds the
device about 30 ms there."""
CPU_PLAN_FLOPS_PER_CORE = 1 << 31
"""Default `max_plan_flops` per core of a CPU worker (BLAS uses them all). Measured there: a
1024^3 matmul (2^31 FLOPs; twice that counted in float64) takes 7-11 ms in float32 and 40 ms in
float64."""
GPU_PLAN_ELEMENTS_PER_SM = 1 << 28
"""Default `max_plan_elements` per streaming multiprocessor of a GPU worker."""
GPU_PLAN_FLOPS_PER_SM = 1 << 34
"""Default `max_plan_flops` per streaming multiprocessor of a GPU worker."""

DEFAULT_MAX_REPLY_BYTES = 64 << 20
"""Replies a session may have waiting to be sent before the worker stops reading its frames."""
DEFAULT_REPLY_TIMEOUT = 30.0
"""Seconds a session's replies may make no progress before the session is ended."""

DEFAULT_MAX_CLIENT_SESSIONS = 16
"""Sessions one client NodeId may have open at once (a process opens one per `Device`)."""
DEFAULT_MAX_CLIENT_DETACHED = 4
DEFAULT_MAX_SESSION_TENSORS = 16_384
"""Tensor ids (stored arrays and failed ids) one session may hold at once. Bounds how many small
Python objects one session can make the worker keep: their pages stay with the process after the
session ends (a session that held 28,000 ids left the worker's RSS 6% above its baseline; one that
held 13,000, 2%; bench/fuzz.py --stall=broadcast)."""
"""Sessions of one client NodeId that may wait detached for a resume at once (an honest client
resumes its session within the window, so it has at most one per `Device` detached)."""

MAX_BACKLOG = 4
"""Batches of one session received and waiting for the device (compiling, queued, being applied)
before the worker stops reading that session's frames."""

TURN_SECONDS = 0.005
"""Longest turn one session's batch takes on the device before the next session's turn (a single
Execute is not split: it is bounded by the work limits instead)."""

INTERNAL_ERROR_TEXT = "internal error in the worker"
"""How an unexpected failure is named to the client whose session it ended."""


@dataclass(frozen=True, slots=True)
class DeviceCapacity:
    """What the defaults scale with: the memory where the device allocates, and its parallel units
    (CPU cores, or a GPU's streaming multiprocessors)."""

    kind: str  # "cpu" or "cuda"
    memory_bytes: int
    units: int


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    """Every limit with its value (`max_session_bytes` None: sessions have no quota of their own)."""

    max_session_bytes: int | None
    max_worker_bytes: int
    max_graph_nodes: int
    max_plan_elements: int
    max_plan_flops: int
    max_reply_bytes: int
    reply_timeout: float
    max_client_sessions: int
    max_client_detached: int
    max_session_tensors: int


@dataclass(frozen=True, slots=True)
class Limits:
    """A worker's configured limits; None leaves a value at its default for the device (except
    `max_session_bytes`, where None means no per-session quota)."""

    max_session_bytes: int | None = None
    max_worker_bytes: int | None = None
    max_graph_nodes: int | None = None
    max_plan_elements: int | None = None
    max_plan_flops: int | None = None
    max_reply_bytes: int | None = None
    reply_timeout: float | None = None
    max_client_sessions: int | None = None
    max_client_detached: int | None = None
    max_session_tensors: int | None = None

    def resolve(self, device: DeviceCapacity) -> WorkerLimits:
        """Every limit set: the configured value, else the default for `device`; ConfigError for a
        value that is not positive."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ConfigError(f"{f.name} must be positive, got {value!r}")
        gpu = device.kind == "cuda"
        units = max(1, device.units)
        return WorkerLimits(
            max_session_bytes=self.max_session_bytes,
            max_worker_bytes=_or(self.max_worker_bytes, int(device.memory_bytes * WORKER_MEMORY_SHARE)),
            max_graph_nodes=_or(self.max_graph_nodes, DEFAULT_MAX_GRAPH_NODES),
            max_plan_elements=_or(
                self.max_plan_elements, GPU_PLAN_ELEMENTS_PER_SM * units if gpu else CPU_PLAN_ELEMENTS
            ),
            max_plan_flops=_or(
                self.max_plan_flops, (GPU_PLAN_FLOPS_PER_SM if gpu else CPU_PLAN_FLOPS_PER_CORE) * units
            ),
            max_reply_bytes=_or(self.max_reply_bytes, DEFAULT_MAX_REPLY_BYTES),
            reply_timeout=_or(self.reply_timeout, DEFAULT_REPLY_TIMEOUT),
            max_client_sessions=_or(self.max_client_sessions, DEFAULT_MAX_CLIENT_SESSIONS),
            max_client_detached=_or(self.max_client_detached, DEFAULT_MAX_CLIENT_DETACHED),
            max_session_tensors=_or(self.max_session_tensors, DEFAULT_MAX_SESSION_TENSORS),
        )


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


__all__ = [
    "MAX_BACKLOG",
    "SESSION_BYTES",
    "TURN_SECONDS",
    "DeviceCapacity",
    "Limits",
    "WorkerLimits",
]
