"""The sans-IO session protocol (protocol/session.py), both ends driven synchronously in memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from emberlink.errors import AuthError, ProtocolError
from emberlink.protocol import messages as m
from emberlink.protocol import session as s
from emberlink.protocol.channel import BULK, MESSAGE, Channel, pack_frames, split_frames
from emberlink.protocol.limits import MAX_REPLY_FRAME_BYTES, MAX_UNACKED_BATCHES, MAX_UNACKED_BYTES

from .session_pair import Pair, Reply, channels

CHUNK = 1 << 12
GID = b"g" * 16


def upload(tid: int, array: np.ndarray) -> m.Upload:
    return m.Upload(tid, array.dtype.name, array.shape, array.nbytes)


def submit_roundtrip(pair: Pair, tid: int, rid: int, array: np.ndarray) -> int:
    pair.waiter.wanted.add(rid)
    return pair.client.submit([upload(tid, array), m.Read(rid, tid)], [array], array.nbytes)


@pytest.mark.parametrize("nbytes", [0, 8, CHUNK - 8, CHUNK, CHUNK + 8, 3 * CHUNK, 3 * CHUNK + 8])
def test_upload_and_result_arrive_intact_at_every_chunk_boundary(nbytes: int) -> None:
    pair = Pair(chunk_size=CHUNK)
    array = np.arange(nbytes, dtype=np.uint8)
    submit_roundtrip(pair, 1, 1, array)
    pair.run()
    (got,) = pair.waiter.answers[1]
    np.testing.assert_array_equal(got, array)


def test_an_empty_result_with_a_zero_dim_arrives_with_its_shape() -> None:
    pair = Pair()
    submit_roundtrip(pair, 1, 1, np.zeros((0, 3), np.float32))
    pair.run()
    (got,) = pair.waiter.answers[1]
    assert got.shape == (0, 3) and got.dtype == np.float32


def test_uploads_go_inline_while_they_fit_one_chunk_together_then_in_bulk() -> None:
    pair = Pair(chunk_size=CHUNK)
    arrays = [np.full(CHUNK // 2, i, np.uint8) for i in range(3)]  # two fit inline, the third not
    pair.client.submit([upload(i + 1, a) for i, a in enumerate(arrays)], arrays, 3 * CHUNK // 2)
    frames = next(iter(pair.client.next_frames() or ()))
    _, plaintext = channels()[1].open(frames)
    batch, start = m.decode_batch_prefix(plaintext)
    assert [u.inline for u in batch.messages if type(u) is m.Upload] == [True, True, False]
    assert len(plaintext) - start == CHUNK


PIPE = 64


@pytest.mark.parametrize("nbytes", [PIPE - 1, PIPE, PIPE + 1, 3 * PIPE, 3 * PIPE + 1, 4 * CHUNK + 1])
def test_a_pipelined_upload_arrives_intact_around_the_frame_size(nbytes: int) -> None:
    pair = Pair(chunk_size=CHUNK, pipeline_chunk=PIPE)
    array = np.arange(nbytes, dtype=np.uint32).astype(np.uint8)
    submit_roundtrip(pair, 1, 1, array)
    pair.run()
    (got,) = pair.waiter.answers[1]
    np.testing.assert_array_equal(got, array)


def bulk_sizes(pair: Pair) -> list[int]:
    """The plaintext bytes of each BULK frame of the next batch, in order (its frames opened)."""
    _, worker = channels()
    frames = list(pair.client.next_frames() or ())
    return [len(plain) for kind, plain in map(worker.open, frames) if kind is BULK]


def test_a_batch_up_to_the_pipeline_bound_goes_in_pipeline_chunks_a_larger_one_in_the_workers() -> None:
    pair = Pair(chunk_size=CHUNK, pipeline_chunk=PIPE)
    small = np.zeros(3 * PIPE + 1, np.uint8)
    pair.client.submit([upload(1, small)], [small], small.nbytes)
    assert bulk_sizes(pair) == [PIPE, PIPE, PIPE, 1]
    pair = Pair(chunk_size=CHUNK, pipeline_chunk=PIPE)
    large = np.zeros(s.PIPELINE_BATCH_BYTES + 1, np.uint8)
    pair.client.submit([upload(1, large)], [large], large.nbytes)
    sizes = bulk_sizes(pair)
    assert set(sizes[:-1]) == {CHUNK} and sum(sizes) == large.nbytes


def test_acknowledged_frees_the_batches_and_their_upload_bytes() -> None:
    pair = Pair()
    a = np.ones(100, np.uint8)
    pair.client.submit([upload(1, a)], [a], a.nbytes)
    pair.client.submit([m.Drop((1,))], [], 0)
    assert pair.client.unacked == 2
    pair.run()
    assert pair.client.unacked == 0
    assert (pair.waiter.acked_batches, pair.waiter.acked_bytes) == (2, 100)


def test_sequence_numbers_count_from_one_in_submission_order() -> None:
    pair = Pair()
    seqs = [pair.client.submit([m.Sync(i + 1)], [], 0) for i in range(3)]
    assert seqs == [1, 2, 3]
    _, worker = channels()
    seen = []
    while (frames := pair.client.next_frames()) is not None:
        for frame in frames:
            seen.append(m.decode_batch_prefix(worker.open(frame)[1])[0].seq)
    assert seen == [1, 2, 3]


def test_a_shifted_copy_of_the_previous_batch_goes_as_a_repeat_and_is_expanded() -> None:
    pair = Pair()
    pair.client.submit([m.Upload(1, "float32", (2,), 8), m.Read(1, 1)], [np.ones(2, np.float32)], 8)
    pair.client.submit([m.Upload(2, "float32", (2,), 8), m.Read(2, 2)], [np.full(2, 7, np.float32)], 8)
    pair.waiter.wanted |= {1, 2}
    pair.run()
    assert pair.client.counters.batches_repeated == 1
    np.testing.assert_array_equal(pair.waiter.answers[2][0], np.full(2, 7, np.float32))


def applied_batches(pair: Pair) -> list[m.Batch]:
    """Every batch the pair's worker applies from now on, as it expanded it."""
    seen: list[m.Batch] = []
    apply = pair.worker._apply

    def recording(batch: m.Batch, uploads: list[np.ndarray]) -> None:
        seen.append(batch)
        apply(batch, uploads)

    pair.worker._apply = recording  # type: ignore[method-assign]
    return seen


