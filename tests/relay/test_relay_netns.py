"""A client in its own network namespace that reaches only the NATS server still trains (Linux, root)."""

from __future__ import annotations

import json

import pytest

import emberlink as el

from ..netns import namespace_with_veth, nats_server_on, netns_unavailable
from . import relay_training
from .relay_harness import client_process, new_key, relay_worker_process

_REASON = netns_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def test_client_in_a_namespace_that_reaches_only_the_relay_still_trains(tmp_path):
    _, worker_key = new_key(tmp_path, "worker")
    _, client_key = new_key(tmp_path, "client")
    with el.Device.cpu() as cpu:
        expected = relay_training.train(cpu)
    with namespace_with_veth() as namespace:
        ns, root_addr = namespace.name, namespace.root_addr
        nats, port = nats_server_on(root_addr, tmp_path)
        url = f"nats://{root_addr}:{port}"
        try:
            worker, ticket = relay_worker_process(tmp_path, url, worker_key)
            try:
                assert ticket.relay == url and ticket.addrs  # a ticket with a direct address and the relay
                (host, direct_port), *_ = ticket.addrs
                client = client_process(
                    tmp_path,
                    "client",
                    *("--probe", f"{host}:{direct_port}", str(ticket), str(client_key), "train", "12"),
                    prefix=["ip", "netns", "exec", ns],
                )
                try:
                    assert client.expect("probe", 30).startswith("probe failed")  # direct is unreachable
                    assert client.expect("connected", 30).split() == ["connected", ticket.node_id, "relay"]
                    losses = json.loads(client.expect("losses", 60).partition(" ")[2])
                    assert client.wait(30) == 0
                finally:
                    client.close()
            finally:
                worker.close()
        finally:
            nats.terminate()
            nats.wait(10)
    assert losses == expected
