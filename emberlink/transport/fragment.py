"""Splits blobs into relay-sized, numbered fragments and joins them back; pure functions, no I/O.

Every relayed message starts with a 5-byte header: kind (1 byte) and a sequence number
(4 bytes, big-endian, wrapping) counted per direction of a session over all kinds. A gap
means the relay dropped a message (NATS core delivers at most once), so the link must fail
rather than hand a corrupt blob upward.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from enum import IntEnum

from emberlink.transport.base import Blob

HEADER = struct.Struct(">BI")
_SEQ_MASK = 0xFFFFFFFF


class Kind(IntEnum):
    MORE = 0  # a fragment; more of the same blob follow
    LAST = 1  # the last (or only) fragment of a blob
    BEAT = 2  # heartbeat on an idle link, no payload
    CLOSE = 3  # the sender closed the session cleanly, no payload


class FragmentError(Exception):
    """A relayed message is malformed or out of sequence."""


class Fragmenter:
    """Numbers and splits one direction's outgoing messages."""

    def __init__(self) -> None:
        self._seq = 0

    def _header(self, kind: Kind) -> bytes:
        header = HEADER.pack(kind, self._seq)
        self._seq = (self._seq + 1) & _SEQ_MASK
        return header

    def fragments(self, blob: Blob, max_payload: int) -> Iterator[bytes]:
        """The messages carrying `blob`, each at most `max_payload` bytes; numbered as they are drawn."""
        room = max_payload - HEADER.size
        if room <= 0:
            raise ValueError(f"max_payload {max_payload} leaves no room for a fragment")
        if len(blob) <= room:
            yield self._header(Kind.LAST) + blob
            return
        # Equal pieces: a blob just over the limit becomes two halves, not a full message and a crumb.
        count = -(-len(blob) // room)
        piece = -(-len(blob) // count)
        view = memoryview(blob)
        for start in range(0, len(blob), piece):
            end = start + piece
            yield self._header(Kind.LAST if end >= len(blob) else Kind.MORE) + view[start:end]

    def control(self, kind: Kind) -> bytes:
        """A payload-free message: BEAT or CLOSE."""
        return self._header(kind)


class Reassembler:
    """Checks one direction's incoming messages and joins fragments into whole blobs."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._expect = 0
        self._parts: list[memoryview] = []
        self._size = 0

    def feed(self, message: bytes) -> tuple[Kind, bytes | memoryview | None]:
        """Take the next message; returns its kind and, on LAST, the whole blob (a view into the
        message when it came in one piece: no copy)."""
        if len(message) < HEADER.size:
            raise FragmentError(f"a relayed message of {len(message)} bytes is shorter than its header")
        raw_kind, seq = HEADER.unpack_from(message)
        if seq != self._expect:
            raise FragmentError(f"expected message {self._expect} but got {seq}: the relay lost messages")
        self._expect = (seq + 1) & _SEQ_MASK
        try:
            kind = Kind(raw_kind)
        except ValueError:
            raise FragmentError(f"unknown relayed message kind {raw_kind}") from None
        if kind in (Kind.BEAT, Kind.CLOSE):
            return kind, None
        payload = memoryview(message)[HEADER.size :]
        self._size += len(payload)
        if self._size > self._limit:
            raise FragmentError(f"a relayed blob grew past {self._limit} bytes")
        if kind is Kind.MORE:
            self._parts.append(payload)
            return kind, None
        blob: bytes | memoryview = payload
        if self._parts:
            self._parts.append(payload)
            blob = b"".join(self._parts)
            self._parts = []
        self._size = 0
        return kind, blob