def test_steps_that_repeat_the_last_shifts_go_as_repeats_and_expand_to_their_own_ids() -> None:
    pair = Pair()
    pair.graph_bodies[GID] = b"body"
    seen = applied_batches(pair)
    for step in range(6):
        x = np.full(2, step, np.float32)
        tid, rid = 10 + 2 * step, 1 + step
        pair.waiter.wanted.add(rid)
        messages: list[m.ClientMessage] = [upload(tid, x), m.Execute(GID, (tid,), (0.5,), tid + 1)]
        if step == 0:
            messages.insert(0, m.Register(GID, b"body"))
        elif step > 1:
            messages.append(m.Drop((tid - 2,)))
        pair.client.submit([*messages, m.Read(rid, tid + 1)], [x], x.nbytes)
        pair.run()  # one step at a time: each end predicts the next between steps
    assert pair.client.counters.batches_repeated == 3  # steps 3 to 5 (0, 1 and 2 differ in form)
    for step, batch in enumerate(seen[2:], 2):
        tid = 10 + 2 * step
        assert batch.messages == (
            m.Upload(tid, "float32", (2,), 8, True),
            m.Execute(GID, (tid,), (0.5,), tid + 1),
            m.Drop((tid - 2,)),
            m.Read(1 + step, tid + 1),
        )
    for step in range(6):
        np.testing.assert_array_equal(pair.waiter.answers[1 + step][0], np.full(2, step, np.float32))


def test_a_batch_of_uploads_only_between_steps_leaves_the_step_before_as_the_template() -> None:
    """A DataLoader sends batch k+1's upload on its own between step k and step k+1: the steps still
    go as Repeats of each other, and the worker expands each to its own ids."""
    pair = Pair()
    pair.graph_bodies[GID] = b"body"
    seen = applied_batches(pair)
    steps = 6
    for step in range(steps):
        x = np.full(2, step, np.float32)
        tid, rid = 10 + 2 * step, 1 + step
        pair.client.submit([upload(tid, x)], [x], x.nbytes)  # the loader's next batch, alone
        pair.waiter.wanted.add(rid)
        messages: list[m.ClientMessage] = [m.Execute(GID, (tid,), (0.5,), tid + 1)]
        if step == 0:
            messages.insert(0, m.Register(GID, b"body"))
        elif step > 1:
            messages.append(m.Drop((tid - 2,)))
        pair.client.submit([*messages, m.Read(rid, tid + 1)], [], 0)
        pair.run()
    assert pair.client.counters.batches_repeated == steps - 3  # steps 3 to 5
    step_batches = [b for b in seen if not s.uploads_only(b.messages)]
    for step, batch in enumerate(step_batches[2:], 2):
        tid = 10 + 2 * step
        assert batch.messages == (
            m.Execute(GID, (tid,), (0.5,), tid + 1),
            m.Drop((tid - 2,)),
            m.Read(1 + step, tid + 1),
        )
    for step in range(steps):
        np.testing.assert_array_equal(pair.waiter.answers[1 + step][0], np.full(2, step, np.float32))


def test_uploads_only_is_a_batch_of_uploads_and_nothing_else() -> None:
    up = m.Upload(1, "float32", (2,), 8)
    assert s.uploads_only((up, up))
    assert not s.uploads_only(())
    assert not s.uploads_only((up, m.Drop((1,))))
    assert not s.uploads_only((m.Read(1, 1),))


def arrives_alike(
    client: s.ClientConnection,
    predicting: s.WorkerConnection[Reply],
    plain: s.WorkerConnection[Reply],
    x: np.ndarray,
    answers: list[m.WorkerMessage] | None = None,
) -> tuple[m.Batch, list[bytes | bytearray]]:
    """Send the batch just submitted to a worker end that predicts and one that never does; both
    must take it in as the same batch with `x` inline, and answer it with `answers` (their
    Results carrying `x`). The batch, and the blobs of the reply."""
    (blob,) = pack_frames(client.next_frames() or ())
    client.predict()
    arrived = []
    reply: list[bytes | bytearray] = []
    for conn in (predicting, plain):
        (frame,) = split_frames(blob)
        event = conn.receive_frame(frame)
        assert isinstance(event, s.BatchArrived)
        assert conn.expect([])
        arrived.append((event.batch, bytes(event.plaintext[event.start :])))
        answered = answers or []
        reply = list(conn.reply(event.batch.seq, answered, [x for msg in answered if type(msg) is m.Result]))
    predicting.predict()
    assert arrived[0] == arrived[1]
    assert arrived[0][1] == x.tobytes()
    return arrived[0][0], reply


def client_and_two_workers() -> tuple[
    s.ClientConnection, s.WorkerConnection[Reply], s.WorkerConnection[Reply]
]:
    """A client's connection and two worker ends of its session: one to predict (`predict` called
    between batches), one never told to, to compare with."""
    client = s.ClientConnection(channels()[0], CHUNK, {}, lambda r: (None, None))
    return client, s.WorkerConnection(channels()[1], CHUNK), s.WorkerConnection(channels()[1], CHUNK)


