"""The session message schema: exact round trips and strict, bounded decoding."""

from __future__ import annotations

import math
import struct
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emberlink.errors import ProtocolError
from emberlink.protocol.channel import Channel
from emberlink.protocol.dtypes import DTYPES, ITEMSIZE
from emberlink.protocol.messages import (
    MAX_IDS,
    Batch,
    Close,
    Done,
    Drop,
    Error,
    Execute,
    GraphUnknown,
    Read,
    Register,
    Repeat,
    Reply,
    Result,
    Stats,
    StatsReply,
    Sync,
    Upload,
    check_reply_tail,
    check_tail,
    decode_batch,
    decode_batch_prefix,
    decode_reply,
    decode_reply_prefix,
    encode_batch,
    encode_reply,
    expand_batch,
    repeat_of,
    rle_encode,
)

GID = bytes(range(16))
ids = st.integers(0, 2**63 - 1)
rids = st.integers(1, 2**63 - 1)
int64 = st.integers(-(2**63), 2**63 - 1)
gids = st.binary(min_size=16, max_size=16)
text = st.text(max_size=50)
scalars = st.one_of(st.booleans(), int64, st.floats(allow_nan=False))


@st.composite
def tensor_desc(draw: st.DrawFn) -> tuple[str, tuple[int, ...], int]:
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 64), max_size=4)))
    return dtype, shape, math.prod(shape) * ITEMSIZE[dtype]


id_lists = st.one_of(
    st.lists(ids, max_size=20).map(tuple),
    st.tuples(st.integers(0, 1000), st.integers(0, 50)).map(lambda s: tuple(range(s[0], s[0] + s[1]))),
)

client_messages = st.one_of(
    st.builds(Register, gids, st.binary(min_size=1, max_size=100)),
    st.builds(Execute, gids, id_lists, st.lists(scalars, max_size=8).map(tuple), ids),
    st.builds(
        lambda tid, d, inline: Upload(tid, d[0], d[1], d[2], inline), ids, tensor_desc(), st.booleans()
    ),
    st.builds(Read, rids, ids),
    st.builds(Drop, id_lists),
    st.builds(Sync, rids),
    st.builds(Stats, rids),
    st.builds(Close, text),
)
worker_messages = st.one_of(
    st.builds(
        lambda rid, d, inline: Result(rid, d[0], d[1], d[2], inline), rids, tensor_desc(), st.booleans()
    ),
    st.builds(Done, rids),
    st.builds(
        StatsReply,
        rids,
        st.dictionaries(st.text(min_size=1, max_size=20), st.one_of(int64, st.floats(allow_nan=False), text)),
    ),
    st.builds(Error, ids, st.text(min_size=1, max_size=20), text),
    st.builds(GraphUnknown, rids, gids),
)
batches = st.builds(Batch, rids, st.lists(client_messages, max_size=6).map(tuple), st.one_of(st.just(0), ids))
replies = st.builds(Reply, ids, st.lists(worker_messages, max_size=6).map(tuple))


@settings(max_examples=300, deadline=None)
@given(batches)
def test_every_valid_batch_round_trips_exactly(batch: Batch) -> None:
    decoded = decode_batch(encode_batch(batch))
    assert decoded == batch
    for got, want in zip(decoded.messages, batch.messages, strict=True):
        if isinstance(want, Execute):
            assert isinstance(got, Execute)
            assert [type(b) for b in got.bindings] == [type(b) for b in want.bindings]


@settings(max_examples=300, deadline=None)
@given(replies)
def test_every_valid_reply_round_trips_exactly(reply: Reply) -> None:
    assert decode_reply(encode_reply(reply)) == reply


shifts = st.integers(-(2**63) + 1, 2**63 - 1)
repeats = st.builds(
    Repeat,
    shifts,
    shifts,
    st.one_of(st.none(), st.lists(st.lists(scalars, max_size=5).map(tuple), max_size=4).map(tuple)),
)


@settings(max_examples=300, deadline=None)
@given(rids, repeats)
def test_every_valid_repeat_round_trips_exactly(seq: int, repeat: Repeat) -> None:
    batch = Batch(seq, (repeat,))
    assert decode_batch(encode_batch(batch)) == batch


