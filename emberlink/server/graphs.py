"""One client's view of the worker's graph cache: Register checks and compiles, Execute looks up.

The cache (graph_replay.cache.GraphCache) is shared by the whole worker and keyed by the client's
NodeId, so a client finds only graphs it registered itself, in any of its sessions (it survives
reconnects). What a client is told about the cache is about its own graphs only
(`ClientGraphs.stats`): the cache's worker-wide counters never reach a client.
"""

from __future__ import annotations

import threading

from emberlink.errors import EmberlinkError, ProtocolError
from emberlink.graph_replay import canonical
from emberlink.graph_replay.cache import GraphCache
from emberlink.graph_replay.plan import Plan, compile_plan

_PRUNE_AT = 4096


class ClientGraphs:
    """Per client identity: the graphs it registered (with their cache charge) and its hits and misses."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sizes: dict[bytes, int] = {}
        self.hits = 0
        self.misses = 0
        self.registered = 0
        self.evicted = 0

    def stats(self, cache: GraphCache, owner: str) -> dict[str, int]:
        """This client's entries, bytes, hits, misses, evictions (graphs it registered that were dropped)."""
        with self._lock:
            self._prune(cache, owner)
            return {
                "entries": len(self.sizes),
                "bytes": sum(self.sizes.values()),
                "hits": self.hits,
                "misses": self.misses,
                "registered": self.registered,
                "evictions": self.evicted,
            }

    def note_registered(self, cache: GraphCache, owner: str, gid: bytes, size: int, stored: bool) -> None:
        with self._lock:
            self.registered += 1
            if stored:
                self.sizes[gid] = size
            else:
                self.evicted += 1  # too large for the whole budget: used for this batch only
            if len(self.sizes) > _PRUNE_AT:
                self._prune(cache, owner)

    def _prune(self, cache: GraphCache, owner: str) -> None:
        gone = [gid for gid in self.sizes if (owner, gid) not in cache]
        for gid in gone:
            del self.sizes[gid]
        self.evicted += len(gone)


class GraphView:
    """The graphs of one client identity in the worker's shared cache (device thread only)."""

    def __init__(self, cache: GraphCache, owner: str, mine: ClientGraphs) -> None:
        self._cache = cache
        self.owner = owner
        self._mine = mine

    def get(self, gid: bytes) -> Plan | None:
        """The compiled plan of gid if this client's part of the cache holds it."""
        entry = self._cache.get(self.owner, gid)
        if entry is None:
            self._mine.misses += 1
            return None
        self._mine.hits += 1
        return entry.plan

    def register(self, gid: bytes, body: bytes) -> Plan:
        """Check that body hashes to gid, then decode, compile and cache it; ProtocolError if not.

        The plan is returned even when the cache cannot keep it (a graph over the whole budget), so
        the batch that registered it still runs.
        """
        canonical.check_graph_id(gid, body)
        entry = self._cache.get(self.owner, gid)
        if entry is not None:
            return entry.plan
        try:
            graph = canonical.decode_graph(body)
            plan = compile_plan(graph)
        except ProtocolError:
            raise
        except EmberlinkError as e:
            raise ProtocolError(f"Register: graph {gid.hex()} does not compile: {e}") from e
        stored = self._cache.put(self.owner, gid, graph, plan, graph_bytes=len(body))
        self._mine.note_registered(self._cache, self.owner, gid, len(body) + plan.overhead_bytes, stored)
        return plan
