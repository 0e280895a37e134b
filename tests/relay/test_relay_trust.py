"""Trusted discovery: a client picks only workers it trusts (known workers, or a cluster's certificate),
whatever a stranger on the same relay says about its load; with no trust configured it refuses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

import emberlink as el
from emberlink.client.discovery import survey
from emberlink.client.trust import CLUSTER_ENV, Trust, read_known_workers
from emberlink.errors import AuthError, ConfigError, ProtocolError
from emberlink.protocol.cluster import Certificate, decode_certificate, issue, parse_certificate
from emberlink.protocol.identity import AllowPolicy, Identity
from emberlink.protocol.presence import Presence, decode_presence, encode_presence

from .relay_harness import client_process, new_key, relay_worker, trust_workers, wait_until, worker_process

CLUSTER = Identity.from_seed(bytes([5]) * 32)
OTHER_CLUSTER = Identity.from_seed(bytes([6]) * 32)
WORKER = Identity.from_seed(bytes([7]) * 32)
STRANGER = Identity.from_seed(bytes([8]) * 32)


def _seen(url: str) -> set[str]:
    return {s.node_id for s in survey(url)}


def _presence(identity: Identity, cert: Certificate | None = None) -> Presence:
    return Presence(f"emberlink://{identity.node_id}@10.0.0.7:7443", "cpu", 1, 0, 0, False, certificate=cert)


# -- certificates and the known-workers file, without a relay ------------------------------------


def test_certificate_round_trips_through_its_file_text_and_presence(tmp_path: Path) -> None:
    cert = issue(CLUSTER, WORKER.node_id, not_after=2_000_000_000)
    assert parse_certificate(cert.text()) == cert == decode_certificate(cert.encode())
    cert.save(tmp_path / "worker.cert")
    assert Certificate.load(tmp_path / "worker.cert") == cert
    presence = _presence(WORKER, cert)
    assert decode_presence(encode_presence(presence, WORKER)).certificate == cert


def test_certificate_changed_after_signing_or_signed_by_another_key_is_refused() -> None:
    cert = issue(CLUSTER, WORKER.node_id)
    version, body, signature = msgpack.unpackb(cert.encode())
    cluster_key, _, not_after = msgpack.unpackb(body)
    for changed in (
        [cluster_key, STRANGER.public_bytes, not_after],  # vouch for another worker
        [OTHER_CLUSTER.public_bytes, WORKER.public_bytes, not_after],  # claim another cluster
        [cluster_key, WORKER.public_bytes, 1],  # change the end date
    ):
        forged = msgpack.packb([version, msgpack.packb(changed), signature])
        with pytest.raises(AuthError):
            decode_certificate(forged)
    for garbage in (b"", b"\xc1", msgpack.packb([1, b"", b""]), msgpack.packb([2, body, signature])):
        with pytest.raises(ProtocolError):
            decode_certificate(garbage)


def test_presence_carrying_a_certificate_for_another_worker_is_refused() -> None:
    stolen = issue(CLUSTER, WORKER.node_id)
    with pytest.raises(ProtocolError, match="certificate for"):
        encode_presence(_presence(STRANGER, stolen), STRANGER)


def test_a_certificate_vouches_only_for_its_worker_to_readers_of_its_cluster_until_its_end() -> None:
    cert = issue(CLUSTER, WORKER.node_id, not_after=1000)
    trust = Trust.of(clusters=[CLUSTER.node_id])
    assert trust.why(_presence(WORKER, cert), now=1000) == f"cluster {CLUSTER.node_id}"
    assert trust.why(_presence(WORKER, cert), now=1001) is None  # expired
    assert Trust.of(clusters=[OTHER_CLUSTER.node_id]).why(_presence(WORKER, cert), now=0) is None
    assert trust.why(_presence(WORKER), now=0) is None  # no certificate
    assert Trust.of(workers=[WORKER.node_id]).why(_presence(WORKER), now=0) == "known worker"


def test_known_workers_file_holds_node_ids_and_clusters_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "known_workers"
    path.write_text(f"# the lab\n{WORKER.node_id}  # gpu-box\n\n@cluster {CLUSTER.node_id}\n")
    assert read_known_workers(path) == ({WORKER.node_id}, {CLUSTER.node_id})
    assert read_known_workers(tmp_path / "absent") == (set(), set())
    env = {"EMBERLINK_KNOWN_WORKERS": str(path), CLUSTER_ENV: f"{OTHER_CLUSTER.node_id}, "}
    trust = Trust.load(env)
    assert trust.workers == {WORKER.node_id}
    assert trust.clusters == {CLUSTER.node_id, OTHER_CLUSTER.node_id}


@pytest.mark.parametrize("line", ["gpu-box", f"@cluster {WORKER.node_id} extra", f"@ca {WORKER.node_id}"])
def test_a_malformed_known_workers_line_is_an_error_naming_file_and_line(tmp_path: Path, line: str) -> None:
    path = tmp_path / "known_workers"
    path.write_text(f"{WORKER.node_id}\n{line}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2")):
        read_known_workers(path)


# -- discovery on a real relay -----------------------------------------------------------------


def test_a_strangers_worker_reporting_a_lower_load_is_never_picked_over_a_known_worker(nats_server, tmp_path):
    client, client_key = new_key(tmp_path, "client")
    other, other_key = new_key(tmp_path, "other")
    with (
        relay_worker(nats_server.url, AllowPolicy.of([client.node_id, other.node_id])) as ours,
        relay_worker(nats_server.url) as stranger,  # --allow-any, and idle: the lower load
        el.Device.remote(ours.ticket, key=str(other_key)) as busy,
    ):
        wait_until(lambda: _seen(nats_server.url) == {ours.node_id, stranger.node_id}, 10, "presence")
        trust_workers(ours.node_id)
        for _ in range(3):
            with el.Device.remote(nats_server.url, key=str(client_key)) as dev:
                assert dev.stats()["worker"] == ours.node_id
        assert stranger.worker.sessions_refused == 0 and not stranger.worker.sessions
        busy.sync()


def test_a_worker_certified_by_a_trusted_cluster_is_picked_and_one_of_another_cluster_is_not(
    nats_server, tmp_path, monkeypatch
):
    _, client_key = new_key(tmp_path, "client")
    worker_id, stranger_id = Identity.generate(os.urandom), Identity.generate(os.urandom)
    ours_cert = issue(CLUSTER, worker_id.node_id)
    theirs_cert = issue(OTHER_CLUSTER, stranger_id.node_id)
    with (
        relay_worker(nats_server.url, identity=worker_id, certificate=ours_cert) as ours,
        relay_worker(nats_server.url, identity=stranger_id, certificate=theirs_cert) as stranger,
        el.Device.remote(ours.ticket, key=str(client_key)) as busy,  # ours is the busier one
    ):
        wait_until(lambda: _seen(nats_server.url) == {ours.node_id, stranger.node_id}, 10, "presence")
        monkeypatch.setenv(CLUSTER_ENV, CLUSTER.node_id)
        with el.Device.remote(nats_server.url, key=str(client_key)) as dev:
            assert dev.stats()["worker"] == ours.node_id
        monkeypatch.setenv(CLUSTER_ENV, OTHER_CLUSTER.node_id)
        with el.Device.remote(nats_server.url, key=str(client_key)) as dev:
            assert dev.stats()["worker"] == stranger.node_id
        assert not stranger.worker.sessions
        busy.sync()


def test_a_relay_address_with_no_trust_configured_refuses_naming_the_workers_and_how_to_trust_them(
    nats_server, tmp_path, client_settings
):
    _, client_key = new_key(tmp_path, "client")
    with (
        relay_worker(nats_server.url) as plain,
        relay_worker(nats_server.url, identity=WORKER, certificate=issue(CLUSTER, WORKER.node_id)) as signed,
    ):
        wait_until(lambda: _seen(nats_server.url) == {plain.node_id, signed.node_id}, 10, "presence")
        with pytest.raises(AuthError) as info:
            el.Device.remote(nats_server.url, key=str(client_key))
        assert not plain.worker.sessions and not signed.worker.sessions
    message = str(info.value)
    assert "2 worker(s) seen" in message and "trusts no worker" in message
    assert f"{plain.node_id} (no cluster certificate)" in message
    assert f"{signed.node_id} (signed by cluster {CLUSTER.node_id})" in message
    assert str(client_settings) in message and "@cluster <cluster-id>" in message and CLUSTER_ENV in message


def _emberlink(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "emberlink", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_cluster_init_and_sign_make_a_worker_that_clients_of_the_cluster_find_and_train_on(
    nats_server, tmp_path, monkeypatch
):
    init = _emberlink("cluster", "init", "--out", str(tmp_path / "cluster.key"))
    assert init.returncode == 0, init.stderr
    cluster_id = init.stdout.strip()
    assert cluster_id == Identity.load(tmp_path / "cluster.key").node_id
    worker, worker_key = new_key(tmp_path, "worker")
    cert_path = tmp_path / "worker.cert"
    sign = _emberlink(
        *("cluster", "sign", "--cluster-key", str(tmp_path / "cluster.key")),
        *("--worker-id", worker.node_id, "--out", str(cert_path), "--days", "30"),
    )
    assert sign.returncode == 0, sign.stderr
    assert Certificate.load(cert_path).worker_id == worker.node_id
    refused = _emberlink(
        *("cluster", "sign", "--cluster-key", str(tmp_path / "cluster.key")),
        *("--worker-id", "gpu-box", "--out", str(tmp_path / "bad.cert")),
    )
    assert refused.returncode == 1 and "--worker-id" in refused.stderr

    _, client_key = new_key(tmp_path, "client")
    proc, ticket = worker_process(
        tmp_path,
        "worker",
        *(
            "--listen",
            "127.0.0.1:0",
            "--allow-any",
            "--relay",
            nats_server.url,
            "--cluster-cert",
            str(cert_path),
        ),
        key=worker_key,
    )
    try:
        wait_until(lambda: _seen(nats_server.url) == {worker.node_id}, 15, "presence")
        monkeypatch.setenv(CLUSTER_ENV, cluster_id)
        client = client_process(tmp_path, "client", nats_server.url, str(client_key), "train", "3")
        try:
            assert client.expect("connected", 30).split()[:2] == ["connected", ticket.node_id]
            client.expect("losses", 60)
            assert client.wait(30) == 0
        finally:
            client.close()
        ls = _emberlink("cluster", "ls", "--nats", nats_server.url)
        assert ls.returncode == 0, ls.stderr
        assert ls.stdout.splitlines()[1].split()[-2:] == ["cluster", cluster_id[:12]]
    finally:
        proc.close()


def test_a_worker_refuses_to_start_with_a_certificate_for_another_worker(nats_server, tmp_path):
    _, worker_key = new_key(tmp_path, "worker")
    cert = tmp_path / "other.cert"
    issue(CLUSTER, STRANGER.node_id).save(cert)
    done = _emberlink(
        *("worker", "--listen", "127.0.0.1:0", "--key", str(worker_key), "--allow-any"),
        *("--relay", nats_server.url, "--cluster-cert", str(cert)),
    )
    assert done.returncode == 2 and f"for worker {STRANGER.node_id}" in done.stderr
