"""One client's view of the worker's graph cache: Register checks and compiles, Execute looks up.

The cache itself (graph_replay.cache.GraphCache) is shared by the whole worker and keyed by the
client's NodeId, so a client sees only graphs it registered itself, in any of its sessions,
and nothing about anyone else's. Called on the device thread only.
"""

from __future__ import annotations

from typing import Any

from emberlink.errors import EmberlinkError, ProtocolError
from emberlink.graph_replay import canonical
from emberlink.graph_replay.plan import Plan, compile_plan


class GraphView:
    """The graphs of one client identity in the worker's shared cache."""

    def __init__(self, cache: Any, owner: str) -> None:
        self._cache = cache
        self.owner = owner

    def get(self, gid: bytes) -> Plan | None:
        """The compiled plan of gid if this client's part of the cache holds it."""
        plan: Plan | None = self._cache.get(self.owner, gid)
        return plan

    def register(self, gid: bytes, body: bytes) -> Plan:
        """Check that body hashes to gid, then decode, compile and cache it; ProtocolError if not."""
        canonical.check_graph_id(gid, body)
        plan = self.get(gid)
        if plan is not None:
            return plan
        try:
            graph = canonical.decode_graph(body)
            plan = compile_plan(graph)
        except ProtocolError:
            raise
        except EmberlinkError as e:
            raise ProtocolError(f"Register: graph {gid.hex()} does not compile: {e}") from e
        self._cache.put(self.owner, gid, plan, len(body) + plan.overhead_bytes)
        return plan
