"""When a batch's Drops free their arrays: after the reply when only Reads follow them on the loop, else at once."""

from __future__ import annotations

import weakref
from typing import Any, cast

import numpy as np

from emberlink.graph_replay.numpy_backend import NumpyBackend
from emberlink.protocol import messages as m
from emberlink.server.runner import BatchRunner, Incoming
from emberlink.server.store import ID_BYTES, Quota, TensorStore


def runner_and_store() -> tuple[BatchRunner, TensorStore]:
    store = TensorStore(Quota(None, parent=Quota(None)))
    graphs = cast(Any, None)  # these batches execute no graph
    return BatchRunner(NumpyBackend(), store, graphs, dict, Quota(None)), store


def batch(seq: int, messages: list[m.ClientMessage], uploads: list[np.ndarray]) -> Incoming:
    return Incoming(m.Batch(seq, tuple(messages)), list(uploads), 0)


def upload(tid: int, a: np.ndarray) -> m.Upload:
    return m.Upload(tid, "float32", a.shape, a.nbytes)


def test_arrays_a_drop_followed_only_by_reads_frees_are_let_go_after_the_reply_and_uncharged_at_once() -> (
    None
):
    runner, store = runner_and_store()
    a, b = np.zeros(256, np.float32), np.ones(4, np.float32)
    runner.apply(batch(1, [upload(1, a), upload(2, b)], [a, b]))
    runner.let_go()
    del a  # (the store holds it alone)
    dropped = weakref.ref(store.peek(1))
    out = runner.apply(batch(2, [m.Drop((1,)), m.Read(1, 2)], []), free_after=True)
    assert out is not None and out.messages == [m.Result(1, "float32", (4,), 16)]
    assert store.peek(1) is None and store.quota.used == 16 + ID_BYTES  # id gone, bytes uncharged
    assert dropped() is not None  # ...the array itself waits for the reply
    runner.let_go()
    assert dropped() is None


def test_arrays_a_drop_frees_before_an_upload_or_execute_are_freed_at_once() -> None:
    runner, store = runner_and_store()
    a, b = np.zeros(256, np.float32), np.ones(4, np.float32)
    runner.apply(batch(1, [upload(1, a)], [a]))
    del a  # (the store holds it alone)
    dropped = weakref.ref(store.peek(1))
    runner.apply(batch(2, [m.Drop((1,)), upload(3, b), m.Read(1, 3)], [b]), free_after=True)
    assert dropped() is None and store.quota.used == 16 + ID_BYTES


def test_without_free_after_a_drop_frees_its_arrays_at_once() -> None:
    runner, store = runner_and_store()
    a, b = np.zeros(256, np.float32), np.ones(4, np.float32)
    runner.apply(batch(1, [upload(1, a), upload(2, b)], [a, b]))
    del a  # (the store holds it alone)
    dropped = weakref.ref(store.peek(1))
    runner.apply(batch(2, [m.Drop((1,)), m.Read(1, 2)], []))  # as on the device thread
    assert dropped() is None
