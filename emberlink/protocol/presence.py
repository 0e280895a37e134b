"""Presence: what a worker tells a relay about itself, signed with its key; encoding only, no I/O, no clocks.

Rules (everything that affects how presence is read lives in this file):
- A presence message is the msgpack array `[3, body, signature]`; `body` is the msgpack array
  `[ticket, device, free_bytes, sessions, queued, admits_anyone, draining, seq, nonce, cert]` and
  `signature` is the worker's Ed25519 signature over `LABEL ‖ body`. The NodeId in the ticket is
  the key that must verify it, so a presence message cannot speak for a worker whose key the
  sender lacks. (Version 2 had no `cert`; a reader of version 3 refuses it.)
- `cert` is empty, or the worker's cluster certificate (protocol/cluster.py) for the ticket's
  NodeId: decoding checks the cluster's signature and that it names this worker; whether the
  reader trusts that cluster is the reader's question.
- Freshness: a query carries a random `NONCE_SIZE`-byte nonce and the answer signs it back, so
  whoever asked knows the answer was made for its query: a recorded answer replayed later (to
  steer clients to a worker that is gone, or loaded) does not carry the new nonce. Periodic
  messages carry an empty nonce and prove nothing about when they were made.
- It never names a client, and never the allow list: `admits_anyone` says only whether a client
  outside any list is admitted.
- `load` orders workers: open sessions first, queued work second; lower is less loaded.
- `seq` grows with every message of one worker process, so a reader keeps the latest it saw.
- Decoding is strict: exact array lengths and Python types, bounded sizes, a ticket that parses.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from emberlink.errors import AuthError, ProtocolError
from emberlink.protocol.cluster import Certificate, decode_certificate
from emberlink.protocol.identity import Identity, public_from_node_id, verify
from emberlink.protocol.ticket import Ticket

VERSION = 3
LABEL = b"emberlink presence v3\x00"
MAX_PRESENCE = 4096
"""An encoded presence message is at most this many bytes (tickets with many addresses included)."""
MAX_DEVICE = 64
_MAX_TICKET = 2048
_MAX_COUNT = 1 << 62
_FIELDS = 10
NONCE_SIZE = 16


@dataclass(frozen=True, slots=True)
class Presence:
    """One worker's state as its presence message states it."""

    ticket: str
    device: str
    free_bytes: int
    sessions: int
    queued: int
    admits_anyone: bool
    draining: bool = False
    seq: int = 0
    nonce: bytes = b""  # the query's nonce in an answer; empty in a periodic message
    certificate: Certificate | None = None  # a cluster's word for this worker, if it has one

    @property
    def node_id(self) -> str:
        return Ticket.parse(self.ticket).node_id

    @property
    def load(self) -> tuple[int, int]:
        """Sort key: (open sessions, queued work items); lower is less loaded."""
        return (self.sessions, self.queued)


def encode_presence(presence: Presence, identity: Identity) -> bytes:
    """The signed message for `presence`; `identity` must be the worker the ticket names."""
    ticket = Ticket.parse(presence.ticket)
    if ticket.node_id != identity.node_id:
        raise ProtocolError(f"presence ticket names {ticket.node_id}, but the key is {identity.node_id}")
    _check_fields(presence)
    body = msgpack.packb(
        [
            str(ticket),
            presence.device,
            presence.free_bytes,
            presence.sessions,
            presence.queued,
            presence.admits_anyone,
            presence.draining,
            presence.seq,
            presence.nonce,
            presence.certificate.encode() if presence.certificate is not None else b"",
        ],
        use_bin_type=True,
    )
    data: bytes = msgpack.packb([VERSION, body, identity.sign(LABEL + body)], use_bin_type=True)
    if len(data) > MAX_PRESENCE:
        raise ProtocolError(f"presence message of {len(data)} bytes exceeds {MAX_PRESENCE}")
    return data


def decode_presence(data: bytes) -> Presence:
    """The presence in `data`: ProtocolError if malformed, AuthError if the signature does not verify."""
    if len(data) > MAX_PRESENCE:
        raise ProtocolError(f"presence message of {len(data)} bytes exceeds {MAX_PRESENCE}")
    outer = _unpack(data, "presence message")
    if not (isinstance(outer, list) and len(outer) == 3):
        raise ProtocolError("presence message must be [version, body, signature]")
    version, body, signature = outer
    if type(version) is not int or version != VERSION:
        raise ProtocolError(f"presence version {version!r} is not {VERSION}")
    if type(body) is not bytes or type(signature) is not bytes:
        raise ProtocolError("presence body and signature must be bytes")
    fields = _unpack(body, "presence body")
    if not (isinstance(fields, list) and len(fields) == _FIELDS):
        raise ProtocolError(f"presence body must be an array of {_FIELDS} fields")
    ticket_text, device, free_bytes, sessions, queued, admits_anyone, draining, seq, nonce, cert = fields
    if type(ticket_text) is not str or len(ticket_text) > _MAX_TICKET:
        raise ProtocolError(f"presence ticket must be a string of at most {_MAX_TICKET} characters")
    ticket = Ticket.parse(ticket_text)
    if not verify(public_from_node_id(ticket.node_id), signature, LABEL + body):
        raise AuthError(f"presence for worker {ticket.node_id} is not signed by its key")
    if type(cert) is not bytes:
        raise ProtocolError("presence cert must be bytes")
    certificate = decode_certificate(cert) if cert else None
    presence = Presence(
        ticket_text, device, free_bytes, sessions, queued, admits_anyone, draining, seq, nonce, certificate
    )
    _check_fields(presence)
    return presence


def _unpack(data: bytes, what: str) -> object:
    n = len(data)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=min(_MAX_TICKET, n),
            max_bin_len=min(MAX_PRESENCE, n),
            max_array_len=min(_FIELDS, n),
            max_map_len=0,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ProtocolError(f"{what} is not valid msgpack: {e}") from e


def _check_fields(p: Presence) -> None:
    if type(p.device) is not str or not 0 < len(p.device) <= MAX_DEVICE:
        raise ProtocolError(f"presence device must be a string of 1..{MAX_DEVICE} characters")
    for name in ("free_bytes", "sessions", "queued", "seq"):
        value = getattr(p, name)
        if type(value) is not int or not 0 <= value < _MAX_COUNT:
            raise ProtocolError(f"presence {name} must be an int in 0..2^62, got {value!r}")
    if type(p.admits_anyone) is not bool or type(p.draining) is not bool:
        raise ProtocolError("presence admits_anyone and draining must be booleans")
    if type(p.nonce) is not bytes or len(p.nonce) not in (0, NONCE_SIZE):
        raise ProtocolError(f"presence nonce must be empty or {NONCE_SIZE} bytes")
    if p.certificate is not None and p.certificate.worker_id != p.node_id:
        raise ProtocolError(
            f"presence of worker {p.node_id} carries a certificate for {p.certificate.worker_id}"
        )


__all__ = ["LABEL", "MAX_PRESENCE", "NONCE_SIZE", "Presence", "decode_presence", "encode_presence"]