@pytest.mark.parametrize(
    ("data", "predicted"),
    [
        ((), [None, (5, 0), (6, 0)]),  # every id shifted: step 2 is not the one predicted; 4 and 5 are
        # a data set's id kept: the same patch every step
        ((5, 5, 5), [None, (5, 0, (5,)), (6, 0, (5,))]),
        # batches cycled: other patched ids every step, each made from the last patches' expansion
        # (step 2 is not a Repeat of step 1's: it adds a Drop)
        ((1, 2, 3), [None, (5, 0, (2,)), (6, 0, (3,))]),
    ],
)
def test_a_predicted_or_patched_repeat_arrives_as_the_full_decoding_of_it_would(
    monkeypatch: pytest.MonkeyPatch, data: tuple[int, ...], predicted: list[tuple[int, ...] | None]
) -> None:
    taken: list[Any] = []  # what the predicted path found, each time it was tried
    decode_repeat, decode_repatched = m.decode_repeat, m.decode_repatched

    def recording(*a: Any) -> tuple[int, int] | None:
        taken.append(decode_repeat(*a))
        return taken[-1]  # type: ignore[no-any-return]

    def recording_patched(*a: Any) -> tuple[int, int, tuple[int, ...]] | None:
        taken.append(decode_repatched(*a))
        return taken[-1]  # type: ignore[no-any-return]

    monkeypatch.setattr(m, "decode_repeat", recording)
    monkeypatch.setattr(m, "decode_repatched", recording_patched)
    client, predicting, plain = client_and_two_workers()
    for step in range(6):
        tid = 10 + 3 * step
        inputs = (data[step % len(data)], tid) if data else (tid,)
        x = np.full(4, step, np.float32)
        messages: list[m.ClientMessage] = [upload(tid, x), m.Execute(GID, inputs, (0.5,), tid + 1)]
        if step >= 2:
            messages.append(m.Drop((tid - 3, tid - 2)))
        client.submit([*messages, m.Read(1 + step, tid + 1)], [x], x.nbytes)
        batch, _ = arrives_alike(client, predicting, plain, x)
        assert batch.messages[1] == m.Execute(GID, inputs, (0.5,), tid + 1)
    assert client.counters.batches_repeated == 4  # steps 1, 3, 4 and 5
    assert taken == predicted


def test_a_binding_equal_to_the_last_but_of_another_type_keeps_its_type_on_the_wire() -> None:
    pair = Pair()
    pair.graph_bodies[GID] = b"body"
    xs = [np.zeros(1, np.float32)] * 3
    pair.client.submit([m.Register(GID, b"body"), *(upload(i, x) for i, x in enumerate(xs, 1))], xs, 12)
    pair.run()
    seen = applied_batches(pair)
    for step, scalar in enumerate([1, 1, 1.0]):  # 1 == 1.0, but an int and a float differ on the wire
        pair.client.submit([m.Execute(GID, (1 + step,), (scalar,), 10 + step)], [], 0)
        pair.run()
    assert pair.client.counters.batches_repeated == 2
    assert [type(b.messages[0].bindings[0]) for b in seen] == [int, int, float]  # type: ignore[union-attr,index]


def test_without_templates_nothing_goes_as_a_repeat() -> None:
    pair = Pair(templates=False)
    for i in (1, 2):
        pair.client.submit([m.Sync(i)], [], 0)
    pair.run()
    assert pair.client.counters.batches_repeated == 0
    assert pair.waiter.answers == {1: [None], 2: [None]}


def test_graph_unknown_resends_from_that_batch_with_the_graph_registered_first() -> None:
    pair = Pair()
    pair.graph_bodies[GID] = b"body"
    x = np.arange(4, dtype=np.float32)
    pair.client.submit([upload(1, x)], [x], x.nbytes)
    pair.client.submit([m.Execute(GID, (1,), (), 2), m.Read(1, 2)], [], 0)
    pair.client.submit([m.Sync(2)], [], 0)
    pair.waiter.wanted.add(1)
    pair.run()
    assert pair.waiter.resent == [2]
    assert pair.client.counters.graph_cache_misses == 1
    assert pair.client.counters.batches_resent == 2  # batches 2 and 3 went again
    np.testing.assert_array_equal(pair.waiter.answers[1][0], x)
    assert pair.waiter.answers[2] == [None]
    assert pair.worker.applied == 3


def test_a_resent_batch_goes_in_full_never_as_a_repeat() -> None:
    pair = Pair()
    pair.graph_bodies[GID] = b"body"
    x = np.zeros(1, np.float32)
    pair.client.submit([upload(1, x), m.Sync(1)], [x], x.nbytes)
    pair.client.submit([upload(2, x), m.Sync(2)], [x], x.nbytes)  # a Repeat of batch 1
    pair.client.submit([m.Execute(GID, (1,), (), 3)], [], 0)
    pair.client.submit([m.Execute(GID, (2,), (), 4)], [], 0)  # a Repeat of batch 3
    pair.run()
    assert pair.worker.applied == 4 and 4 in pair.worker.store
    assert pair.client.counters.batches_repeated == 2  # the two resent batches went in full


def test_a_stale_graph_unknown_is_ignored() -> None:
    pair = Pair()
    pair.client.submit([m.Sync(1)], [], 0)
    pair.run()
    blob = pair.worker.conn.reply(0, [m.GraphUnknown(1, GID)], [])
    assert pair.client.receive(next(blob)) == []
    assert not pair.client.pending()


def test_graph_unknown_for_a_graph_never_sent_is_refused() -> None:
    pair = Pair()
    pair.client.submit([m.Execute(GID, (1,), (), 2)], [], 0)
    pair.send_all()
    pair.deliver_up()
    with pytest.raises(ProtocolError, match="never sent"):
        pair.deliver_down()


def test_each_batch_tells_the_last_reply_taken_in_whole() -> None:
    pair = Pair(chunk_size=CHUNK)
    submit_roundtrip(pair, 1, 1, np.arange(4 * CHUNK, dtype=np.uint8))
    pair.send_all()
    pair.deliver_up()
    frames = [f for blob in pair.wire_down for f in split_frames(blob)]
    pair.waiter.on(pair.client.receive(frames[0]))  # the reply, its result's bytes not yet in
    assert pair.client.received == 0
    for frame in frames[1:]:
        pair.waiter.on(pair.client.receive(frame))
    assert pair.client.received == 1
    pair.client.submit([m.Sync(2)], [], 0)
    (sealed,) = list(pair.client.next_frames() or ())
    batch, _ = m.decode_batch_prefix(pair.worker.conn.channel.open(sealed)[1])
    assert batch.received == 1


