"""Resume credentials: both ends derive the same one from the handshake, a token proves itself for one
handshake only, and the chain moves on with every resume."""

from __future__ import annotations

import random
from typing import Any

import pytest

from emberlink.errors import ProtocolError
from emberlink.protocol.handshake import ClientHandshake, WorkerHandshake
from emberlink.protocol.identity import AllowPolicy, Identity, Rng
from emberlink.protocol.resume import TOKEN_SIZE, Credential, ResumeRequest, is_token, parse_token

CLIENT = Identity.from_seed(bytes([1]) * 32)
WORKER = Identity.from_seed(bytes([2]) * 32)
SECRET = bytes(range(32))
TH2 = bytes(range(100, 132))


def rng(seed: int) -> Rng:
    return random.Random(seed).randbytes


def handshake(seed: int, **client_options: Any) -> tuple[ClientHandshake, WorkerHandshake]:
    """A completed handshake: (client side, worker side)."""
    client = ClientHandshake(CLIENT, WORKER.node_id, rng(seed), **client_options)
    worker = WorkerHandshake(WORKER, AllowPolicy.of([CLIENT.node_id]), rng(seed + 1000), {"x": 1})
    auth, _, _ = client.receive_welcome(worker.receive_hello(client.hello()))
    worker.receive_auth(auth)
    return client, worker


def test_both_ends_of_a_handshake_hold_the_same_resume_secret_and_transcript() -> None:
    client, worker = handshake(1)
    assert len(client.resume_secret) == 32
    assert client.resume_secret == worker.resume_secret
    assert client.transcript == worker.transcript and len(client.transcript) == 32


def test_every_handshake_gives_a_fresh_resume_secret() -> None:
    first, _ = handshake(1)
    second, _ = handshake(2)
    assert first.resume_secret != second.resume_secret
    assert first.transcript != second.transcript


def test_the_token_is_made_from_the_new_transcript_and_reaches_the_worker_signed() -> None:
    credential = Credential(SECRET)
    _, worker = handshake(3, token_for=lambda th2: credential.token(th2, 7))
    token = worker.client_token
    assert token is not None and is_token(token) and len(token) == TOKEN_SIZE
    request = parse_token(token)
    assert request.received == 7 and request.id == credential.id
    assert credential.proves(request, worker.transcript)


def test_a_token_proves_itself_for_its_own_handshake_only() -> None:
    credential = Credential(SECRET)
    request = parse_token(credential.token(TH2, 3))
    assert credential.proves(request, TH2)
    assert not credential.proves(request, bytes(32))  # replayed into another handshake


def test_a_token_made_without_the_secret_or_altered_does_not_verify() -> None:
    credential = Credential(SECRET)
    assert not credential.proves(parse_token(Credential(bytes(32)).token(TH2, 0)), TH2)
    real = parse_token(credential.token(TH2, 0))
    assert credential.proves(real, TH2)
    assert not credential.proves(ResumeRequest(real.counter, real.id, 1, real.mac), TH2)  # received
    assert not credential.proves(ResumeRequest(real.counter + 1, real.id, 0, real.mac), TH2)  # counter


def test_the_credential_chain_moves_on_with_each_resume_and_both_ends_agree() -> None:
    start = Credential(SECRET)
    handshake_secret = bytes(range(200, 232))
    client_next, worker_next = start.after(handshake_secret), start.after(handshake_secret)
    assert client_next.secret == worker_next.secret and client_next.counter == 1
    assert client_next.id != start.id
    # The old credential proves nothing for the new one: it is used up.
    assert not client_next.proves(parse_token(start.token(TH2, 0)), TH2)
    # The next step depends on the new handshake too.
    assert start.after(bytes(32)).secret != client_next.secret


def test_a_known_credential_gives_known_bytes() -> None:
    credential = Credential(SECRET)
    assert credential.id.hex() == KNOWN_ID
    assert credential.token(TH2, 5).hex() == KNOWN_TOKEN
    assert credential.after(bytes(range(32, 64))).secret.hex() == KNOWN_NEXT


@pytest.mark.parametrize(
    ("what", "token"),
    [
        ("short", b"EMLR" + bytes(10)),
        ("long", Credential(SECRET).token(TH2, 0) + b"\x00"),
        ("wrong version", b"EMLR\x02" + Credential(SECRET).token(TH2, 0)[5:]),
        ("received out of range", Credential(SECRET).token(TH2, 0)[:29] + b"\xff" * 8 + bytes(32)),
    ],
)
def test_a_malformed_token_is_refused(what: str, token: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_token(token)


def test_tokens_that_open_new_sessions_are_not_resume_tokens() -> None:
    assert not is_token(b"")
    assert not is_token(b"some application token")


KNOWN_ID = "c90d9550f5b6734c96b3069489da13e4"
KNOWN_TOKEN = "454d4c520100000000c90d9550f5b6734c96b3069489da13e40000000000000005fdc30858cbeb194d0aa4d00f89cafd5db658d1db64b09492e7b179b3500eb0f6"
KNOWN_NEXT = "259a1fa5bc971d7c844fdc23241a73f74c9540cfd979eb8a0a59e5a985d091ed"
