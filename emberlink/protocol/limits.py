"""Limits that more than one part of emberlink enforces or must stay under; values only, no I/O.

A limit that one side checks and the other side (or another decoder) relies on lives here, once,
so the two cannot drift apart: the message schema (protocol/messages.py) and the graph decoder
(graph_replay/canonical.py) bound the same graphs; a worker announces the flow-control limits in
its Welcome, enforces them, and a client caps what it is told with the same values.
"""

from __future__ import annotations

MAX_RANK = 16
"""Most dimensions a tensor may have, in a message, a graph or a spec."""
MAX_GRAPH_BYTES = 16 << 20
"""Largest canonical graph, in bytes (the body of a Register)."""
MAX_BINDINGS = 4096
"""Most per-step scalars a graph may take, and so the most bindings an Execute may carry."""

MAX_UNACKED_BATCHES = 64
"""Batches a client may have sent that the worker has not acknowledged yet."""
MAX_UNACKED_BYTES = 256 << 20
"""Upload bytes a client may have sent that the worker has not acknowledged (applied) yet; the
worker ends a session that goes past it, which an honest client never does."""

__all__ = ["MAX_BINDINGS", "MAX_GRAPH_BYTES", "MAX_RANK", "MAX_UNACKED_BATCHES", "MAX_UNACKED_BYTES"]