def test_a_reply_with_many_messages_is_split_into_frames_that_fit() -> None:
    pair = Pair()
    pair.client.submit([m.Stats(i + 1) for i in range(1000)], [], 0)
    pair.client.submit([m.Stats(i + 1001) for i in range(1000)], [], 0)
    pair.send_all()
    pair.deliver_up()
    sizes = [len(f) for blob in pair.wire_down for f in split_frames(blob)]
    assert all(size <= MAX_REPLY_FRAME_BYTES + 64 for size in sizes)
    pair.deliver_down()
    assert sorted(pair.waiter.answers) == list(range(1, 2001))


def test_worker_refuses_a_batch_too_far_ahead_of_its_acks() -> None:
    client, worker = channels()
    conn: s.WorkerConnection[Reply] = s.WorkerConnection(worker, CHUNK)
    frame = client.seal(m.encode_batch(m.Batch(MAX_UNACKED_BATCHES + 1, (m.Sync(1),))), MESSAGE)
    with pytest.raises(ProtocolError, match="without waiting for acks"):
        conn.receive_frame(memoryview(frame))


def upload_batch(client: Channel, seq: int, nbytes: int) -> memoryview:
    u = m.Upload(seq, "uint8", (nbytes,), nbytes)
    return memoryview(client.seal(m.encode_batch(m.Batch(seq, (u,))), MESSAGE))


def test_worker_refuses_uploads_past_the_unacknowledged_bytes() -> None:
    client, worker = channels()
    conn: s.WorkerConnection[Reply] = s.WorkerConnection(worker, CHUNK)
    half = MAX_UNACKED_BYTES // 2 + 8
    assert isinstance(conn.receive_frame(upload_batch(client, 1, half)), s.BatchArrived)
    conn.expect([])  # where its bulk goes is not what this test is about
    with pytest.raises(ProtocolError, match="bytes of uploads without waiting"):
        conn.receive_frame(upload_batch(client, 2, half))


def test_an_ack_sent_frees_the_unacknowledged_bytes() -> None:
    client, worker = channels()
    conn: s.WorkerConnection[Reply] = s.WorkerConnection(worker, CHUNK)
    half = MAX_UNACKED_BYTES // 2 + 8
    for seq in (1, 2, 3):
        assert isinstance(conn.receive_frame(upload_batch(client, seq, half)), s.BatchArrived)
        conn.expect([])
        list(conn.reply(seq, [], []))


def test_a_batch_sent_again_counts_its_upload_bytes_once_until_acked() -> None:
    client, worker = channels()
    conn: s.WorkerConnection[Reply] = s.WorkerConnection(worker, CHUNK)
    half = MAX_UNACKED_BYTES // 2 + 8

    def arrive(seq: int) -> None:
        assert isinstance(conn.receive_frame(upload_batch(client, seq, half)), s.BatchArrived)
        conn.expect([])

    arrive(1)
    arrive(1)  # sent again (as after a GraphUnknown): it replaces itself
    list(conn.reply(1, [], []))  # acked: none of its bytes are unacknowledged now
    arrive(2)
    list(conn.reply(2, [], []))
    arrive(3)  # refused if batch 1 still counted


def test_one_batch_alone_may_pass_the_unacknowledged_bytes() -> None:
    client, worker = channels()
    conn: s.WorkerConnection[Reply] = s.WorkerConnection(worker, CHUNK)
    assert isinstance(conn.receive_frame(upload_batch(client, 1, MAX_UNACKED_BYTES + 8)), s.BatchArrived)


def test_worker_refuses_a_batch_before_the_bulk_of_the_previous_one() -> None:
    client, worker = channels()
    conn: s.WorkerConnection[Reply] = s.WorkerConnection(worker, CHUNK)
    u = m.Upload(1, "uint8", (CHUNK * 2,), CHUNK * 2)
    conn.receive_frame(memoryview(client.seal(m.encode_batch(m.Batch(1, (u,))), MESSAGE)))
    conn.expect([(None, u.nbytes)])
    with pytest.raises(ProtocolError, match="before the bulk bytes"):
        conn.receive_frame(memoryview(client.seal(m.encode_batch(m.Batch(2, (m.Sync(1),))), MESSAGE)))


def test_worker_refuses_bulk_nobody_announced() -> None:
    client, worker = channels()
    conn: s.WorkerConnection[Reply] = s.WorkerConnection(worker, CHUNK)
    (frame,) = client.seal_chunks(b"x" * 10)
    with pytest.raises(ProtocolError, match="without an upload"):
        conn.receive_frame(memoryview(frame))


def test_worker_refuses_a_repeat_with_nothing_to_repeat() -> None:
    client, worker = channels()
    conn: s.WorkerConnection[Reply] = s.WorkerConnection(worker, CHUNK)
    frame = client.seal(m.encode_batch(m.Batch(1, (m.Repeat(1, 1),))), MESSAGE)
    with pytest.raises(ProtocolError, match="has none"):
        conn.receive_frame(memoryview(frame))


def test_client_refuses_bulk_nobody_announced_and_a_reply_cut_into() -> None:
    pair = Pair()
    (frame,) = pair.worker.conn.channel.seal_chunks(b"x" * 10)
    with pytest.raises(ProtocolError, match="without a result"):
        pair.client.receive(frame)
    pair = Pair(chunk_size=CHUNK)
    submit_roundtrip(pair, 1, 1, np.zeros(2 * CHUNK, np.uint8))
    pair.send_all()
    pair.deliver_up()
    frames = list(split_frames(b"".join(pair.wire_down)))
    pair.client.receive(frames[0])
    reply = next(pair.worker.conn.reply(1, [m.Done(5)], []))
    with pytest.raises(ProtocolError, match="before the bytes"):
        pair.client.receive(reply)


