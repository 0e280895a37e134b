"""Protocol benchmark: handshake, small frames, chunked bulk and the message codec against the bare
primitives; no network.

Run: .venv/bin/python bench/protocol.py [--quick] [--codec]   (--codec: only the message codec rows)
Prints one markdown table; every figure is a median over repeats, measured in this run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.mlkem import MLKEM768PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from emberlink.protocol import messages as m
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


def replayed_step(step: int) -> tuple[m.ClientMessage, ...]:
    """Step `step` of a small jitted training loop as the client builds it: one small inline
    upload, an Execute over it and the 18 parameters and moments the previous step made, with four
    bindings (F32 where the graph casts to float32), those 18 dropped, the loss read."""
    base = 1_000 + 20 * step
    state = tuple(range(base - 18, base))
    return (
        m.Upload(base, "float32", (8, 16), 8 * 16 * 4, True),
        m.Execute(bytes(range(16)), (base, *state), (m.F32.of(1e-3), m.F32.of(0.9), 0.999, step), base + 1),
        m.Drop(state),
        m.Read(10 + step, base + 1),
    )


def bench_codec(repeats: int) -> list[tuple[str, float, float]]:
    """Median seconds per call of the message codec on a replayed step, each against bare msgpack
    packing and unpacking the same wire objects: (what, emberlink, bare)."""
    previous, current = replayed_step(7), replayed_step(8)
    repeat = m.repeat_of(previous, current)
    assert repeat is not None and repeat.bindings is not None
    tail = bytes(8 * 16 * 4)
    full = m.encode_batch(m.Batch(9, current, 8)) + tail
    repeated = m.encode_batch(m.Batch(9, (repeat,), 8)) + tail
    reply = m.Reply(9, (m.Result(18, "float32", (), 4, True),))
    replied = m.encode_reply(reply) + bytes(4)
    full_wire = msgpack.unpackb(full[: -len(tail)])
    repeat_wire = msgpack.unpackb(repeated[: -len(tail)])
    reply_wire = msgpack.unpackb(replied[:-4])

    def bare(wire: object) -> Callable[[], object]:
        return lambda: msgpack.unpackb(msgpack.packb(wire))

    def full_step() -> object:
        batch, start = m.decode_batch_prefix(m.encode_batch(m.Batch(9, current, 8)) + tail)
        m.check_tail(batch, len(full) - start)
        return batch

    def client_repeat() -> object:
        return m.encode_batch(m.Batch(9, (m.repeat_of(previous, current) or repeat,), 8))

    def worker_repeat() -> object:
        batch, start = m.decode_batch_prefix(repeated)
        batch = m.expand_batch(batch, previous)
        m.check_tail(batch, len(repeated) - start)
        return batch

    def reply_trip() -> object:
        got, start = m.decode_reply_prefix(m.encode_reply(reply) + bytes(4))
        m.check_reply_tail(got, len(replied) - start)
        return got

    rows = []
    for what, ours, floor in (
        ("codec: full step batch, encode + decode_prefix + check_tail", full_step, bare(full_wire)),
        ("codec: replayed step, client (repeat_of + encode_batch)", client_repeat, bare(repeat_wire)),
        (
            "codec: replayed step, worker (decode_prefix + expand + check_tail)",
            worker_repeat,
            bare(repeat_wire),
        ),
        ("codec: Reply of one inline Result, encode + decode_prefix", reply_trip, bare(reply_wire)),
    ):
        rows.append((what, *paired_medians(ours, floor, 2000, repeats)))
    return rows


def codec_rows(repeats: int) -> list[tuple[str, ...]]:
    return [
        (
            what,
            f"{ours * 1e6:.2f} µs",
            f"{bare * 1e6:.2f} µs (msgpack packb + unpackb)",
            f"{ours / bare:.2f}x time",
            "-",
            "-",
        )
        for what, ours, bare in bench_codec(repeats)
    ]


def print_table(rows: list[tuple[str, ...]]) -> None:
    header = ("measurement", "emberlink", "bare", "ratio", "goal", "met")
    print(f"| {' | '.join(header)} |")
    print(f"|{'|'.join('---' for _ in header)}|")
    for row in rows:
        print(f"| {' | '.join(row)} |")


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    handshakes = 40 if quick else 200
    repeats = 3 if quick else 9
    if "--codec" in argv:
        print_table(codec_rows(repeats * 3))
        print(f"\nmedians of {repeats * 3} repeats of 2000 calls", file=sys.stderr)
        return 0
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
        *codec_rows(repeats),
    ]
    print_table(rows)
    print(
        f"\nmedians: {handshakes} handshakes; {repeats} repeats of 5000 small frames and of the bulk transfer",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
