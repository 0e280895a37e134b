"""A relay that dies: relayed sessions that may not resume end with WorkerLost, direct ones carry on, the
worker comes back. (Sessions that resume through a relay restart: tests/chaos.)"""

from __future__ import annotations

import time

import pytest

import emberlink as el
from emberlink.client.discovery import survey
from emberlink.errors import TransportError
from emberlink.protocol.ticket import Ticket

from . import relay_training
from .relay_harness import new_key, relay_worker_process, wait_until


def _relayed_device(ticket: Ticket, key: str, timeout: float) -> el.Device:
    """A device through the relay, retrying while the worker has not re-attached yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return el.Device.remote(str(ticket), key=key, timeout=5)
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_relay_loss_fails_relayed_sessions_with_worker_lost_spares_direct_ones_and_the_worker_reattaches(
    nats_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("EMBERLINK_RESUME_WINDOW", "0")  # how soon a lost relay is noticed, resume aside
    _, worker_key = new_key(tmp_path, "worker")
    _, client_key = new_key(tmp_path, "client")
    worker, ticket = relay_worker_process(tmp_path, nats_server.url, worker_key)
    with el.Device.cpu() as cpu:
        expected = relay_training.train(cpu, 8)
    data = relay_training.batches(8)
    try:
        relay_only = Ticket(ticket.node_id, (), ticket.relay)
        direct_only = Ticket(ticket.node_id, ticket.addrs)
        relayed = el.Device.remote(str(relay_only), key=str(client_key))
        direct = el.Device.remote(str(direct_only), key=str(client_key))
        assert (relayed.stats()["path"], direct.stats()["path"]) == ("relay", "grpc")
        r_model, r_opt = relay_training.make_model(relayed)
        d_model, d_opt = relay_training.make_model(direct)
        losses = [relay_training.step(direct, d_model, d_opt, *batch) for batch in data[:4]]
        relay_training.step(relayed, r_model, r_opt, *data[0])

        nats_server.kill()
        killed = time.monotonic()
        with pytest.raises(el.WorkerLost):
            for batch in data * 1000:  # never reached in full: each step reads a loss back
                relay_training.step(relayed, r_model, r_opt, *batch)
        lost_after = time.monotonic() - killed
        assert lost_after < 2.0, (
            f"the relayed session noticed the relay's death only after {lost_after:.2f} s"
        )
        with pytest.raises(el.WorkerLost):  # and it stays failed, at once
            float(relayed.tensor([1.0]).sum())
        relayed.close()

        losses += [relay_training.step(direct, d_model, d_opt, *batch) for batch in data[4:]]
        assert losses == expected  # the direct session never noticed
        direct.close()

        nats_server.start()  # same port
        with _relayed_device(relay_only, str(client_key), timeout=20) as again:
            assert again.stats()["path"] == "relay"
            assert relay_training.train(again, 8) == expected
        # Presence came back too: discovery finds the worker again.
        wait_until(lambda: ticket.node_id in {s.node_id for s in survey(nats_server.url)}, 10, "presence")
    finally:
        worker.close()


def test_worker_started_while_the_relay_is_down_serves_directly_and_attaches_when_it_comes_up(
    nats_server, tmp_path
):
    _, worker_key = new_key(tmp_path, "worker")
    _, client_key = new_key(tmp_path, "client")
    nats_server.stop()
    worker, ticket = relay_worker_process(tmp_path, nats_server.url, worker_key)
    try:
        with el.Device.remote(str(ticket), key=str(client_key)) as direct:
            assert direct.stats()["path"] == "tcp"  # the worker's ticket: tcp first
            assert float(direct.tensor([1.0, 2.0]).sum()) == 3.0
        nats_server.start()
        with _relayed_device(
            Ticket(ticket.node_id, (), ticket.relay), str(client_key), timeout=20
        ) as relayed:
            assert relayed.stats()["path"] == "relay"
            assert float(relayed.tensor([1.0, 2.0]).sum()) == 3.0
    finally:
        worker.close()
