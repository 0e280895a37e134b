"""The handshake: known-answer vectors, both sides agreeing, and every attack refused."""

from __future__ import annotations

import copy
import hashlib
import json
import random
import struct
from collections.abc import Callable
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given, settings
from hypothesis import strategies as st

from emberlink.errors import AuthError, ProtocolError
from emberlink.protocol.channel import MESSAGE, Channel
from emberlink.protocol.handshake import (
    VERSION,
    ClientHandshake,
    ClientState,
    Suite,
    WorkerHandshake,
    WorkerState,
)
from emberlink.protocol.identity import AllowPolicy, Identity, Rng

from .make_vectors import PATH, run

CLIENT = Identity.from_seed(bytes([1]) * 32)
WORKER = Identity.from_seed(bytes([2]) * 32)
LIMITS = {"quota_bytes": 1 << 30}
BOTH = (Suite.X25519_MLKEM768_AES256GCM, Suite.X25519_AES256GCM)


def rng(seed: int) -> Rng:
    return random.Random(seed).randbytes


def client(seed: int = 1, **kwargs: Any) -> ClientHandshake:
    return ClientHandshake(CLIENT, WORKER.node_id, rng(seed), **kwargs)


def worker(
    seed: int = 2, allow: AllowPolicy | None = None, identity: Identity = WORKER, **kwargs: Any
) -> WorkerHandshake:
    return WorkerHandshake(identity, allow or AllowPolicy.of([CLIENT.node_id]), rng(seed), LIMITS, **kwargs)


def flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def handshake(c: ClientHandshake, w: WorkerHandshake) -> tuple[Channel, Channel, dict[str, int], str]:
    auth, client_channel, limits = c.receive_welcome(w.receive_hello(c.hello()))
    worker_channel, client_id = w.receive_auth(auth)
    return client_channel, worker_channel, limits, client_id


# -- known answers ----------------------------------------------------------------------------


def vector() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(PATH.read_text())
    return data


def test_vectors_reproduce_byte_for_byte() -> None:
    v = vector()
    assert run(v["inputs"]) == v["outputs"]


def test_vector_follows_the_documented_key_schedule() -> None:
    """Recompute the vector from the rules in handshake.py's docstring, without handshake.py."""
    v = vector()
    inputs, out = v["inputs"], v["outputs"]
    hello, welcome, auth = (bytes.fromhex(out[k]) for k in ("hello", "welcome", "auth"))
    client_x = X25519PrivateKey.from_private_bytes(bytes.fromhex(inputs["client_draws"][0]))
    assert hello[:8] == b"EMLH\x02\x01\x00\x01"  # version 2
    assert hello[8:40] == client_x.public_key().public_bytes_raw()
    assert hello[-32:] == Identity.from_seed(bytes.fromhex(inputs["worker_identity_seed"])).public_bytes
    assert welcome[:7] == b"EMLW\x02\x00\x01"
    worker_x = welcome[7:39]
    ct = welcome[41 : 41 + 1088]
    assert ct.hex() == inputs["kem_ciphertext"]
    signed_end = 41 + 1088 + 32 + 32
    worker_key = welcome[signed_end - 32 : signed_end]
    signature = welcome[signed_end : signed_end + 64]
    label = b"emberlink handshake v1\x00"
    th1 = hashlib.sha256(label + hello + welcome[:signed_end]).digest()
    Ed25519PublicKey.from_public_bytes(worker_key).verify(
        signature, b"emberlink v1 worker signature\x00" + th1
    )
    ikm = client_x.exchange(X25519PublicKey.from_public_bytes(worker_x)) + bytes.fromhex(
        inputs["kem_shared_secret"]
    )

    def hkdf(salt: bytes, info: bytes) -> bytes:
        return HKDF(algorithm=hashes.SHA256(), length=64, salt=salt, info=info).derive(ikm)

    hs = hkdf(th1, b"emberlink v1 handshake keys")
    sealed = welcome[signed_end + 66 :]
    plain = AESGCM(hs[:32]).decrypt(bytes(12), sealed, welcome[: signed_end + 66])
    assert plain[:8].hex() == out["session_id"]
    client_key = Identity.from_seed(bytes.fromhex(inputs["client_identity_seed"])).public_bytes
    assert AESGCM(hs[32:]).decrypt(bytes(12), auth[7:], auth[:7])[:32] == client_key
    th2 = hashlib.sha256(label + hello + welcome).digest()
    traffic = hkdf(th2, b"emberlink v1 traffic keys")
    c2w, w2c = traffic[:32], traffic[32:]
    session_id = bytes.fromhex(out["session_id"])
    message = bytes.fromhex(inputs["client_message"])
    header = struct.pack(">BB8sQI", 1, 1, session_id, 0, len(message) + 16)
    nonce = struct.pack(">IQ", 0x454D0001, 0)
    assert bytes.fromhex(out["client_frame"]) == header + AESGCM(c2w).encrypt(nonce, message, header)
    message = bytes.fromhex(inputs["worker_message"])
    header = struct.pack(">BB8sQI", 1, 1, session_id, 0, len(message) + 16)
    nonce = struct.pack(">IQ", 0x454D0002, 0)
    assert bytes.fromhex(out["worker_frame"]) == header + AESGCM(w2c).encrypt(nonce, message, header)


