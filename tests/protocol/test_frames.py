"""Sealed frames: counters, sessions, rekeying, chunked bulk, framing of blobs."""

from __future__ import annotations

import struct

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from emberlink.errors import AuthError, ProtocolError
from emberlink.protocol.channel import (
    BULK,
    HEADER_SIZE,
    MAX_PLAINTEXT,
    MESSAGE,
    OVERHEAD,
    SMALL_FRAME,
    TAG_SIZE,
    Channel,
    Kind,
    pack_frames,
    rekey,
    split_frames,
)

SID = bytes.fromhex("0102030405060708")
K_C2W = bytes(range(32))
K_W2C = bytes(range(32, 64))


def pair(**limits: int) -> tuple[Channel, Channel]:
    return Channel.pair(SID, K_C2W, K_W2C, **limits)


def test_frame_round_trips_both_ways() -> None:
    client, worker = pair()
    assert worker.open(client.seal(b"to worker")) == (MESSAGE, b"to worker")
    assert client.open(worker.seal(b"to client", BULK)) == (BULK, b"to client")


def test_frame_bytes_are_header_then_aes_gcm_with_counter_nonce() -> None:
    client, _ = pair()
    client.seal(b"first")
    frame = client.seal(b"hello")
    header = struct.pack(">BB8sQI", 1, 1, SID, 1, 5 + TAG_SIZE)
    nonce = struct.pack(">IQ", 0x454D0001, 1)
    assert frame == header + AESGCM(K_C2W).encrypt(nonce, b"hello", header)
    assert len(frame) == 5 + OVERHEAD


