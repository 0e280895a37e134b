"""Moves opaque, already-sealed byte blobs between a client and a worker; never sees plaintext.

`base.Link` is the one interface sessions use. Transports: `memory` (in-process), `grpc`, and
`nats` (a relay; needs the `nats` extra). Import the one you need: this package imports neither.
"""

from emberlink.transport.base import MAX_BLOB, Blob, Handler, Link, Listener

__all__ = ["MAX_BLOB", "Blob", "Handler", "Link", "Listener"]
