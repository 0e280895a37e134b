"""Known-answer vectors for the handshake and frames: fixed keys and randomness in, exact bytes out.

Regenerate (only when the wire format changes on purpose):

    .venv/bin/python tests/protocol/make_vectors.py            # keeps the recorded ML-KEM encapsulation
    .venv/bin/python tests/protocol/make_vectors.py --new-kem  # draws a fresh one

`cryptography` offers no way to fix ML-KEM's encapsulation randomness, so the vector records one
real encapsulation (shared secret and ciphertext) as an input and the worker replays it through
WorkerHandshake's `encapsulate` parameter; the client decapsulates it for real.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.mlkem import MLKEM768PrivateKey, MLKEM768PublicKey

from emberlink.protocol.channel import MESSAGE
from emberlink.protocol.handshake import ClientHandshake, WorkerHandshake
from emberlink.protocol.identity import AllowPolicy, Identity

PATH = Path(__file__).parent / "vectors" / "handshake.json"


class ScriptedRng:
    """Hands out the given byte strings in order; a draw of another size is a test failure."""

    def __init__(self, draws: list[bytes]) -> None:
        self._draws = list(draws)

    def __call__(self, n: int) -> bytes:
        if not self._draws:
            raise AssertionError(f"unexpected draw of {n} bytes")
        data = self._draws.pop(0)
        if len(data) != n:
            raise AssertionError(f"draw of {n} bytes, script has {len(data)}")
        return data

    @property
    def exhausted(self) -> bool:
        return not self._draws


def fixed(byte: int, n: int) -> bytes:
    """n bytes counting up from byte (mod 256): recognisable in a hex dump."""
    return bytes((byte + i) % 256 for i in range(n))


def default_inputs() -> dict[str, Any]:
    client_mlkem_seed = fixed(0x40, 64)
    return {
        "client_identity_seed": fixed(0x01, 32).hex(),
        "worker_identity_seed": fixed(0x21, 32).hex(),
        "client_draws": [fixed(0x80, 32).hex(), client_mlkem_seed.hex(), fixed(0xA0, 32).hex()],
        "worker_draws": [fixed(0xC0, 32).hex(), fixed(0xE0, 32).hex(), fixed(0x10, 8).hex()],
        "limits": {"max_frame": 16777216, "quota_bytes": 1073741824},
        "token": b"vector-token".hex(),
        "client_message": b"first frame from the client".hex(),
        "worker_message": b"first frame from the worker".hex(),
        "client_bulk": fixed(0x33, 40).hex(),
    }


def replay_encapsulation(
    secret: bytes, ciphertext: bytes, expected_ek: bytes
) -> Callable[[MLKEM768PublicKey], tuple[bytes, bytes]]:
    def encapsulate(public: MLKEM768PublicKey) -> tuple[bytes, bytes]:
        if public.public_bytes_raw() != expected_ek:
            raise AssertionError("the Hello carries another ML-KEM key than the vector's")
        return secret, ciphertext

    return encapsulate


def run(inputs: dict[str, Any]) -> dict[str, str]:
    """Run both sides on the vector's inputs; returns every output as hex."""
    client_id = Identity.from_seed(bytes.fromhex(inputs["client_identity_seed"]))
    worker_id = Identity.from_seed(bytes.fromhex(inputs["worker_identity_seed"]))
    client_rng = ScriptedRng([bytes.fromhex(d) for d in inputs["client_draws"]])
    worker_rng = ScriptedRng([bytes.fromhex(d) for d in inputs["worker_draws"]])
    ek = (
        MLKEM768PrivateKey.from_seed_bytes(bytes.fromhex(inputs["client_draws"][1]))
        .public_key()
        .public_bytes_raw()
    )
    encapsulate = replay_encapsulation(
        bytes.fromhex(inputs["kem_shared_secret"]), bytes.fromhex(inputs["kem_ciphertext"]), ek
    )
    client = ClientHandshake(client_id, worker_id.node_id, client_rng, bytes.fromhex(inputs["token"]))
    worker = WorkerHandshake(
        worker_id, AllowPolicy.of([client_id.node_id]), worker_rng, inputs["limits"], encapsulate=encapsulate
    )
    hello = client.hello()
    welcome = worker.receive_hello(hello)
    auth, client_channel, limits = client.receive_welcome(welcome)
    worker_channel, client_node_id = worker.receive_auth(auth)
    if not (client_rng.exhausted and worker_rng.exhausted):
        raise AssertionError("a side drew less randomness than the vector gives it")
    if limits != inputs["limits"] or client_node_id != client_id.node_id:
        raise AssertionError("handshake outputs differ from its inputs")
    client_frame = client_channel.seal(bytes.fromhex(inputs["client_message"]), MESSAGE)
    client_bulk = b"".join(client_channel.seal_chunks(bytes.fromhex(inputs["client_bulk"]), chunk_size=16))
    worker_frame = worker_channel.seal(bytes.fromhex(inputs["worker_message"]), MESSAGE)
    return {
        "client_node_id": client_id.node_id,
        "worker_node_id": worker_id.node_id,
        "hello": hello.hex(),
        "welcome": welcome.hex(),
        "auth": auth.hex(),
        "session_id": client_channel.session_id.hex(),
        "client_frame": client_frame.hex(),
        "client_bulk_frames": client_bulk.hex(),
        "worker_frame": worker_frame.hex(),
    }


def main(argv: list[str]) -> int:
    previous: dict[str, Any] = json.loads(PATH.read_text()) if PATH.exists() else {}
    inputs = default_inputs()
    old_inputs = previous.get("inputs", {})
    if (
        "--new-kem" in argv
        or "kem_ciphertext" not in old_inputs
        or old_inputs["client_draws"][1] != inputs["client_draws"][1]
    ):
        ek = MLKEM768PrivateKey.from_seed_bytes(bytes.fromhex(inputs["client_draws"][1])).public_key()
        secret, ciphertext = ek.encapsulate()
        inputs["kem_shared_secret"], inputs["kem_ciphertext"] = secret.hex(), ciphertext.hex()
    else:
        inputs["kem_shared_secret"] = old_inputs["kem_shared_secret"]
        inputs["kem_ciphertext"] = old_inputs["kem_ciphertext"]
    vector = {
        "about": "emberlink handshake v1 and frames; see tests/protocol/make_vectors.py",
        "inputs": inputs,
        "outputs": run(inputs),
    }
    PATH.parent.mkdir(exist_ok=True)
    PATH.write_text(json.dumps(vector, indent=1) + "\n")
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
