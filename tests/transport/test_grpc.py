"""The gRPC transport over real loopback sockets, including peers that die or freeze."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import pytest

from emberlink.errors import TransportError, TransportTimeout
from emberlink.transport import grpc as grpc_transport
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

ECHO_WORKER = echo_worker_script("grpc", "GrpcListener")

CLIENT = client_script("grpc")


async def started(handler: Handler) -> tuple[grpc_transport.GrpcListener, int]:
    listener = grpc_transport.GrpcListener("127.0.0.1", 0, handler)
    return listener, await listener.start()


async def test_blobs_round_trip_whole_and_in_order() -> None:
    listener, port = await started(echo)
    link = await grpc_transport.connect("127.0.0.1", port)
    sent = blobs([0, 1, 64, 4096, 1 << 20, (1 << 20) + 64])
    assert await ping_pong(link, sent) == sent
    assert await pipelined(link, blobs([100] * 200 + [1 << 20] * 8)) is not None
    await link.close()
    await listener.stop(1)


async def test_blobs_past_grpc_default_4_mib_limit_up_to_max_blob_pass() -> None:
    listener, port = await started(echo)
    link = await grpc_transport.connect("127.0.0.1", port)
    sent = blobs([4 * 1024 * 1024 + 16, MAX_BLOB])
    assert await ping_pong(link, sent) == sent
    with pytest.raises(TransportError, match="exceeds"):
        await link.send(bytes(MAX_BLOB + 1))
    assert await ping_pong(link, [b"still open"]) == [b"still open"]
    await link.close()
    await listener.stop(1)


async def test_concurrent_sessions_are_isolated() -> None:
    listener, port = await started(echo)
    links = [await grpc_transport.connect("127.0.0.1", port) for _ in range(4)]
    await check_sessions_are_isolated(links, [blobs([i + 1, 5000, 70_000] * 5) for i in range(len(links))])
    await listener.stop(1)


async def test_client_close_makes_the_worker_recv_raise_after_its_last_blob() -> None:
    recorder = Recorder()
    listener, port = await started(recorder)
    await check_client_close_reaches_the_worker_after_its_last_blob(
        await grpc_transport.connect("127.0.0.1", port), recorder
    )
    await listener.stop(1)


async def test_worker_handler_return_makes_client_recv_raise_peer_closed() -> None:
    listener, port = await started(echo_once)
    await check_handler_return_closes_the_client(await grpc_transport.connect("127.0.0.1", port))
    await listener.stop(1)


async def test_own_close_wakes_a_pending_recv_with_transport_error() -> None:
    listener, port = await started(echo)
    link = await grpc_transport.connect("127.0.0.1", port)
    pending = asyncio.create_task(link.recv())
    await asyncio.sleep(0.05)
    await link.close()
    with pytest.raises(TransportError):
        await within(5, pending)
    await listener.stop(1)


async def test_listener_stop_ends_sessions_and_refuses_new_ones() -> None:
    listener, port = await started(echo)
    link = await grpc_transport.connect("127.0.0.1", port)
    await listener.stop(0)
    with pytest.raises(TransportError):
        await within(5, link.recv())
    with pytest.raises(TransportError, match=f"127.0.0.1:{port}"):
        await grpc_transport.connect("127.0.0.1", port, timeout=5)
    await link.close()


async def test_connect_where_nothing_listens_fails_fast_naming_the_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        started_at = time.monotonic()
        with pytest.raises(TransportError, match=f"127.0.0.1:{port}") as info:
            await grpc_transport.connect("127.0.0.1", port, timeout=30)
    assert not isinstance(info.value, TransportTimeout)
    assert time.monotonic() - started_at < 15  # far from the 30 s timeout: it did not wait it out


async def test_connect_to_a_silent_listener_times_out_naming_the_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()  # accepts TCP in the backlog, never speaks HTTP/2
        port = s.getsockname()[1]
        with pytest.raises(TransportTimeout, match=f"127.0.0.1:{port}"):
            await grpc_transport.connect("127.0.0.1", port, timeout=0.5)


async def test_sigkilled_worker_makes_client_recv_raise_promptly() -> None:
    await check_sigkilled_worker_makes_client_recv_raise(
        ECHO_WORKER, lambda port: grpc_transport.connect("127.0.0.1", port)
    )


async def test_sigkilled_client_makes_worker_recv_raise_promptly() -> None:
    recorder = Recorder()
    listener, port = await started(recorder)
    await check_sigkilled_client_makes_worker_recv_raise(CLIENT, port, recorder)
    await listener.stop(1)


async def test_frozen_worker_is_noticed_by_keepalive() -> None:
    async with Child(ECHO_WORKER) as worker:
        link = await grpc_transport.connect("127.0.0.1", int(worker.ready_line))
        assert await ping_pong(link, [b"alive"]) == [b"alive"]
        worker.signal(signal.SIGSTOP)  # the socket stays open: only keepalive can tell
        with pytest.raises(TransportError):
            await within(5, link.recv())
        await link.close()


async def test_frozen_client_is_noticed_by_keepalive() -> None:
    recorder = Recorder()
    listener, port = await started(recorder)
    async with Child(CLIENT, str(port)) as client:
        await asyncio.sleep(0.1)
        client.signal(signal.SIGSTOP)
        error = await within(5, recorder.ended)
    assert isinstance(error, TransportError)
    await listener.stop(1)


async def test_idle_session_survives_several_keepalive_rounds() -> None:
    listener, port = await started(echo)
    link = await grpc_transport.connect("127.0.0.1", port)
    await asyncio.sleep(2.5)  # many keepalive pings: the worker must not answer GOAWAY too_many_pings
    assert await ping_pong(link, [b"still here"]) == [b"still here"]
    await link.close()
    await listener.stop(1)


@pytest.mark.parametrize("busy", ["sending", "sleeping"])
async def test_peer_reset_reaches_the_worker_handler_as_transport_error_not_cancellation(busy: str) -> None:
    recorder = Recorder()

    async def handler(link: Link) -> None:
        try:
            if busy == "sending":  # blocks on flow control: the client never reads
                while True:
                    await link.send(bytes(MAX_BLOB))
            await asyncio.sleep(0.3)
            await link.recv()
        except BaseException as e:
            recorder.ended.set_result(e)
            raise

    listener, port = await started(handler)
    link = await grpc_transport.connect("127.0.0.1", port)
    await asyncio.sleep(0.1)
    link._call.cancel()  # an RST_STREAM, not a clean half-close
    error = await within(5, recorder.ended)
    assert isinstance(error, TransportError)
    await link.close()
    await listener.stop(1)


async def test_memoryview_and_bytearray_blobs_are_sent_as_bytes() -> None:
    listener, port = await started(echo)
    link = await grpc_transport.connect("127.0.0.1", port)
    data = bytearray(b"sealed frame")
    await link.send(memoryview(data))
    await link.send(data)
    assert [await link.recv(), await link.recv()] == [bytes(data), bytes(data)]
    await link.close()
    await listener.stop(1)


async def test_second_listener_on_a_taken_port_fails_instead_of_sharing_it() -> None:
    listener, port = await started(echo)
    with pytest.raises(TransportError, match=f"127.0.0.1:{port}"):
        await grpc_transport.GrpcListener("127.0.0.1", port, echo).start()
    await listener.stop(1)