@pytest.mark.parametrize(
    ("at", "byte", "error", "why"),
    [
        (0, 2, ProtocolError, "unsupported frame version"),
        (1, 7, ProtocolError, "unknown frame kind"),
        (2, 0xFF, AuthError, "another session"),
        (17, 9, AuthError, "out of order"),
        (21, 0x30, ProtocolError, "truncated frame"),
        (30, 0x55, AuthError, "failed authentication"),
    ],
    ids=["version", "kind", "session", "counter", "length", "ciphertext"],
)
def test_a_reply_frame_with_any_part_changed_is_refused_and_the_next_one_taken(
    at: int, byte: int, error: type[Exception], why: str
) -> None:
    """A blob of one reply frame (a step's) is opened without `split_frames` first: every check
    of its header still refuses it, as it did, and the channel still expects that frame."""
    pair = Pair()
    pair.waiter.wanted.add(1)
    pair.client.submit([upload(1, np.ones(2, np.float32)), m.Read(1, 1)], [np.ones(2, np.float32)], 8)
    pair.send_all()
    pair.deliver_up()
    (blob,) = pair.wire_down
    bad = bytearray(blob)
    bad[at] = byte if bad[at] != byte else byte ^ 1
    with pytest.raises(error, match=why):
        pair.client.receive(bytes(bad))
    pair.waiter.on(pair.client.receive(blob))
    (got,) = pair.waiter.answers[1]
    np.testing.assert_array_equal(got, np.ones(2, np.float32))


def test_an_error_for_request_zero_ends_the_session() -> None:
    pair = Pair()
    pair.waiter.on(pair.client.receive(pair.worker.conn.final(m.Error(0, "refused", "no"), 0)))
    assert pair.waiter.ended == m.Error(0, "refused", "no")


def test_a_result_nobody_waits_for_is_skipped() -> None:
    pair = Pair(chunk_size=CHUNK)
    a = np.arange(3 * CHUNK, dtype=np.uint8)
    pair.client.submit([upload(1, a), m.Read(7, 1), m.Read(8, 1)], [a], a.nbytes)
    pair.waiter.wanted.add(8)
    pair.run()
    assert list(pair.waiter.answers) == [8]


def test_resume_after_a_drop_answers_every_request_exactly_once() -> None:
    pair = Pair(chunk_size=CHUNK)
    arrays = {rid: np.full(CHUNK + rid, rid, np.uint8) for rid in range(1, 5)}
    submit_roundtrip(pair, 1, 1, arrays[1])
    pair.run()
    submit_roundtrip(pair, 2, 2, arrays[2])
    pair.send_all()
    pair.deliver_up()  # applied; its reply is lost on the wire
    submit_roundtrip(pair, 3, 3, arrays[3])
    pair.send_all()  # lost before the worker saw it
    pair.resume()
    submit_roundtrip(pair, 4, 4, arrays[4])
    pair.run()
    assert sorted(pair.waiter.answers) == [1, 2, 3, 4]
    for rid, values in pair.waiter.answers.items():
        assert len(values) == 1
        np.testing.assert_array_equal(values[0], arrays[rid])
    assert pair.worker.applied == 4


def test_a_resume_forgets_the_templates_on_both_ends() -> None:
    pair = Pair()
    pair.client.submit([m.Sync(1)], [], 0)
    pair.run()
    pair.resume()
    pair.client.submit([m.Sync(2)], [], 0)  # would be a Repeat of batch 1 on the old link
    pair.run()
    assert pair.client.counters.batches_repeated == 0
    assert pair.waiter.answers[2] == [None]


def test_within_flow_allows_one_batch_alone_past_the_byte_limit() -> None:
    assert s.within_flow(0, 0, 10**12, 64, 1 << 20)
    assert not s.within_flow(1, 1, 1 << 20, 64, 1 << 20)
    assert not s.within_flow(64, 0, 0, 64, 1 << 20)
    assert s.within_flow(63, 10, 10, 64, 1 << 20)


def test_the_reply_log_keeps_what_the_client_has_not_confirmed() -> None:
    log: s.ReplyLog[Reply] = s.ReplyLog()
    log.keep(Reply(1, [m.Done(1)], []))
    log.keep(Reply(1, [m.GraphUnknown(2, GID)], []))  # not kept: the batch goes again anyway
    log.keep(Reply(2, [m.Done(2)], []))
    log.confirm(1)
    assert [r.ack for r in log] == [2]


def test_frames_of_a_batch_pack_into_blobs_in_order() -> None:
    pair = Pair(chunk_size=CHUNK)
    a = np.arange(5 * CHUNK, dtype=np.uint8)
    pair.client.submit([upload(1, a)], [a], a.nbytes)
    blobs = list(pack_frames(pair.client.next_frames() or ()))
    assert sum(len(split_frames(b)) for b in blobs) == 6  # the MESSAGE frame and five chunks


def staged_batch(arrays: list[np.ndarray], room: int) -> tuple[list[np.ndarray], s.Staged]:
    """Copies of `arrays` laid out back to back after `room` free bytes of one buffer (as
    RemoteExecutor.host_array lays out a step's host batch)."""
    buffer = np.zeros(room + sum(a.nbytes for a in arrays) + 64, np.uint8)
    at, views = room, []
    for a in arrays:
        view = buffer[at : at + a.nbytes].view(a.dtype).reshape(a.shape)
        view[...] = a
        views.append(view)
        at += a.nbytes
    return views, s.Staged(buffer.data, room)


def two_array_steps(n: int) -> dict[int, list[np.ndarray]]:
    """Step k's host batch: 80,000 bytes of k and three int64s from k."""
    return {k: [np.full(20_000, k, np.float32), np.arange(3, dtype=np.int64) + k] for k in range(n)}