def test_both_sides_derive_the_same_keys() -> None:
    client_channel, worker_channel, limits, client_id = handshake(client(), worker())
    assert limits == LIMITS
    assert client_id == CLIENT.node_id
    assert client_channel.session_id == worker_channel.session_id
    assert worker_channel.open(client_channel.seal(b"ping")) == (MESSAGE, b"ping")
    assert client_channel.open(worker_channel.seal(b"pong")) == (MESSAGE, b"pong")


def test_both_sides_derive_the_same_link_secret_fresh_for_each_session() -> None:
    c, w = client(), worker()
    assert (c.link_secret, w.link_secret) == (b"", b"")
    welcome = w.receive_hello(c.hello())
    assert len(w.link_secret) == 32  # the worker knows it before the client has answered
    c.receive_welcome(welcome)
    assert c.link_secret == w.link_secret
    c2, w2 = client(seed=11), worker(seed=12)
    handshake(c2, w2)
    assert c2.link_secret == w2.link_secret != c.link_secret


def test_client_may_send_frames_together_with_auth() -> None:
    c, w = client(), worker()
    auth, client_channel, _ = c.receive_welcome(w.receive_hello(c.hello()))
    early = client_channel.seal(b"first batch")
    worker_channel, _ = w.receive_auth(auth)
    assert worker_channel.open(early) == (MESSAGE, b"first batch")


def test_token_reaches_the_worker() -> None:
    w = worker()
    handshake(client(token=b"secret"), w)
    assert w.client_token == b"secret"
    w = worker()
    handshake(client(), w)
    assert w.client_token == b""


def test_fresh_randomness_gives_fresh_sessions() -> None:
    a, _, _, _ = handshake(client(1), worker(2))
    b, _, _, _ = handshake(client(3), worker(4))
    assert a.session_id != b.session_id
    assert a.seal(b"x") != b.seal(b"x")


# -- attacks ----------------------------------------------------------------------------------


def test_every_flipped_bit_of_hello_is_refused() -> None:
    c = client()
    hello = c.hello()
    for bit in range(len(hello) * 8):
        try:
            welcome = worker().receive_hello(flip(hello, bit))
        except ProtocolError:
            continue
        # The worker could not tell (an ephemeral key or random changed): the client must.
        with pytest.raises(ProtocolError):
            copy.deepcopy(c).receive_welcome(welcome)


def test_every_flipped_bit_of_welcome_is_refused() -> None:
    c = client()
    welcome = worker().receive_hello(c.hello())
    for bit in range(len(welcome) * 8):
        with pytest.raises(ProtocolError):
            copy.deepcopy(c).receive_welcome(flip(welcome, bit))


