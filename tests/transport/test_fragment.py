"""Fragment numbering and reassembly, without any relay."""

from __future__ import annotations

import os

import pytest

from emberlink.transport.fragment import HEADER, Fragmenter, FragmentError, Kind, Reassembler


def roundtrip(blobs: list[bytes], max_payload: int) -> list[bytes | memoryview]:
    out, back = Fragmenter(), Reassembler(limit=1 << 24)
    got: list[bytes | memoryview] = []
    for blob in blobs:
        for message in out.fragments(blob, max_payload):
            assert len(message) <= max_payload
            _kind, whole = back.feed(message)
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
    out._seq = back._expect = 0xFFFFFFFF
    for _ in range(3):
        assert back.feed(next(out.fragments(b"a", 50))) == (Kind.LAST, b"a")
