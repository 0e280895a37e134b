"""The NATS relay transport against a real nats-server: fragmentation, isolation, dead peers, a dying relay."""

from __future__ import annotations

import asyncio
import signal

import nats
import pytest
from nats.aio.msg import Msg

from emberlink.errors import TransportError, TransportTimeout
from emberlink.transport import nats as nats_transport
from emberlink.transport.base import Handler

from .transport_checks import (
    Child,
    Recorder,
    blobs,
    check_client_close_reaches_the_worker_after_its_last_blob,
    check_handler_return_closes_the_client,
    check_sessions_are_isolated,
    echo,
    echo_once,
    ping_pong,
    pipelined,
    within,
)

NODE = "workernodeid"

ECHO_WORKER = """
    import asyncio, sys
    from emberlink.transport import nats

    async def echo(link):
        while True:
            await link.send(await link.recv())

    async def main():
        listener = nats.NatsListener(sys.argv[1], sys.argv[2], echo)
        print(await listener.start(), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
"""

CLIENT = """
    import asyncio, sys
    from emberlink.transport import nats

    async def main():
        link = await nats.connect(sys.argv[1], sys.argv[2], timeout=10)
        await link.send(b"hello")
        print("connected", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
"""


async def listening(url: str, handler: Handler = echo) -> nats_transport.NatsListener:
    listener = nats_transport.NatsListener(url, NODE, handler)
    await listener.start()
    return listener


async def test_blobs_round_trip_whole_and_in_order(nats_server) -> None:
    listener = await listening(nats_server.url)
    link = await nats_transport.connect(nats_server.url, NODE)
    sent = blobs([0, 1, 64, 4096, (1 << 20) - 5, 1 << 20, (1 << 20) + 1])
    assert await ping_pong(link, sent) == sent
    many = blobs([100] * 300 + [200_000] * 10)
    assert await pipelined(link, many) == many
    await link.close()
    await listener.stop(1)


async def test_3_mib_blob_is_fragmented_under_the_default_1_mib_max_payload(nats_server) -> None:
    listener = await listening(nats_server.url)
    link = await nats_transport.connect(nats_server.url, NODE)
    assert link._nc.max_payload == 1 << 20
    sent = blobs([3 << 20, 3 << 20])
    assert await pipelined(link, sent) == sent
    await link.close()
    await listener.stop(1)


async def test_max_payload_is_read_from_the_server_not_assumed(make_nats_server) -> None:
    server = make_nats_server(max_payload=64 * 1024)
    listener = await listening(server.url)
    link = await nats_transport.connect(server.url, NODE)
    assert link._nc.max_payload == 64 * 1024
    sent = blobs([64 * 1024, 3 << 20, 10])
    assert await ping_pong(link, sent) == sent
    await link.close()
    await listener.stop(1)


async def test_concurrent_sessions_are_isolated_on_their_own_subjects(nats_server) -> None:
    listener = await listening(nats_server.url)
    links = [await nats_transport.connect(nats_server.url, NODE) for _ in range(4)]
    assert len({link._out for link in links}) == len(links)
    await check_sessions_are_isolated(links, [blobs([i + 1, 5000, 1_500_000] * 3) for i in range(len(links))])
    await listener.stop(1)


async def test_relay_sees_no_client_identity_only_random_subjects(nats_server) -> None:
    seen: list[tuple[str, bytes, object]] = []
    spy = await nats.connect(nats_server.url)

    async def record(msg: Msg) -> None:
        seen.append((msg.subject, msg.data, msg.headers))

    await spy.subscribe(">", cb=record)
    await spy.flush()
    listener = await listening(nats_server.url)
    link = await nats_transport.connect(nats_server.url, NODE)
    assert await ping_pong(link, [b"sealed"]) == [b"sealed"]
    await link.close()
    await listener.stop(1)
    await spy.flush()
    await spy.close()
    subjects = {subject for subject, _, _ in seen}
    assert f"emberlink.node.{NODE}" in subjects
    for subject, data, headers in seen:
        assert headers is None
        assert subject.startswith(
            ("emberlink.node.", "emberlink.w.", "emberlink.c.anon.", "emberlink.i.anon.")
        )
        if subject.startswith("emberlink.node."):
            # A version byte, two random tokens, and the relay user (none here): nothing else.
            assert len(data) == 1 + 32 + len("anon") and data.endswith(b"anon")


