"""The raw TCP transport over real loopback sockets: the shared Link checks, and peers that break the
framing, die, freeze or stop reading."""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from emberlink.errors import ConfigError, TransportError, TransportTimeout
from emberlink.settings import SPIN_ENV
from emberlink.transport import tcp
from emberlink.transport.base import MAX_BLOB, Handler, Link

from .transport_checks import (
    Child,
    Recorder,
    blobs,
    check_client_close_reaches_the_worker_after_its_last_blob,
    check_handler_return_closes_the_client,
    check_sessions_are_isolated,
    check_sigkilled_client_makes_worker_recv_raise,
    check_sigkilled_worker_makes_client_recv_raise,
    client_script,
    echo,
    echo_once,
    echo_worker_script,
    ping_pong,
    pipelined,
    within,
)

ECHO_WORKER = echo_worker_script("tcp", "TcpListener")

CLIENT = client_script("tcp")


async def started(handler: Handler) -> tuple[tcp.TcpListener, int]:
    listener = tcp.TcpListener("127.0.0.1", 0, handler)
    return listener, await listener.start()


async def raw_socket(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A plain TCP connection to the listener, for writing bytes no Link would."""
    return await asyncio.open_connection("127.0.0.1", port)


async def test_blobs_round_trip_whole_and_in_order() -> None:
    listener, port = await started(echo)
    link = await tcp.connect("127.0.0.1", port)
    sent = blobs([0, 1, 64, 4096, tcp.SLICE - 1, tcp.SLICE + 64, 3 * tcp.SLICE + 5])
    assert await ping_pong(link, sent) == sent
    many = blobs([100] * 200 + [1 << 20] * 8 + [5] * 50)
    assert await pipelined(link, many) == many
    await link.close()
    await listener.stop(1)


async def test_blobs_up_to_max_blob_pass_and_larger_are_refused_on_send() -> None:
    listener, port = await started(echo)
    link = await tcp.connect("127.0.0.1", port)
    sent = blobs([MAX_BLOB])
    assert await ping_pong(link, sent) == sent
    with pytest.raises(TransportError, match="exceeds"):
        await link.send(bytes(MAX_BLOB + 1))
    assert await ping_pong(link, [b"still open"]) == [b"still open"]
    await link.close()
    await listener.stop(1)


async def test_concurrent_sessions_are_isolated() -> None:
    listener, port = await started(echo)
    links = [await tcp.connect("127.0.0.1", port) for _ in range(4)]
    await check_sessions_are_isolated(links, [blobs([i + 1, 5000, 70_000] * 5) for i in range(len(links))])
    await listener.stop(1)


async def test_concurrent_large_sends_on_one_link_do_not_interleave() -> None:
    listener, port = await started(echo)
    link = await tcp.connect("127.0.0.1", port)
    sent = blobs([3 * tcp.SLICE, 10, 2 * tcp.SLICE + 7, 20])
    await asyncio.gather(*(link.send(b) for b in sent))
    got = [bytes(await within(10, link.recv())) for _ in sent]
    assert got == sent  # whole blobs, in the order the sends started
    await link.close()
    await listener.stop(1)


async def test_client_close_makes_the_worker_recv_raise_after_its_last_blob() -> None:
    recorder = Recorder()
    listener, port = await started(recorder)
    await check_client_close_reaches_the_worker_after_its_last_blob(
        await tcp.connect("127.0.0.1", port), recorder
    )
    await listener.stop(1)


async def test_worker_handler_return_makes_client_recv_raise_peer_closed() -> None:
    listener, port = await started(echo_once)
    await check_handler_return_closes_the_client(await tcp.connect("127.0.0.1", port))
    await listener.stop(1)


async def test_own_close_wakes_a_pending_recv_with_transport_error() -> None:
    listener, port = await started(echo)
    link = await tcp.connect("127.0.0.1", port)
    pending = asyncio.create_task(link.recv())
    await asyncio.sleep(0.05)
    await link.close()
    with pytest.raises(TransportError, match="closed"):
        await within(5, pending)
    with pytest.raises(TransportError, match="closed"):
        await link.send(b"after close")
    await listener.stop(1)


async def test_listener_stop_ends_sessions_and_refuses_new_ones() -> None:
    listener, port = await started(echo)
    link = await tcp.connect("127.0.0.1", port)
    await listener.stop(0)
    with pytest.raises(TransportError):
        await within(5, link.recv())
    with pytest.raises(TransportError, match=f"127.0.0.1:{port}"):
        await tcp.connect("127.0.0.1", port, timeout=5)
    await link.close()


async def test_connect_where_nothing_listens_fails_fast_naming_the_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        started_at = time.monotonic()
        with pytest.raises(TransportError, match=f"127.0.0.1:{port}") as info:
            await tcp.connect("127.0.0.1", port, timeout=30)
    assert not isinstance(info.value, TransportTimeout)
    assert time.monotonic() - started_at < 15


async def test_second_listener_on_a_taken_port_fails_instead_of_sharing_it() -> None:
    listener, port = await started(echo)
    with pytest.raises(TransportError, match=f"127.0.0.1:{port}"):
        await tcp.TcpListener("127.0.0.1", port, echo).start()
    await listener.stop(1)


async def test_memoryview_and_bytearray_blobs_are_sent_whole() -> None:
    listener, port = await started(echo)
    link = await tcp.connect("127.0.0.1", port)
    data = bytearray(b"sealed frame")
    big = bytearray(b"x" * (2 * tcp.SLICE + 3))
    for blob in (memoryview(data), data, memoryview(big)):
        await link.send(blob)
    assert [bytes(await link.recv()) for _ in range(3)] == [bytes(data), bytes(data), bytes(big)]
    await link.close()
    await listener.stop(1)


LOOPS = ["asyncio", "uvloop"]


def run_on(loop: str, main: Callable[[], Any]) -> None:
    """`main()` on asyncio's event loop or uvloop's (what emberlink runs on, transport/loop.py)."""
    factory = asyncio.new_event_loop if loop == "asyncio" else pytest.importorskip("uvloop").new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_stream_cut_anywhere_delivers_every_blob_whole_and_unchanged_by_later_reads(loop: str) -> None:
    run_on(loop, _stream_cut_anywhere)


async def _stream_cut_anywhere() -> None:
    # Cuts inside prefixes, inside small and large bodies, and several blobs in one piece; the
    # blobs wait unread until the last one is in, so the loop's later reads, which reuse one
    # buffer, must not have changed those delivered before.
    sizes = [0, 3, 70_000, 5, tcp._READ_BUFFER - 4, tcp._READ_BUFFER + 1, 12, 401_000, 1, 2 * tcp.SLICE + 7]
    sent = blobs(sizes)
    stream = b"".join(len(b).to_bytes(4, "big") + b for b in sent)
    starts = list(itertools.accumulate((4 + len(b) for b in sent), initial=0))
    whole = {starts[i] for i in (1, 2, 3, 4, 6, 7)}  # pieces that are exactly one small blob, too
    inside = {2, starts[2] + 2, 40_001, *range(70_020, 70_100, 7), 200_000, 600_000, len(stream) - 3}
    cuts = sorted(whole | inside)
    received: asyncio.Future[list[bytes | memoryview]] = asyncio.get_running_loop().create_future()
    written = asyncio.Event()

    async def collect(link: Link) -> None:
        await written.wait()
        received.set_result([await link.recv() for _ in sent])

    listener, port = await started(collect)
    _, writer = await raw_socket(port)
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        writer.write(stream[start:end])
        await writer.drain()
        await asyncio.sleep(0.002)  # each piece read on its own
    await asyncio.sleep(0.05)
    written.set()
    got = await within(5, received)
    assert [bytes(b) for b in got] == sent
    writer.close()
    await listener.stop(1)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_large_blob_leaves_in_one_write_with_its_length_prefix_where_the_loop_can(loop: str) -> None:
    # One syscall and one segment: a prefix written alone wakes the peer for four bytes. asyncio's
    # writelines joins its buffers (a copy) before Python 3.12: there the prefix goes alone.
    run_on(
        loop, functools.partial(_large_blob_write, vectored=loop == "uvloop" or sys.version_info >= (3, 12))
    )


async def _large_blob_write(vectored: bool) -> None:
    listener, port = await started(echo)
    link = await tcp.connect("127.0.0.1", port)
    assert link._transport is not None
    calls: list[list[int]] = []
    transport = link._transport
    write, writelines = transport.write, transport.writelines

    class Recording:
        def __getattr__(self, name: str) -> Any:
            return getattr(transport, name)

        def write(self, data: Any) -> None:
            calls.append([len(data)])
            write(data)

        def writelines(self, parts: Any) -> None:
            parts = list(parts)
            calls.append([len(p) for p in parts])
            writelines(parts)

    link._transport = Recording()  # type: ignore[assignment]
    big = os.urandom(tcp.SLICE + 10)
    await link.send(big)
    assert bytes(await within(5, link.recv())) == big
    assert link._vectored is vectored
    assert calls == ([[4, tcp.SLICE], [10]] if vectored else [[4], [tcp.SLICE], [10]])
    link._transport = transport
    await link.close()
    await listener.stop(1)


async def test_a_receiver_takes_blobs_as_they_come_and_what_it_declines_waits_for_recv_in_order() -> None:
    listener, port = await started(echo)
    link = await tcp.connect("127.0.0.1", port)
    taken: list[bytes] = []
    decline = {b"3"}

    def on_blob(blob: bytes | memoryview) -> bool:
        if bytes(blob) in decline:
            return False
        taken.append(bytes(blob))
        return True

    link.set_receiver(on_blob)
    for i in range(1, 7):
        await link.send(str(i).encode())
    for _ in range(500):  # until the echoes are in
        if len(taken) == 2 and link._frames and len(link._frames) == 4:
            break
        await asyncio.sleep(0.01)
    # "3" was declined: it and every blob after it wait for recv, in order, even those the
    # receiver would take.
    assert taken == [b"1", b"2"]
    assert [bytes(await link.recv()) for _ in range(4)] == [b"3", b"4", b"5", b"6"]
    await link.send(b"7")  # nothing queued any more: the receiver has it again
    await within(5, _until(lambda: taken == [b"1", b"2", b"7"]))
    link.set_receiver(None)
    await link.send(b"8")
    assert bytes(await within(5, link.recv())) == b"8"
    await link.close()
    await listener.stop(1)


async def _until(done: Callable[[], bool]) -> None:
    while not done():
        await asyncio.sleep(0.01)


async def test_the_link_ends_for_recv_while_a_receiver_takes_its_blobs() -> None:
    listener, port = await started(echo_once)
    link = await tcp.connect("127.0.0.1", port)
    taken: list[bytes] = []

    def take(blob: bytes | memoryview) -> bool:
        taken.append(bytes(blob))
        return True

    link.set_receiver(take)
    await link.send(b"last")
    with pytest.raises(TransportError, match="closed the session"):
        await within(5, link.recv())
    assert taken == [b"last"]  # delivered before the end was told
    await link.close()
    await listener.stop(1)


async def test_send_nowait_writes_a_small_blob_now_and_declines_what_would_wait() -> None:
    listener, port = await started(echo)
    link = await tcp.connect("127.0.0.1", port)
    assert link.send_nowait(b"now")
    assert bytes(await within(5, link.recv())) == b"now"
    assert not link.send_nowait(bytes(tcp.SMALL + 1))  # a large blob goes through send, in slices
    assert not link.send_nowait(bytearray(b"copy"))  # only bytes: a buffer may change after the call
    await link.close()
    assert not link.send_nowait(b"closed")  # send raises for it
    with pytest.raises(TransportError, match="closed"):
        await link.send(b"closed")
    await listener.stop(1)


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        ((MAX_BLOB + 1).to_bytes(4, "big") + b"x", "malformed length prefix"),
        ((0xFFFF_FFF0).to_bytes(4, "big"), "malformed length prefix"),
        ((100).to_bytes(4, "big") + b"only ten b", "middle of a blob"),
        (b"\x00\x00", "middle of a blob"),
    ],
    ids=["oversize", "garbage-prefix", "truncated-body", "truncated-prefix"],
)
async def test_bad_framing_ends_that_session_with_a_clear_error_and_the_worker_serves_others(
    raw: bytes, error: str
) -> None:
    recorder = Recorder()
    listener, port = await started(recorder)
    _, writer = await raw_socket(port)
    writer.write((3).to_bytes(4, "big") + b"ok!" + raw)
    await writer.drain()
    writer.write_eof()
    ended = await within(5, recorder.ended)
    assert isinstance(ended, TransportError) and error in str(ended)
    assert recorder.received == [b"ok!"]
    writer.close()
    other = await tcp.connect("127.0.0.1", port)
    await other.send(b"next session")
    await other.close()
    listener2_received = recorder.received  # the same handler serves the new session
    for _ in range(100):
        if b"next session" in listener2_received:
            break
        await asyncio.sleep(0.01)
    assert b"next session" in listener2_received
    await listener.stop(1)


async def test_peer_that_never_reads_blocks_send_instead_of_buffering() -> None:
    gate = asyncio.Event()

    async def sleeper(link: Link) -> None:
        await gate.wait()  # never reads until told

    listener, port = await started(sleeper)
    link = await tcp.connect("127.0.0.1", port)
    blob = bytes(tcp.SLICE)
    sent = 0

    async def flood() -> None:
        nonlocal sent
        while True:
            await link.send(blob)
            sent += 1

    task = asyncio.create_task(flood())
    await asyncio.sleep(1.0)
    # The worker's queue (pauses at RECV_BUFFER_BYTES), the kernel's socket buffers and one slice in
    # flight: bounded, not the hundreds of MiB an unbounded buffer would take in a second.
    assert not task.done()
    assert sent * len(blob) < tcp.RECV_BUFFER_BYTES + 64 * tcp.SLICE
    assert link._transport is not None and link._transport.get_write_buffer_size() <= 2 * tcp.SLICE
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    await link.close()
    await listener.stop(1)


async def test_reader_that_catches_up_resumes_a_paused_connection() -> None:
    release = asyncio.Event()
    got: list[int] = []

    async def slow(link: Link) -> None:
        await release.wait()
        while True:
            got.append(len(await link.recv()))

    listener, port = await started(slow)
    link = await tcp.connect("127.0.0.1", port)
    count = 2 * tcp.RECV_BUFFER_BYTES // MAX_BLOB + 4  # more than the worker queues before pausing
    sending = asyncio.gather(*(link.send(bytes(MAX_BLOB)) for _ in range(count)))
    await asyncio.sleep(0.3)
    release.set()
    await within(30, sending)
    for _ in range(3000):
        if len(got) == count:
            break
        await asyncio.sleep(0.01)
    assert got == [MAX_BLOB] * count
    await link.close()
    await listener.stop(1)


async def test_idle_session_survives_several_keepalive_rounds() -> None:
    listener, port = await started(echo)
    link = await tcp.connect("127.0.0.1", port)
    await asyncio.sleep(tcp.DEAD_AFTER_S * 1.5)
    assert await ping_pong(link, [b"still here"]) == [b"still here"]
    await link.close()
    await listener.stop(1)


async def test_sigkilled_worker_makes_client_recv_raise_promptly() -> None:
    await check_sigkilled_worker_makes_client_recv_raise(
        ECHO_WORKER, lambda port: tcp.connect("127.0.0.1", port)
    )


async def test_sigkilled_client_makes_worker_recv_raise_promptly() -> None:
    recorder = Recorder()
    listener, port = await started(recorder)
    await check_sigkilled_client_makes_worker_recv_raise(CLIENT, port, recorder)
    await listener.stop(1)


async def test_frozen_worker_is_noticed_by_keepalive() -> None:
    async with Child(ECHO_WORKER) as worker:
        link = await tcp.connect("127.0.0.1", int(worker.ready_line))
        assert await ping_pong(link, [b"alive"]) == [b"alive"]
        worker.signal(signal.SIGSTOP)  # the socket stays open: only the heartbeat can tell
        with pytest.raises(TransportError, match="no sign of life"):
            await within(tcp.DEAD_AFTER_S + 5, link.recv())
        await link.close()


async def test_frozen_client_is_noticed_by_keepalive() -> None:
    recorder = Recorder()
    listener, port = await started(recorder)
    async with Child(CLIENT, str(port)) as client:
        await asyncio.sleep(0.1)
        client.signal(signal.SIGSTOP)
        error = await within(tcp.DEAD_AFTER_S + 5, recorder.ended)
    assert isinstance(error, TransportError) and "no sign of life" in str(error)
    await listener.stop(1)


# -- a socket owned by a user thread (transport/tcp.py, "Owned by a user thread") -------------------


def keeper(into: list[bytes]) -> Callable[[bytes | memoryview], bool]:
    """A receiver that keeps every blob."""

    def keep(blob: bytes | memoryview) -> bool:
        into.append(bytes(blob))
        return True

    return keep


async def parked(link: tcp.TcpLink, taken: list[bytes], blob: bytes = b"park") -> None:
    """Make `link` parkable, hand what arrives to `taken`, send `blob` and wait for the peer's
    answer to arrive (the link parks then)."""
    link.set_receiver(keeper(taken))
    link.allow_parking(lambda: True)
    count = len(taken)
    await link.send(blob)
    await within(5, until(lambda: len(taken) > count))


async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A raw peer's answer to `parked`'s blob."""
    await reader.readexactly(int.from_bytes(await reader.readexactly(4), "big"))
    writer.write((2).to_bytes(4, "big") + b"hi")


class RawPeer:
    """A plain asyncio server running `handler` for each connection, every connection closed at the end."""

    def __init__(self, handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any]) -> None:
        self._handler = handler
        self._writers: list[asyncio.StreamWriter] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        await self._handler(reader, writer)

    async def __aenter__(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for writer in self._writers:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass
        await self._server.wait_closed()


def owner_round_trip(link: tcp.TcpLink, blob: bytes) -> list[bytes]:
    """On a user thread: claim the link, write `blob`, read until a blob comes back, release."""
    assert link.try_claim()
    got: list[bytes] = []
    try:
        assert link.write_direct(blob)
        while not got:
            assert link.read_direct(keeper(got))
    finally:
        link.release(keep=True)
    return got


async def test_a_parked_link_is_written_and_read_by_the_thread_that_claims_it_then_by_the_loop() -> None:
    listener, port = await started(echo)
    link = await tcp.connect("127.0.0.1", port)
    taken: list[bytes] = []
    await parked(link, taken, b"first")
    for n in (1, 100, tcp.SMALL):
        blob = os.urandom(n)
        assert await asyncio.to_thread(owner_round_trip, link, blob) == [blob]
    assert taken == [b"first"]  # what the owner read was its own
    await link.send(b"loop")  # the loop takes the parked link back, and reads again
    await within(5, until(lambda: taken == [b"first", b"loop"]))
    assert await asyncio.to_thread(owner_round_trip, link, b"again") == [b"again"]  # parked again
    await link.close()
    await listener.stop(1)


async def test_work_handed_to_the_loop_keeps_the_link_from_being_claimed_until_it_has_run() -> None:
    listener, port = await started(echo)
    link = await tcp.connect("127.0.0.1", port)
    taken: list[bytes] = []
    await parked(link, taken)
    ran: list[bool] = []
    link.call_on_loop(lambda: ran.append(link.try_claim()))  # (its own claim: the call has begun)
    assert not link.try_claim()
    await within(5, until(lambda: bool(ran)))
    assert ran == [True]
    link.release(keep=True)
    await link.close()
    await listener.stop(1)


async def test_the_loop_taking_a_link_back_makes_its_owner_release_at_once() -> None:
    listener, port = await started(echo)
    link = await tcp.connect("127.0.0.1", port)
    taken: list[bytes] = []
    await parked(link, taken)
    claimed = threading.Event()
    reads: list[bool] = []

    def owner() -> None:
        assert link.try_claim()
        claimed.set()
        while True:  # nothing comes back to it: only the loop's call ends its wait
            ok = link.read_direct(lambda b: True)
            reads.append(ok)
            if not ok:
                break
        link.release(keep=True)

    thread = asyncio.create_task(asyncio.to_thread(owner))
    await within(5, asyncio.to_thread(claimed.wait))
    await within(5, link.send(b"from the loop"))  # waits for the owner to release
    await within(5, thread)
    assert reads[-1] is False
    await within(5, until(lambda: taken == [b"park", b"from the loop"]))
    await link.close()
    await listener.stop(1)


async def test_an_owner_notices_a_silent_peer_and_the_link_ends_saying_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tcp, "KEEPALIVE_S", 0.05)
    monkeypatch.setattr(tcp, "DEAD_AFTER_S", 0.3)

    async def one_blob_then_silence(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_once(reader, writer)
        await reader.read()  # reads the heartbeats, never answers them

    def owner() -> None:
        assert link.try_claim()
        while link.read_direct(lambda b: True):
            pass
        link.release(keep=True)

    async with RawPeer(one_blob_then_silence) as port:
        link = await tcp.connect("127.0.0.1", port)
        await parked(link, [])
        await within(10, asyncio.to_thread(owner))
        with pytest.raises(TransportError, match="no sign of life"):
            await within(5, link.recv())
        await link.close()


async def test_an_owner_sends_heartbeats_while_it_waits_even_when_the_peer_chatters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tcp, "KEEPALIVE_S", 0.05)
    heard: list[bytes] = []

    async def busy_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_once(reader, writer)
        await reader.readexactly(int.from_bytes(await reader.readexactly(4), "big"))  # the request

        async def listen() -> None:  # what the client says meanwhile
            while True:
                heard.append(await reader.readexactly(4))

        listening = asyncio.create_task(listen())
        for _ in range(50):  # busy for ten keepalive periods, sending its own heartbeats meanwhile
            writer.write((0xFFFF_FFFF).to_bytes(4, "big"))
            await asyncio.sleep(0.01)
        listening.cancel()
        writer.write((6).to_bytes(4, "big") + b"answer")

    async with RawPeer(busy_worker) as port:
        link = await tcp.connect("127.0.0.1", port)
        await parked(link, [])
        assert await within(20, asyncio.to_thread(owner_round_trip, link, b"request")) == [b"answer"]
        assert len(heard) >= 3 and set(heard) == {(0xFFFF_FFFF).to_bytes(4, "big")}
        await link.close()


