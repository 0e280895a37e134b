"""A relay run with deploy/nats.conf's authorization: nkey users made by `emberlink cluster nats-user`, each
kept to its role's subjects; credentials come from files and never show in logs, presence or tickets."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

import emberlink as el
from emberlink import cli
from emberlink.errors import TransportError
from emberlink.protocol.identity import Identity
from emberlink.protocol.ticket import Ticket
from emberlink.transport import nats as nats_transport
from emberlink.transport.nats_access import CA_ENV, CREDS_ENV, RelayAccess, create_user_seed

from ..conftest import NatsServer
from . import relay_training
from .relay_harness import Eavesdropper, new_key, trust_workers, wait_until, worker_process

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@dataclass
class Cluster:
    server: NatsServer
    worker_key: Path
    worker: Identity
    other_worker: Identity
    seeds: dict[str, Path]  # worker, other_worker, client, spy

    @property
    def url(self) -> str:
        return self.server.url

    def secret(self, name: str) -> str:
        return self.seeds[name].read_text().strip()


def _nats_user(capsys: pytest.CaptureFixture[str], *argv: str) -> None:
    assert cli.main(["cluster", "nats-user", *argv]) == 0
    capsys.readouterr()


@pytest.fixture
def cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> object:
    """deploy/nats.conf, with users.conf made by the CLI: two workers, a client, and a spy that may read
    everything (a test-only user, to look at what crossed the relay)."""
    conf_dir = tmp_path / "relay"
    conf_dir.mkdir()
    shutil.copy(DEPLOY / "nats.conf", conf_dir / "nats.conf")
    users = conf_dir / "users.conf"
    worker, worker_key = new_key(tmp_path, "worker")
    other, _ = new_key(tmp_path, "other-worker")
    seeds = {name: tmp_path / f"{name}.nk" for name in ("worker", "other_worker", "client", "spy")}
    for name, role in (("worker", worker), ("other_worker", other)):
        _nats_user(
            capsys,
            "--role",
            "worker",
            "--worker-id",
            role.node_id,
            "--out",
            str(seeds[name]),
            "--users-conf",
            str(users),
        )
    _nats_user(capsys, "--role", "client", "--out", str(seeds["client"]), "--users-conf", str(users))
    spy = create_user_seed(seeds["spy"])
    text = users.read_text()
    users.write_text(
        text.rstrip()[:-1] + json.dumps({"nkey": spy, "permissions": {"subscribe": ">"}}) + "\n]\n"
    )
    assert users.read_text().count('"nkey"') == 4
    with NatsServer(tmp_path / "nats", config=conf_dir / "nats.conf") as server:
        yield Cluster(server, worker_key, worker, other, seeds)


class Conn:
    """A raw nats-py connection with the given seed that records the errors the server sends it."""

    def __init__(self, nc: Client, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors
        self.got: list[tuple[str, bytes]] = []

    @classmethod
    async def open(cls, url: str, seed: Path) -> Conn:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        nc = await nats.connect(url, nkeys_seed=str(seed), allow_reconnect=False, error_cb=on_error)
        return cls(nc, errors)

    async def keep(self, msg: Msg) -> None:
        self.got.append((msg.subject, msg.data))

    async def violations(self, n: int) -> list[str]:
        for _ in range(100):
            await self.nc.flush()
            if len(self.errors) >= n:
                break
            await asyncio.sleep(0.02)
        return [e for e in self.errors if "permissions violation" in e.lower()]


def test_relay_refuses_strangers_and_keeps_each_role_to_its_own_subjects(cluster) -> None:
    asyncio.run(_refuses_strangers_and_keeps_each_role_to_its_own_subjects(cluster))


async def _refuses_strangers_and_keeps_each_role_to_its_own_subjects(cluster: Cluster) -> None:
    url, w = cluster.url, cluster.worker.node_id
    with pytest.raises(TransportError, match="(?i)authorization"):  # no credentials
        await nats_transport.connect(url, w, timeout=5, access=RelayAccess())
    unknown = cluster.seeds["spy"].parent / "unknown.nk"
    create_user_seed(unknown)
    with pytest.raises(TransportError, match="(?i)authorization"):  # a login the relay does not know
        await nats_transport.connect(url, w, timeout=5, access=RelayAccess(unknown))

    worker = await Conn.open(url, cluster.seeds["worker"])  # the real worker, listening where it may
    for subject in (f"emberlink.node.{w}", f"emberlink.w.{w}.*"):
        await worker.nc.subscribe(subject, cb=worker.keep)
    await worker.nc.flush()
    assert await worker.violations(0) == []

    other = await Conn.open(url, cluster.seeds["other_worker"])
    client = await Conn.open(url, cluster.seeds["client"])
    spy = await Conn.open(url, cluster.seeds["spy"])
    await spy.nc.subscribe(">", cb=spy.keep)
    await spy.nc.flush()
    # Another worker may not take this worker's requests or sessions, nor speak for it.
    for subject in (f"emberlink.node.{w}", f"emberlink.w.{w}.*", "emberlink.c.>"):
        await other.nc.subscribe(subject, cb=other.keep)
    for subject in (f"emberlink.node.{w}", f"emberlink.w.{w}.x", f"emberlink.presence.{w}"):
        await other.nc.publish(subject, b"forged")
    # A client may not read requests, workers' inboxes or other clients' inboxes, nor speak as a worker.
    for subject in (f"emberlink.node.{w}", "emberlink.w.>", "emberlink.c.anon.*", "emberlink.presence.*"):
        await client.nc.subscribe(subject, cb=client.keep)
    for subject in (f"emberlink.presence.{w}", "emberlink.c.anon.x", f"emberlink.i.{'U' * 56}.x"):
        await client.nc.publish(subject, b"forged")
    assert len(await other.violations(6)) == 6, other.errors
    assert len(await client.violations(7)) == 7, client.errors
    # What a client may do reaches the worker: a session request and a message to a session inbox.
    await client.nc.publish(f"emberlink.node.{w}", b"request")
    await client.nc.publish(f"emberlink.w.{w}.x", b"to a session")
    await client.nc.flush()
    for _ in range(100):
        if len(worker.got) >= 2:
            break
        await asyncio.sleep(0.02)
    assert sorted(worker.got) == [
        (f"emberlink.node.{w}", b"request"),
        (f"emberlink.w.{w}.x", b"to a session"),
    ]
    assert b"forged" not in {data for _, data in spy.got}  # nothing refused went anywhere
    assert other.got == [] and client.got == []
    for conn in (worker, other, client, spy):
        await conn.nc.close()


def test_authorized_worker_and_client_train_through_the_relay_and_the_secrets_stay_in_their_files(
    cluster, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.DEBUG)
    spy = Eavesdropper(cluster.url, creds=cluster.seeds["spy"])
    proc, ticket = worker_process(
        tmp_path,
        "worker",
        *("--listen", "127.0.0.1:0", "--allow-any", "--relay", cluster.url, "-v"),
        *("--nats-creds", str(cluster.seeds["worker"])),
        key=cluster.worker_key,
    )
    try:
        monkeypatch.setenv(CREDS_ENV, str(cluster.seeds["client"]))
        trust_workers(ticket.node_id)
        with el.Device.cpu() as cpu:
            expected = relay_training.train(cpu, 4)
        with el.Device.remote(str(Ticket(ticket.node_id, (), cluster.url))) as dev:
            assert dev.stats()["path"] == "relay"
            assert relay_training.train(dev, 4) == expected
        with el.Device.remote(cluster.url) as dev:  # discovery, through the client's login
            assert dev.stats()["worker"] == ticket.node_id
        ls = subprocess.run(
            [sys.executable, "-m", "emberlink", "cluster", "ls", "--nats", cluster.url],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        wait_until(
            lambda: any(s.startswith("emberlink.presence.") for s, _, _ in spy.messages), 5, "presence"
        )
    finally:
        proc.close()
        spy.close()
    assert ticket.node_id[:12] in ls.stdout
    seen_on_relay = spy.everything()
    assert any(s.startswith(f"emberlink.w.{ticket.node_id}.") for s, _, _ in spy.messages)
    texts = {
        "the worker's log": proc.log.read_text(),
        "the ticket": str(ticket),
        "the client's log": caplog.text,
        "cluster ls": ls.stdout + ls.stderr,
    }
    assert "logging in to the relay as U" in texts["the worker's log"]
    for name in ("worker", "client"):
        secret = cluster.secret(name)
        assert secret.startswith("SU")
        for where, text in texts.items():
            assert secret not in text and secret[2:20] not in text, f"{name}'s seed in {where}"
        assert secret.encode() not in seen_on_relay and secret[2:20].encode() not in seen_on_relay


def test_a_credentials_file_others_can_read_stops_the_worker_at_start_up(cluster, tmp_path):
    cluster.seeds["worker"].chmod(0o644)
    done = subprocess.run(
        [sys.executable, "-m", "emberlink", "worker", "--listen", "127.0.0.1:0", "--allow-any"]
        + [
            "--key",
            str(cluster.worker_key),
            "--relay",
            cluster.url,
            "--nats-creds",
            str(cluster.seeds["worker"]),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "chmod 600" in done.stderr
    assert cluster.secret("worker") not in done.stderr + done.stdout


def _tls_files(folder: Path) -> tuple[Path, Path, Path]:
    """(CA bundle, server certificate, server key) for 127.0.0.1, made here."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder(
            name("test relay CA"), name("test relay CA"), ca_key.public_key(), 1, now, now + ONE_DAY
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder(ca.subject, name("127.0.0.1"), key.public_key(), 2, now, now + ONE_DAY)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "server.pem", folder / "server-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