def test_every_flipped_bit_of_auth_is_refused() -> None:
    c, w = client(), worker()
    auth, _, _ = c.receive_welcome(w.receive_hello(c.hello()))
    for bit in range(len(auth) * 8):
        with pytest.raises(ProtocolError):
            copy.deepcopy(w).receive_auth(flip(auth, bit))
    w.receive_auth(auth)


def test_worker_presenting_another_key_than_the_tickets_is_refused() -> None:
    impostor = Identity.from_seed(bytes([9]) * 32)
    c = client()
    hello = bytearray(c.hello())
    hello[-32:] = impostor.public_bytes  # the attacker re-aims the Hello at its own key
    welcome = worker(identity=impostor).receive_hello(bytes(hello))
    with pytest.raises(AuthError, match=impostor.node_id):
        c.receive_welcome(welcome)


def test_hello_aimed_at_another_worker_is_refused() -> None:
    c = ClientHandshake(CLIENT, Identity.from_seed(bytes([9]) * 32).node_id, rng(1))
    with pytest.raises(AuthError, match="asked for"):
        worker().receive_hello(c.hello())


def test_client_not_on_the_allow_list_is_refused_naming_it() -> None:
    someone_else = Identity.from_seed(bytes([7]) * 32).node_id
    c, w = client(), worker(allow=AllowPolicy.of([someone_else]))
    auth, _, _ = c.receive_welcome(w.receive_hello(c.hello()))
    with pytest.raises(AuthError, match=CLIENT.node_id):
        w.receive_auth(auth)
    assert w.state is WorkerState.FAILED


def test_allow_any_admits_an_unknown_client() -> None:
    _, _, _, client_id = handshake(client(), worker(allow=AllowPolicy.allow_any()))
    assert client_id == CLIENT.node_id


def test_downgrade_of_the_offered_suites_is_refused() -> None:
    c = client(suites=BOTH)
    hello = c.hello()
    assert hello[5:10] == b"\x02\x00\x01\x00\x02"
    # A man in the middle strips the hybrid suite and its ML-KEM key, so the worker picks X25519 only.
    ek_at = 10 + 32
    stripped = hello[:5] + b"\x01\x00\x02" + hello[10:ek_at] + b"\x00\x00" + hello[ek_at + 2 + 1184 :]
    welcome = worker(suites=BOTH).receive_hello(stripped)
    assert welcome[5:7] == b"\x00\x02"
    with pytest.raises(AuthError, match="signature"):
        c.receive_welcome(welcome)


def test_downgrade_of_the_chosen_suite_is_refused() -> None:
    c = client(suites=BOTH)
    welcome = bytearray(worker(suites=BOTH).receive_hello(c.hello()))
    welcome[5:7] = b"\x00\x02"
    with pytest.raises(ProtocolError):
        c.receive_welcome(bytes(welcome))


def test_reordered_offer_is_refused() -> None:
    c = client(suites=BOTH)
    hello = c.hello()
    swapped = hello[:6] + hello[8:10] + hello[6:8] + hello[10:]
    welcome = worker(suites=BOTH).receive_hello(swapped)
    with pytest.raises(AuthError):
        c.receive_welcome(welcome)


def test_classical_suite_works_only_when_both_sides_allow_it() -> None:
    classical = (Suite.X25519_AES256GCM,)
    client_channel, worker_channel, _, _ = handshake(client(suites=classical), worker(suites=BOTH))
    assert worker_channel.open(client_channel.seal(b"x")) == (MESSAGE, b"x")
    with pytest.raises(ProtocolError, match="no common suite"):
        worker().receive_hello(client(suites=classical).hello())


def test_hybrid_is_preferred_when_both_are_offered() -> None:
    c = client(suites=(Suite.X25519_AES256GCM, Suite.X25519_MLKEM768_AES256GCM))
    welcome = worker(suites=BOTH).receive_hello(c.hello())
    assert welcome[5:7] == b"\x00\x01"
    c.receive_welcome(welcome)


