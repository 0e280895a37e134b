"""The worker: what all sessions share (identity, allow policy, device thread, compile thread,
graph cache, memory budget, limits, stats).

A `Worker` is transport-agnostic: `handle` is the `transport.Handler` a listener runs for each
new Link. Listeners, signals and the ticket are the daemon's business (`server/daemon.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from emberlink.errors import ErrorCode
from emberlink.graph_replay.backend import Backend
from emberlink.graph_replay.cache import GraphCache
from emberlink.protocol import messages as m
from emberlink.protocol.channel import CHUNK_SIZE
from emberlink.protocol.identity import AllowPolicy, Identity
from emberlink.protocol.limits import MAX_UNACKED_BATCHES, MAX_UNACKED_BYTES
from emberlink.server.detached import DEFAULT_RESUME_WINDOW, ResumeRegistry
from emberlink.server.device import DeviceThread
from emberlink.server.graphs import Compiler, Costs, GraphView
from emberlink.server.limits import Limits, WorkerLimits
from emberlink.server.session import Session, State
from emberlink.server.store import Quota
from emberlink.transport.base import Link
from emberlink.transport.malloc import release_free_memory

log = logging.getLogger("emberlink.server")

DEFAULT_GRAPH_CACHE_BYTES = 64 << 20  # per client; graph_replay/cache.py keeps at most 64 clients
DEVICE_CACHE_FRACTION = 8


def default_graph_cache_bytes(backend: Backend) -> int:
    """Each client's graph-cache budget unless one is given: DEFAULT_GRAPH_CACHE_BYTES, plus, on a
    device with its own memory (a GPU), an eighth of what is free there when the worker starts.

    On a GPU a cache entry is also charged its captured graph (arena, fixed input buffers, pinned
    staging), which for a real model is far more than 64 MiB (the 4096-wide MLP step of
    bench/gpu_step.py holds several hundred MiB: two 64 MiB weights in fixed buffers, their
    gradients and new values in its arena): the budget then bounds how much device memory the
    captures of a client's least recently used graphs may keep before they are evicted and freed,
    and an eighth of the device leaves the rest to tensors. The session quota still bounds all a
    session holds, captures included."""
    free = backend.free_bytes()
    return DEFAULT_GRAPH_CACHE_BYTES + (free // DEVICE_CACHE_FRACTION if free is not None else 0)


TRIM_DELAY = 0.5
"""Seconds after a session ends before the heap's free pages go back to the OS (at most one trim
per TRIM_DELAY, on a thread): the worker's RSS then follows what its sessions hold, which
transport/malloc.py's tuning would otherwise keep (a trim takes a few ms per 100 MB returned)."""