ONE_DAY = datetime.timedelta(days=1)


def test_a_relay_that_requires_tls_serves_workers_and_clients_given_its_ca_and_refuses_others(
    tmp_path, monkeypatch
):
    ca, cert, key = _tls_files(tmp_path)
    conf = tmp_path / "tls.conf"
    conf.write_text(f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n}}\n')
    worker, worker_key = new_key(tmp_path, "worker")
    with NatsServer(tmp_path / "nats", config=conf) as server:
        proc, _ = worker_process(
            tmp_path,
            "worker",
            *("--listen", "127.0.0.1:0", "--allow-any", "--relay", server.url, "--nats-ca", str(ca)),
            key=worker_key,
        )
        try:
            relay_only = str(Ticket(worker.node_id, (), server.url))
            with pytest.raises(TransportError, match="(?i)certificate"):  # the system's CAs do not know it
                el.Device.remote(relay_only, timeout=5)
            monkeypatch.setenv(CA_ENV, str(ca))
            with el.Device.remote(relay_only) as dev:
                assert dev.stats()["path"] == "relay"
                assert float(dev.tensor([1.0, 2.0]).sum()) == 3.0
        finally:
            proc.close()


def test_relay_login_flags_without_a_relay_and_a_seed_file_that_exists_are_refused(tmp_path, capsys):
    from emberlink.errors import ConfigError
    from emberlink.server.daemon import load_config

    _, key = new_key(tmp_path, "worker")
    args = cli.build_parser().parse_args(
        ["worker", "--listen", "127.0.0.1:0", "--key", str(key), "--allow-any", "--nats-creds", "x.nk"]
    )
    with pytest.raises(ConfigError, match="--relay"):
        load_config(args)
    seed = tmp_path / "client.nk"
    assert cli.main(["cluster", "nats-user", "--role", "client", "--out", str(seed)]) == 0
    first = seed.read_text()
    assert cli.main(["cluster", "nats-user", "--role", "client", "--out", str(seed)]) == 1
    assert cli.main(["cluster", "nats-user", "--role", "client", "--worker-id", "x", "--out", "y"]) == 1
    assert seed.read_text() == first and oct(seed.stat().st_mode & 0o777) == "0o600"
    assert first.strip() not in capsys.readouterr().out