@settings(max_examples=300, deadline=None)
@given(batches, st.integers(-1000, 10**6), st.integers(-1000, 10**6), st.binary(max_size=40))
def test_a_shifted_batch_is_found_as_a_repeat_that_expands_to_it(
    batch: Batch, d: int, dr: int, tail: bytes
) -> None:
    try:
        shifted = expand_batch(Batch(batch.seq, (Repeat(d, dr),)), batch.messages)
    except ProtocolError:
        return  # the shift takes an id or rid out of range
    repeat = repeat_of(batch.messages, shifted.messages)
    if repeat is None:  # only for an empty batch, or a NaN binding (never equal to itself)
        assert not batch.messages or any(
            isinstance(b, float) and math.isnan(b) for x in batch.messages for b in getattr(x, "bindings", ())
        )
        return
    wire = encode_batch(Batch(shifted.seq, (repeat,))) + tail
    decoded, start = decode_batch_prefix(wire)
    assert wire[start:] == tail
    assert expand_batch(decoded, batch.messages) == shifted


def test_repeat_of_refuses_what_a_shift_cannot_make() -> None:
    a = (Upload(1, "float32", (2,), 8), Execute(GID, (1, 0), (0.5, 3), 2), Read(1, 2), Drop((1,)))
    assert repeat_of(a, a) == Repeat(0, 0)
    b = (Upload(5, "float32", (2,), 8), Execute(GID, (5, 4), (0.5, 3), 6), Read(3, 6), Drop((5,)))
    assert repeat_of(a, b) == Repeat(4, 2)
    assert repeat_of(a, (b[0], Execute(GID, (5, 4), (0.25, 3), 6), *b[2:])) == Repeat(4, 2, ((0.25, 3),))
    # an input not shifted alike: the one shift, and a patch for the id at position 2 (after 1 and 1)
    assert repeat_of(a, (b[0], Execute(GID, (5, 3), (0.5, 3), 6), *b[2:])) == Repeat(4, 2, None, ((2, 3),))
    for other in (
        (Upload(5, "float32", (3,), 12), *b[1:]),  # another shape
        (Upload(5, "float32", (2,), 8, True), *b[1:]),  # inline where it was not
        (b[0], Execute(GID, (5, 4), (0.5, 3.0), 6), *b[2:]),  # 3.0 == 3, but another type
        (*b[:3], Drop((5, 6))),
        b[:3],
    ):
        r = repeat_of(a, other)
        assert r is None or (r.bindings is not None and expand_batch(Batch(2, (r,)), a).messages == other)
    assert repeat_of(a, (b[0], Execute(GID, (5, 4), (0.5, 3.0), 6), *b[2:])) == Repeat(4, 2, ((0.5, 3.0),))
    zero = (Execute(GID, (), (0.0,), 1),)
    assert repeat_of(zero, (Execute(GID, (), (-0.0,), 1),)) == Repeat(0, 0, ((-0.0,),))


def test_repeat_needs_a_template_and_bindings_that_fit_it() -> None:
    with pytest.raises(ProtocolError, match="has none"):
        expand_batch(Batch(1, (Repeat(1, 1),)), None)
    with pytest.raises(ProtocolError, match="Executes"):
        expand_batch(Batch(2, (Repeat(1, 1, ((1.0,),)),)), (Sync(1),))
    with pytest.raises(ProtocolError, match="leaves"):
        expand_batch(Batch(2, (Repeat(2**63 - 1, 0),)), (Read(1, 1),))


def test_inline_tail_must_be_exactly_the_inline_uploads() -> None:
    batch = Batch(1, (Upload(1, "float32", (2,), 8, True), Upload(2, "int64", (1,), 8), Sync(1)))
    data = encode_batch(batch) + bytes(8)
    decoded, start = decode_batch_prefix(data)
    assert decoded == batch and len(data) - start == 8
    check_tail(decoded, 8)
    for wrong in (0, 7, 16):
        with pytest.raises(ProtocolError):
            check_tail(decoded, wrong)
    with pytest.raises(ProtocolError):
        decode_batch(data)  # a whole-plaintext decode refuses the tail


def test_a_reply_tail_must_be_exactly_the_inline_results() -> None:
    reply = Reply(3, (Result(1, "float32", (), 4, True), Done(2), Result(3, "int64", (2,), 16)))
    data = encode_reply(reply) + bytes(4)
    decoded, start = decode_reply_prefix(data)
    assert decoded == reply and len(data) - start == 4
    check_reply_tail(decoded, 4)
    for wrong in (0, 3, 20):
        with pytest.raises(ProtocolError):
            check_reply_tail(decoded, wrong)
    with pytest.raises(ProtocolError):
        decode_reply(data)  # a whole-plaintext decode refuses the tail
    big = Reply(1, tuple(Done(r) for r in range(1, 2000)))  # past the first feed: the streaming path
    assert decode_reply_prefix(encode_reply(big) + b"tail")[0] == big


