"""One client's view of the worker's graph cache: Register checks, compiles and admits; Execute
looks up; no I/O, no backend calls.

The cache (graph_replay.cache.GraphCache) is shared by the whole worker and keyed by the client's
NodeId, so a client finds only graphs it registered itself, in any of its sessions (it survives
reconnects), and is told only its own cache figures.

Compiling runs on the worker's compile thread (`Compiler`), never on the device thread, so a large
graph never delays other sessions' work. A graph is admitted only within the worker's limits
(server/limits.py): at most `max_graph_nodes` nodes (checked before compiling), and a plan that
touches at most `max_plan_elements` elements and does at most `max_plan_flops` FLOPs
(graph_replay/work.py). A graph past a limit is not cached; the Register answers with a
`Refusal` (code `limit`) whose failure the batch's Executes of it take, and the session goes on. Each
admitted plan's `Cost` (its peak bytes, graph_replay/memory.py) is worked out once, here.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from emberlink.errors import EmberlinkError, ErrorCode, ProtocolError
from emberlink.graph_replay import canonical
from emberlink.graph_replay.cache import GraphCache
from emberlink.graph_replay.memory import plan_peak_bytes
from emberlink.graph_replay.plan import Plan, compile_plan
from emberlink.graph_replay.work import plan_work
from emberlink.server.limits import WorkerLimits
from emberlink.server.store import Failure

REFUSALS_KEPT = 1024
"""Graphs a limit refused that the worker remembers (by client and graph id)."""

SMALL_GRAPH_BYTES = 64 << 10
"""A Register of a graph already cached is checked on the event loop (hashing its body) when the
body is at most this long; anything else goes to the compile thread."""


@dataclass(frozen=True, slots=True)
class Cost:
    """What the worker reserves before running a plan: its peak bytes, inputs apart."""

    peak_bytes: int


@dataclass(frozen=True, slots=True)
class Refusal:
    """A registered graph a limit refused: why, and how many outputs its Executes poison."""

    failure: Failure
    outputs: int


class Costs:
    """Plan -> Cost for the whole worker, computed once per plan, and the graphs a limit refused
    lately, so a client that registers one again and again costs a hash each time; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._costs: weakref.WeakKeyDictionary[Plan, Cost] = weakref.WeakKeyDictionary()
        self._refused: OrderedDict[tuple[str, bytes], Refusal] = OrderedDict()

    def refused(self, owner: str, gid: bytes) -> Refusal | None:
        with self._lock:
            return self._refused.get((owner, gid))

    def refuse(self, owner: str, gid: bytes, refusal: Refusal) -> Refusal:
        with self._lock:
            self._refused[(owner, gid)] = refusal
            while len(self._refused) > REFUSALS_KEPT:
                self._refused.popitem(last=False)
        return refusal

    def of(self, plan: Plan) -> Cost:
        with self._lock:
            cost = self._costs.get(plan)
        if cost is None:
            cost = Cost(plan_peak_bytes(plan))
            with self._lock:
                self._costs[plan] = cost
        return cost


class Compiler:
    """The worker's compile thread: Registers are decoded, compiled and admitted here, one at a time."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emberlink-compile")

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


Prepared = dict[bytes, Plan | Refusal]
"""The plans of a batch's Registers, by graph id, or why a graph was not admitted."""


class GraphView:
    """The graphs of one client identity in the worker's shared cache, under the worker's limits."""

    def __init__(self, cache: GraphCache, owner: str, limits: WorkerLimits, costs: Costs) -> None:
        self._cache = cache
        self.owner = owner
        self._limits = limits
        self.costs = costs

    def get(self, gid: bytes) -> Plan | None:
        """The compiled plan of gid if this client's part of the cache holds it."""
        return self._cache.get(self.owner, gid)

    def cached(self, gid: bytes, body: bytes) -> Plan | Refusal | None:
        """gid's plan if it is cached (or its refusal if a limit refused it lately) and `body` is
        small enough to check here; ProtocolError if body does not hash to gid. None: prepare it
        on the compile thread."""
        if len(body) > SMALL_GRAPH_BYTES:
            return None
        if (self.owner, gid) in self._cache:
            canonical.check_graph_id(gid, body)
            return self._cache.get(self.owner, gid)
        refused = self.costs.refused(self.owner, gid)
        if refused is not None:
            canonical.check_graph_id(gid, body)
        return refused

    def prepare(self, gid: bytes, body: bytes) -> Plan | Refusal:
        """On the compile thread: check that body hashes to gid (ProtocolError if not), then decode,
        check the limits, compile, admit and cache it; a Refusal if a limit refuses it.

        The plan is returned even when the cache cannot keep it (a graph over the whole budget),
        so the batch that registered it still runs: the batch holds its plans until it is done.
        """
        canonical.check_graph_id(gid, body)
        plan = self._cache.get(self.owner, gid)
        if plan is not None:
            return plan
        refused = self.costs.refused(self.owner, gid)
        if refused is not None:
            return refused
        found = self._admit(gid, body)
        return self.costs.refuse(self.owner, gid, found) if isinstance(found, Refusal) else found

    def _admit(self, gid: bytes, body: bytes) -> Plan | Refusal:
        limits = self._limits
        nodes, outputs = canonical.graph_size(body)  # before paying for decoding the nodes
        if nodes > limits.max_graph_nodes:
            return _limit(
                outputs,
                f"graph {gid.hex()} has {nodes} nodes; this worker takes graphs of at most "
                f"{limits.max_graph_nodes} nodes (--max-graph-nodes)",
            )
        graph = canonical.decode_graph(body)
        try:
            plan = compile_plan(graph)
        except ProtocolError:
            raise
        except EmberlinkError as e:
            raise ProtocolError(f"Register: graph {gid.hex()} does not compile: {e}") from e
        work = plan_work(plan)
        if work.elements > limits.max_plan_elements:
            return _limit(
                outputs,
                f"graph {gid.hex()} touches about {work.elements} elements a run; this worker runs "
                f"at most {limits.max_plan_elements} elements a plan (--max-plan-elements)",
            )
        if work.flops > limits.max_plan_flops:
            return _limit(
                outputs,
                f"graph {gid.hex()} does about {work.flops} FLOPs a run; this worker runs at most "
                f"{limits.max_plan_flops} FLOPs a plan (--max-plan-flops)",
            )
        self.costs.of(plan)
        self._cache.put(self.owner, gid, plan, len(body) + plan.overhead_bytes)
        return plan

    def charge(self, gid: bytes, plan: Plan, delta: int) -> bool:
        """Count `delta` more bytes (a captured graph's memory; negative when it is freed) against
        this client's cache entry of `plan`; False if it does not fit or the entry is gone."""
        return self._cache.resize(self.owner, gid, plan, delta)

    def stats(self) -> dict[str, int]:
        """This client's own cache figures: size, entries, hits, misses, evictions, budget."""
        return self._cache.stats(self.owner)


def _limit(outputs: int, message: str) -> Refusal:
    return Refusal(Failure(ErrorCode.LIMIT, message), outputs)


__all__ = ["Compiler", "Cost", "Costs", "GraphView", "Prepared", "Refusal"]
