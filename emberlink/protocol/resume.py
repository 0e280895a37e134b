"""Resume credentials: a client proving, inside a new handshake, that a detached session is its own; no I/O, no clocks.

Rules (everything that decides whether a resume is accepted lives in this file):
- Every handshake yields a 32-byte resume secret (protocol/handshake.py: HKDF-SHA256 of the same
  ikm as the traffic keys, salt = th2, its own info label), known to both ends only.
- A session's credential n holds a secret S_n. S_0 is the opening handshake's secret. A resume
  runs a full new handshake (fresh ephemeral keys, so fresh traffic keys and counters: nothing
  recorded on an earlier link opens on the new one); when its own secret is T, the session's next
  credential is S_{n+1} = HKDF(T, salt = S_n, info = label ‖ n+1): bound to every link so far.
- `id(S)` = 16 bytes of HKDF(S, "id"): how the worker finds the session; it tells nothing about S.
- The token travels in the Auth message's token field, so it is sealed under the new handshake's
  key and signed, with the transcript, by the client's static key:
      "EMLR" version:u8 counter:u32 id[16] received:u64 mac[32]
  mac = HMAC-SHA256(HKDF(S_n, "proof"), label ‖ th2 ‖ counter ‖ id ‖ received), th2 being the new
  handshake's transcript hash: a token proves itself for one handshake only.
- The worker accepts a token at most once: the id names a session it holds, the new handshake's
  client is that session's client, the counter is the credential's, and the mac verifies. Only
  then is S_n forgotten and S_{n+1} taken; a refused token consumes nothing.
- `received` is the highest Reply.ack whose messages and bulk bytes the client took in whole on
  the old link: the worker sends again what it replied after that.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from emberlink.errors import ProtocolError

SECRET_SIZE = 32
ID_SIZE = 16
MAC_SIZE = 32
MAGIC = b"EMLR"
VERSION = 1
_TOKEN = struct.Struct(">4sBI16sQ32s")
TOKEN_SIZE = _TOKEN.size  # 65
_FIELDS = struct.Struct(">I16sQ")
_ID_INFO = b"emberlink v1 resume id"
_PROOF_INFO = b"emberlink v1 resume proof key"
_NEXT_INFO = b"emberlink v1 resume next"
_MAC_LABEL = b"emberlink v1 resume proof\x00"
MAX_COUNTER = (1 << 32) - 1
MAX_RECEIVED = (1 << 63) - 1


def _derive(ikm: bytes, info: bytes, length: int = SECRET_SIZE, salt: bytes | None = None) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)


@dataclass(frozen=True, slots=True)
class ResumeRequest:
    """A token as parsed from an Auth message, not yet checked against any session."""

    counter: int
    id: bytes
    received: int
    mac: bytes


def is_token(token: bytes) -> bool:
    """Whether an Auth token asks to resume a session (any other token opens a new one)."""
    return token[: len(MAGIC)] == MAGIC


def parse_token(token: bytes) -> ResumeRequest:
    """The resume request in a token that `is_token`; ProtocolError if it is malformed."""
    if len(token) != TOKEN_SIZE:
        raise ProtocolError(f"a resume token is {TOKEN_SIZE} bytes, got {len(token)}")
    magic, version, counter, ident, received, mac = _TOKEN.unpack(token)
    if magic != MAGIC:
        raise ProtocolError("not a resume token")
    if version != VERSION:
        raise ProtocolError(f"resume token of version {version}; this side speaks {VERSION}")
    if received > MAX_RECEIVED:
        raise ProtocolError("resume token's received ack is out of range")
    return ResumeRequest(counter, ident, received, mac)


class Credential:
    """One step of a session's credential chain, the same object on both ends."""

    __slots__ = ("_proof_key", "counter", "id", "secret")

    def __init__(self, secret: bytes, counter: int = 0) -> None:
        if len(secret) != SECRET_SIZE:
            raise ValueError(f"a resume secret is {SECRET_SIZE} bytes, got {len(secret)}")
        if not 0 <= counter <= MAX_COUNTER:
            raise ValueError(f"resume counter {counter} out of range")
        self.secret = bytes(secret)
        self.counter = counter
        self.id = _derive(self.secret, _ID_INFO, ID_SIZE)
        self._proof_key = _derive(self.secret, _PROOF_INFO)

    def _mac(self, transcript: bytes, received: int) -> bytes:
        fields = _FIELDS.pack(self.counter, self.id, received)
        return hmac.new(self._proof_key, _MAC_LABEL + transcript + fields, hashlib.sha256).digest()

    def token(self, transcript: bytes, received: int) -> bytes:
        """The token that resumes this credential's session in the handshake whose th2 is `transcript`."""
        if not 0 <= received <= MAX_RECEIVED:
            raise ValueError(f"received ack {received} out of range")
        return _TOKEN.pack(MAGIC, VERSION, self.counter, self.id, received, self._mac(transcript, received))

    def proves(self, request: ResumeRequest, transcript: bytes) -> bool:
        """Whether `request`, presented in the handshake whose th2 is `transcript`, is this credential's."""
        if request.counter != self.counter or not hmac.compare_digest(request.id, self.id):
            return False
        return hmac.compare_digest(request.mac, self._mac(transcript, request.received))

    def after(self, handshake_secret: bytes) -> Credential:
        """The next credential, once a resume over a handshake whose resume secret is
        `handshake_secret` has been accepted."""
        if self.counter >= MAX_COUNTER:
            raise ProtocolError("resume counter exhausted; open a new session")
        counter = self.counter + 1
        info = _NEXT_INFO + counter.to_bytes(4, "big")
        return Credential(_derive(handshake_secret, info, salt=self.secret), counter)


__all__ = [
    "ID_SIZE",
    "SECRET_SIZE",
    "TOKEN_SIZE",
    "Credential",
    "ResumeRequest",
    "is_token",
    "parse_token",
]