@pytest.mark.parametrize("size", [0, 100, SMALL_FRAME - 1, SMALL_FRAME, 3 * SMALL_FRAME])
def test_a_frame_of_parts_is_the_frame_of_the_joined_parts(size: int) -> None:
    """seal_parts seals small frames one way and large ones another; the bytes are the same."""
    parts: list[bytes | memoryview] = [b"head", memoryview(bytes(range(256)) * (size // 256 + 1))[:size]]
    joined = b"".join(parts)
    one, _ = pair()
    other, worker = pair()
    frame = other.seal_parts(parts)
    assert frame == one.seal(joined)
    assert worker.open(frame) == (MESSAGE, joined)


def test_empty_plaintext_is_a_valid_frame() -> None:
    client, worker = pair()
    assert worker.open(client.seal(b"")) == (MESSAGE, b"")


def test_replayed_frame_is_refused() -> None:
    client, worker = pair()
    frame = client.seal(b"once")
    worker.open(frame)
    with pytest.raises(AuthError, match="replayed"):
        worker.open(frame)


def test_reordered_frames_are_refused() -> None:
    client, worker = pair()
    first, second = client.seal(b"1"), client.seal(b"2")
    with pytest.raises(AuthError):
        worker.open(second)
    assert worker.open(first) == (MESSAGE, b"1")
    assert worker.open(second) == (MESSAGE, b"2")


def test_dropped_frame_is_refused() -> None:
    client, worker = pair()
    client.seal(b"lost")
    with pytest.raises(AuthError, match="dropped"):
        worker.open(client.seal(b"next"))


def test_frame_echoed_back_to_its_sender_is_refused() -> None:
    client, _ = pair()
    with pytest.raises(AuthError):
        client.open(client.seal(b"mirror"))


def test_frame_for_another_session_is_refused() -> None:
    client, _ = pair()
    _, other_worker = Channel.pair(b"\xff" * 8, K_C2W, K_W2C)
    with pytest.raises(AuthError, match="another session"):
        other_worker.open(client.seal(b"x"))


def test_frame_from_another_session_with_its_id_rewritten_is_refused() -> None:
    client, _ = Channel.pair(b"\xff" * 8, bytes(32), bytes(32))
    _, worker = pair()
    frame = bytearray(client.seal(b"x"))
    frame[2:10] = SID
    with pytest.raises(AuthError):
        worker.open(bytes(frame))


def test_every_flipped_bit_of_a_sealed_frame_is_refused() -> None:
    client, worker = pair()
    frame = client.seal(b"a small message of forty bytes or so....")
    for i in range(len(frame) * 8):
        bad = bytearray(frame)
        bad[i // 8] ^= 1 << (i % 8)
        with pytest.raises(ProtocolError):  # AuthError is a ProtocolError
            worker.open(bytes(bad))
    assert worker.open(frame)[1].startswith(b"a small")  # refusals changed nothing


def test_refused_frame_leaves_channel_unchanged() -> None:
    client, worker = pair()
    frame = bytearray(client.seal(b"x"))
    frame[-1] ^= 1
    with pytest.raises(AuthError):
        worker.open(bytes(frame))
    frame[-1] ^= 1
    assert worker.open(bytes(frame)) == (MESSAGE, b"x")


def test_rekey_happens_at_the_frame_limit_on_both_sides() -> None:
    client, worker = pair(rekey_frames=3)
    frames = [client.seal(bytes([i])) for i in range(7)]
    assert [worker.open(f)[1] for f in frames] == [bytes([i]) for i in range(7)]
    # Frames 0..2 under the first key, 3..5 under the second, 6 under the third.
    header = struct.pack(">BB8sQI", 1, 1, SID, 6, 1 + TAG_SIZE)
    nonce = struct.pack(">IQ", 0x454D0001, 6)
    assert frames[6] == header + AESGCM(rekey(rekey(K_C2W))).encrypt(nonce, bytes([6]), header)


def test_rekey_happens_before_the_byte_limit() -> None:
    client, worker = pair(rekey_bytes=10)
    frames = [client.seal(b"abcd") for _ in range(3)]  # 4 + 4 fit; the third starts a new key
    for f in frames:
        worker.open(f)
    header = struct.pack(">BB8sQI", 1, 1, SID, 2, 4 + TAG_SIZE)
    nonce = struct.pack(">IQ", 0x454D0001, 2)
    assert frames[2] == header + AESGCM(rekey(K_C2W)).encrypt(nonce, b"abcd", header)


def test_frame_sealed_under_a_stale_key_after_rekey_is_refused() -> None:
    client, worker = pair(rekey_frames=1)
    worker.open(client.seal(b"0"))
    stale_client, _ = pair()
    stale_client.seal(b"0")
    with pytest.raises(AuthError):
        worker.open(stale_client.seal(b"1"))


def test_chunks_reassemble_into_a_preallocated_buffer() -> None:
    client, worker = pair(rekey_frames=2)
    data = bytes(range(256)) * 41  # 10,496 bytes: 10 full chunks and a short one
    frames = list(client.seal_chunks(data, chunk_size=1024))
    assert len(frames) == 11
    out = bytearray(len(data))
    view = memoryview(out)
    offset = 0
    for frame in split_frames(b"".join(frames)):
        kind, n = worker.open_into(frame, view[offset:])
        assert kind is BULK
        offset += n
    assert offset == len(data) and bytes(out) == data


def test_chunks_accept_any_contiguous_buffer() -> None:
    np = pytest.importorskip("numpy")
    client, worker = pair()
    array = np.arange(1000, dtype=np.float32)
    out = np.empty_like(array)
    offset = 0
    for frame in client.seal_chunks(array, chunk_size=1000):
        offset += worker.open_into(frame, memoryview(out).cast("B")[offset:])[1]
    assert (out == array).all()


def test_chunk_frames_and_message_frames_share_one_counter() -> None:
    client, worker = pair()
    sequence: list[bytes | bytearray] = [
        client.seal(b"head"),
        *client.seal_chunks(b"x" * 10, chunk_size=4),
        client.seal(b"tail"),
    ]
    assert [worker.open(f) for f in sequence] == [
        (MESSAGE, b"head"),
        (BULK, b"xxxx"),
        (BULK, b"xxxx"),
        (BULK, b"xx"),
        (MESSAGE, b"tail"),
    ]


def test_open_into_refuses_a_frame_larger_than_the_buffer() -> None:
    client, worker = pair()
    with pytest.raises(ProtocolError):
        worker.open_into(client.seal(b"12345", BULK), memoryview(bytearray(4)))


def test_split_frames_finds_every_frame_in_a_blob() -> None:
    client, worker = pair()
    frames = [client.seal(bytes([i]) * i) for i in range(5)]
    parts = split_frames(b"".join(frames))
    assert [bytes(p) for p in parts] == frames
    assert [worker.open(p)[1] for p in parts] == [bytes([i]) * i for i in range(5)]
    assert split_frames(b"") == []


def test_truncated_blob_is_refused() -> None:
    client, _ = pair()
    blob = client.seal(b"abc") + client.seal(b"def")
    for cut in range(1, len(blob)):
        if cut == len(blob) // 2:
            continue  # a whole first frame is a valid blob
        with pytest.raises(ProtocolError):
            split_frames(blob[:cut])


def test_header_claiming_four_gibibytes_is_refused_without_allocating() -> None:
    header = struct.pack(">BB8sQI", 1, 1, SID, 0, 0xFFFFFFFF)
    with pytest.raises(ProtocolError, match="length"):
        split_frames(header + b"x" * 100)
    _, worker = pair()
    with pytest.raises(ProtocolError):
        worker.open(header + b"x" * 100)


def test_unknown_version_and_kind_are_refused() -> None:
    client, worker = pair()
    frame = bytearray(client.seal(b"x"))
    for index, value in ((0, 2), (1, 3), (1, 0)):
        bad = bytearray(frame)
        bad[index] = value
        with pytest.raises(ProtocolError):
            worker.open(bytes(bad))
    assert Kind(frame[1]) is MESSAGE


def test_plaintext_over_the_limit_is_refused_when_sealing() -> None:
    client, _ = pair()
    with pytest.raises(ProtocolError):
        client.seal(bytes(MAX_PLAINTEXT + 1))


def test_a_large_frame_over_the_limit_is_refused_when_sealing_and_changes_nothing() -> None:
    client, worker = pair()
    with pytest.raises(ProtocolError, match="at most"):
        client.seal_parts([bytes(MAX_PLAINTEXT), b"x"])  # (sealed into a fresh buffer: _seal_new)
    assert worker.open(client.seal(b"next")) == (MESSAGE, b"next")  # still frame 0


def test_no_frame_is_sealed_past_the_last_counter_chunked_or_large() -> None:
    client, _ = pair()
    client._send.counter = (1 << 64) - 1
    with pytest.raises(ProtocolError, match="exhausted"):
        next(client.seal_chunks(bytes(100), 64))
    with pytest.raises(ProtocolError, match="exhausted"):
        client.seal_parts([bytes(SMALL_FRAME), b"x"])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_refused_with_protocol_error_only(blob: bytes) -> None:
    _, worker = pair()
    try:
        frames = split_frames(blob)
    except ProtocolError:
        frames = [memoryview(blob)]
    for frame in frames:
        with pytest.raises(ProtocolError):
            worker.open(frame)
        with pytest.raises(ProtocolError):
            worker.open_into(frame, memoryview(bytearray(256)))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=64), st.sampled_from([MESSAGE, BULK])), max_size=20))
