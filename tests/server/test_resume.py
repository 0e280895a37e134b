"""Sessions that survive a dropped link: the client resumes on a new link with a one-time credential,
every batch runs exactly once, every tensor is intact; a replayed, stolen or late credential resumes
nothing. In-process worker, memory and gRPC links that the tests cut where they choose."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import emberlink as el
from emberlink.client.device import Device
from emberlink.client.remote import connect_link
from emberlink.errors import TransportError, WorkerLost
from emberlink.protocol import messages as m
from emberlink.protocol.channel import split_frames
from emberlink.protocol.handshake import ClientHandshake
from emberlink.protocol.identity import Identity
from emberlink.protocol.resume import Credential
from emberlink.server.session import Session, State
from emberlink.testing import InProcessWorker
from emberlink.transport.base import Blob
from emberlink.transport.loop import io_loop
from emberlink.transport.memory import MemoryLink

from ..training import mlp_losses
from .server_harness import executor_of, grpc_device, worker_stats


class Tap:
    """A memory Link a test can cut where it likes: it keeps every blob the client sent, can break
    after a number of blobs sent or received, and can fail on the client's side only (the worker
    still believes the link alive)."""

    def __init__(self, inner: MemoryLink) -> None:
        self.inner = inner
        self.peer = inner.peer
        self.sent: list[bytes] = []
        self.received = 0
        self.cut_after_send: int | None = None
        self.cut_after_recv: int | None = None
        self.silent = False  # fail here but leave the worker's end open

    def _break(self, why: str) -> TransportError:
        if not self.silent:
            self.inner.cut()
        return TransportError(why)

    async def send(self, blob: Blob) -> None:
        if self.cut_after_send is not None and len(self.sent) >= self.cut_after_send:
            raise self._break("cut while sending")
        self.sent.append(bytes(blob))
        await self.inner.send(blob)

    async def recv(self) -> bytes:
        blob = await self.inner.recv()
        self.received += 1
        if self.cut_after_recv is not None and self.received >= self.cut_after_recv:
            raise self._break("cut while receiving")
        return blob

    async def close(self) -> None:
        if not self.silent:
            await self.inner.close()

    def cut(self) -> None:
        self.inner.cut()


class Tapped:
    """A remote device whose every link is a Tap; `refuse` makes new links fail (the network is down)."""

    def __init__(
        self, worker: InProcessWorker, identity: Identity | None = None, window: float | None = None
    ):
        self.worker = worker
        self.taps: list[Tap] = []
        self.refuse = False
        self.gate: threading.Event | None = None  # reconnects wait for it (set from the test)

        async def open_tap() -> Tap:
            link = await worker.open_link()
            assert isinstance(link, MemoryLink)
            tap = Tap(link)
            self.taps.append(tap)
            return tap

        async def reconnect(_timeout: float) -> tuple[str, Tap]:
            while self.gate is not None and not self.gate.is_set():
                await asyncio.sleep(0.01)
            if self.refuse:
                raise TransportError("network unreachable (test)")
            return "memory", await open_tap()

        who = identity if identity is not None else worker.client
        executor = connect_link(
            open_tap, worker.node_id, who, path="memory", reconnect=reconnect, resume_window=window
        )
        self.dev = Device(executor, "remote(tap)")

    @property
    def tap(self) -> Tap:
        return self.taps[-1]

    def cut(self) -> None:
        on_loop(self.tap.cut)

    def credential(self) -> Credential:
        resumer = executor_of(self.dev)._session.resumer
        assert resumer is not None
        return resumer._candidates[0]


def on_loop(fn: Callable[[], object]) -> None:
    async def run() -> None:
        fn()

    io_loop().call(run(), 10)


def open_session(worker: InProcessWorker) -> Session:
    """The worker's session that is open (not a link carrying a resume)."""
    (session,) = [s for s in worker.worker.sessions if s._runner is not None]
    return session


def distinct_batches(dev: Device) -> int:
    stats = dev.stats()
    return int(stats["batches_sent"]) - int(stats["batches_resent"])


