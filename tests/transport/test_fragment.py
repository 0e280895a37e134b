"""Fragment numbering and reassembly, without any relay."""

from __future__ import annotations

import os

import pytest

from emberlink.transport.fragment import HEADER, TAGGED_HEADER, Fragmenter, FragmentError, Kind, Reassembler


def roundtrip(blobs: list[bytes], max_payload: int) -> list[bytes | memoryview]:
    out, back = Fragmenter(), Reassembler(limit=1 << 24)
    got: list[bytes | memoryview] = []
    for blob in blobs:
        for message in out.fragments(blob, max_payload):
            assert len(message) <= max_payload
            fed = back.feed(message)
            assert fed is not None  # an open link drops nothing: it fails instead
            _kind, whole = fed
            if whole is not None:
                got.append(whole)
    return got


@pytest.mark.parametrize("max_payload", [HEADER.size + 1, 64, 1000, 1 << 20])
def test_blobs_of_any_size_reassemble_exactly(max_payload: int) -> None:
    blobs = [
        b"",
        b"x",
        os.urandom(max_payload - HEADER.size),
        os.urandom(max_payload),
        os.urandom(3 * max_payload + 7),
    ]
    assert roundtrip(blobs, max_payload) == blobs


def test_a_lost_message_is_detected() -> None:
    out, back = Fragmenter(), Reassembler(limit=1 << 20)
    messages = list(out.fragments(os.urandom(300), 100))
    back.feed(messages[0])
    with pytest.raises(FragmentError, match="lost"):
        back.feed(messages[2])


def test_heartbeats_and_close_count_in_the_sequence() -> None:
    out, back = Fragmenter(), Reassembler(limit=1 << 20)
    assert back.feed(out.control(Kind.BEAT)) == (Kind.BEAT, None)
    assert back.feed(next(out.fragments(b"hi", 100))) == (Kind.LAST, b"hi")
    assert back.feed(out.control(Kind.CLOSE)) == (Kind.CLOSE, None)


def test_a_blob_past_the_limit_is_refused() -> None:
    out, back = Fragmenter(), Reassembler(limit=250)
    with pytest.raises(FragmentError, match="past"):
        for message in out.fragments(os.urandom(300), 100):
            back.feed(message)


@pytest.mark.parametrize("message", [b"", b"\x01\x00", bytes([9, 0, 0, 0, 0])])
def test_malformed_messages_are_refused(message: bytes) -> None:
    with pytest.raises(FragmentError):
        Reassembler(limit=100).feed(message)


def test_sequence_numbers_wrap_around() -> None:
    out, back = Fragmenter(), Reassembler(limit=100)
    out._count = back._count = 0xFFFFFFFF
    for _ in range(3):
        assert back.feed(next(out.fragments(b"a", 50))) == (Kind.LAST, b"a")


# -- tagged messages: only those tagged under the session's key count ----------------------------

KEY = bytes(range(32))


def tagged() -> tuple[Fragmenter, Reassembler]:
    return Fragmenter(KEY), Reassembler(limit=1 << 24, key=KEY)


@pytest.mark.parametrize("max_payload", [TAGGED_HEADER.size + 1, 64, 1 << 20])
def test_tagged_blobs_of_any_size_reassemble_exactly(max_payload: int) -> None:
    out, back = tagged()
    blobs = [b"", b"x", os.urandom(max_payload), os.urandom(3 * max_payload + 7)]
    got = []
    for blob in blobs:
        for message in out.fragments(blob, max_payload):
            assert len(message) <= max_payload
            kind, whole = back.feed(message) or (None, None)
            if kind is Kind.LAST:
                got.append(whole)
    assert got == blobs and back.dropped == 0


def _forgeries(genuine: bytes) -> list[bytes]:
    kind, seq, tag = TAGGED_HEADER.unpack_from(genuine)
    body = genuine[TAGGED_HEADER.size :]
    flipped = bytearray(genuine)
    flipped[-1] ^= 1
    return [
        HEADER.pack(Kind.BEAT, seq),  # the old attack: an untagged heartbeat with the next number
        TAGGED_HEADER.pack(Kind.BEAT, seq, bytes(16)),
        TAGGED_HEADER.pack(Kind.CLOSE, seq, os.urandom(16)),
        TAGGED_HEADER.pack(Kind.LAST, seq, os.urandom(16)) + os.urandom(50),
        TAGGED_HEADER.pack(Kind.MORE if kind == Kind.LAST else Kind.LAST, seq, tag) + body,  # kind changed
        bytes(flipped),  # payload changed
        next(Fragmenter(bytes(32)).fragments(b"hi", 100)),  # tagged under another key
        genuine[:10],
        b"",
    ]


def test_forged_messages_with_the_next_number_are_dropped_and_change_nothing() -> None:
    out, back = tagged()
    genuine = next(out.fragments(b"real", 100))
    for forged in _forgeries(genuine):
        assert back.feed(forged) is None
    assert back.feed(genuine) == (Kind.LAST, b"real")
    assert back.dropped == len(_forgeries(genuine))


def test_replayed_and_reordered_tagged_messages_are_dropped() -> None:
    out, back = tagged()
    first, second = (next(out.fragments(blob, 100)) for blob in (b"one", b"two"))
    assert back.feed(first) == (Kind.LAST, b"one")
    assert back.feed(first) is None  # a duplicate
    assert back.feed(second) == (Kind.LAST, b"two")
    assert back.feed(first) is None  # an old one, replayed after a newer
    assert back.dropped == 2


def test_a_tagged_message_ahead_of_its_turn_means_messages_were_lost() -> None:
    out, back = tagged()
    messages = list(out.fragments(os.urandom(300), 100))
    back.feed(messages[0])
    with pytest.raises(FragmentError, match="lost"):
        back.feed(messages[2])


def test_a_forged_message_far_ahead_does_not_fail_the_link() -> None:
    out, back = tagged()
    assert back.feed(TAGGED_HEADER.pack(Kind.BEAT, 5, os.urandom(16))) is None
    assert back.feed(out.control(Kind.BEAT)) == (Kind.BEAT, None)


def test_tagged_sequence_numbers_wrap_around() -> None:
    out, back = tagged()
    out._count = back._count = 0xFFFFFFFF
    for _ in range(3):
        assert back.feed(next(out.fragments(b"a", 50))) == (Kind.LAST, b"a")