def submit_staged(pair: Pair, k: int, arrays: list[np.ndarray]) -> None:
    """Submit step k with `arrays` staged (its answer wanted)."""
    views, where = staged_batch(arrays, 4096)
    pair.waiter.wanted.add(k + 1)
    pair.client.submit(step_batch(k, arrays), views, 80_024, where)


def resume_and_check_each_applied_once(pair: Pair, arrays: dict[int, list[np.ndarray]]) -> None:
    """Resume the dropped link and run it out: each step k read its own first array back, and the
    worker applied each step's batch once."""
    pair.resume()
    pair.run()
    for k in range(len(arrays)):
        (got,) = pair.waiter.answers[k + 1]
        np.testing.assert_array_equal(got, arrays[k][0])
    assert pair.worker.applied == len(arrays)


def step_batch(k: int, arrays: list[np.ndarray]) -> list[m.ClientMessage]:
    """A step's batch: its uploads, then a read of the first (ids shift by 10 a step)."""
    return [*(upload(10 * k + i + 1, a) for i, a in enumerate(arrays)), m.Read(k + 1, 10 * k + 1)]


@pytest.mark.parametrize("room", [4096, 8])
def test_staged_uploads_go_on_the_wire_exactly_as_the_same_batch_unstaged(room: int) -> None:
    # (room 8: the head does not fit before the uploads, so they are joined as before)
    plain, staged = Pair(chunk_size=1 << 20), Pair(chunk_size=1 << 20)
    for k in range(4):  # the first batch in full, the others as Repeats
        arrays: list[np.ndarray] = [
            np.arange(20_000, dtype=np.float32) + k,
            np.arange(128, dtype=np.int64) * k,
        ]
        views, where = staged_batch(arrays, room)
        for pair in (plain, staged):
            pair.waiter.wanted.add(k + 1)
        plain.client.submit(step_batch(k, arrays), arrays, sum(a.nbytes for a in arrays))
        staged.client.submit(step_batch(k, arrays), views, sum(a.nbytes for a in arrays), where)
        plain.send_all()
        staged.send_all()
        assert [bytes(b) for b in staged.wire_up] == [bytes(b) for b in plain.wire_up]
        plain.run()
        staged.run()
        (got,) = staged.waiter.answers[k + 1]
        np.testing.assert_array_equal(got, arrays[0])
    assert staged.client.counters.batches_repeated == 3


def test_a_staged_batch_resent_after_a_drop_arrives_intact() -> None:
    pair = Pair(chunk_size=1 << 20)
    arrays = two_array_steps(3)
    for k in range(3):
        submit_staged(pair, k, arrays[k])
        if k == 0:
            pair.run()
    pair.send_all()  # batches 2 and 3 lost before the worker saw them: resent in full
    resume_and_check_each_applied_once(pair, arrays)


def test_an_ack_hands_back_the_staging_buffers_of_the_batches_it_acknowledges_only() -> None:
    pair = Pair(chunk_size=1 << 20, pipeline_chunk=PIPE * 64)
    arrays = [[np.full(20_000, k, np.float32)] for k in range(3)]
    staged = []
    for k in range(2):
        views, where = staged_batch(arrays[k], 4096)
        staged.append(where)
        pair.waiter.wanted.add(k + 1)
        pair.client.submit(step_batch(k, arrays[k]), views, 80_000, where)
        pair.send_all()
        pair.deliver_up()  # the worker applies it: its ack goes down with the next delivery
    pair.client.submit(step_batch(2, arrays[2]), [arrays[2][0]], 80_000)  # not staged
    pair.deliver_down()
    assert [f.buffer for f in pair.waiter.freed] == [staged[0].buffer, staged[1].buffer]
    pair.run()
    assert len(pair.waiter.freed) == 2  # the unstaged batch's ack hands back nothing


def test_an_ack_for_a_batch_not_yet_sent_does_not_free_its_staging_buffer() -> None:
    pair = Pair(chunk_size=1 << 20)
    arrays = [np.full(20_000, 1, np.float32)]
    views, where = staged_batch(arrays, 4096)
    pair.client.submit(step_batch(0, arrays), views, 80_000, where)  # queued, not sealed
    # a worker that breaks the protocol: it acknowledges a batch it cannot have had
    blobs = list(pair.worker.conn.reply(1, [], []))
    for blob in blobs:
        pair.waiter.on(pair.client.receive(blob))
    assert pair.waiter.acked_batches == 1 and pair.waiter.freed == []


def test_staging_buffers_overwritten_as_soon_as_freed_never_change_a_batch_sent_again() -> None:
    # What the executor does with a freed buffer (the next batch's bytes in it), done at once:
    # batches lost on a dropped link and resent after the resume still carry their own values.
    pair = Pair(chunk_size=1 << 20, pipeline_chunk=PIPE * 64)
    scribble = pair.waiter.on

    def on(events: list[s.ClientEvent]) -> None:
        scribble(events)
        for freed in pair.waiter.freed:
            np.frombuffer(freed.buffer, np.uint8)[:] = 0xFF
        pair.waiter.freed.clear()

    pair.waiter.on = on  # type: ignore[method-assign]
    arrays = two_array_steps(4)
    for k in range(4):
        submit_staged(pair, k, arrays[k])
        if k == 0:
            pair.run()
        elif k == 1:
            pair.send_all()
            pair.deliver_up()  # applied; its reply is lost with the link
    pair.send_all()  # batches 3 and 4 lost before the worker saw them
    resume_and_check_each_applied_once(pair, arrays)