async def _present(
    worker: InProcessWorker, identity: Identity, credential: Credential, received: int = 0
) -> m.Reply:
    link = await worker.open_link()
    hs = ClientHandshake(
        identity, worker.node_id, os.urandom, token_for=lambda th2: credential.token(th2, received)
    )
    await link.send(hs.hello())
    auth, channel, _ = hs.receive_welcome(bytes(await link.recv()))
    await link.send(auth)
    (frame,) = split_frames(await asyncio.wait_for(link.recv(), 10))
    _, plaintext = channel.open(frame)
    await link.close()
    return m.decode_reply(plaintext)


def present(worker: InProcessWorker, identity: Identity, credential: Credential) -> m.Reply:
    """Open a raw link and present `credential` as `identity`: the worker's answer."""
    return worker.call(_present(worker, identity, credential))


def refusal(reply: m.Reply) -> str | None:
    """The worker's reason when the reply refuses a resume, else None."""
    errors = [msg for msg in reply.messages if type(msg) is m.Error and msg.rid == 0]
    return errors[0].message if errors else None


def test_training_goes_on_through_dropped_links_with_the_same_losses(worker: InProcessWorker) -> None:
    with el.Device.cpu() as cpu:
        expected = mlp_losses(cpu, 8)
    tapped = Tapped(worker)

    def cut_three_times() -> None:
        for _ in range(3):
            time.sleep(0.02)
            tapped.cut()

    cuts = threading.Thread(target=cut_three_times)
    cuts.start()
    got = mlp_losses(tapped.dev, 8)
    cuts.join()
    tapped.dev.sync()  # a cut after the last step: resumed too
    stats = tapped.dev.stats()
    assert got == expected
    resumes = int(stats["resumes"])
    assert resumes >= 1 and len(tapped.taps) == 1 + resumes
    tapped.dev.close()


def test_training_over_grpc_goes_on_when_its_call_is_cut(worker: InProcessWorker) -> None:
    with el.Device.cpu() as cpu:
        expected = mlp_losses(cpu, 6)
    with grpc_device(worker) as dev:
        first = mlp_losses(dev, 1)
        link = executor_of(dev)._session._link
        on_loop(link._call.cancel)  # type: ignore[attr-defined]  # the stream dies as in a reset
        time.sleep(0.05)
        assert mlp_losses(dev, 6) == expected  # a new model: the session still works in full
        assert first == expected[:1] and dev.stats()["resumes"] == 1 and dev.stats()["path"] == "grpc"


def test_a_batch_whose_reply_was_lost_runs_once_and_its_reply_comes_again(worker: InProcessWorker) -> None:
    tapped = Tapped(worker)
    dev = tapped.dev
    x = dev.tensor(np.arange(6, dtype=np.float32))
    assert float(x.sum()) == 15.0
    tapped.tap.cut_after_recv = tapped.tap.received + 1  # the next reply is lost, after the worker ran it
    y = x * 2.0 + 1.0
    np.testing.assert_array_equal(y.numpy(), np.arange(6, dtype=np.float32) * 2 + 1)
    assert dev.stats()["resumes"] == 1
    assert dev.stats()["batches_resent"] == 0  # the worker said it had applied it: nothing went again
    sent = distinct_batches(dev)  # the Stats batch below is not counted in its own answer
    assert worker_stats(dev)["session_batches"] == sent
    dev.close()


def test_a_batch_lost_on_the_way_is_sent_again_and_runs_once(worker: InProcessWorker) -> None:
    tapped = Tapped(worker)
    dev = tapped.dev
    x = dev.tensor(np.arange(6, dtype=np.float32))
    assert float(x.sum()) == 15.0
    tapped.tap.cut_after_send = len(tapped.tap.sent)  # the next batch never reaches the worker
    assert float((x * 3.0).sum()) == 45.0
    assert int(dev.stats()["batches_resent"]) >= 1
    sent = distinct_batches(dev)  # the Stats batch below is not counted in its own answer
    assert worker_stats(dev)["session_batches"] == sent
    dev.close()


def test_a_result_cut_off_mid_transfer_arrives_whole(worker: InProcessWorker) -> None:
    tapped = Tapped(worker)
    dev = tapped.dev
    data = np.random.default_rng(0).standard_normal(3 << 20).astype(np.float32)  # 12 MiB: many frames
    x = dev.tensor(data)
    dev.sync()
    tapped.tap.cut_after_recv = tapped.tap.received + 4  # a few MiB into the download
    np.testing.assert_array_equal((x + 1.0).numpy(), data + 1.0)
    assert dev.stats()["resumes"] == 1
    sent = distinct_batches(dev)  # the Stats batch below is not counted in its own answer
    assert worker_stats(dev)["session_batches"] == sent
    dev.close()