class Worker:
    """Serves sessions on one device. Create it inside the event loop that runs its listeners.

    `limits` are the governance limits (server/limits.py), each left None at its default for the
    device; `max_session_bytes` is a shorthand for `limits.max_session_bytes`."""

    def __init__(
        self,
        identity: Identity,
        allow: AllowPolicy,
        *,
        device: str = "cpu",
        backend: Backend | None = None,
        max_session_bytes: int | None = None,
        limits: Limits | None = None,
        graph_cache_bytes: int | None = None,
        chunk_size: int = CHUNK_SIZE,
        resume_window: float = DEFAULT_RESUME_WINDOW,
    ) -> None:
        self.identity = identity
        self.allow = allow  # read by each new session's handshake, so it may be replaced while serving
        self.chunk_size = chunk_size
        configured = limits if limits is not None else Limits()
        if max_session_bytes is not None:
            configured = dataclasses.replace(configured, max_session_bytes=max_session_bytes)
        self.device = DeviceThread(device, backend)
        try:
            self.limits: WorkerLimits = configured.resolve(self.device.capacity())
        except BaseException:
            self.device.shutdown()
            raise
        self.compiler = Compiler()
        self.costs = Costs()
        if graph_cache_bytes is None:
            graph_cache_bytes = default_graph_cache_bytes(self.device.backend)
        self.cache = GraphCache(graph_cache_bytes)
        self.sessions: set[Session] = set()
        self.draining = False
        self.started = time.monotonic()
        self.sessions_total = 0
        self.sessions_refused = 0
        self._trim: asyncio.TimerHandle | None = None  # a trim scheduled or running
        self._trim_again = False  # a session ended while a trim ran: trim once more after it
        self._release_free_memory = release_free_memory  # what a trim runs (a test counts it)
        self._closed_bytes_in = 0
        self._closed_bytes_out = 0
        # Every session's Quota charges this too: the worker's memory budget.
        self.held = Quota(
            self.limits.max_worker_bytes,
            code=ErrorCode.OUT_OF_MEMORY,
            label="the worker's memory budget (--max-worker-bytes)",
        )
        log.info("worker limits: %s", self.limits)
        self.resumes = ResumeRegistry(  # sessions a client may resume on a new link
            resume_window,
            max_open=self.limits.max_client_sessions,
            max_detached=self.limits.max_client_detached,
        )
        if allow.admits_anyone:
            log.warning(
                "worker %s admits ANY client (--allow-any): anyone who can reach it can use it",
                identity.node_id,
            )

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    @property
    def max_session_bytes(self) -> int | None:
        return self.limits.max_session_bytes

    def welcome_limits(self) -> dict[str, int]:
        """What the Welcome tells a client about this worker."""
        return {
            "chunk_size": self.chunk_size,
            "max_session_bytes": self.limits.max_session_bytes or 0,
            "max_unacked_batches": MAX_UNACKED_BATCHES,
            "max_unacked_bytes": MAX_UNACKED_BYTES,
            "resume_window_ms": round(self.resumes.window * 1000),
        }

    def graphs_of(self, client: str) -> GraphView:
        """The cache as `client` sees it (its entries outlive its sessions), under this worker's limits."""
        return GraphView(self.cache, client, self.limits, self.costs)

    async def handle(self, link: Link) -> None:
        """The per-Link coroutine listeners run (a `transport.Handler`)."""
        if self.draining:
            return
        session = Session(self, link)
        self.sessions.add(session)
        try:
            await session.run()
        finally:
            self.sessions.discard(session)
            self._trim_soon()
            if session.client is None:
                self.sessions_refused += 1
            else:
                self.sessions_total += 1
            self._closed_bytes_in += session.bytes_in
            self._closed_bytes_out += session.bytes_out

    def _trim_soon(self) -> None:
        """Trim the heap TRIM_DELAY from now; while a trim is scheduled, a session that ends is
        covered by it, and while one runs, another follows it. Before, a session that ended while
        a trim ran left its freed pages in the heap until some later session ended: the fuzz run
        of CI (bench/fuzz.py --stall --check-rss) saw the worker's RSS end 5.4-5.7 MiB (+6%) above
        its baseline in 2 of 10 runs, the rest within 1%."""
        if self._trim is not None:
            self._trim_again = True
            return
        loop = asyncio.get_running_loop()
        self._trim = loop.call_later(TRIM_DELAY, self._start_trim, loop)

    def _start_trim(self, loop: asyncio.AbstractEventLoop) -> None:
        self._trim_again = False  # what was freed until now, this trim hands back
        future = loop.run_in_executor(None, self._release_free_memory)
        future.add_done_callback(self._trimmed)

    def _trimmed(self, _: object) -> None:
        self._trim = None
        if self._trim_again:
            self._trim_again = False
            self._trim_soon()

    async def drain(self) -> None:
        """SIGTERM: refuse new sessions, finish every session's queued work, end them with going_away."""
        self.draining = True
        await asyncio.gather(*(s.drain() for s in list(self.sessions)), return_exceptions=True)
        # Give each session a moment to flush its last reply and close.
        for _ in range(100):
            if not any(s.state is not State.CLOSED for s in self.sessions):
                break
            await asyncio.sleep(0.01)

    def close(self) -> None:
        """Stop the compile thread and the device thread (after its queued work)."""
        self.compiler.shutdown()
        self.device.shutdown()

    # -- stats --------------------------------------------------------------------------------------------

    def memory_stats(self) -> dict[str, int]:
        """in_use_bytes, peak_bytes, pool_bytes: the backend's measured figures (what sessions are
        charged where it measures none), and the budget: `held_bytes` (what sessions hold or have
        reserved: stored tensors, plans' peaks while they run, replies waiting, 1 MiB a session),
        its high point `held_peak_bytes`, and `budget_bytes` (--max-worker-bytes)."""
        backend = dict(self.device.backend.memory_stats())
        measured = "in_use_bytes" in backend
        return {
            "in_use_bytes": int(backend["in_use_bytes"]) if measured else self.held.used,
            "peak_bytes": int(backend.get("peak_bytes", 0)) if measured else self.held.peak,
            "pool_bytes": int(backend.get("pool_bytes", 0)),
            "held_bytes": self.held.used,
            "held_peak_bytes": self.held.peak,
            "budget_bytes": self.limits.max_worker_bytes,
        }

    def stats_for(self, session: Session) -> dict[str, m.StatValue]:
        """The StatsReply for one session: worker-wide memory and traffic, this client's cache, this session.

        Cache figures are the asking client's own (its NodeId's part of the cache): one client
        learns nothing about another's graphs.
        """
        sessions = list(self.sessions)
        stats: dict[str, m.StatValue] = {
            "device": self.device.spec,
            "backend": str(self.device.backend.name),
            "uptime_s": round(time.monotonic() - self.started, 3),
            "sessions_open": sum(1 for s in sessions if s.state is State.OPEN),
            "sessions_detached": sum(1 for s in sessions if s.state is State.DETACHED),
            "sessions_total": self.sessions_total + len(sessions),
            "bytes_in": self._closed_bytes_in + sum(s.bytes_in for s in sessions),
            "bytes_out": self._closed_bytes_out + sum(s.bytes_out for s in sessions),
        }
        stats.update(self.memory_stats())
        stats.update({f"cache_{k}": v for k, v in self._cache_stats(session.client).items()})
        stats.update(session.stats())
        return stats

    def _cache_stats(self, owner: str | None) -> dict[str, int]:
        return self.cache.stats(owner) if owner is not None else {}

    def log_stats(self) -> None:
        """Worker-wide figures (which no client is told) to the log."""
        log.info("worker stats: memory %s, graph cache %s", self.memory_stats(), self.cache.stats())