def test_a_reply_foreseen_by_the_client_is_taken_without_decoding_and_a_different_one_is_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decoded: list[m.Reply] = []
    decode = m.decode_reply_prefix

    def counted(data: m.BytesLike) -> tuple[m.Reply, int]:
        out = decode(data)
        decoded.append(out[0])
        return out

    monkeypatch.setattr(m, "decode_reply_prefix", counted)
    pair = Pair()
    sizes = [4, 4, 4, 4, 8, 8, 8]  # a step's loss, then a result of another shape
    for k, n in enumerate(sizes):
        array = np.arange(n, dtype=np.float32) + k
        submit_roundtrip(pair, k + 1, k + 1, array)
        pair.run()
        (got,) = pair.waiter.answers[k + 1]
        np.testing.assert_array_equal(got, array)
    # decoded: the first reply (nothing to foresee it by) and the first of the new shape
    assert [r.ack for r in decoded] == [1, 5]
    pair.client.submit([m.Read(99, 12345)], [], 0)  # an unknown tensor: an Error, not the Result foreseen
    pair.waiter.wanted.add(99)
    pair.run()
    assert pair.waiter.answers[99] == [("unknown_tensor", "no tensor 12345")]
    pair.client.submit([m.Sync(100)], [], 0)
    pair.run()
    assert pair.waiter.answers[100] == [None]
    assert [r.ack for r in decoded] == [1, 5, 8, 9]


def submit_alike(
    seeing: Pair, blind: Pair, messages: list[m.ClientMessage], arrays: list[np.ndarray], read: int
) -> None:
    """One batch (its answer read as `read`) through both pairs, the blind one's client never
    foreseeing a batch (worked out afresh each time); both put the same bytes on the wire."""
    for pair in (seeing, blind):
        pair.graph_bodies[GID] = b"body"
        pair.waiter.wanted.add(read)
        pair.client.submit(messages, arrays, sum(a.nbytes for a in arrays))
        pair.send_all()
        if pair is blind:
            pair.client._foreseen = None
    assert [bytes(b) for b in seeing.wire_up] == [bytes(b) for b in blind.wire_up]


@pytest.mark.parametrize("pipeline_chunk", [0, 16], ids=["inline", "pipelined"])
def test_a_batch_foreseen_by_the_client_goes_on_the_wire_as_the_one_worked_out_afresh(
    monkeypatch: pytest.MonkeyPatch, pipeline_chunk: int
) -> None:
    """`predict` works the next batch out ahead (layout, Repeat, encoded head); the batch that
    comes is sent from it only when it is that batch, and either way in exactly the bytes the
    connection would work out for it when it arrives. Pipelined in 16-byte chunks, the 16-byte
    uploads go inline and the 32-byte ones in BULK frames: foreseen alike."""
    used: list[int] = []  # the seqs sent as foreseen
    plan = s.ClientConnection._plan

    def planned(self: s.ClientConnection, batch: s.OutBatch, resent: bool, chunk: int) -> Any:
        out = plan(self, batch, resent, chunk)
        fast = self._foreseen
        if fast is not None and out[-1] is fast.head:
            used.append(batch.seq)
        return out

    monkeypatch.setattr(s.ClientConnection, "_plan", planned)
    seeing, blind = Pair(pipeline_chunk=pipeline_chunk), Pair(pipeline_chunk=pipeline_chunk)
    pairs = (seeing, blind)
    # steps: (elements uploaded, whether the reply is taken in before the next batch is made)
    steps = [(4, True)] * 4 + [(8, True)] * 3 + [(8, False)] * 2 + [(8, True)] * 2
    for k, (n, answered) in enumerate(steps):
        x = np.arange(n, dtype=np.float32) + k
        tid = 10 + 2 * k
        messages: list[m.ClientMessage] = [upload(tid, x), m.Execute(GID, (tid,), (0.5,), tid + 1)]
        if k == 0:
            messages.insert(0, m.Register(GID, b"body"))
        else:
            messages.append(m.Drop((tid - 2, tid - 1)))
        submit_alike(seeing, blind, [*messages, m.Read(k + 1, tid + 1)], [x], k + 1)
        if answered:
            for pair in pairs:
                pair.run()
    for pair in pairs:
        pair.run()
        for k, (n, _) in enumerate(steps):
            (got,) = pair.waiter.answers[k + 1]
            np.testing.assert_array_equal(got, np.arange(n, dtype=np.float32) + k)
    # seq 3 is the first Repeat, so seq 4 the first foreseen; seq 5 uploads another size, seq 6
    # follows a batch that was no Repeat; seqs 9 and 10 go before the replies to 8 and 9 are in
    # (another `received` than foreseen)
    assert used == [4, 7, 8, 11]


@pytest.mark.parametrize("inline", [False, True], ids=["no upload", "an inline upload"])
def test_batches_cycled_go_as_the_foreseen_repeat_patching_their_ids_in_the_bytes_worked_out_afresh(
    monkeypatch: pytest.MonkeyPatch, inline: bool
) -> None:
    """Batches uploaded beforehand and cycled: each step's Repeat patches other ids at the same
    positions. The client makes it from the expansion it foresaw (`predict`), with the ids the
    batch has there, and it goes in exactly the bytes worked out afresh; a batch that differs
    anywhere else is worked out afresh."""
    afresh: list[int] = []  # the seqs the seeing client laid out afresh
    layout = s.ClientConnection._layout

    def laid_out(self: s.ClientConnection, batch: s.OutBatch, room: int) -> Any:
        if self is seeing.client:
            afresh.append(batch.seq)
        return layout(self, batch, room)

    monkeypatch.setattr(s.ClientConnection, "_layout", laid_out)
    seeing, blind = Pair(), Pair()
    pairs = (seeing, blind)
    data = [(1, 2), (3, 4), (5, 6)]  # x and y of three batches uploaded beforehand (seq 1)
    for pair in pairs:
        beforehand = [np.full(2, tid, np.float32) for tid in range(1, 8)]
        pair.client.submit([upload(tid, a) for tid, a in enumerate(beforehand, 1)], beforehand, 56)
        pair.send_all()
        pair.run()
    for k in range(9):
        tid = 10 + 3 * k
        x, y = data[k % 3]
        lr = 0.25 if k == 7 else 0.5  # another binding: no Repeat of the last one's patches alone
        messages: list[m.ClientMessage] = [m.Execute(GID, (x, tid, y), (lr,), tid + 1)]
        arrays = []
        if inline:
            a = np.full(3, k, np.float32)
            messages.insert(0, upload(tid, a))
            arrays.append(a)
        if k == 0:
            messages.insert(0, m.Register(GID, b"body"))
        else:
            messages.append(m.Drop((tid - 3, tid - 2)))
        submit_alike(seeing, blind, [*messages, m.Read(k + 1, tid + 1)], arrays, k + 1)
        for pair in pairs:
            pair.run()
            assert pair.waiter.answers[k + 1]
    assert seeing.client.counters.batches_repeated == blind.client.counters.batches_repeated == 7
    # seq 4 is the first Repeat (of seq 3, not of the uploads only), so seq 5 the first foreseen;
    # seq 9 differs elsewhere (a binding) and seq 10 follows it (a Repeat with bindings)
    assert afresh == [1, 2, 3, 4, 9, 10]