def test_an_upload_cut_off_mid_transfer_is_sent_again_whole(worker: InProcessWorker) -> None:
    tapped = Tapped(worker)
    dev = tapped.dev
    assert float(dev.tensor([1.0]).sum()) == 1.0
    data = np.random.default_rng(1).standard_normal(3 << 20).astype(np.float32)
    tapped.tap.cut_after_send = len(tapped.tap.sent) + 4
    np.testing.assert_array_equal((dev.tensor(data) * 2.0).numpy(), data * 2.0)
    assert dev.stats()["resumes"] == 1 and int(dev.stats()["batches_resent"]) >= 1
    assert worker.worker.memory_stats()["in_use_bytes"] >= data.nbytes  # stored once: nothing leaked
    dev.close()
    assert worker.worker.held.used == 0


def test_a_detached_session_keeps_its_tensors_and_its_memory_counted_until_resumed(
    worker: InProcessWorker,
) -> None:
    tapped = Tapped(worker)
    dev = tapped.dev
    data = np.arange(1 << 18, dtype=np.float32)
    x = dev.tensor(data)
    dev.sync()
    tapped.gate = threading.Event()  # the network stays down until the gate opens
    tapped.cut()
    deadline = time.monotonic() + 10
    while open_session(worker).state is not State.DETACHED and time.monotonic() < deadline:
        time.sleep(0.01)
    session = open_session(worker)
    assert session.state is State.DETACHED
    assert worker.worker.held.used >= data.nbytes  # still held, still counted
    assert worker.worker.resumes.window == 30.0
    tapped.gate.set()
    np.testing.assert_array_equal((x - 1.0).numpy(), data - 1.0)
    assert session.state.value == State.OPEN.value  # mypy narrowed `state` above; it has moved on
    dev.close()


def test_after_the_window_the_client_gets_worker_lost_and_the_worker_frees_the_session(make_worker) -> None:
    worker = make_worker(resume_window=0.5)
    tapped = Tapped(worker)
    dev = tapped.dev
    x = dev.tensor(np.ones(1 << 16, np.float32))
    dev.sync()
    tapped.refuse = True
    tapped.cut()
    started = time.monotonic()
    with pytest.raises(WorkerLost, match="resume window of 0.5 s") as lost:
        float(x.sum())
    assert time.monotonic() - started < 5
    assert str(lost.value).count("lost worker") == 1, str(lost.value)  # said once, not once a layer
    with pytest.raises(WorkerLost):
        dev.sync()
    deadline = time.monotonic() + 5
    while worker.worker.sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.worker.sessions and worker.worker.held.used == 0
    dev.close()


def test_a_worker_without_a_resume_window_ends_a_dropped_session_at_once(make_worker) -> None:
    worker = make_worker(resume_window=0)
    tapped = Tapped(worker)
    assert float(tapped.dev.tensor([2.0]).sum()) == 2.0
    tapped.cut()
    with pytest.raises(WorkerLost):
        tapped.dev.sync()
    assert len(tapped.taps) == 1  # it did not even try: the worker announced no window
    tapped.dev.close()


def test_a_used_credential_resumes_nothing(worker: InProcessWorker) -> None:
    tapped = Tapped(worker)
    dev = tapped.dev
    x = dev.tensor([1.0, 2.0])
    dev.sync()
    used = tapped.credential()
    tapped.cut()
    assert float(x.sum()) == 3.0 and dev.stats()["resumes"] == 1  # `used` resumed the session once
    answer = present(worker, worker.client, used)
    assert "cannot resume" in (refusal(answer) or "")
    assert float((x * 2.0).sum()) == 6.0  # the refusal did not disturb the session
    assert tapped.credential().id != used.id
    dev.close()


