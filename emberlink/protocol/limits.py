"""Limits that more than one part of emberlink enforces or must stay under; values only, no I/O.

A limit that one side checks and the other side (or another decoder) relies on lives here, once,
so the two cannot drift apart: the message schema (protocol/messages.py) and the graph decoder
(graph_replay/canonical.py) bound the same graphs; a worker announces the flow-control limits in
its Welcome, enforces them, and a client caps what it is told with the same values. Limits only
the worker enforces (quotas, work, replies waiting) live in server/limits.py.
"""

from __future__ import annotations

MAX_RANK = 16
"""Most dimensions a tensor may have, in a message, a graph or a spec."""
MAX_GRAPH_BYTES = 16 << 20
"""Largest canonical graph, in bytes (the body of a Register)."""
MAX_BINDINGS = 4096
"""Most per-step scalars a graph may take, and so the most bindings an Execute may carry."""

MAX_UNACKED_BATCHES = 64
"""Batches a client may have sent that the worker has not acknowledged yet; the worker ends a
session whose batch seq runs further ahead of the acks it has sent."""
MAX_UNACKED_BYTES = 256 << 20
"""Upload bytes a client may have sent that the worker has not acknowledged (applied) yet; the
worker ends a session that goes past it, which an honest client never does."""

MAX_BATCH_MESSAGES = 1024
"""Most messages one client batch may hold. It bounds the event-loop work of one frame: decoding
takes about 1.2 µs a message here (1024: about 1.2 ms), and a frame is decoded in one go. The
client flushes a little before it (client/remote.py), so a resend's Register still fits."""
MAX_REPLY_FRAME_BYTES = 128 << 10
"""Most plaintext bytes of one reply MESSAGE frame: replies are split by bytes (and by
MAX_REPLY_MESSAGES), so a frame always fits a transport blob (8 MiB), and sealing one costs the
event loop about 1.5 ms at most (msgpack encodes ~100 MB/s of small messages here)."""
MAX_REPLY_MESSAGES = 2048
"""Most messages of one reply MESSAGE frame (2048 Done messages encode in about 0.7 ms)."""

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