async def test_client_close_makes_worker_recv_raise_after_its_last_blob(nats_server) -> None:
    recorder = Recorder()
    listener = await listening(nats_server.url, recorder)
    await check_client_close_reaches_the_worker_after_its_last_blob(
        await nats_transport.connect(nats_server.url, NODE), recorder
    )
    await listener.stop(1)


async def test_worker_handler_return_makes_client_recv_raise_peer_closed(nats_server) -> None:
    listener = await listening(nats_server.url, echo_once)
    await check_handler_return_closes_the_client(await nats_transport.connect(nats_server.url, NODE))
    await listener.stop(1)


async def test_idle_link_stays_up_on_heartbeats(nats_server) -> None:
    listener = await listening(nats_server.url)
    link = await nats_transport.connect(nats_server.url, NODE)
    await asyncio.sleep(3 * nats_transport.SILENCE_S)
    assert await ping_pong(link, [b"still here"]) == [b"still here"]
    await link.close()
    await listener.stop(1)


async def test_connect_to_a_relay_nobody_runs_fails_fast_naming_it(nats_server) -> None:
    url = nats_server.url
    nats_server.stop()
    with pytest.raises(TransportError, match=url.removeprefix("nats://")) as info:
        await within(5, nats_transport.connect(url, NODE, timeout=30))
    assert not isinstance(info.value, TransportTimeout)


async def test_connect_to_an_absent_worker_fails_fast_naming_it(nats_server) -> None:
    with pytest.raises(TransportError, match="no worker absentnode") as info:
        await within(5, nats_transport.connect(nats_server.url, "absentnode", timeout=30))
    assert not isinstance(info.value, TransportTimeout)


async def test_connect_to_a_worker_that_never_answers_times_out(nats_server) -> None:
    mute = await nats.connect(nats_server.url)
    await mute.subscribe(f"emberlink.node.{NODE}")  # a subscriber that never replies
    await mute.flush()
    with pytest.raises(TransportTimeout, match=NODE):
        await nats_transport.connect(nats_server.url, NODE, timeout=0.5)
    await mute.close()


async def test_sigkilled_worker_makes_client_recv_raise_promptly(nats_server) -> None:
    async with Child(ECHO_WORKER, nats_server.url, NODE) as worker:
        link = await nats_transport.connect(nats_server.url, NODE)
        assert await ping_pong(link, [b"alive"]) == [b"alive"]
        pending = asyncio.create_task(link.recv())
        worker.signal(signal.SIGKILL)
        with pytest.raises(TransportError, match="no word"):
            await within(5, pending)
        await link.close()


async def test_sigkilled_client_makes_worker_recv_raise_promptly(nats_server) -> None:
    recorder = Recorder()
    listener = await listening(nats_server.url, recorder)
    async with Child(CLIENT, nats_server.url, NODE) as client:
        await asyncio.sleep(0.1)
        client.signal(signal.SIGKILL)
        error = await within(5, recorder.ended)
    assert isinstance(error, TransportError)
    assert recorder.received == [b"hello"]
    await listener.stop(1)


async def test_frozen_worker_is_noticed_by_heartbeats(nats_server) -> None:
    async with Child(ECHO_WORKER, nats_server.url, NODE) as worker:
        link = await nats_transport.connect(nats_server.url, NODE)
        assert await ping_pong(link, [b"alive"]) == [b"alive"]
        worker.signal(signal.SIGSTOP)
        with pytest.raises(TransportError, match="no word"):
            await within(5, link.recv())
        await link.close()


async def test_relay_death_fails_every_link_and_the_listener_reattaches(nats_server) -> None:
    listener = await listening(nats_server.url)
    links = [await nats_transport.connect(nats_server.url, NODE) for _ in range(3)]
    pending = [asyncio.create_task(link.recv()) for link in links]
    nats_server.kill()
    for task in pending:
        with pytest.raises(TransportError, match="relay"):
            await within(5, task)
    for link in links:
        await link.close()
    nats_server.start()  # same port
    await within(10, listener.attached.wait())
    link = await nats_transport.connect(nats_server.url, NODE)
    assert await ping_pong(link, [b"back"]) == [b"back"]
    await link.close()
    await listener.stop(1)


async def test_graceful_relay_restart_fails_links_and_new_sessions_work(nats_server) -> None:
    recorder = Recorder()
    listener = await listening(nats_server.url, recorder)
    link = await nats_transport.connect(nats_server.url, NODE)
    await link.send(b"before")
    pending = asyncio.create_task(link.recv())
    nats_server.restart()
    with pytest.raises(TransportError):
        await within(5, pending)
    assert isinstance(await within(5, recorder.ended), TransportError)
    await link.close()
    await within(10, listener.attached.wait())
    await listener.stop(1)
    listener = await listening(nats_server.url)
    link = await nats_transport.connect(nats_server.url, NODE)
    assert await ping_pong(link, [b"after"]) == [b"after"]
    await link.close()
    await listener.stop(1)