def test_any_sequence_of_frames_round_trips_in_order(items: list[tuple[bytes, Kind]]) -> None:
    client, worker = pair(rekey_frames=4, rekey_bytes=100)
    blob = b"".join(client.seal(data, kind) for data, kind in items)
    assert [worker.open(f) for f in split_frames(blob)] == [(kind, data) for data, kind in items]


def test_header_size_is_small() -> None:
    assert HEADER_SIZE == 22
    assert OVERHEAD == 38


@given(sizes=st.lists(st.integers(0, 3000), max_size=30), target=st.integers(1, 8000))
@settings(max_examples=60, deadline=None)
def test_packed_frames_split_back_into_the_same_frames_in_order(sizes: list[int], target: int) -> None:
    client, worker = pair()
    frames = [client.seal(bytes([i % 251]) * n, BULK if i % 2 else MESSAGE) for i, n in enumerate(sizes)]
    blobs = list(pack_frames(iter(frames), target))
    assert all(type(b) is bytes for b in blobs)
    assert all(len(b) <= target or len(split_frames(b)) == 1 for b in blobs)
    opened = [worker.open(f) for b in blobs for f in split_frames(b)]
    assert opened == [(Kind(BULK if i % 2 else MESSAGE), bytes([i % 251]) * n) for i, n in enumerate(sizes)]


def test_bulk_frames_fill_their_target_in_order_or_are_discarded_in_step() -> None:
    client, worker = pair()
    data = bytes(range(256)) * 40
    frames = list(client.seal_chunks(data, chunk_size=4000))
    target = bytearray(len(data))
    remaining = len(data)
    for frame in frames[:-1]:
        remaining -= worker.open_bulk(frame, memoryview(target), remaining, "upload")
    with pytest.raises(ProtocolError, match="remain of the upload"):
        worker.open_bulk(frames[-1], memoryview(target), remaining - 1, "upload")
    remaining -= worker.open_bulk(frames[-1], memoryview(target), remaining, "upload")
    assert remaining == 0 and bytes(target) == data
    # A refused transfer is still opened (into scratch), so the next frame authenticates.
    assert worker.open_bulk(client.seal(b"x" * 10, BULK), None, 10, "upload") == 10
    assert worker.open(client.seal(b"after", MESSAGE)) == (Kind(MESSAGE), b"after")
