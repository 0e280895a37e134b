"""A relay that freezes (no FIN, no RST: a partition) ends relayed sessions that may not resume with
WorkerLost, not a hang."""

from __future__ import annotations

import signal
import time

import pytest

import emberlink as el
from emberlink.protocol.ticket import Ticket

from . import relay_training
from .relay_harness import new_key, relay_worker


def test_frozen_relay_fails_the_relayed_session_with_worker_lost_within_two_seconds(
    nats_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("EMBERLINK_RESUME_WINDOW", "0")  # how soon the freeze is noticed, resume aside
    _, client_key = new_key(tmp_path, "client")
    with relay_worker(nats_server.url) as worker:
        relayed = el.Device.remote(str(Ticket(worker.node_id, (), nats_server.url)), key=str(client_key))
        model, opt = relay_training.make_model(relayed)
        data = relay_training.batches(4)
        relay_training.step(relayed, model, opt, *data[0])
        nats_server._proc.send_signal(signal.SIGSTOP)
        try:
            frozen = time.monotonic()
            with pytest.raises(el.WorkerLost):
                for batch in data * 1000:
                    relay_training.step(relayed, model, opt, *batch)
            lost_after = time.monotonic() - frozen
        finally:
            nats_server._proc.send_signal(signal.SIGCONT)
        relayed.close()
    assert lost_after < 2.0, f"the relayed session noticed the frozen relay only after {lost_after:.2f} s"
