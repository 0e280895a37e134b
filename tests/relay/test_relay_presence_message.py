"""Presence messages: signed by the worker the ticket names, strictly decoded; forged ones are ignored."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import msgpack
import nats
import pytest
from nats.aio.msg import Msg

from emberlink.client.discovery import survey
from emberlink.errors import AuthError, ProtocolError
from emberlink.protocol.identity import Identity
from emberlink.protocol.presence import LABEL, VERSION, Presence, decode_presence, encode_presence
from emberlink.transport.presence import PRESENCE_PREFIX

from .relay_harness import relay_worker, wait_until

WORKER = Identity.from_seed(bytes(range(32)))
OTHER = Identity.from_seed(bytes(range(1, 33)))


def presence(identity: Identity = WORKER, **changes: Any) -> Presence:
    base = Presence(
        ticket=f"emberlink://{identity.node_id}@10.0.0.7:7443?relay=nats://10.0.0.1:4222",
        device="cuda:0",
        free_bytes=80 << 30,
        sessions=2,
        queued=5,
        admits_anyone=False,
        draining=False,
        seq=9,
    )
    return dataclasses.replace(base, **changes)


def test_presence_round_trips_and_orders_by_sessions_then_queued_work():
    p = presence()
    assert decode_presence(encode_presence(p, WORKER)) == p
    assert presence(sessions=1, queued=50).load < presence(sessions=2, queued=0).load


def test_presence_signed_by_another_key_than_the_tickets_is_refused():
    with pytest.raises(ProtocolError):
        encode_presence(presence(), OTHER)
    body = msgpack.packb([presence().ticket, "cpu", 1, 0, 0, True, False, 1, b"", b""])
    forged = msgpack.packb([VERSION, body, OTHER.sign(LABEL + body)])
    with pytest.raises(AuthError):
        decode_presence(forged)


def test_presence_whose_body_was_changed_after_signing_is_refused():
    version, body, signature = msgpack.unpackb(encode_presence(presence(), WORKER))
    fields = msgpack.unpackb(body)
    fields[3] = 0  # claim no sessions
    with pytest.raises(AuthError):
        decode_presence(msgpack.packb([version, msgpack.packb(fields), signature]))


@pytest.mark.parametrize(
    "fields",
    [
        ["not a ticket", "cpu", 1, 0, 0, True, False, 1, b"", b""],
        [None, "cpu", 1, 0, 0, True, False, 1, b"", b""],
        ["T", "", 1, 0, 0, True, False, 1, b"", b""],
        ["T", "cpu", -1, 0, 0, True, False, 1, b"", b""],
        ["T", "cpu", 1, 0.5, 0, True, False, 1, b"", b""],
        ["T", "cpu", 1, 0, 0, 1, False, 1, b"", b""],
        ["T", "cpu", 1, 0, 0, True, False, 1, b"short nonce", b""],
        ["T", "cpu", 1, 0, 0, True, False, 1, "a str nonce, not bytes", b""],
        ["T", "cpu", 1, 0, 0, True, False, 1, b"", "a str cert, not bytes"],
        ["T", "cpu", 1, 0, 0, True, False, 1, b"", b"not a certificate"],
        ["T", "cpu", 1, 0, 0, True, False, 1, b""],  # a version 2 body: no cert
        ["T", "cpu", 1, 0, 0, True, False, 1, b"", b"", "extra"],
    ],
)
def test_malformed_presence_is_a_protocol_error(fields):
    ticket = presence().ticket
    body = msgpack.packb([ticket if f == "T" else f for f in fields])
    with pytest.raises(ProtocolError):
        decode_presence(msgpack.packb([VERSION, body, WORKER.sign(LABEL + body)]))


@pytest.mark.parametrize(
    "data", [b"", b"\xc1", msgpack.packb([1, b"", b""]), msgpack.packb({"v": 1}), b"x" * 5000]
)
def test_garbage_presence_is_a_protocol_error(data):
    with pytest.raises(ProtocolError):
        decode_presence(data)


def test_discovery_ignores_presence_published_for_a_worker_without_its_key(nats_server):
    async def forge() -> None:
        nc = await nats.connect(nats_server.url)
        body = msgpack.packb([presence(WORKER).ticket, "cuda:0", 1 << 40, 0, 0, True, False, 1, b"", b""])
        for _ in range(40):
            await nc.publish(
                PRESENCE_PREFIX + WORKER.node_id, msgpack.packb([VERSION, body, OTHER.sign(LABEL + body)])
            )
            await nc.publish(PRESENCE_PREFIX + WORKER.node_id, encode_presence(presence(OTHER), OTHER))
            await asyncio.sleep(0.05)
        await nc.close()

    with relay_worker(nats_server.url) as honest:
        wait_until(lambda: honest.node_id in {s.node_id for s in survey(nats_server.url)}, 10, "presence")

        forger = threading.Thread(target=asyncio.run, args=(forge(),))
        forger.start()
        try:
            seen = {s.node_id for s in survey(nats_server.url, window=1.5, quiet=1.5)}
        finally:
            forger.join()
    # OTHER's own presence is validly signed but published on WORKER's subject: ignored too.
    assert seen == {honest.node_id}


def test_an_answer_recorded_earlier_and_replayed_does_not_bring_back_a_worker_that_is_gone(nats_server):
    """Answers sign back the query's nonce: one captured from an earlier query (here, of a worker
    that has stopped since) and replayed to every new query is refused, as are periodic messages."""
    from emberlink.transport.presence import QUERY_SUBJECT

    async def capture() -> list[bytes]:
        nc = await nats.connect(nats_server.url)
        answers: list[bytes] = []
        inbox = nc.new_inbox()

        async def keep(msg: Msg) -> None:
            answers.append(msg.data)

        await nc.subscribe(inbox, cb=keep)
        await nc.publish(QUERY_SUBJECT, b"x" * 16, reply=inbox)
        for _ in range(200):  # a loaded machine may take seconds to answer; wait for it, not a fixed time
            if answers:
                break
            await asyncio.sleep(0.05)
        await nc.close()
        return answers

    with relay_worker(nats_server.url) as gone:
        wait_until(lambda: gone.node_id in {s.node_id for s in survey(nats_server.url)}, 10, "presence")
        recorded = asyncio.run(capture())
    assert recorded and decode_presence(recorded[0]).node_id == gone.node_id

    stop = threading.Event()

    async def replay() -> None:
        nc = await nats.connect(nats_server.url)

        async def answer(msg: Msg) -> None:
            await msg.respond(recorded[0])

        await nc.subscribe(QUERY_SUBJECT, cb=answer)
        while not stop.is_set():
            await nc.publish(PRESENCE_PREFIX + gone.node_id, recorded[0])  # and as a periodic message
            await asyncio.sleep(0.05)
        await nc.close()

    replayer = threading.Thread(target=asyncio.run, args=(replay(),))
    replayer.start()
    try:
        time.sleep(0.3)
        with relay_worker(nats_server.url) as here:
            surveys: list[set[str]] = []

            def here_found() -> bool:
                surveys.append({s.node_id for s in survey(nats_server.url, window=1.5, quiet=1.0)})
                return here.node_id in surveys[-1]

            wait_until(here_found, 20, "the live worker's presence")  # a loaded machine answers late
    finally:
        stop.set()
        replayer.join()
    assert all(gone.node_id not in seen for seen in surveys), surveys
    assert surveys[-1] == {here.node_id}
