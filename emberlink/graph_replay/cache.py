"""The worker's graph cache: compiled graphs per client identity, each client's own LRU; no I/O.

Rules:
- Keys are `(client NodeId, graph id)`: a client only ever finds graphs it registered itself, so it
  cannot probe another's (a miss looks the same whether or not someone else has that graph).
- Every client has its own LRU under its own byte budget (`budget_bytes`). One client's
  registrations never evict another client's graphs, so a client cannot learn from its own misses
  whether anyone else is busy. (A single LRU under one shared budget leaked exactly that.)
- Memory stays bounded: at most `max_clients` clients keep a cache. Past that, the client whose
  cache was used least recently loses its whole cache. That is the one way clients can affect each
  other, and only on a worker serving more than `max_clients` identities.
- An entry's size is its canonical byte length plus an estimate of its plan's overhead, plus the
  memory of the plan's captured CUDA graphs while they exist (`resize`); a graph larger than the
  budget is not stored (the caller runs it once, uncached).
- Thread-safe: the event loop and the device thread may both use it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from emberlink.errors import ConfigError
from emberlink.graph_replay.canonical import encode_graph
from emberlink.graph_replay.plan import Plan

DEFAULT_MAX_CLIENTS = 64


@dataclass(eq=False, slots=True)
class _Counts:
    size: int = 0
    entries: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0


@dataclass(eq=False, slots=True)
class _ClientCache:
    entries: OrderedDict[bytes, tuple[Plan, int]] = field(default_factory=OrderedDict)
    counts: _Counts = field(default_factory=_Counts)


class GraphCache:
    """`(client, gid) -> Plan`, an LRU of `budget_bytes` per client, for at most `max_clients` clients.

    A plan carries its graph (`plan.graph`), so the entry is the plan plus the bytes it is charged.
    """

    def __init__(self, budget_bytes: int, max_clients: int = DEFAULT_MAX_CLIENTS) -> None:
        if type(budget_bytes) is not int or budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        if type(max_clients) is not int or max_clients < 1:
            raise ConfigError(f"max_clients must be a positive int, got {max_clients!r}")
        self._budget = budget_bytes
        self._max_clients = max_clients
        self._clients: OrderedDict[str, _ClientCache] = OrderedDict()  # least recently used first
        self._total = _Counts()
        self._lock = threading.Lock()

    def _client(self, client: str) -> _ClientCache:
        """`client`'s cache, now the most recently used; drops the least recent past max_clients."""
        found = self._clients.get(client)
        if found is None:
            found = self._clients[client] = _ClientCache()
            while len(self._clients) > self._max_clients:
                _, dropped = self._clients.popitem(last=False)
                self._total.size -= dropped.counts.size
                self._total.entries -= dropped.counts.entries
                self._total.evictions += dropped.counts.entries
        else:
            self._clients.move_to_end(client)
        return found

    def get(self, client: str, gid: bytes) -> Plan | None:
        """The plan `client` stored under `gid` (now its most recently used), or None."""
        with self._lock:
            mine = self._client(client)
            found = mine.entries.get(gid)
            for c in (self._total, mine.counts):
                if found is None:
                    c.misses += 1
                else:
                    c.hits += 1
            if found is None:
                return None
            mine.entries.move_to_end(gid)
            return found[0]

    def put(self, client: str, gid: bytes, plan: Plan, size: int | None = None) -> bool:
        """Store `plan` (and so its graph) for `client`, evicting that client's least recently used
        entries to fit. `size` defaults to the canonical encoding's length plus `plan.overhead_bytes`.
        Returns False, storing and evicting nothing, when the entry alone exceeds the budget.
        """
        if size is None:
            size = len(encode_graph(plan.graph)) + plan.overhead_bytes
        with self._lock:
            mine = self._client(client)
            self._remove(mine, gid)
            if size > self._budget:
                return False
            while mine.counts.size + size > self._budget:
                self._remove(mine, next(iter(mine.entries)))
                mine.counts.evictions += 1
                self._total.evictions += 1
            mine.entries[gid] = (plan, size)
            for c in (self._total, mine.counts):
                c.size += size
                c.entries += 1
            return True

    def resize(self, client: str, gid: bytes, plan: Plan, delta: int) -> bool:
        """Charge `delta` more bytes (fewer, if negative) to `client`'s entry `gid` if it still
        holds `plan` (a captured graph's memory), evicting that client's least recently used other
        entries to fit. False, changing nothing, if the entry is gone or alone would pass the budget.
        """
        with self._lock:
            mine = self._clients.get(client)
            found = mine.entries.get(gid) if mine is not None else None
            if mine is None or found is None or found[0] is not plan:
                return False
            size = found[1] + delta
            if size > self._budget:
                return False
            while mine.counts.size + delta > self._budget:
                oldest = next(g for g in mine.entries if g != gid)
                self._remove(mine, oldest)
                mine.counts.evictions += 1
                self._total.evictions += 1
            mine.entries[gid] = (plan, size)
            for c in (self._total, mine.counts):
                c.size += delta
            return True

    def _remove(self, mine: _ClientCache, gid: bytes) -> None:
        found = mine.entries.pop(gid, None)
        if found is not None:
            for c in (self._total, mine.counts):
                c.size -= found[1]
                c.entries -= 1

    def forget(self, client: str) -> int:
        """Drop every entry of `client`; returns how many there were."""
        with self._lock:
            mine = self._clients.pop(client, None)
            if mine is None:
                return 0
            self._total.size -= mine.counts.size
            self._total.entries -= mine.counts.entries
            return mine.counts.entries

    def __contains__(self, key: tuple[str, bytes]) -> bool:
        """`(client, gid) in cache`, without touching the LRU order or the counters."""
        client, gid = key
        with self._lock:
            mine = self._clients.get(client)
            return mine is not None and gid in mine.entries

    def stats(self, client: str | None = None) -> dict[str, int]:
        """`size` (bytes), `entries`, `hits`, `misses`, `evictions`, `budget` (bytes, per client)
        and, for the worker's figures, `clients`. With `client`, only that client's figures (what
        a client may be told); without, the worker's totals."""
        with self._lock:
            if client is None:
                c, extra = self._total, {"clients": len(self._clients)}
            else:
                mine = self._clients.get(client)
                c, extra = (mine.counts if mine is not None else _Counts()), {}
            return {
                "size": c.size,
                "entries": c.entries,
                "hits": c.hits,
                "misses": c.misses,
                "evictions": c.evictions,
                "budget": self._budget,
                **extra,
            }


__all__ = ["DEFAULT_MAX_CLIENTS", "GraphCache"]
