"""Protocol benchmark: handshake, small frames and chunked bulk against the bare primitives; no network.

Run: .venv/bin/python bench/protocol.py [--quick]
Prints one markdown table; every figure is a median over repeats, measured in this run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.mlkem import MLKEM768PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from emberlink.protocol.channel import HEADER_SIZE, TAG_SIZE, Channel
from emberlink.protocol.handshake import ClientHandshake, WorkerHandshake
from emberlink.protocol.identity import AllowPolicy, Identity

MiB = 1024 * 1024


def paired_medians(
    ours: Callable[[], object], bare: Callable[[], object], inner: int, repeats: int
) -> tuple[float, float]:
    """Median seconds per call of ours and of bare, their repeats interleaved so both see the same load."""
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((ours, samples[0]), (bare, samples[1])):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - start) / inner)
    return statistics.median(samples[0]), statistics.median(samples[1])


def bench_handshake(repeats: int) -> tuple[float, float, float, float]:
    """Median seconds per handshake: (client side, worker side, client floor, worker floor).

    The floor is the public-key work each side cannot avoid, timed bare; every repeat times the
    handshake and both floors back to back, so all four medians see the same machine load.
    """
    client_id, worker_id = Identity.generate(os.urandom), Identity.generate(os.urandom)
    allow = AllowPolicy.of([client_id.node_id])
    signer = Ed25519PrivateKey.generate()
    signature = signer.sign(b"x" * 32)
    peer_x = X25519PrivateKey.generate().public_key()
    kem = MLKEM768PrivateKey.generate()
    _, ct = kem.public_key().encapsulate()
    ek = kem.public_key()

    def client_floor() -> None:
        X25519PrivateKey.generate().exchange(peer_x)
        MLKEM768PrivateKey.generate().decapsulate(ct)
        signer.public_key().verify(signature, b"x" * 32)
        signer.sign(b"x" * 32)

    def worker_floor() -> None:
        X25519PrivateKey.generate().exchange(peer_x)
        ek.encapsulate()
        signer.sign(b"x" * 32)
        signer.public_key().verify(signature, b"x" * 32)

    samples: list[list[float]] = [[], [], [], []]
    for _ in range(repeats):
        client = ClientHandshake(client_id, worker_id.node_id, os.urandom)
        worker = WorkerHandshake(worker_id, allow, os.urandom, {"quota_bytes": 1 << 30})
        t0 = time.perf_counter()
        hello = client.hello()
        t1 = time.perf_counter()
        welcome = worker.receive_hello(hello)
        t2 = time.perf_counter()
        auth, _, _ = client.receive_welcome(welcome)
        t3 = time.perf_counter()
        worker.receive_auth(auth)
        t4 = time.perf_counter()
        client_floor()
        t5 = time.perf_counter()
        worker_floor()
        t6 = time.perf_counter()
        for i, seconds in enumerate(((t1 - t0) + (t3 - t2), (t2 - t1) + (t4 - t3), t5 - t4, t6 - t5)):
            samples[i].append(seconds)
    client_hs, worker_hs, client_fl, worker_fl = (statistics.median(s) for s in samples)
    return client_hs, worker_hs, client_fl, worker_fl


def bench_small_frame(repeats: int) -> tuple[float, float]:
    """Median seconds of seal+open of a 100-byte frame: (emberlink, bare AES-GCM encrypt+decrypt)."""
    client, worker = Channel.pair(os.urandom(8), os.urandom(32), os.urandom(32))
    payload = os.urandom(100)

    def ours() -> None:
        worker.open(client.seal(payload))

    aead = AESGCM(os.urandom(32))
    nonce, aad = os.urandom(12), os.urandom(HEADER_SIZE)

    def bare() -> None:
        aead.decrypt(nonce, aead.encrypt(nonce, payload, aad), aad)

    return paired_medians(ours, bare, 5000, repeats)


def bench_bulk(total: int, chunk: int, repeats: int) -> tuple[float, float]:
    """Median seconds to seal and open `total` bytes in `chunk`-sized frames: (emberlink, bare)."""
    data = os.urandom(total)
    out = bytearray(total)
    out_view = memoryview(out)

    def ours() -> None:
        client, worker = Channel.pair(b"\x00" * 8, b"\x01" * 32, b"\x02" * 32)
        offset = 0
        for frame in client.seal_chunks(data, chunk):
            offset += worker.open_into(frame, out_view[offset:])[1]

    aead = AESGCM(os.urandom(32))
    nonce, aad = os.urandom(12), os.urandom(HEADER_SIZE)
    sealed = bytearray(chunk + TAG_SIZE)
    sealed_view = memoryview(sealed)
    data_view = memoryview(data)

    def bare() -> None:
        for offset in range(0, total, chunk):
            n = min(chunk, total - offset)
            aead.encrypt_into(nonce, data_view[offset : offset + n], aad, sealed_view[: n + TAG_SIZE])
            aead.decrypt_into(nonce, sealed_view[: n + TAG_SIZE], aad, out_view[offset : offset + n])

    ours()  # warm the allocator
    return paired_medians(ours, bare, 1, repeats)


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    handshakes = 40 if quick else 200
    repeats = 3 if quick else 9
    total = 16 * MiB if quick else 64 * MiB

    client_hs, worker_hs, client_floor, worker_floor = bench_handshake(handshakes)
    small_ours, small_bare = bench_small_frame(repeats)
    bulk_ours, bulk_bare = bench_bulk(total, MiB, repeats)
    gbps_ours, gbps_bare = total / bulk_ours / 1e9, total / bulk_bare / 1e9

    rows = [
        (
            "handshake, client side (hello + receive_welcome)",
            f"{client_hs * 1e6:.0f} µs",
            f"{client_floor * 1e6:.0f} µs (its public-key ops)",
            f"{client_hs / client_floor:.2f}x time",
            "close to the floor",
            "-",
        ),
        (
            "handshake, worker side (receive_hello + receive_auth)",
            f"{worker_hs * 1e6:.0f} µs",
            f"{worker_floor * 1e6:.0f} µs (its public-key ops)",
            f"{worker_hs / worker_floor:.2f}x time",
            "close to the floor",
            "-",
        ),
        (
            "seal + open, 100-byte frame",
            f"{small_ours * 1e6:.2f} µs",
            f"{small_bare * 1e6:.2f} µs (AESGCM encrypt + decrypt)",
            f"{small_ours / small_bare:.2f}x time",
            "< 10 µs",
            "yes" if small_ours < 10e-6 else "NO",
        ),
        (
            f"seal + open, {total // MiB} MiB in 1 MiB chunks",
            f"{gbps_ours:.2f} GB/s",
            f"{gbps_bare:.2f} GB/s (encrypt_into + decrypt_into)",
            f"{gbps_ours / gbps_bare:.2f}x throughput",
            ">= 0.8x",
            "yes" if gbps_ours >= 0.8 * gbps_bare else "NO",
        ),
    ]
    header = ("measurement", "emberlink", "bare", "ratio", "goal", "met")
    print(f"| {' | '.join(header)} |")
    print(f"|{'|'.join('---' for _ in header)}|")
    for row in rows:
        print(f"| {' | '.join(row)} |")
    print(
        f"\nmedians: {handshakes} handshakes; {repeats} repeats of 5000 small frames and of the bulk transfer",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
