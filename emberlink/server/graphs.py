"""One client's view of the worker's graph cache: Register checks and compiles, Execute looks up.

The cache (graph_replay.cache.GraphCache) is shared by the whole worker and keyed by the client's
NodeId, so a client finds only graphs it registered itself, in any of its sessions (it survives
reconnects), and is told only its own cache figures. Used on the device thread.
"""

from __future__ import annotations

from emberlink.errors import EmberlinkError, ProtocolError
from emberlink.graph_replay import canonical
from emberlink.graph_replay.cache import GraphCache
from emberlink.graph_replay.plan import Plan, compile_plan


class GraphView:
    """The graphs of one client identity in the worker's shared cache."""

    def __init__(self, cache: GraphCache, owner: str) -> None:
        self._cache = cache
        self.owner = owner

    def get(self, gid: bytes) -> Plan | None:
        """The compiled plan of gid if this client's part of the cache holds it."""
        return self._cache.get(self.owner, gid)

    def register(self, gid: bytes, body: bytes) -> Plan:
        """Check that body hashes to gid, then decode, compile and cache it; ProtocolError if not.

        The plan is returned even when the cache cannot keep it (a graph over the whole budget),
        so the batch that registered it still runs: the batch holds its plans until it is done.
        """
        canonical.check_graph_id(gid, body)
        if (self.owner, gid) in self._cache:
            plan = self._cache.get(self.owner, gid)
            if plan is not None:
                return plan
        try:
            plan = compile_plan(canonical.decode_graph(body))
        except ProtocolError:
            raise
        except EmberlinkError as e:
            raise ProtocolError(f"Register: graph {gid.hex()} does not compile: {e}") from e
        self._cache.put(self.owner, gid, plan, len(body) + plan.overhead_bytes)
        return plan

    def charge(self, gid: bytes, plan: Plan, delta: int) -> bool:
        """Count `delta` more bytes (a captured graph's memory; negative when it is freed) against
        this client's cache entry of `plan`; False if it does not fit or the entry is gone."""
        return self._cache.resize(self.owner, gid, plan, delta)

    def stats(self) -> dict[str, int]:
        """This client's own cache figures: size, entries, hits, misses, evictions, budget."""
        return self._cache.stats(self.owner)