@pytest.mark.parametrize("extra", [b"", b"\x00", b"\x00" * 5], ids=["one short", "one over", "five over"])
def test_a_foreseen_reply_with_other_inline_bytes_than_its_results_is_refused(extra: bytes) -> None:
    pair = Pair()
    for k in range(3):  # a step's loss: the third reply is foreseen
        submit_roundtrip(pair, k + 1, k + 1, np.full(4, k, np.float32))
        pair.run()
    submit_roundtrip(pair, 4, 4, np.full(4, 3, np.float32))
    pair.send_all()
    reply = m.encode_reply(m.Reply(4, (m.Result(4, "float32", (4,), 16, True),)))
    body = np.full(4, 3, np.float32).tobytes()
    tail = body[:-1] if not extra else body + extra  # one byte short, or some over
    frame = pair.worker.conn.channel.seal(reply + tail)  # (the worker's, with the reply bytes foreseen)
    with pytest.raises(ProtocolError, match="inline bytes"):
        pair.client.receive(frame)


@pytest.mark.parametrize("nbytes", [4, CHUNK])
def test_a_reply_of_one_result_carries_it_inline_after_the_reply_as_any_small_reply_does(nbytes: int) -> None:
    client, worker = channels()
    conn: s.WorkerConnection[Reply] = s.WorkerConnection(worker, CHUNK)
    x = np.arange(nbytes // 4, dtype=np.float32)
    result = m.Result(5, "float32", x.shape, x.nbytes)
    (blob,) = conn.reply(9, [result], [x])
    (frame,) = split_frames(blob)
    kind, plaintext = client.open(frame)
    inline = m.Result(5, "float32", x.shape, x.nbytes, inline=True)
    assert kind is MESSAGE and plaintext == m.encode_reply(m.Reply(9, (inline,))) + x.tobytes()
    assert conn.acked == 9


def decoders_run(monkeypatch: pytest.MonkeyPatch, **labels: str) -> list[str]:
    """Which of messages' decoders each batch goes through from now on: each function named is
    wrapped to note its label (in call order) in the list returned."""
    seen: list[str] = []

    def noting(decode: Callable[..., Any], label: str) -> Callable[..., Any]:
        def noted(*a: Any) -> Any:
            seen.append(label)
            return decode(*a)

        return noted

    for name, label in labels.items():
        monkeypatch.setattr(m, name, noting(getattr(m, name), label))
    return seen


def step_alike(
    client: s.ClientConnection,
    predicting: s.WorkerConnection[Reply],
    plain: s.WorkerConnection[Reply],
    step: int,
    data: tuple[int, ...],
) -> m.Batch:
    """Step `step` of a replayed graph: an upload of 4 floats (id 10 + 2 * step), an Execute of the
    tensors `data` and that upload, the result read; it arrives at both workers alike
    (`arrives_alike`), and the client takes in the reply. The batch as the workers saw it."""
    tid = 10 + 2 * step
    x = np.full(4, step, np.float32)
    execute = m.Execute(GID, (*data, tid), (0.5,), tid + 1)
    client.submit([upload(tid, x), execute, m.Read(1 + step, tid + 1)], [x], 16)
    batch, reply = arrives_alike(client, predicting, plain, x, [m.Result(1 + step, "float32", (4,), 16)])
    for r in reply:
        client.receive(r)
    return batch


def test_a_repeat_sent_as_the_worker_foresaw_it_is_taken_in_as_the_full_decoding_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed = decoders_run(monkeypatch, decode_repeat="repeat", decode_batch_prefix="full")
    client, predicting, plain = client_and_two_workers()
    for step in range(5):
        batch = step_alike(client, predicting, plain, step, ())
        assert batch.received == step  # the client took in every reply before its next batch
    # The worker that never predicts decodes all five in full; the predicting one steps 0 and 1
    # (no Repeat yet, then the first), and takes 2, 3 and 4 by their foreseen bytes, unparsed.
    assert parsed == ["full"] * 7


@pytest.mark.parametrize(
    ("data", "parsed"),
    [
        # a data set's id kept (a resident DataLoader's step): the same patch every step, so steps
        # 2 to 4 are taken in by the bytes the worker foresaw, neither decoder run
        ((5,), ["full", "full"]),
        # batches cycled: other ids every step; no bytes foreseen can match, each is repatched
        ((1, 2), ["full", "full", "patched", "patched", "patched"]),
    ],
)
def test_a_patched_repeat_with_the_last_patches_is_taken_in_by_its_foreseen_bytes(
    monkeypatch: pytest.MonkeyPatch, data: tuple[int, ...], parsed: list[str]
) -> None:
    seen = decoders_run(monkeypatch, decode_repatched="patched", decode_batch_prefix="full")
    client, predicting, plain = client_and_two_workers()
    for step in range(5):
        tid = 10 + 2 * step
        batch = step_alike(client, predicting, plain, step, (data[step % len(data)],))
        assert seen.pop() == "full"  # the worker that never predicts decodes every batch in full
        assert batch.messages[1] == m.Execute(GID, (data[step % len(data)], tid), (0.5,), tid + 1)
        assert batch.received == step
    assert seen == parsed
