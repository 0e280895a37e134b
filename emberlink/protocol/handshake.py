"""The one-round-trip handshake (hybrid X25519 + ML-KEM-768, Ed25519 identities); no I/O, no clocks.

Rules (everything that affects the handshake's state machines lives in this file):
- Three messages: Hello (client -> worker), Welcome (worker -> client), Auth (client -> worker).
  All integers are big-endian; every message has an exact length, trailing bytes are refused.
    Hello   = "EMLH" version:u8 n:u8 suite:u16*n client_x25519[32] ek_len:u16 ek random[32] target[32]
    Welcome = "EMLW" version:u8 suite:u16 worker_x25519[32] ct_len:u16 ct random[32] worker_key[32]
              signature[64] sealed_len:u16 sealed(session_id[8] ‖ msgpack limits)
    Auth    = "EMLA" version:u8 sealed_len:u16 sealed(client_key[32] signature[64] token_len:u16 token)
  `target` is the public key the client means to reach; `ek` (ML-KEM-768 encapsulation key) is
  present exactly when a hybrid suite is offered, `ct` exactly when one is chosen.
- th1 = SHA-256(label ‖ Hello ‖ Welcome up to the signature); th2 = SHA-256(label ‖ Hello ‖ Welcome).
  Both cover every offered and chosen parameter, so changing any of them (a downgrade of the
  offered suites included) breaks a signature.
- ikm = X25519 secret ‖ ML-KEM secret (empty for the classical suite).
  Handshake keys = HKDF-SHA256(ikm, salt=th1): one seals Welcome's tail, one seals Auth.
  Traffic keys = HKDF-SHA256(ikm, salt=th2): one AES-256-GCM key per direction for the Channel.
  Link secret = HKDF-SHA256(ikm, salt=th2, another label): 32 bytes that a transport which needs
  its own keys (the relay's fragment tags and session subjects) derives them from, never the
  traffic keys themselves. The worker knows it once Welcome is made, the client once it is read.
  Resume secret = HKDF-SHA256(ikm, salt=th2, its own label): what protocol/resume.py's credentials
  grow from; both sides expose it with th2 (`resume_secret`, `transcript`) once done.
- The worker signs th1; the client signs th2 and its token. Labels keep the two roles apart.
- The client pins the worker key it expected (from the ticket): any other key is an AuthError.
  The worker refuses a Hello aimed at another key and a client its AllowPolicy does not admit
  (AuthError naming the client's NodeId).
- Each side is a state machine; a call out of turn is a ProtocolError, and any refusal leaves the
  handshake FAILED for good.
- Randomness is the `rng` parameter. The one exception is ML-KEM encapsulation, which draws from
  OpenSSL's generator inside `cryptography`; WorkerHandshake takes it as the `encapsulate`
  parameter so tests can fix it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence
from enum import Enum, IntEnum
from typing import Any

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.mlkem import MLKEM768PrivateKey, MLKEM768PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from emberlink.errors import AuthError, ProtocolError
from emberlink.protocol.channel import SESSION_ID_SIZE, Channel, Role
from emberlink.protocol.identity import (
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    AllowPolicy,
    Identity,
    Rng,
    draw,
    node_id_from_public,
    public_from_node_id,
    verify,
)

VERSION = 2
"""The session protocol's version, sent in every handshake message; a peer speaking another one
is refused at the handshake, before any batch. 2: a batch of uploads only is no `Repeat`
template (protocol/session.py `uploads_only`): a peer of version 1 would expand the step after it
against another batch."""


class Suite(IntEnum):
    X25519_MLKEM768_AES256GCM = 1  # hybrid post-quantum: the default
    X25519_AES256GCM = 2  # classical; only when both sides are configured to allow it


DEFAULT_SUITES: tuple[Suite, ...] = (Suite.X25519_MLKEM768_AES256GCM,)
_HYBRID = frozenset({Suite.X25519_MLKEM768_AES256GCM})

MLKEM_EK_SIZE = 1184
MLKEM_CT_SIZE = 1088
X25519_SIZE = 32
RANDOM_SIZE = 32
MAX_SUITES = 16
MAX_TOKEN = 1024
MAX_LIMITS = 64
MAX_LIMIT_NAME = 64
_MAX_SEALED = 8 * 1024

_HELLO = b"EMLH"
_WELCOME = b"EMLW"
_AUTH = b"EMLA"
_TRANSCRIPT_LABEL = b"emberlink handshake v1\x00"
_WORKER_SIG_LABEL = b"emberlink v1 worker signature\x00"
_CLIENT_SIG_LABEL = b"emberlink v1 client signature\x00"
_HANDSHAKE_INFO = b"emberlink v1 handshake keys"
_TRAFFIC_INFO = b"emberlink v1 traffic keys"
_LINK_INFO = b"emberlink v1 link secret"
_RESUME_INFO = b"emberlink v1 resume secret"
_ZERO_NONCE = bytes(12)  # each handshake key seals exactly one message
_U16 = struct.Struct(">H")

Encapsulate = Callable[[MLKEM768PublicKey], tuple[bytes, bytes]]
"""ML-KEM encapsulation: public key -> (shared secret, ciphertext)."""


def _mlkem_encapsulate(public: MLKEM768PublicKey) -> tuple[bytes, bytes]:
    return public.encapsulate()


class ClientState(Enum):
    START = "start"
    HELLO_SENT = "hello sent"
    DONE = "done"
    FAILED = "failed"


class WorkerState(Enum):
    START = "start"
    WELCOME_SENT = "welcome sent"
    DONE = "done"
    FAILED = "failed"


# -- wire helpers -----------------------------------------------------------------------------


class _Reader:
    """Reads fixed fields from one handshake message; ProtocolError when it is short or long."""

    __slots__ = ("_data", "_offset", "_what")

    def __init__(self, data: bytes, magic: bytes, what: str) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ProtocolError(f"{what} must be bytes")
        self._data = bytes(data)
        self._offset = 0
        self._what = what
        if self.take(len(magic)) != magic:
            raise ProtocolError(f"not a {what} message (handshake message out of turn?)")
        version = self.u8()
        if version != VERSION:
            raise ProtocolError(
                f"{what} of protocol version {version}; this side speaks {VERSION}: client and worker "
                "must run emberlink versions of the same protocol (upgrade the older side)"
            )

    @property
    def offset(self) -> int:
        return self._offset

    def take(self, n: int) -> bytes:
        end = self._offset + n
        if end > len(self._data):
            raise ProtocolError(f"truncated {self._what}")
        chunk = self._data[self._offset : end]
        self._offset = end
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        value: int = _U16.unpack(self.take(2))[0]
        return value

    def sized(self, allowed: Sequence[int]) -> bytes:
        n = self.u16()
        if n not in allowed:
            raise ProtocolError(
                f"{self._what}: field of {n} bytes where {' or '.join(map(str, allowed))} belong"
            )
        return self.take(n)

    def end(self) -> None:
        if self._offset != len(self._data):
            raise ProtocolError(f"{len(self._data) - self._offset} trailing bytes after {self._what}")


def _hkdf(ikm: bytes, salt: bytes, info: bytes) -> tuple[bytes, bytes]:
    out = HKDF(algorithm=hashes.SHA256(), length=64, salt=salt, info=info).derive(ikm)
    return out[:32], out[32:]


def _link_secret(ikm: bytes, th2: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=th2, info=_LINK_INFO).derive(ikm)


def _resume_secret(ikm: bytes, th2: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=th2, info=_RESUME_INFO).derive(ikm)


def _transcript(*parts: bytes) -> bytes:
    h = hashlib.sha256(_TRANSCRIPT_LABEL)
    for part in parts:
        h.update(part)
    return h.digest()


def _x25519(private: X25519PrivateKey, peer: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(peer))
    except ValueError as e:  # a low-order point gives an all-zero secret, which OpenSSL refuses
        raise AuthError("peer's X25519 key gives no shared secret") from e


def _open_sealed(key: bytes, sealed: bytes, aad: bytes, what: str) -> bytes:
    try:
        return AESGCM(key).decrypt(_ZERO_NONCE, sealed, aad)
    except InvalidTag as e:
        raise AuthError(f"{what} failed authentication") from e


def encode_limits(limits: Mapping[str, int]) -> bytes:
    for name, value in limits.items():
        if type(name) is not str or not 0 < len(name) <= MAX_LIMIT_NAME or type(value) is not int:
            raise ValueError(f"limits map short names to ints, got {name!r}: {value!r}")
    if len(limits) > MAX_LIMITS:
        raise ValueError(f"at most {MAX_LIMITS} limits")
    try:
        data: bytes = msgpack.packb(dict(limits))
    except OverflowError as e:
        raise ValueError(f"limit out of range: {e}") from e
    return data


def decode_limits(data: bytes) -> dict[str, int]:
    try:
        obj: Any = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_map_len=MAX_LIMITS,
            max_array_len=0,
            max_bin_len=0,
            max_ext_len=0,
        )
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError) as e:
        raise ProtocolError(f"malformed limits: {e}") from e
    if type(obj) is not dict:
        raise ProtocolError("limits must be a map")
    for name, value in obj.items():
        if type(name) is not str or not 0 < len(name) <= MAX_LIMIT_NAME or type(value) is not int:
            raise ProtocolError(f"limits map short names to ints, got {name!r:.80}: {value!r:.40}")
        if not -(1 << 63) <= value < (1 << 63):
            raise ProtocolError(f"limit {name} out of range")
    return obj


def _check_suites(suites: Sequence[Suite]) -> tuple[Suite, ...]:
    result = tuple(Suite(s) for s in suites)
    if not 0 < len(result) <= MAX_SUITES or len(set(result)) != len(result):
        raise ValueError(f"suites must be 1..{MAX_SUITES} distinct suites, got {suites!r}")
    return result


# -- client -----------------------------------------------------------------------------------


class ClientHandshake:
    """The client's side: `hello()`, then `receive_welcome(welcome)` -> (auth, channel, limits).

    `token_for`, if given, makes the Auth's token from th2 (a resume token proves itself over the
    new transcript: protocol/resume.py); it replaces `token`."""

    def __init__(
        self,
        identity: Identity,
        expected_node_id: str,
        rng: Rng,
        token: bytes | None = None,
        *,
        suites: Sequence[Suite] = DEFAULT_SUITES,
        token_for: Callable[[bytes], bytes] | None = None,
    ) -> None:
        if token is not None and len(token) > MAX_TOKEN:
            raise ValueError(f"a token is at most {MAX_TOKEN} bytes")
        self._identity = identity
        self._expected = public_from_node_id(expected_node_id)
        self._rng = rng
        self._token = bytes(token or b"")
        self._token_for = token_for
        self._suites = _check_suites(suites)
        self.state = ClientState.START
        self.link_secret = b""
        """The session's link secret (see the rules above) once receive_welcome has succeeded."""
        self.transcript = b""
        """th2, once receive_welcome has succeeded."""
        self.resume_secret = b""
        """This handshake's resume secret, once receive_welcome has succeeded."""
        self._hello = b""
        self._x25519: X25519PrivateKey | None = None
        self._mlkem: MLKEM768PrivateKey | None = None

    def hello(self) -> bytes:
        """The Hello message to send first."""
        if self.state is not ClientState.START:
            raise ProtocolError(f"hello() called in state {self.state.value}")
        self._x25519 = X25519PrivateKey.from_private_bytes(draw(self._rng, 32))
        ek = b""
        if _HYBRID & set(self._suites):
            self._mlkem = MLKEM768PrivateKey.from_seed_bytes(draw(self._rng, 64))
            ek = self._mlkem.public_key().public_bytes_raw()
        parts = [
            _HELLO,
            bytes([VERSION, len(self._suites)]),
            b"".join(_U16.pack(s) for s in self._suites),
            self._x25519.public_key().public_bytes_raw(),
            _U16.pack(len(ek)),
            ek,
            draw(self._rng, RANDOM_SIZE),
            self._expected,
        ]
        self._hello = b"".join(parts)
        self.state = ClientState.HELLO_SENT
        return self._hello

    def receive_welcome(self, welcome: bytes) -> tuple[bytes, Channel, dict[str, int]]:
        """Check the worker's Welcome; returns (Auth to send, the session's Channel, worker limits)."""
        if self.state is not ClientState.HELLO_SENT:
            raise ProtocolError(f"Welcome received in state {self.state.value}")
        try:
            result = self._receive_welcome(welcome)
        except BaseException:
            self.state = ClientState.FAILED
            raise
        self.state = ClientState.DONE
        return result

    def _receive_welcome(self, welcome: bytes) -> tuple[bytes, Channel, dict[str, int]]:
        r = _Reader(welcome, _WELCOME, "Welcome")
        suite_id = r.u16()
        worker_x25519 = r.take(X25519_SIZE)
        ct = r.sized((0, MLKEM_CT_SIZE))
        r.take(RANDOM_SIZE)
        worker_key = r.take(PUBLIC_KEY_SIZE)
        signed_end = r.offset
        signature = r.take(SIGNATURE_SIZE)
        sealed = r.sized(range(16, _MAX_SEALED + 1))
        r.end()
        welcome = bytes(welcome)

        if worker_key != self._expected:
            raise AuthError(
                f"expected worker {node_id_from_public(self._expected)}, "
                f"but {node_id_from_public(worker_key)} answered"
            )
        th1 = _transcript(self._hello, welcome[:signed_end])
        if not verify(worker_key, signature, _WORKER_SIG_LABEL + th1):
            raise AuthError("worker's handshake signature does not verify")
        if suite_id not in self._suites:
            raise ProtocolError(f"worker chose suite {suite_id}, which was not offered")
        hybrid = Suite(suite_id) in _HYBRID
        if (len(ct) == MLKEM_CT_SIZE) != hybrid:
            raise ProtocolError("ML-KEM ciphertext present for a classical suite or missing for a hybrid one")

        if self._x25519 is None:
            raise ProtocolError("no hello was sent")
        ikm = _x25519(self._x25519, worker_x25519)
        if hybrid:
            if self._mlkem is None:
                raise ProtocolError("hybrid suite chosen but no ML-KEM key was offered")
            try:
                ikm += self._mlkem.decapsulate(ct)
            except ValueError as e:
                raise ProtocolError("malformed ML-KEM ciphertext") from e
        welcome_key, auth_key = _hkdf(ikm, th1, _HANDSHAKE_INFO)
        plain = _open_sealed(welcome_key, sealed, welcome[: len(welcome) - len(sealed)], "Welcome")
        if len(plain) < SESSION_ID_SIZE:
            raise ProtocolError("Welcome carries no session id")
        session_id, limits = plain[:SESSION_ID_SIZE], decode_limits(plain[SESSION_ID_SIZE:])

        th2 = _transcript(self._hello, welcome)
        token = self._token if self._token_for is None else self._token_for(th2)
        if len(token) > MAX_TOKEN:
            raise ValueError(f"a token is at most {MAX_TOKEN} bytes")
        token_field = _U16.pack(len(token)) + token
        signature = self._identity.sign(_CLIENT_SIG_LABEL + th2 + token_field)
        auth_plain = self._identity.public_bytes + signature + token_field
        header = _AUTH + bytes([VERSION]) + _U16.pack(len(auth_plain) + 16)
        auth = header + AESGCM(auth_key).encrypt(_ZERO_NONCE, auth_plain, header)

        c2w, w2c = _hkdf(ikm, th2, _TRAFFIC_INFO)
        self.link_secret = _link_secret(ikm, th2)
        self.transcript, self.resume_secret = th2, _resume_secret(ikm, th2)
        self._x25519 = self._mlkem = None
        return auth, Channel(session_id, c2w, w2c, Role.CLIENT), limits


