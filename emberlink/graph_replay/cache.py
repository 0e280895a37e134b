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
from emberlink.graph_replay.plan import Plan


@dataclass(eq=False, slots=True)
class _Counts:
    size: int = 0
    entries: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class GraphCache:
    """LRU of `(client, gid) -> Plan` under `budget_bytes` shared by every client.

    A plan carries its graph (`plan.graph`), so the entry is the plan plus the bytes it is charged.
    """

    def __init__(self, budget_bytes: int) -> None:
        if type(budget_bytes) is not int or budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        self._budget = budget_bytes
        self._entries: OrderedDict[tuple[str, bytes], tuple[Plan, int]] = OrderedDict()
        self._total = _Counts()
        self._clients: dict[str, _Counts] = {}
        self._lock = threading.Lock()

    def _count(self, client: str) -> tuple[_Counts, _Counts]:
        return self._total, self._clients.setdefault(client, _Counts())

    def get(self, client: str, gid: bytes) -> Plan | None:
        """The plan `client` stored under `gid` (now the most recently used), or None."""
        key = (client, gid)
        with self._lock:
            found = self._entries.get(key)
            for c in self._count(client):
                if found is None:
                    c.misses += 1
                else:
                    c.hits += 1
            if found is None:
                return None
            self._entries.move_to_end(key)
            return found[0]

    def put(self, client: str, gid: bytes, plan: Plan, size: int | None = None) -> bool:
        """Store `plan` (and so its graph) for `client`, evicting least recently used entries to fit.

        `size` defaults to the canonical encoding's length plus `plan.overhead_bytes`; pass it when
        the caller already has the bytes. Returns False, storing and evicting nothing, when the
        entry alone exceeds the budget.
        """
        if size is None:
            size = len(encode_graph(plan.graph)) + plan.overhead_bytes
        key = (client, gid)
        with self._lock:
            self._remove(key)
            if size > self._budget:
                return False
            while self._total.size + size > self._budget:
                oldest = next(iter(self._entries))
                self._remove(oldest)
                for c in self._count(oldest[0]):
                    c.evictions += 1
            self._entries[key] = (plan, size)
            for c in self._count(client):
                c.size += size
                c.entries += 1
            return True

    def _remove(self, key: tuple[str, bytes]) -> None:
        found = self._entries.pop(key, None)
        if found is not None:
            for c in self._count(key[0]):
                c.size -= found[1]
                c.entries -= 1

    def forget(self, client: str) -> int:
        """Drop every entry of `client`; returns how many there were."""
        with self._lock:
            keys = [k for k in self._entries if k[0] == client]
            for k in keys:
                self._remove(k)
            return len(keys)

    def __contains__(self, key: tuple[str, bytes]) -> bool:
        """`(client, gid) in cache`, without touching the LRU order or the counters."""
        with self._lock:
            return key in self._entries

    def stats(self, client: str | None = None) -> dict[str, int]:
        """`size` (bytes), `entries`, `hits`, `misses`, `evictions` and `budget` (bytes).

        With `client`, only that client's figures (what a client may be told); without, the worker's.
        """
        with self._lock:
            c = self._total if client is None else self._clients.get(client, _Counts())
            return {
                "size": c.size,
                "entries": c.entries,
                "hits": c.hits,
                "misses": c.misses,
                "evictions": c.evictions,
                "budget": self._budget,
            }


__all__ = ["GraphCache"]
