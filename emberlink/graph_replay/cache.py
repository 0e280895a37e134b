"""The worker's graph cache: compiled graphs per client identity, LRU under one byte budget; no I/O.

Keys are `(client NodeId, graph id)`, so a client only ever finds graphs it registered itself and
cannot probe another's (a miss looks the same whether or not someone else has that graph). All
clients of a worker share the budget and one LRU order. An entry's size is its canonical byte
length plus an estimate of its plan's overhead; a graph larger than the whole budget is not
stored. Thread-safe: the event loop and the device thread may both use it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from emberlink.errors import ConfigError
from emberlink.graph_replay.canonical import encode_graph
from emberlink.graph_replay.ir import Graph
from emberlink.graph_replay.plan import Plan


@dataclass(frozen=True, eq=False, slots=True)
class CacheEntry:
    """A cached graph, its compiled plan, and the bytes it is charged."""

    graph: Graph
    plan: Plan
    size: int


class GraphCache:
    """LRU of `(client, gid) -> CacheEntry` under `budget_bytes` shared by every client."""

    def __init__(self, budget_bytes: int) -> None:
        if type(budget_bytes) is not int or budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        self._budget = budget_bytes
        self._entries: OrderedDict[tuple[str, bytes], CacheEntry] = OrderedDict()
        self._size = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def get(self, client: str, gid: bytes) -> CacheEntry | None:
        """The entry `client` stored under `gid` (now the most recently used), or None."""
        key = (client, gid)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry

    def put(
        self, client: str, gid: bytes, graph: Graph, plan: Plan, *, graph_bytes: int | None = None
    ) -> bool:
        """Store a graph for `client`, evicting least recently used entries to fit.

        `graph_bytes` is the canonical encoding's length when the caller has it (else it is
        computed). Returns False, storing nothing, when the entry alone exceeds the budget.
        """
        if graph_bytes is None:
            graph_bytes = len(encode_graph(graph))
        entry = CacheEntry(graph, plan, graph_bytes + plan.overhead_bytes)
        key = (client, gid)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._size -= old.size
            if entry.size > self._budget:
                return False
            while self._size + entry.size > self._budget:
                _, evicted = self._entries.popitem(last=False)
                self._size -= evicted.size
                self._evictions += 1
            self._entries[key] = entry
            self._size += entry.size
            return True

    def forget(self, client: str) -> int:
        """Drop every entry of `client`; returns how many there were."""
        with self._lock:
            keys = [k for k in self._entries if k[0] == client]
            for k in keys:
                self._size -= self._entries.pop(k).size
            return len(keys)

    def __contains__(self, key: tuple[str, bytes]) -> bool:
        """`(client, gid) in cache`, without touching the LRU order or the counters."""
        with self._lock:
            return key in self._entries

    def stats(self) -> dict[str, int]:
        """`size` and `budget` in bytes, `entries`, `hits`, `misses`, `evictions`."""
        with self._lock:
            return {
                "size": self._size,
                "budget": self._budget,
                "entries": len(self._entries),
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
            }


__all__ = ["CacheEntry", "GraphCache"]
