"""A hypothesis state machine over the sans-IO session pair (protocol/session.py): random valid
batches (uploads of random sizes, graph steps that repeat, syncs), the worker's replies delivered
at random points, graphs evicted from the worker, links dropped and the session resumed."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from emberlink.protocol import messages as m
from emberlink.protocol.limits import MAX_UNACKED_BATCHES, MAX_UNACKED_BYTES
from emberlink.protocol.session import within_flow

from .session_pair import Pair

CHUNK = 1 << 12
GIDS = [bytes([i]) * 16 for i in range(1, 4)]


class Once:
    """The client pump's side: each request resolved once (later answers ignored, as futures are)."""

    def __init__(self, pair: Pair) -> None:
        self.got: dict[int, Any] = {}
        self.order: list[int] = []
        waiter = pair.waiter
        original = waiter.on

        def on(events: Any) -> None:
            before = {rid: list(values) for rid, values in waiter.answers.items()}
            original(events)
            for rid, values in waiter.answers.items():
                if rid in waiter.wanted and len(values) > len(before.get(rid, [])):
                    waiter.wanted.discard(rid)
                    self.got[rid] = values[len(before.get(rid, []))]
                    self.order.append(rid)

        waiter.on = on  # type: ignore[method-assign]


class SessionPair(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair(chunk_size=CHUNK)
        self.once = Once(self.pair)
        self.expected: dict[int, Any] = {}
        self.batch_of: dict[int, int] = {}  # rid -> the seq of the batch that asked
        self.sent_bytes = 0
        self.next_rid = 1
        self.next_tid = 1
        self.registered: set[bytes] = set()
        for gid in GIDS:
            self.pair.graph_bodies[gid] = b"graph " + gid

    def _rid(self) -> int:
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.pair.waiter.wanted.add(rid)
        self.batch_of[rid] = self.pair.client.submitted + 1
        return rid

    def _submit(self, messages: list[m.ClientMessage], bulks: list[np.ndarray], nbytes: int) -> None:
        """As the executor does: wait for acks while one more batch would break flow control."""
        pair = self.pair
        while not within_flow(
            pair.client.unacked,
            self.sent_bytes - pair.waiter.acked_bytes,
            nbytes,
            MAX_UNACKED_BATCHES,
            MAX_UNACKED_BYTES,
        ):
            pair.run()
        self.sent_bytes += nbytes
        pair.client.submit(messages, bulks, nbytes)

    def _tid(self, n: int = 1) -> int:
        tid, self.next_tid = self.next_tid, self.next_tid + n
        return tid

    @rule(
        sizes=st.lists(
            st.sampled_from([0, 1, 8, CHUNK - 4, CHUNK, CHUNK + 4, 3 * CHUNK + 1]), min_size=1, max_size=3
        ),
        seed=st.integers(0, 255),
    )
    def upload_and_read(self, sizes: list[int], seed: int) -> None:
        messages: list[m.ClientMessage] = []
        bulks: list[np.ndarray] = []
        for i, size in enumerate(sizes):
            array = (np.arange(size, dtype=np.uint8) + seed + i).astype(np.uint8)
            tid, rid = self._tid(), self._rid()
            messages += [m.Upload(tid, "uint8", (size,), size), m.Read(rid, tid)]
            if size:
                bulks.append(array)
            self.expected[rid] = array
        self._submit(messages, bulks, sum(sizes))

    @rule(gid=st.sampled_from(GIDS), value=st.floats(-4, 4, width=32), steps=st.integers(1, 3))
    def graph_steps(self, gid: bytes, value: float, steps: int) -> None:
        """Steps of one shape, so that every one after the first goes as a Repeat."""
        for _ in range(steps):
            x = np.full(4, value, np.float32)
            tid = self._tid(2)
            rid = self._rid()
            messages: list[m.ClientMessage] = []
            if gid not in self.registered:
                self.registered.add(gid)
                messages.append(m.Register(gid, self.pair.graph_bodies[gid]))
            messages += [m.Upload(tid, "float32", (4,), 16), m.Execute(gid, (tid,), (), tid + 1)]
            messages += [m.Read(rid, tid + 1), m.Drop((tid, tid + 1))]
            self.expected[rid] = x
            self._submit(messages, [x], 16)
            self.batch_of[rid] = self.pair.client.submitted

    @rule()
    def sync(self) -> None:
        rid = self._rid()
        self.expected[rid] = None
        self._submit([m.Sync(rid)], [], 0)

    @rule()
    def send(self) -> None:
        self.pair.send_all()

    @rule()
    def deliver_to_worker(self) -> None:
        self.pair.deliver_up()

    @rule()
    def deliver_to_client(self) -> None:
        self.pair.deliver_down()

    @rule()
    def worker_evicts_its_graphs(self) -> None:
        self.pair.worker.graphs.clear()

    @precondition(lambda self: self.pair.client.submitted > 0)
    @rule()
    def link_drops_and_the_session_resumes(self) -> None:
        self.pair.resume()

    @invariant()
    def answers_are_intact_and_in_batch_order(self) -> None:
        # (within one reply, a result whose bytes follow in BULK frames completes after the
        # results carried inline or empty)
        batches = [self.batch_of[rid] for rid in self.once.order]
        assert batches == sorted(batches)
        for rid, value in self.once.got.items():
            want = self.expected[rid]
            if want is None:
                assert value is None
            else:
                np.testing.assert_array_equal(value, want)

    def teardown(self) -> None:
        pair = self.pair
        self.sync()
        pair.run()
        assert set(self.once.got) == set(self.expected), "every request answered"
        self.answers_are_intact_and_in_batch_order()
        pair.client.submit([m.Close("done")], [], 0)  # tells the worker every reply before it arrived
        pair.run()
        assert pair.worker.closed == "done"
        assert pair.client.unacked == 0 and not pair.client.pending()
        assert not pair.worker.conn.receiving_bulk
        assert pair.worker.pending is None
        assert len(pair.worker.conn.replies) <= 1  # the Close's reply, which nothing confirms later


TestSessionPair = SessionPair.TestCase
TestSessionPair.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
