"""Discovery on the relay: clients spread over workers by load, refusing workers are skipped, `cluster ls`."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

import emberlink as el
from emberlink.cli import cluster_table
from emberlink.client.discovery import Seen, survey
from emberlink.errors import AuthError, TransportError
from emberlink.protocol.identity import AllowPolicy
from emberlink.protocol.presence import Presence
from emberlink.protocol.ticket import Ticket

from .relay_harness import (
    allow_file,
    client_process,
    new_key,
    relay_worker,
    trust_workers,
    wait_until,
    worker_process,
)


def _seen(url: str) -> set[str]:
    return {s.node_id for s in survey(url)}


def test_discovery_gives_each_of_three_clients_its_own_worker_and_a_killed_worker_fails_only_its_client(
    nats_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("EMBERLINK_RESUME_WINDOW", "1")  # the clients try to resume a killed worker for 1 s
    client, client_key = new_key(tmp_path, "client")
    allow = allow_file(tmp_path, "allow", client.node_id)
    workers = {}
    clients = []
    try:
        for i in range(3):
            _, key = new_key(tmp_path, f"worker-{i}")
            proc, ticket = worker_process(
                tmp_path,
                f"worker-{i}",
                *("--listen", "127.0.0.1:0", "--allow", str(allow), "--relay", nats_server.url),
                key=key,
            )
            workers[ticket.node_id] = proc
        wait_until(lambda: _seen(nats_server.url) == set(workers), 15, "every worker's presence")
        trust_workers(*workers)

        picked = []
        for i in range(3):  # one after another: each sees the sessions of the ones before
            proc = client_process(tmp_path, f"client-{i}", nats_server.url, str(client_key), "loop")
            clients.append(proc)
            _, worker_id, path = proc.expect("connected", 30).split()
            picked.append(worker_id)
            assert path == "tcp"  # direct addresses work here (tcp first); discovery does not force the relay
            proc.expect("step", 30)
        assert sorted(picked) == sorted(workers), f"clients piled up: {picked}"

        workers[picked[0]].kill()
        assert clients[0].expect("lost", 10).startswith("lost WorkerLost")
        assert clients[0].wait(10) == 3
        for proc in clients[1:]:
            proc.send("stop\n")
            proc.expect("done", 30)
            assert proc.wait(30) == 0
    finally:
        for proc in clients + list(workers.values()):
            proc.close()


def test_discovery_skips_a_worker_that_refuses_this_client(nats_server, tmp_path):
    client, client_key = new_key(tmp_path, "client")
    other, other_key = new_key(tmp_path, "other")
    with (
        relay_worker(nats_server.url, AllowPolicy.of([other.node_id])) as refusing,
        relay_worker(nats_server.url, AllowPolicy.of([client.node_id, other.node_id])) as admitting,
        # The admitting worker is busier, so the refusing one is first in line.
        el.Device.remote(admitting.ticket, key=str(other_key)) as busy,
    ):
        wait_until(lambda: _seen(nats_server.url) == {refusing.node_id, admitting.node_id}, 10, "presence")
        trust_workers(refusing.node_id, admitting.node_id)
        with el.Device.remote(nats_server.url, key=str(client_key)) as dev:
            assert dev.stats()["worker"] == admitting.node_id
        wait_until(lambda: refusing.worker.sessions_refused == 1, 5, "the refusing worker was tried")
        busy.sync()


def test_discovery_where_no_worker_admits_this_client_raises_auth_error_saying_how_many_were_seen(
    nats_server, tmp_path
):
    _, client_key = new_key(tmp_path, "client")
    stranger, _ = new_key(tmp_path, "stranger")
    with (
        relay_worker(nats_server.url, AllowPolicy.of([stranger.node_id])) as a,
        relay_worker(nats_server.url, AllowPolicy.of([stranger.node_id])) as b,
    ):
        wait_until(lambda: _seen(nats_server.url) == {a.node_id, b.node_id}, 10, "presence")
        trust_workers(a.node_id, b.node_id)
        with pytest.raises(AuthError, match=r"none of the 2 trusted worker\(s\) seen"):
            el.Device.remote(nats_server.url, key=str(client_key))


def test_discovery_on_a_relay_without_workers_says_none_was_seen(nats_server, tmp_path):
    _, client_key = new_key(tmp_path, "client")
    with pytest.raises(TransportError, match="0 workers seen"):
        el.Device.remote(nats_server.url, key=str(client_key))


def test_cluster_ls_prints_a_row_per_worker_with_device_memory_load_addresses_relay_and_trust(nats_server):
    with relay_worker(nats_server.url) as a, relay_worker(nats_server.url, grpc=False) as b:
        wait_until(lambda: _seen(nats_server.url) == {a.node_id, b.node_id}, 10, "presence")
        trust_workers(a.node_id)
        out = subprocess.run(
            [sys.executable, "-m", "emberlink", "cluster", "ls", "--nats", nats_server.url],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    header, *lines = out.splitlines()
    names = header.split()
    assert names == ["node", "device", "free", "load", "addresses", "relay", "admits", "trusted"]
    starts = [header.index(name) for name in names]
    rows = [
        {name: line[start:end].strip() for name, start, end in zip(names, starts, [*starts[1:], None])}
        for line in lines
    ]
    by_node = {row["node"]: row for row in rows}
    assert set(by_node) == {a.node_id[:12], b.node_id[:12]}
    for row in rows:
        assert row["device"] == "cpu" and row["load"].startswith("0 sessions") and row["free"].endswith("B")
        assert (row["relay"], row["admits"]) == (nats_server.url, "anyone")
    assert by_node[a.node_id[:12]]["addresses"] == f"127.0.0.1:{a.port}"
    assert by_node[b.node_id[:12]]["addresses"] == "-"  # relay-only: no direct address
    assert by_node[a.node_id[:12]]["trusted"] == "known worker"
    assert by_node[b.node_id[:12]]["trusted"] == "no"


def test_presence_load_counts_open_sessions_and_work_waiting_for_the_device(nats_server):
    with relay_worker(nats_server.url) as worker:
        wait_until(lambda: _seen(nats_server.url) == {worker.node_id}, 10, "presence")
        ((only,),) = [[s.presence for s in survey(nats_server.url)]]
        assert only.load == (0, 0)
        release = threading.Event()
        with el.Device.remote(worker.ticket) as dev:
            worker.worker.device.post(release.wait)  # the device is busy ...
            worker.worker.device.post(lambda: None)  # ... so this waits in its queue
            try:
                (seen,) = survey(nats_server.url)
                assert seen.presence.sessions == 1 and seen.presence.queued >= 1
            finally:
                release.set()
            dev.sync()


def test_cluster_ls_lists_a_workers_tcp_and_grpc_addresses_as_its_ticket_does():
    ticket = Ticket.parse(f"emberlink://{'a' * 52}@tcp:gpu-box:7444,gpu-box:7443?relay=nats://relay:4222")
    presence = Presence(str(ticket), "cuda:0", 1 << 30, 0, 0, False)
    header, row = cluster_table([Seen(presence, ticket)]).splitlines()
    addresses = row[header.index("addresses") : header.index("relay")].strip()
    assert addresses == "tcp:gpu-box:7444,gpu-box:7443"
