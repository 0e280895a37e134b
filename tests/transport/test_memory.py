"""The in-process transport: pairs, named endpoints, backpressure and closing."""

from __future__ import annotations

import asyncio

import pytest

from emberlink.errors import TransportError
from emberlink.transport import memory
from emberlink.transport.base import MAX_BLOB, Link

from .transport_checks import blobs, echo, pipelined


async def test_pair_delivers_blobs_whole_and_in_order() -> None:
    a, b = memory.pair()
    sent = blobs([0, 1, 64, 1 << 20, 3])
    for blob in sent:
        await a.send(blob)
    assert [await b.recv() for _ in sent] == sent


async def test_send_waits_while_the_queue_is_full() -> None:
    a, b = memory.pair(capacity=2)
    await a.send(b"1")
    await a.send(b"2")
    blocked = asyncio.create_task(a.send(b"3"))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    assert await b.recv() == b"1"
    await blocked
    assert [await b.recv(), await b.recv()] == [b"2", b"3"]


async def test_closed_peer_makes_recv_raise_after_the_blobs_it_sent() -> None:
    a, b = memory.pair()
    await a.send(b"last words")
    await a.close()
    assert await b.recv() == b"last words"
    with pytest.raises(TransportError, match="peer closed"):
        await b.recv()
    with pytest.raises(TransportError, match="peer closed"):
        await b.send(b"x")


async def test_close_wakes_a_pending_recv_and_a_blocked_send() -> None:
    a, b = memory.pair(capacity=1)
    waiting = asyncio.create_task(b.recv())
    await a.send(b"fill")  # b's recv takes this one
    assert await waiting == b"fill"
    await a.send(b"fill")
    blocked = asyncio.create_task(a.send(b"over"))
    pending = asyncio.create_task(a.recv())
    await asyncio.sleep(0.01)
    await b.close()
    with pytest.raises(TransportError):
        await blocked
    with pytest.raises(TransportError):
        await pending


async def test_own_close_makes_recv_and_send_raise() -> None:
    a, _ = memory.pair()
    await a.close()
    with pytest.raises(TransportError, match="closed"):
        await a.recv()
    with pytest.raises(TransportError, match="closed"):
        await a.send(b"x")


async def test_oversized_blob_is_refused_without_breaking_the_link() -> None:
    a, b = memory.pair()
    with pytest.raises(TransportError, match="exceeds"):
        await a.send(bytes(MAX_BLOB + 1))
    await a.send(b"ok")
    assert await b.recv() == b"ok"


async def test_bytearray_is_copied_when_sent() -> None:
    a, b = memory.pair()
    buf = bytearray(b"abc")
    await a.send(buf)
    buf[0] = ord("z")
    assert await b.recv() == b"abc"


async def test_listener_serves_concurrent_sessions_in_isolation() -> None:
    hub = memory.MemoryHub()
    listener = memory.MemoryListener("worker", echo, hub=hub)
    await listener.start()
    links = [await memory.connect("worker", hub=hub) for _ in range(5)]
    per_link = [blobs([10 + i, 1000, 7]) for i in range(len(links))]
    results = await asyncio.gather(*(pipelined(link, sent) for link, sent in zip(links, per_link)))
    assert results == per_link
    for link in links:
        await link.close()
    await listener.stop(1.0)


async def test_connect_to_an_unknown_name_fails_naming_it() -> None:
    with pytest.raises(TransportError, match="nobody-home"):
        await memory.connect("nobody-home", hub=memory.MemoryHub())


async def test_hubs_are_isolated_and_names_are_unique_per_hub() -> None:
    hub_a, hub_b = memory.MemoryHub(), memory.MemoryHub()
    first = memory.MemoryListener("w", echo, hub=hub_a)
    await first.start()
    await memory.MemoryListener("w", echo, hub=hub_b).start()
    with pytest.raises(TransportError, match="already"):
        await memory.MemoryListener("w", echo, hub=hub_a).start()
    await first.stop()
    with pytest.raises(TransportError):
        await memory.connect("w", hub=hub_a)


async def test_listener_stop_closes_sessions_so_the_client_recv_raises() -> None:
    hub = memory.MemoryHub()
    listener = memory.MemoryListener("w", echo, hub=hub)
    await listener.start()
    link = await memory.connect("w", hub=hub)
    await listener.stop(0)
    with pytest.raises(TransportError):
        await link.recv()


async def test_handler_return_closes_the_link() -> None:
    hub = memory.MemoryHub()

    async def once(link: Link) -> None:
        await link.send(await link.recv())

    listener = memory.MemoryListener("w", once, hub=hub)
    await listener.start()
    link = await memory.connect("w", hub=hub)
    await link.send(b"1")
    assert await link.recv() == b"1"
    with pytest.raises(TransportError, match="peer closed"):
        await link.recv()
    await listener.stop()