async def test_listener_stop_ends_sessions_and_new_ones_find_no_worker(nats_server) -> None:
    listener = await listening(nats_server.url)
    link = await nats_transport.connect(nats_server.url, NODE)
    await listener.stop(0)
    with pytest.raises(TransportError):
        await within(5, link.recv())
    with pytest.raises(TransportError, match="no worker"):
        await nats_transport.connect(nats_server.url, NODE, timeout=5)
    await link.close()


async def test_start_fails_clearly_when_the_relay_is_unreachable(nats_server) -> None:
    url = nats_server.url
    nats_server.stop()
    with pytest.raises(TransportError, match=url.removeprefix("nats://")):
        await nats_transport.NatsListener(url, NODE, echo).start()


async def test_listener_publishes_and_collect_gathers_presence(nats_server) -> None:
    listener = await listening(nats_server.url)

    async def announce() -> None:
        for _ in range(5):
            await listener.publish(f"emberlink.presence.{NODE}", b"load=0")
            await asyncio.sleep(0.05)

    task = asyncio.create_task(announce())
    got = await nats_transport.collect(nats_server.url, "emberlink.presence.*", window=0.4)
    await task
    assert got and all(item == (f"emberlink.presence.{NODE}", b"load=0") for item in got)
    await listener.stop(1)


def test_node_id_must_be_a_single_subject_token() -> None:
    with pytest.raises(TransportError, match="subject token"):
        nats_transport.NatsListener("nats://127.0.0.1:1", "a.b", echo)


async def test_frozen_relay_fails_links_by_silence_and_sessions_resume_after(nats_server) -> None:
    listener = await listening(nats_server.url)
    link = await nats_transport.connect(nats_server.url, NODE)
    assert await ping_pong(link, [b"alive"]) == [b"alive"]
    nats_server.send_signal(signal.SIGSTOP)  # sockets stay open: only heartbeats can tell
    try:
        with pytest.raises(TransportError, match="no word"):
            await within(5, link.recv())
    finally:
        nats_server.send_signal(signal.SIGCONT)
    await link.close()
    await within(10, listener.attached.wait())
    fresh = None
    for _ in range(50):  # the listener may still be re-attaching after its ping timeout
        try:
            fresh = await nats_transport.connect(nats_server.url, NODE, timeout=2)
            break
        except TransportError:
            await asyncio.sleep(0.2)
    assert fresh is not None
    assert await ping_pong(fresh, [b"thawed"]) == [b"thawed"]
    await fresh.close()
    await listener.stop(1)


SECRET = bytes(range(32))


async def bind_then_echo(link) -> None:
    """The worker's order: read the first blob, bind, answer on the request's subjects, then echo."""
    first = await link.recv()
    await link.bind(SECRET)
    await link.send(first)
    await echo(link)


async def test_bound_links_move_to_subjects_named_by_the_secret_and_ignore_the_old_ones(nats_server) -> None:
    listener = await listening(nats_server.url, bind_then_echo)
    link = await nats_transport.connect(nats_server.url, NODE)
    old_out, old_in = link._out, link._in
    assert await ping_pong(link, [b"hello"]) == [b"hello"]
    await link.bind(SECRET)
    assert link.bound and {link._out, link._in}.isdisjoint({old_out, old_in})
    assert link._out.startswith(f"emberlink.w.{NODE}.") and link._in.startswith("emberlink.c.anon.")
    intruder = await nats.connect(nats_server.url)
    for subject in (old_out, old_in):  # an untagged close and heartbeat with the next numbers
        await intruder.publish(subject, bytes([3, 0, 0, 0, 2]))
        await intruder.publish(subject, bytes([2, 0, 0, 0, 2]))
    await intruder.publish(link._in, bytes([3, 0, 0, 0, 0]))
    await intruder.flush()
    sent = blobs([10, 3 << 20, 5])
    assert await ping_pong(link, sent) == sent
    await asyncio.sleep(3 * nats_transport.SILENCE_S)  # idle, bound heartbeats keep it up
    assert await ping_pong(link, [b"still"]) == [b"still"]
    assert link.dropped == 1
    await intruder.close()
    await link.close()
    await listener.stop(1)