def test_a_credential_presented_by_another_client_is_refused_and_not_used_up(worker: InProcessWorker) -> None:
    tapped = Tapped(worker)
    dev = tapped.dev
    x = dev.tensor([1.0, 2.0])
    dev.sync()
    stolen = tapped.credential()
    thief = worker.new_client()  # admitted by the worker, but not the session's owner
    answer = present(worker, thief, stolen)
    assert "another client" in (refusal(answer) or "")
    tapped.cut()
    assert float(x.sum()) == 3.0 and dev.stats()["resumes"] == 1  # the owner's credential still works
    dev.close()


def test_a_credential_resumes_within_the_window_and_not_after_it(make_worker) -> None:
    worker = make_worker(resume_window=0.5)
    early, late = Tapped(worker, window=0), Tapped(worker, window=0)  # these clients never retry
    for tapped in (early, late):
        tapped.dev.tensor([1.0]).numpy()
    early_credential, late_credential = early.credential(), late.credential()
    early.cut()
    late.cut()
    time.sleep(0.05)
    answer = present(worker, worker.client, early_credential)
    assert refusal(answer) is None and answer.ack >= 1  # within the window: taken back
    time.sleep(1.0)
    assert "cannot resume" in (refusal(present(worker, worker.client, late_credential)) or "")
    for tapped in (early, late):
        tapped.dev.close()


def test_frames_recorded_before_the_drop_are_refused_after_the_resume(worker: InProcessWorker) -> None:
    tapped = Tapped(worker)
    dev = tapped.dev
    x = dev.tensor(np.ones(4, np.float32))
    assert float((x * 5.0).sum()) == 20.0
    first = tapped.tap
    recorded = list(first.sent)  # Hello, Auth, then sealed batches
    tapped.cut()
    assert float(x.sum()) == 4.0 and len(tapped.taps) == 2
    session = open_session(worker)
    runner = session._runner  # kept: a session that ended lets go of its runner
    assert runner is not None
    applied = runner.counters.batches

    # A whole recorded connection replayed as a new one: its Auth does not open under fresh keys.
    async def replay_connection() -> None:
        link = await worker.open_link()
        await link.send(recorded[0])
        await link.recv()
        for blob in recorded[1:]:
            try:
                await link.send(blob)
            except TransportError:
                break
        await link.close()

    worker.call(replay_connection())
    assert runner.counters.batches == applied and session.state is State.OPEN
    # The old link's batches replayed into the resumed link: refused (wrong keys and session id).
    worker.call(tapped.tap.inner.send(recorded[2]))
    with pytest.raises(el.RemoteError, match="refused|another session|authentication"):
        dev.sync()
    assert runner.counters.batches == applied


def test_a_resume_takes_over_a_link_the_worker_still_believes_alive(worker: InProcessWorker) -> None:
    tapped = Tapped(worker)
    dev = tapped.dev
    x = dev.tensor(np.arange(3, dtype=np.float32))
    dev.sync()
    tapped.tap.silent = True
    tapped.tap.cut_after_recv = tapped.tap.received + 1
    assert float((x + 1.0).sum()) == 6.0  # the client gave up the link; the worker had not noticed
    assert dev.stats()["resumes"] == 1
    assert open_session(worker).state is State.OPEN
    assert float((x * x).sum()) == 5.0
    dev.close()
    deadline = time.monotonic() + 5
    while worker.worker.sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.worker.sessions


def test_a_closed_device_leaves_nothing_waiting_for_a_resume(worker: InProcessWorker) -> None:
    tapped = Tapped(worker)
    tapped.dev.tensor(np.ones(1000, np.float32)).numpy()
    tapped.dev.close()
    deadline = time.monotonic() + 5
    while worker.worker.sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.worker.sessions and len(worker.worker.resumes) == 0


def test_draining_the_worker_ends_a_detached_session_at_once(worker: InProcessWorker) -> None:
    tapped = Tapped(worker, window=1)  # the drained worker stops listening: the client gives up after 1 s
    tapped.dev.tensor(np.ones(1 << 16, np.float32)).numpy()
    tapped.gate = threading.Event()
    tapped.cut()
    deadline = time.monotonic() + 10
    while open_session(worker).state is not State.DETACHED and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    worker.drain(10)
    assert time.monotonic() - started < 5  # not the 30 s window
    assert not worker.worker.sessions and worker.worker.held.used == 0
    tapped.gate.set()
    with pytest.raises(WorkerLost):
        tapped.dev.sync()
    tapped.dev.close()