def test_nan_and_infinite_bindings_survive() -> None:
    batch = decode_batch(encode_batch(Batch(1, (Execute(GID, (), (math.nan, math.inf, -0.0), 0),))))
    (execute,) = batch.messages
    assert isinstance(execute, Execute)
    assert math.isnan(execute.bindings[0])
    assert execute.bindings[1] == math.inf
    assert math.copysign(1.0, execute.bindings[2]) == -1.0


def test_id_lists_travel_run_length_encoded() -> None:
    assert rle_encode([5, 6, 7, 9, 10, 3]) == [5, 3, 9, 2, 3, 1]
    wire = msgpack.unpackb(encode_batch(Batch(1, (Drop(tuple(range(100, 1100))),))))
    assert wire == [1, [[5, [100, 1000]]]]


def wire_batch(*messages: Any, seq: Any = 1) -> bytes:
    return msgpack.packb([seq, list(messages)], use_bin_type=True)


@pytest.mark.parametrize(
    ("what", "data"),
    [
        ("seq 0", wire_batch([6, 1], seq=0)),
        ("seq is a bool", wire_batch([6, 1], seq=True)),
        ("seq is a float", wire_batch([6, 1], seq=1.0)),
        ("unknown tag", wire_batch([99, 1])),
        ("worker tag in a batch", wire_batch([17, 1])),
        ("tag is a bool", wire_batch([True, 1])),
        ("tag is a float", wire_batch([6.0, 1])),
        ("extra field", wire_batch([6, 1, 2])),
        ("missing field", wire_batch([4, 1])),
        ("rid 0", wire_batch([6, 0])),
        ("rid is a bool", wire_batch([6, True])),
        ("negative tid", wire_batch([4, 1, -1])),
        ("tid past int63", wire_batch([4, 1, 2**63])),
        ("gid of 15 bytes", wire_batch([1, bytes(15), b"g"])),
        ("gid as str", wire_batch([1, "x" * 16, b"g"])),
        ("empty graph", wire_batch([1, GID, b""])),
        ("graph as str", wire_batch([1, GID, "g"])),
        ("odd rle", wire_batch([5, [1, 2, 3]])),
        ("rle count 0", wire_batch([5, [1, 0]])),
        ("rle count is a bool", wire_batch([5, [1, True]])),
        ("rle past the largest id", wire_batch([5, [2**63 - 1, 2]])),
        ("rle over the id budget", wire_batch([5, [0, MAX_IDS + 1]])),
        ("ids over the budget across messages", wire_batch([5, [0, MAX_IDS]], [5, [0, 1]])),
        ("binding is a str", wire_batch([2, GID, [], ["x"], 0])),
        ("binding is None", wire_batch([2, GID, [], [None], 0])),
        ("binding past int64", wire_batch([2, GID, [], [2**63], 0])),
        ("bindings not an array", wire_batch([2, GID, [], 1.0, 0])),
        ("unknown dtype code", wire_batch([3, 1, 7, [2], 16])),
        ("dtype as a name", wire_batch([3, 1, "float32", [2], 8])),
        ("nbytes does not match shape", wire_batch([3, 1, 5, [2], 9])),
        ("negative dimension", wire_batch([3, 1, 5, [-2], 8])),
        ("rank 17", wire_batch([3, 1, 1, [1] * 17, 1])),
        ("element count overflow", wire_batch([3, 1, 1, [2**40, 2**40], 0])),
        ("dimension is a float", wire_batch([3, 1, 1, [2.0], 2])),
        ("close reason is bytes", wire_batch([8, b"bye"])),
        ("repeat with another message", wire_batch([9, 1, 1], [6, 1])),
        ("repeat twice", wire_batch([9, 1, 1], [9, 1, 1])),
        ("repeat without shifts", wire_batch([9, 1])),
        ("repeat with a fifth field", wire_batch([9, 1, 1, [], 0])),
        ("repeat shift is a bool", wire_batch([9, True, 1])),
        ("repeat shift is a float", wire_batch([9, 1, 1.0])),
        ("repeat shift past int63", wire_batch([9, 2**63, 1])),
        ("repeat shift below -int63", wire_batch([9, 1, -(2**63)])),
        ("repeat bindings not an array", wire_batch([9, 1, 1, 1.0])),
        ("repeat bindings not arrays of arrays", wire_batch([9, 1, 1, [1.0]])),
        ("repeat binding is a str", wire_batch([9, 1, 1, [["x"]]])),
        ("repeat binding is None", wire_batch([9, 1, 1, [[None]]])),
        ("inline upload nbytes mismatch", wire_batch([10, 1, 5, [2], 9])),
        ("message not an array", wire_batch({"tag": 6})),
        ("empty message", wire_batch([])),
        ("envelope is a map", msgpack.packb({1: []})),
        ("envelope of four", msgpack.packb([1, [], 2, 3])),
        ("received of zero", msgpack.packb([1, [], 0])),
        ("received not an int", msgpack.packb([1, [], 2.0])),
        ("messages not an array", msgpack.packb([1, 5])),
        ("trailing bytes", wire_batch([6, 1]) + b"\x00"),
        ("ext type", msgpack.packb([1, [[6, msgpack.ExtType(1, b"x")]]])),
        ("nesting 10,000 deep", b"\x92\x01" + b"\x91" * 10_000 + b"\x00"),
        ("array header claiming 4 Gi items", b"\x92\x01\xdd\xff\xff\xff\xff"),
        ("bin header claiming 4 GiB", b"\x92\x01\x91\x93\x01\xc6\xff\xff\xff\xff"),
        ("not msgpack", b"\xc1"),
        ("empty", b""),
    ],
)
def test_malformed_batch_is_refused(what: str, data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_batch(data)


def wire_reply(*messages: Any, ack: Any = 0) -> bytes:
    return msgpack.packb([ack, list(messages)], use_bin_type=True)


@pytest.mark.parametrize(
    ("what", "data"),
    [
        ("negative ack", wire_reply([17, 1], ack=-1)),
        ("client tag in a reply", wire_reply([6, 1])),
        ("stats value is a bool", wire_reply([18, 1, {"a": True}])),
        ("stats value is a list", wire_reply([18, 1, {"a": [1]}])),
        ("stats key is an int", msgpack.packb([0, [[18, 1, {1: 2}]]])),
        ("stats key empty", wire_reply([18, 1, {"": 2}])),
        ("stats not a map", wire_reply([18, 1, [1, 2]])),
        ("stats with 257 entries", wire_reply([18, 1, {str(i): i for i in range(257)}])),
        ("error code empty", wire_reply([19, 1, "", "m"])),
        ("error code too long", wire_reply([19, 1, "c" * 65, "m"])),
        ("error message too long", wire_reply([19, 1, "c", "m" * 70_000])),
        ("result rid 0", wire_reply([16, 0, 5, [], 4])),
        ("result nbytes mismatch", wire_reply([16, 1, 5, [], 8])),
        ("graph unknown seq 0", wire_reply([20, 0, GID])),
    ],
)
def test_malformed_reply_is_refused(what: str, data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_reply(data)


def test_message_of_the_wrong_kind_is_refused_when_encoding() -> None:
    with pytest.raises(ProtocolError):
        encode_batch(Batch(1, (Done(1),)))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        encode_reply(Reply(1, (Sync(1),)))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        encode_batch(Batch(1, (Upload(1, "complex64", (1,), 8),)))
    with pytest.raises(ProtocolError):
        encode_batch(Batch(1, (Execute(GID, (), (2**64,), 0),)))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_protocol_error(data: bytes) -> None:
    for decode in (decode_batch, decode_reply, decode_batch_prefix):
        try:
            decode(data)
        except ProtocolError:
            pass


msgpack_trees = st.recursive(
    st.one_of(
        st.none(), st.booleans(), int64, st.integers(0, 2**64 - 1), st.floats(), text, st.binary(max_size=20)
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=6), st.dictionaries(st.one_of(text, int64), children, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None)
@given(msgpack_trees, st.integers(0, 20))
def test_arbitrary_msgpack_trees_raise_only_protocol_error(tree: Any, tag: int) -> None:
    payloads = [tree, [1, tree], [1, [tree]], [1, [[tag, tree]]]]
    if isinstance(tree, list):
        payloads.append([1, [[tag, *tree]]])
    for payload in payloads:
        data = msgpack.packb(payload, use_bin_type=True, strict_types=False)
        for decode in (decode_batch, decode_reply, decode_batch_prefix):
            try:
                decode(data)
            except ProtocolError:
                pass


def test_replayed_training_step_costs_at_most_256_bytes_on_the_wire() -> None:
    # A replayed Adam step of a 3-layer MLP: 2 new inputs (x, y), 6 parameters and 12 moment
    # tensors that are the previous step's outputs, 4 per-step scalars, then a Read of the loss.
    params = tuple(range(10_000, 10_018))
    step = Batch(
        123_456,
        (
            Upload(20_001, "float32", (64, 784), 64 * 784 * 4),
            Upload(20_002, "int64", (64,), 64 * 8),
            Execute(GID, (20_001, 20_002, *params), (1e-3, 0.9, 0.999, 1234), 20_003),
            Read(5_000, 20_021),
        ),
    )
    client, worker = Channel.pair(bytes(8), bytes(32), bytes(32))
    frame = client.seal(encode_batch(step))
    x, y = bytes(64 * 784 * 4), bytes(64 * 8)
    bulk = [*client.seal_chunks(x), *client.seal_chunks(y)]
    overhead = len(frame) + sum(len(f) for f in bulk) - len(x) - len(y)
    assert overhead <= 256, overhead
    assert decode_batch(worker.open(frame)[1]) == step


@pytest.mark.parametrize(
    "data",
    [
        b"\x92\x01\xdd\xff\xff\xff\xff",  # an array claiming 4 Gi items
        b"\x92\x01\x91\x93\x01\xc6\xff\xff\xff\xff",  # a bin claiming 4 GiB
        b"\x92\x01\x91\x93\x12\x01\xdf\xff\xff\xff\xff",  # a map claiming 4 Gi entries
        b"\x92\x01\x91\x92\x08\xdb\xff\xff\xff\xff",  # a str claiming 4 GiB
        b"\x92\x01" + b"\x91" * 10_000 + b"\x00",  # nesting 10,000 deep
        msgpack.packb([1, [[5, [0, MAX_IDS]], [5, [0, MAX_IDS]]]]),  # id budget spent twice over
        msgpack.packb([1, [[3, 1, 5, [1 << 20] * 16, 0]]]),  # 2^320 elements
    ],
)
def test_hostile_input_is_refused_without_large_allocations(data: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            decode_batch(data)
        with pytest.raises(ProtocolError):
            decode_batch_prefix(data)
        with pytest.raises(ProtocolError):
            decode_reply(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024, peak  # far below what the headers claim; the id budget is ~10 MB


def test_f32_bindings_travel_as_float32_and_decode_to_the_same_floats() -> None:
    from emberlink.protocol.messages import F32

    lr = F32.of(0.01)
    assert type(lr) is F32 and lr == struct.unpack(">f", struct.pack(">f", 0.01))[0]
    plain = Batch(7, (Read(1, 2), Execute(GID, (5, 6, 9), (float(lr), 3, True, 0.5), 40), Drop((5, 6))))
    marked = Batch(7, (Read(1, 2), Execute(GID, (5, 6, 9), (lr, 3, True, F32.of(0.5)), 40), Drop((5, 6))))
    data = encode_batch(marked)
    assert len(data) == len(encode_batch(plain)) - 2 * 4
    # Everything but the two floats is byte for byte what the one-call encoder writes.
    as32 = b"\xca" + struct.pack(">f", lr) + b"\x03\xc3" + b"\xca" + struct.pack(">f", 0.5)
    as64 = b"\xcb" + struct.pack(">d", lr) + b"\x03\xc3" + b"\xcb" + struct.pack(">d", 0.5)
    assert data == encode_batch(plain).replace(as64, as32)
    decoded = decode_batch(data)
    assert decoded == marked
    assert all(type(b) is not F32 for b in decoded.messages[1].bindings)  # type: ignore[union-attr]
    acked = Batch(7, marked.messages, received=5)  # the three-item envelope, assembled from parts too
    assert decode_batch(encode_batch(acked)) == acked


def test_f32_of_a_value_beyond_float32_stays_a_plain_float() -> None:
    from emberlink.protocol.messages import F32

    assert type(F32.of(1e300)) is float
    assert math.isnan(F32.of(math.nan)) and F32.of(math.inf) == math.inf
