"""The tensor store's quota accounting: what a session holds is what its quota (and the worker's) says."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from emberlink.errors import ErrorCode, ProtocolError
from emberlink.server import store as store_module
from emberlink.server.store import ID_BYTES, Failure, Quota, TensorStore


def test_storing_many_results_charges_their_bytes_net_of_replaced_values_and_the_reservation() -> None:
    worker = Quota(None)
    store = TensorStore(Quota(4000, parent=worker))
    store.put(1, np.zeros(10, np.uint8), 10, charged=False)
    store.poison(3, Failure(ErrorCode.EXECUTION, "old failure"))
    assert store.quota.reserve(60)  # an Execute's outputs, reserved before it ran
    store.put_many([1, 2, 3], [np.zeros(n, np.uint8) for n in (20, 30, 10)], [20, 30, 10], reserved=60)
    # Each id also costs ID_BYTES (store.py): 3 ids of 20 + 30 + 10 bytes; the replaced value and
    # the replaced failure are freed, the 60 reserved bytes become part of the charge.
    assert store.quota.used == worker.used == 60 + 3 * ID_BYTES
    assert store.get(3).nbytes == 10  # the stored value replaced the failure
    store.drop_many([1, 3, 99])  # an unknown id is ignored
    assert store.quota.used == worker.used == 30 + ID_BYTES and len(store) == 1
    store.clear()
    assert store.quota.used == worker.used == 0 and store.quota.peak == worker.peak == 60 + 3 * ID_BYTES


def test_values_of_many_ids_come_in_order_or_fail_with_the_first_id_that_has_none() -> None:
    store = TensorStore(Quota(None))
    a, b = np.zeros(2, np.uint8), np.ones(3, np.uint8)
    store.put(1, a, 2, charged=False)
    store.put(2, b, 3, charged=False)
    store.poison(3, Failure(ErrorCode.EXECUTION, "it failed"))
    assert [x is y for x, y in zip(store.get_many([2, 1, 2]), [b, a, b], strict=True)] == [True] * 3
    with pytest.raises(LookupError) as failed:
        store.get_many([1, 3, 9])
    assert failed.value.args[0] == Failure(ErrorCode.EXECUTION, "it failed")
    with pytest.raises(LookupError) as unknown:
        store.get_many([1, 9, 3])
    assert (
        unknown.value.args[0].code == ErrorCode.UNKNOWN_TENSOR and "tensor 9" in unknown.value.args[0].message
    )


def test_a_dropped_array_a_reply_still_holds_stays_charged_until_it_is_garbage() -> None:
    worker = Quota(None)
    store = TensorStore(Quota(None, parent=worker))
    store.put(1, np.zeros(100, np.uint8), 100, charged=False)
    store.put(2, np.zeros(50, np.uint8), 50, charged=False)
    store.poison(3, Failure(ErrorCode.EXECUTION, "failed"))
    held = store.get(1)  # e.g. a Result waiting to be sent
    store.drop_many([1, 2, 3])
    # 2 and the failure are freed at once; 1's bytes follow the array, not the id.
    assert len(store) == 0 and store.peek(1) is None
    assert store.quota.used == worker.used == 100 + ID_BYTES
    del held
    assert store.quota.used == worker.used == 0


def test_a_stored_tiny_tensor_costs_the_store_one_object_besides_its_array() -> None:
    # The entry alone (array and size): its charge, size + ID_BYTES, is computed when released,
    # not kept as one more int per id, which would outlive a session holding many tiny tensors as
    # allocator fragmentation (issue 12).
    store = TensorStore(Quota(None))
    arrays = [np.ones(1, np.float32) for _ in range(2000)]
    tids = list(range(1000, 1000 + len(arrays)))  # ints made before measuring, as a decoded message's
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for tid, a in zip(tids, arrays, strict=True):
            store.put(tid, a, a.nbytes, charged=False)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    only = [tracemalloc.Filter(True, store_module.__file__)]
    grown = after.filter_traces(only).compare_to(before.filter_traces(only), "filename")
    assert sum(s.count_diff for s in grown) <= len(arrays) + 20  # + the dict's table as it grows
    assert store.quota.used == len(arrays) * (4 + ID_BYTES) == store.nbytes
    del a
    arrays.clear()  # the store holds the only references now
    store.drop_many(tids)
    assert store.quota.used == 0


def test_ids_past_the_stores_limit_are_refused_and_nothing_reserved_for_them_stays_charged() -> None:
    quota = Quota(None)
    store = TensorStore(quota, max_ids=3)
    a = np.ones(4, np.float32)
    store.put(1, a, a.nbytes, charged=False)
    store.poison(2, Failure(ErrorCode.EXECUTION, "failed"))  # a failed id counts as held too
    held = quota.used
    assert quota.reserve(2 * (a.nbytes + ID_BYTES))
    with pytest.raises(ProtocolError, match="--max-session-tensors"):
        store.put_many((3, 4), (a, a), [a.nbytes, a.nbytes], reserved=2 * (a.nbytes + ID_BYTES))
    assert quota.used == held and len(store) == 1
    store.put(1, a, a.nbytes, charged=False)  # replacing an id it holds needs no room
    store.put_many((3,), (a,), [a.nbytes])  # the third id fits
    assert quota.reserve(a.nbytes + ID_BYTES)
    with pytest.raises(ProtocolError, match="4 tensor ids"):
        store.put(5, a, a.nbytes, charged=True)
    with pytest.raises(ProtocolError, match="--max-session-tensors"):
        store.poison(6, Failure(ErrorCode.EXECUTION, "failed"))
    store.drop_many((1, 2, 3))
    del a  # the arrays stay charged while anything holds them (here this test)
    assert quota.used == 0
