"""Relayed sessions against someone on the relay who sees every message and publishes what it likes:
only frames sealed under the session's keys can end, stall or reorder a session."""

from __future__ import annotations

import time

import numpy as np
import pytest

import emberlink as el
from emberlink.protocol.ticket import Ticket
from emberlink.transport.nats_link import NatsLink

from . import relay_training
from .relay_harness import Attacker, relay_worker, wait_until


@pytest.fixture(scope="module")
def cpu_losses() -> list[float]:
    with el.Device.cpu() as dev:
        return relay_training.train(dev, 12)


def _train_under(mode: str, url: str, cpu_losses: list[float]) -> None:
    attacker = Attacker(url)
    try:
        with relay_worker(url, grpc=False) as worker:
            relay_only = Ticket(worker.node_id, (), url)
            with el.Device.remote(str(relay_only)) as dev:
                assert dev.stats()["path"] == "relay"
                model, opt = relay_training.make_model(dev)
                # The attacker starts once the session is up, so it knows the subjects the session uses.
                wait_until(lambda: bool(attacker._history), 5, "the attacker saw the session's traffic")
                attacker.mode = mode
                losses = []
                for x, y in relay_training.batches(12):
                    losses.append(relay_training.step(dev, model, opt, x, y))
                    time.sleep(0.05)  # idle moments too: the heartbeats then carry the session
                time.sleep(1.0)  # longer than the link's silence limit, under attack, with no work
                attacker.mode = None
                assert float(dev.tensor(np.ones(4, np.float32)).sum()) == 4.0  # the session lives on
                (session,) = worker.worker.sessions
                assert isinstance(session._link, NatsLink)
                dropped = session._link.dropped  # the forgeries reached the worker's end, and did nothing
    finally:
        attacker.close()
    assert attacker.published > 0 and dropped > 0, "the attacker never reached the session"
    assert losses == cpu_losses


def test_forged_heartbeats_with_the_next_sequence_number_do_not_end_a_relayed_session(
    nats_server, cpu_losses
):
    _train_under("beat", nats_server.url, cpu_losses)


def test_a_forged_close_does_not_end_a_relayed_session(nats_server, cpu_losses):
    _train_under("close", nats_server.url, cpu_losses)


def test_injected_fragments_neither_corrupt_nor_stall_a_relayed_session(nats_server, cpu_losses):
    _train_under("inject", nats_server.url, cpu_losses)


def test_replayed_and_reordered_fragments_of_the_session_itself_are_ignored(nats_server, cpu_losses):
    _train_under("replay", nats_server.url, cpu_losses)


def test_a_flood_on_the_session_subjects_leaves_the_training_results_correct(nats_server, cpu_losses):
    _train_under("flood", nats_server.url, cpu_losses)