# -- worker -----------------------------------------------------------------------------------


class WorkerHandshake:
    """The worker's side: `receive_hello(hello)` -> welcome, then `receive_auth(auth)` -> (channel, client)."""

    def __init__(
        self,
        identity: Identity,
        allow: AllowPolicy,
        rng: Rng,
        limits: Mapping[str, int],
        *,
        suites: Sequence[Suite] = DEFAULT_SUITES,
        encapsulate: Encapsulate = _mlkem_encapsulate,
    ) -> None:
        self._identity = identity
        self._allow = allow
        self._rng = rng
        self._limits = encode_limits(limits)
        self._suites = _check_suites(suites)
        self._encapsulate = encapsulate
        self.state = WorkerState.START
        self.client_token: bytes | None = None
        """The client's token (empty if none) once receive_auth has succeeded."""
        self.link_secret = b""
        """The session's link secret (see the rules above) once receive_hello has succeeded."""
        self._th2 = b""
        self._auth_key = b""
        self._traffic = (b"", b"")
        self._resume = b""
        self.transcript = b""
        """th2, once receive_auth has succeeded."""
        self.resume_secret = b""
        """This handshake's resume secret, once receive_auth has succeeded."""
        self._session_id = b""

    def receive_hello(self, hello: bytes) -> bytes:
        """Answer a client's Hello; returns the Welcome to send."""
        if self.state is not WorkerState.START:
            raise ProtocolError(f"Hello received in state {self.state.value}")
        try:
            welcome = self._receive_hello(hello)
        except BaseException:
            self.state = WorkerState.FAILED
            raise
        self.state = WorkerState.WELCOME_SENT
        return welcome

    def _receive_hello(self, hello: bytes) -> bytes:
        r = _Reader(hello, _HELLO, "Hello")
        n = r.u8()
        if not 0 < n <= MAX_SUITES:
            raise ProtocolError(f"Hello offers {n} suites; 1..{MAX_SUITES} allowed")
        offered = [r.u16() for _ in range(n)]
        client_x25519 = r.take(X25519_SIZE)
        ek = r.sized((0, MLKEM_EK_SIZE))
        r.take(RANDOM_SIZE)
        target = r.take(PUBLIC_KEY_SIZE)
        r.end()
        hello = bytes(hello)

        if target != self._identity.public_bytes:
            raise AuthError(
                f"this worker is {self._identity.node_id}; the client asked for {node_id_from_public(target)}"
            )
        if len(set(offered)) != len(offered):
            raise ProtocolError("Hello offers a suite twice")
        offers_hybrid = any(s in offered for s in _HYBRID)
        if (len(ek) == MLKEM_EK_SIZE) != offers_hybrid:
            raise ProtocolError("ML-KEM key present without a hybrid suite or missing with one")
        suite = next((s for s in self._suites if s in offered), None)
        if suite is None:
            raise ProtocolError(
                f"no common suite: client offers {offered}, worker allows {list(map(int, self._suites))}"
            )

        x25519 = X25519PrivateKey.from_private_bytes(draw(self._rng, 32))
        ikm = _x25519(x25519, client_x25519)
        ct = b""
        if suite in _HYBRID:
            try:
                public = MLKEM768PublicKey.from_public_bytes(ek)
            except ValueError as e:
                raise ProtocolError("malformed ML-KEM encapsulation key") from e
            kem_secret, ct = self._encapsulate(public)
            ikm += kem_secret

        signed = b"".join(
            [
                _WELCOME,
                bytes([VERSION]),
                _U16.pack(suite),
                x25519.public_key().public_bytes_raw(),
                _U16.pack(len(ct)),
                ct,
                draw(self._rng, RANDOM_SIZE),
                self._identity.public_bytes,
            ]
        )
        th1 = _transcript(hello, signed)
        welcome_key, self._auth_key = _hkdf(ikm, th1, _HANDSHAKE_INFO)
        self._session_id = draw(self._rng, SESSION_ID_SIZE)
        plain = self._session_id + self._limits
        head = signed + self._identity.sign(_WORKER_SIG_LABEL + th1) + _U16.pack(len(plain) + 16)
        welcome = head + AESGCM(welcome_key).encrypt(_ZERO_NONCE, plain, head)

        self._th2 = _transcript(hello, welcome)
        self._traffic = _hkdf(ikm, self._th2, _TRAFFIC_INFO)
        self.link_secret = _link_secret(ikm, self._th2)
        self._resume = _resume_secret(ikm, self._th2)
        return welcome

    def receive_auth(self, auth: bytes) -> tuple[Channel, str]:
        """Check the client's Auth; returns (the session's Channel, the client's NodeId)."""
        if self.state is not WorkerState.WELCOME_SENT:
            raise ProtocolError(f"Auth received in state {self.state.value}")
        try:
            result = self._receive_auth(auth)
        except BaseException:
            self.state = WorkerState.FAILED
            raise
        self.state = WorkerState.DONE
        return result

    def _receive_auth(self, auth: bytes) -> tuple[Channel, str]:
        r = _Reader(auth, _AUTH, "Auth")
        sealed = r.sized(range(16 + PUBLIC_KEY_SIZE + SIGNATURE_SIZE + 2, _MAX_SEALED + 1))
        r.end()
        auth = bytes(auth)
        plain = _open_sealed(self._auth_key, sealed, auth[: len(auth) - len(sealed)], "Auth")

        client_key = plain[:PUBLIC_KEY_SIZE]
        signature = plain[PUBLIC_KEY_SIZE : PUBLIC_KEY_SIZE + SIGNATURE_SIZE]
        token_field = plain[PUBLIC_KEY_SIZE + SIGNATURE_SIZE :]
        (token_len,) = _U16.unpack(token_field[:2])
        if token_len != len(token_field) - 2 or token_len > MAX_TOKEN:
            raise ProtocolError("malformed token in Auth")
        client = node_id_from_public(client_key)
        if not verify(client_key, signature, _CLIENT_SIG_LABEL + self._th2 + token_field):
            raise AuthError(f"client {client}'s handshake signature does not verify")
        if not self._allow.admits(client):
            raise AuthError(f"client {client} is not on this worker's allow list")

        self.client_token = token_field[2:]
        c2w, w2c = self._traffic
        self.transcript, self.resume_secret = self._th2, self._resume
        self._auth_key = b""
        self._traffic = (b"", b"")
        self._resume = b""
        return Channel(self._session_id, w2c, c2w, Role.WORKER), client
