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

__all__ = [
    "MAX_BATCH_MESSAGES",
    "MAX_BINDINGS",
    "MAX_GRAPH_BYTES",
    "MAX_RANK",
    "MAX_REPLY_FRAME_BYTES",
    "MAX_REPLY_MESSAGES",
    "MAX_UNACKED_BATCHES",
    "MAX_UNACKED_BYTES",
]

MAX_BATCH_MESSAGES = 17_408
"""Most messages one client batch may hold. It bounds the event-loop work of one frame (decoding
takes about 1 µs a message). The client flushes at 16,384 messages (client/remote.py's
FLUSH_MESSAGES) and a resend adds a Register: this leaves 1,024 to spare."""
MAX_REPLY_FRAME_BYTES = 1 << 20
"""Most plaintext bytes of one reply MESSAGE frame: replies are split by bytes (and by
MAX_REPLY_MESSAGES), so a frame always fits a transport blob (8 MiB)."""
MAX_REPLY_MESSAGES = 8192
"""Most messages of one reply MESSAGE frame: bounds the event-loop work of sealing one frame."""