async def test_what_an_owner_cannot_write_at_once_goes_from_the_loop_first_and_in_order() -> None:
    go = asyncio.Event()
    got: list[bytes] = []

    async def slow_reader(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_once(reader, writer)
        await go.wait()  # until then the socket's buffers fill up
        while not got or got[-1] != b"after":
            n = int.from_bytes(await reader.readexactly(4), "big")
            if n != 0xFFFF_FFFF:  # a heartbeat
                got.append(await reader.readexactly(n))

    def owner() -> list[bytes]:
        assert link.try_claim()
        written = []
        for i in range(100_000):
            blob = i.to_bytes(4, "big") * (tcp.SMALL // 4)
            written.append(blob)
            if not link.write_direct(blob):
                break
        link.release(keep=True)  # something is left to write: the loop's now
        return written

    async with RawPeer(slow_reader) as port:
        link = await tcp.connect("127.0.0.1", port)
        await parked(link, [])
        written = await within(30, asyncio.to_thread(owner))
        assert len(written) < 100_000  # a buffer filled up
        sending = asyncio.create_task(link.send(b"after"))
        go.set()
        await within(30, sending)
        await within(30, until(lambda: bool(got) and got[-1] == b"after"))
        assert got == [*written, b"after"]
        await link.close()


async def until(done: Callable[[], bool]) -> None:
    while not done():
        await asyncio.sleep(0.01)


async def next_blob(reader: asyncio.StreamReader) -> bytes:
    """The next blob a raw peer reads, heartbeats skipped."""
    while (n := int.from_bytes(await reader.readexactly(4), "big")) == 0xFFFF_FFFF:
        pass
    return await reader.readexactly(n)


async def test_an_owner_polls_without_sleeping_only_while_answers_come_within_the_spin_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SPIN_ENV, "100000")  # 100 ms
    delays = [0.002, 0.5, 0.002, 0.002]  # seconds the peer takes to answer each request
    yields: list[int] = []  # sched_yield calls during each round trip (polls without sleeping)
    count = [0]
    sched_yield = os.sched_yield

    def counted() -> None:
        count[0] += 1
        sched_yield()

    monkeypatch.setattr(os, "sched_yield", counted)

    async def slow_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_once(reader, writer)
        for delay in delays:
            blob = await next_blob(reader)
            await asyncio.sleep(delay)
            writer.write(len(blob).to_bytes(4, "big") + blob)

    def round_trips() -> list[list[bytes]]:
        out = []
        for k in range(len(delays)):
            count[0] = 0
            out.append(owner_round_trip(link, b"step %d" % k))
            yields.append(count[0])
        return out

    async with RawPeer(slow_echo) as port:
        link = await tcp.connect("127.0.0.1", port)
        await parked(link, [])
        got = await within(20, asyncio.to_thread(round_trips))
        assert got == [[b"step %d" % k] for k in range(len(delays))]
        await link.close()
    # the first answer comes within the spin time; the second does not (spun, then slept), so the
    # third wait sleeps at once; it was short, so the fourth spins again
    assert yields[0] > 0 and yields[1] > 0 and yields[2] == 0 and yields[3] > 0


async def test_an_owner_never_polls_without_sleeping_when_the_spin_time_is_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SPIN_ENV, "0")
    yields: list[None] = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(None))

    async def late_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_once(reader, writer)
        for _ in range(3):
            blob = await next_blob(reader)
            await asyncio.sleep(0.002)
            writer.write(len(blob).to_bytes(4, "big") + blob)

    async with RawPeer(late_echo) as port:
        link = await tcp.connect("127.0.0.1", port)
        await parked(link, [])
        for k in range(3):
            assert await within(10, asyncio.to_thread(owner_round_trip, link, b"%d" % k)) == [b"%d" % k]
        await link.close()
    assert yields == []


@pytest.mark.parametrize("text", ["fast", "-1", "2000000"])
def test_a_spin_setting_that_is_not_a_number_of_microseconds_in_range_is_refused(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv(SPIN_ENV, text)
    with pytest.raises(ConfigError, match=SPIN_ENV):
        tcp.spin_setting()