def test_welcome_replayed_into_a_new_handshake_is_refused() -> None:
    old = worker().receive_hello(client(1).hello())
    c = client(5)
    c.hello()
    with pytest.raises(AuthError):
        c.receive_welcome(old)


def test_auth_replayed_into_a_new_handshake_is_refused() -> None:
    c, w = client(), worker()
    auth, _, _ = c.receive_welcome(w.receive_hello(c.hello()))
    c2, w2 = client(5), worker(6)
    w2.receive_hello(c2.hello())
    with pytest.raises(AuthError):
        w2.receive_auth(auth)


def test_low_order_x25519_key_is_refused() -> None:
    hello = bytearray(client().hello())
    hello[8:40] = bytes(32)
    with pytest.raises(AuthError):
        worker().receive_hello(bytes(hello))


@pytest.mark.parametrize(
    "step",
    [
        "welcome before hello",
        "hello twice",
        "auth before hello",
        "hello after welcome",
        "hello fed to receive_auth",
        "welcome fed to receive_hello",
        "auth fed to receive_welcome",
        "hello fed to receive_welcome",
    ],
)
def test_handshake_message_out_of_turn_is_refused(step: str) -> None:
    c, w = client(), worker()
    actions: dict[str, Callable[[], object]] = {
        "welcome before hello": lambda: c.receive_welcome(worker().receive_hello(client().hello())),
        "hello twice": lambda: (c.hello(), c.hello()),
        "auth before hello": lambda: w.receive_auth(b"EMLA\x01"),
        "hello after welcome": lambda: (w.receive_hello(c.hello()), w.receive_hello(client(3).hello())),
        "hello fed to receive_auth": lambda: (w.receive_hello(hello := c.hello()), w.receive_auth(hello)),
        "welcome fed to receive_hello": lambda: w.receive_hello(worker().receive_hello(c.hello())),
        "auth fed to receive_welcome": lambda: c.receive_welcome(
            c.hello()[:0] + b"EMLA\x01\x00\x10" + bytes(16)
        ),
        "hello fed to receive_welcome": lambda: c.receive_welcome(c.hello()),
    }
    with pytest.raises(ProtocolError):
        actions[step]()


def test_failed_handshake_refuses_everything_after() -> None:
    c = client()
    c.hello()
    with pytest.raises(ProtocolError):
        c.receive_welcome(b"garbage")
    assert c.state is ClientState.FAILED
    with pytest.raises(ProtocolError):
        c.receive_welcome(worker().receive_hello(client().hello()))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000), st.sampled_from([b"", b"EMLH\x02", b"EMLW\x02", b"EMLA\x02", b"EMLH\x01"]))
def test_arbitrary_bytes_raise_only_protocol_error(data: bytes, prefix: bytes) -> None:
    message = prefix + data
    with pytest.raises(ProtocolError):
        worker().receive_hello(message)
    c = client()
    c.hello()
    with pytest.raises(ProtocolError):
        c.receive_welcome(message)
    w = worker()
    w.receive_hello(client().hello())
    with pytest.raises(ProtocolError):
        w.receive_auth(message)


def test_a_peer_of_another_protocol_version_is_refused_at_the_handshake_saying_so() -> None:
    """Client and worker of different protocol versions (the Repeat template rule changed at 2)
    stop at the first message, with both versions named, before any batch could be misread."""
    hello = bytearray(client().hello())
    hello[4] = VERSION - 1
    with pytest.raises(
        ProtocolError, match=rf"Hello of protocol version {VERSION - 1}; this side speaks {VERSION}"
    ):
        worker().receive_hello(bytes(hello))
    c = client()
    welcome = bytearray(worker().receive_hello(c.hello()))
    welcome[4] = VERSION + 1
    with pytest.raises(ProtocolError, match="upgrade the older side"):
        c.receive_welcome(bytes(welcome))
