"""Sessions through the NATS relay: training that matches the CPU, path choice, and what the relay sees."""

from __future__ import annotations

import base64
import json
import socket
import time

import numpy as np
import pytest

import emberlink as el
from emberlink.protocol.identity import AllowPolicy
from emberlink.protocol.presence import decode_presence
from emberlink.protocol.ticket import Ticket
from emberlink.transport.presence import PRESENCE_PREFIX

from . import relay_training
from .relay_harness import (
    Eavesdropper,
    client_process,
    new_key,
    relay_worker,
    relay_worker_process,
    wait_until,
)


@pytest.fixture(scope="module")
def cpu_losses() -> list[float]:
    with el.Device.cpu() as dev:
        return relay_training.train(dev)


def test_script_trains_through_a_relay_only_ticket_with_the_cpus_losses(nats_server, tmp_path, cpu_losses):
    _, worker_key = new_key(tmp_path, "worker")
    _, client_key = new_key(tmp_path, "client")
    worker, ticket = relay_worker_process(tmp_path, nats_server.url, worker_key)
    try:
        assert ticket.relay == nats_server.url  # the worker's ticket names its relay
        relay_only = Ticket(ticket.node_id, (), ticket.relay)
        client = client_process(tmp_path, "client", str(relay_only), str(client_key), "train", "12")
        try:
            assert client.expect("connected", 30).split() == ["connected", ticket.node_id, "relay"]
            losses = json.loads(client.expect("losses", 60).partition(" ")[2])
            assert client.wait(30) == 0
        finally:
            client.close()
    finally:
        worker.close()
    assert losses == cpu_losses


def test_ticket_with_a_working_direct_address_uses_grpc(nats_server, cpu_losses):
    with relay_worker(nats_server.url) as worker:
        ticket = str(worker.relay.ticket)  # type: ignore[attr-defined]  # relay_worker sets .relay
        with el.Device.remote(ticket) as dev:
            assert dev.stats()["path"] == "grpc"
            assert relay_training.train(dev) == cpu_losses


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_refused_direct_address_falls_back_to_the_relay(nats_server, cpu_losses):
    with relay_worker(nats_server.url) as worker:
        ticket = Ticket(worker.node_id, (("127.0.0.1", _closed_port()),), nats_server.url)
        with el.Device.remote(str(ticket)) as dev:
            assert dev.stats()["path"] == "relay"
            assert relay_training.train(dev) == cpu_losses


def test_stalled_direct_address_falls_back_to_the_relay_without_waiting_for_the_timeout(nats_server):
    # A socket that accepts connections (the kernel does, from the backlog) but never speaks HTTP/2.
    with socket.socket() as silent, relay_worker(nats_server.url) as worker:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        ticket = Ticket(worker.node_id, (("127.0.0.1", silent.getsockname()[1]),), nats_server.url)
        started = time.monotonic()
        with el.Device.remote(str(ticket), timeout=30) as dev:
            connected_after = time.monotonic() - started
            assert dev.stats()["path"] == "relay"
            assert float(dev.tensor(np.ones(3, np.float32)).sum()) == 3.0
    assert connected_after < 5, f"fell back to the relay only after {connected_after:.1f} s"


def _encodings(public: bytes, node_id: str) -> list[bytes]:
    """Every spelling of the client's identity the test can think of."""
    return [
        node_id.encode(),
        node_id.upper().encode(),
        node_id[:20].encode(),
        public,
        public.hex().encode(),
        public.hex().upper().encode(),
        base64.b64encode(public).rstrip(b"="),
        base64.urlsafe_b64encode(public).rstrip(b"="),
        base64.b32encode(public).rstrip(b"="),
    ]


def test_eavesdropper_on_the_relay_sees_neither_uploaded_plaintext_nor_the_client_node_id(
    nats_server, tmp_path
):
    client, client_key = new_key(tmp_path, "client")
    pattern = b"EMBERLINK-PLAINTEXT-CANARY-7f3a9c"
    # int32: the dtypes a tensor may have do not include uint8; the bytes are the pattern either way.
    canary = np.frombuffer((pattern * ((3 << 20) // len(pattern) + 1))[: 3 << 20], dtype=np.int32)
    spy = Eavesdropper(nats_server.url)
    try:
        with relay_worker(nats_server.url, AllowPolicy.of([client.node_id])) as worker:
            relay_only = Ticket(worker.node_id, (), nats_server.url)
            with el.Device.remote(str(relay_only), key=str(client_key)) as dev:
                assert dev.stats()["path"] == "relay"
                t = dev.tensor(canary)
                assert np.array_equal(t.numpy(), canary)  # the pattern went both ways
                assert np.array_equal((t + 0).numpy(), canary)
                relay_training.train(dev, 2)
            wait_until(lambda: any(s.startswith(PRESENCE_PREFIX) for s, _, _ in spy.messages), 5, "presence")
    finally:
        spy.close()
    seen = spy.everything()
    assert len(seen) > 2 * canary.nbytes, "the eavesdropper did not see the session's traffic"
    for needle in (pattern, pattern[:12], pattern[-12:]):
        assert needle not in seen
    for spelling in _encodings(client.public_bytes, client.node_id):
        assert spelling not in seen, f"the relay saw the client's identity as {spelling[:16]!r}..."


def test_presence_says_whether_anyone_is_admitted_but_never_names_the_allowed(nats_server, tmp_path):
    allowed, _ = new_key(tmp_path, "allowed")
    spy = Eavesdropper(nats_server.url)
    try:
        with relay_worker(nats_server.url, AllowPolicy.of([allowed.node_id])) as worker:
            subject = PRESENCE_PREFIX + worker.node_id
            wait_until(lambda: any(s == subject for s, _, _ in spy.messages), 5, "presence")
    finally:
        spy.close()
    presence = decode_presence(next(d for s, _, d in spy.messages if s == subject))
    assert presence.admits_anyone is False
    assert Ticket.parse(presence.ticket).relay == nats_server.url
    assert presence.device == "cpu" and presence.free_bytes > 0
    for spelling in _encodings(allowed.public_bytes, allowed.node_id):
        assert spelling not in spy.everything()
