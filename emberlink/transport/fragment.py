"""Splits blobs into relay-sized, numbered fragments and joins them back; pure functions, no I/O.

Rules (everything that decides what a relayed message may do to a link lives here):
- Every relayed message starts with its kind (1 byte) and a sequence number (4 bytes, big-endian,
  wrapping) counted per direction of a session over all kinds.
- Open messages (no key: the few messages of the handshake) are that 5-byte header and the payload.
  Anything malformed or out of sequence fails the link: NATS core delivers at most once, and a
  gap means the relay dropped a message, so a corrupt blob must not go upward.
- Tagged messages (a key derived from the session's link secret, once the handshake has made one)
  carry a 16-byte tag after the header: AES-GMAC of the payload under the direction's key, with
  nonce = kind ‖ 3 zero bytes ‖ the 64-bit counter that the 4-byte number abbreviates. Each
  counter is used once per key, so the tag binds kind, position and payload.
- A tagged message that does not verify, is malformed, or repeats a number already taken (a
  duplicate, a replay, a reordering) is dropped and changes nothing. Only a message that verifies
  can move the sequence, carry a blob, close the link, or fail it: a verified message ahead of the
  next expected number means the relay lost messages on the way.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from enum import IntEnum

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from emberlink.transport.base import Blob

HEADER = struct.Struct(">BI")
TAG_SIZE = 16
TAGGED_HEADER = struct.Struct(f">BI{TAG_SIZE}s")
KEY_SIZE = 32
_SEQ_MASK = 0xFFFFFFFF
_BEHIND = 1 << 31  # a number this far or further "ahead" is really behind: already taken
_NONCE = struct.Struct(">B3xQ")


class Kind(IntEnum):
    MORE = 0  # a fragment; more of the same blob follow
    LAST = 1  # the last (or only) fragment of a blob
    BEAT = 2  # heartbeat on an idle link, no payload
    CLOSE = 3  # the sender closed the session cleanly, no payload


_KINDS = frozenset(int(k) for k in Kind)


class FragmentError(Exception):
    """A relayed message is malformed or out of sequence."""


def _aead(key: bytes | None) -> AESGCM | None:
    if key is None:
        return None
    if len(key) != KEY_SIZE:
        raise ValueError(f"a fragment key is {KEY_SIZE} bytes, not {len(key)}")
    return AESGCM(key)


class Fragmenter:
    """Numbers and splits one direction's outgoing messages; tags them when given a key."""

    def __init__(self, key: bytes | None = None) -> None:
        self._count = 0
        self._aead = _aead(key)
        self.header_size = HEADER.size if self._aead is None else TAGGED_HEADER.size

    def _header(self, kind: Kind, payload: Blob) -> bytes:
        count = self._count
        self._count += 1
        if self._aead is None:
            return HEADER.pack(kind, count & _SEQ_MASK)
        tag = self._aead.encrypt(_NONCE.pack(kind, count), b"", payload)
        return TAGGED_HEADER.pack(kind, count & _SEQ_MASK, tag)

    def fragments(self, blob: Blob, max_payload: int) -> Iterator[bytes]:
        """The messages carrying `blob`, each at most `max_payload` bytes; numbered as they are drawn."""
        room = max_payload - self.header_size
        if room <= 0:
            raise ValueError(f"max_payload {max_payload} leaves no room for a fragment")
        if len(blob) <= room:
            yield self._header(Kind.LAST, blob) + blob
            return
        # Equal pieces: a blob just over the limit becomes two halves, not a full message and a crumb.
        count = -(-len(blob) // room)
        piece = -(-len(blob) // count)
        view = memoryview(blob)
        for start in range(0, len(blob), piece):
            end = start + piece
            part = view[start:end]
            yield self._header(Kind.LAST if end >= len(blob) else Kind.MORE, part) + part

    def control(self, kind: Kind) -> bytes:
        """A payload-free message: BEAT or CLOSE."""
        return self._header(kind, b"")


class Reassembler:
    """Checks one direction's incoming messages and joins fragments into whole blobs; with a key, only
    messages tagged under it count."""

    def __init__(self, limit: int, key: bytes | None = None) -> None:
        self._limit = limit
        self._count = 0
        self._aead = _aead(key)
        self._parts: list[memoryview] = []
        self._size = 0
        self.dropped = 0
        """Tagged messages dropped so far: forged, malformed or already taken."""

    def feed(self, message: bytes) -> tuple[Kind, bytes | memoryview | None] | None:
        """Take the next message; returns its kind and, on LAST, the whole blob (a view into the
        message when it came in one piece: no copy); None when a tagged link dropped it."""
        if self._aead is None:
            kind, payload = self._check_open(message)
        else:
            checked = self._check_tagged(self._aead, message)
            if checked is None:
                self.dropped += 1
                return None
            kind, payload = checked
        self._count += 1
        if kind in (Kind.BEAT, Kind.CLOSE):
            return kind, None
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

    def _check_open(self, message: bytes) -> tuple[Kind, memoryview]:
        if len(message) < HEADER.size:
            raise FragmentError(f"a relayed message of {len(message)} bytes is shorter than its header")
        raw_kind, seq = HEADER.unpack_from(message)
        expect = self._count & _SEQ_MASK
        if seq != expect:
            raise FragmentError(f"expected message {expect} but got {seq}: the relay lost messages")
        if raw_kind not in _KINDS:
            raise FragmentError(f"unknown relayed message kind {raw_kind}")
        return Kind(raw_kind), memoryview(message)[HEADER.size :]

    def _check_tagged(self, aead: AESGCM, message: bytes) -> tuple[Kind, memoryview] | None:
        if len(message) < TAGGED_HEADER.size:
            return None
        raw_kind, seq, tag = TAGGED_HEADER.unpack_from(message)
        ahead = (seq - self._count) & _SEQ_MASK
        if ahead >= _BEHIND or raw_kind not in _KINDS:
            return None
        payload = memoryview(message)[TAGGED_HEADER.size :]
        try:
            aead.decrypt(_NONCE.pack(raw_kind, self._count + ahead), tag, payload)
        except InvalidTag:
            return None
        if ahead:
            raise FragmentError(
                f"expected message {self._count & _SEQ_MASK} but got {seq}: the relay lost messages"
            )
        return Kind(raw_kind), payload
