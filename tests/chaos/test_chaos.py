"""Training through faults: a cut link, a restarted relay, 5% packet loss, a frozen worker, a path that
changes from direct to relay, and 64 clients at once. Real worker processes, real nats-server, clients
in their own network namespace where the fault needs one (Linux, root; iptables from Debian's package).
Every run's losses must equal an undisturbed run's; what resuming added beyond the fault is measured
and reported (tests/chaos/conftest.py), not asserted."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

import emberlink as el
from emberlink.protocol.identity import Identity
from emberlink.protocol.ticket import Ticket

from ..netns import Namespace, iptables_unavailable, namespace_with_veth, nats_server_on, netns_unavailable
from ..process_harness import Process
from ..relay import relay_training
from ..relay.relay_harness import ROOT, new_key, worker_process

STEPS = 40
PACE = 0.05  # seconds between steps
FAULT_AT = 8  # the fault starts once this step's loss has arrived

_NETNS = netns_unavailable()
needs_netns = pytest.mark.skipif(_NETNS is not None, reason=_NETNS or "")
_IPTABLES = _NETNS or iptables_unavailable()
needs_iptables = pytest.mark.skipif(_IPTABLES is not None, reason=_IPTABLES or "")

Fault = Callable[[], tuple[float, float]]
"""Does the fault; returns when it started and ended (time.monotonic)."""


@pytest.fixture(scope="module")
def expected() -> list[float]:
    with el.Device.cpu() as cpu:
        return relay_training.train(cpu, STEPS)


@dataclass
class Run:
    losses: list[float]
    stats: dict[str, object]
    ends: list[float]  # when each step's loss arrived (time.monotonic)
    fault: tuple[float, float]
    started_on: str  # the path the session opened on

    def added(self) -> float:
        """Seconds the fault stalled training beyond its own length and one ordinary step."""
        start, end = self.fault
        before = max((t for t in self.ends if t <= start), default=start)
        after = min(t for t in self.ends if t > end)
        gaps = [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]
        ordinary = statistics.median(gaps)
        return max(after - before - (end - start) - ordinary, 0.0)

    def describe(self, what: str) -> str:
        start, end = self.fault
        return (
            f"{what}: fault {end - start:.2f} s, added {self.added():.2f} s beyond it, "
            f"resumes {self.stats['resumes']} (last {self.stats['resume_ms']} ms), path now {self.stats['path']}"
        )


def train_through(
    tmp_path: Path, address: str, key: Path, fault: Fault, *, prefix: list[str] | None = None
) -> Run:
    """Run tests/chaos/chaos_client.py against `address`, doing `fault` once step FAULT_AT is done."""
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *([path] if path else [])]))
    argv = [sys.executable, "-m", "tests.chaos.chaos_client", address, str(key), str(STEPS), str(PACE)]
    client = Process([*(prefix or []), *argv], tmp_path / "client.log", env=env)
    ends: list[float] = []

    def until(prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = client.next_line(max(deadline - time.monotonic(), 0.01))
            if line.startswith("step "):
                ends.append(float(line.split()[2]))
            if line.startswith("lost "):
                raise AssertionError(f"training died: {line}\n{client.stderr()}")
            if line.startswith(prefix):
                return line

    try:
        started_on = until("connected", 30).split()[1]
        until(f"step {FAULT_AT} ", 60)
        window = fault()
        losses = json.loads(until("losses", 120).partition(" ")[2])
        stats = json.loads(until("stats", 10).partition(" ")[2])
        assert client.wait(30) == 0
    finally:
        client.close()
    return Run(losses, stats, ends, window, started_on)


def timed(action: Callable[[], None], seconds: float, undo: Callable[[], None]) -> tuple[float, float]:
    start = time.monotonic()
    action()
    time.sleep(seconds)
    undo()
    return start, time.monotonic()


@pytest.mark.slow
@needs_netns
@pytest.mark.parametrize("seconds", [1.0, 5.0])
def test_training_goes_on_through_a_cut_link_with_the_same_losses(
    tmp_path, expected, chaos_report, seconds
) -> None:
    _, worker_key = new_key(tmp_path, "worker")
    _, client_key = new_key(tmp_path, "client")
    with namespace_with_veth() as ns:
        worker, ticket = worker_process(
            tmp_path, "worker", "--listen", f"{ns.root_addr}:0", "--allow-any", key=worker_key
        )
        try:
            run = train_through(
                tmp_path,
                str(ticket),
                client_key,
                lambda: timed(lambda: ns.link("down"), seconds, lambda: ns.link("up")),
                prefix=ns.prefix,
            )
        finally:
            worker.close()
    chaos_report(run.describe(f"link cut for {seconds:g} s (direct)"))
    assert run.losses == expected


@pytest.mark.slow
def test_training_goes_on_through_a_relay_restart_with_the_same_losses(
    tmp_path, expected, chaos_report, nats_server
) -> None:
    _, worker_key = new_key(tmp_path, "worker")
    _, client_key = new_key(tmp_path, "client")
    worker, ticket = worker_process(
        tmp_path,
        "worker",
        "--listen",
        "127.0.0.1:0",
        "--allow-any",
        "--relay",
        nats_server.url,
        key=worker_key,
    )
    try:
        relay_only = Ticket(ticket.node_id, (), ticket.relay)
        run = train_through(
            tmp_path,
            str(relay_only),
            client_key,
            lambda: timed(nats_server.kill, 1.0, nats_server.start),
        )
    finally:
        worker.close()
    chaos_report(run.describe("nats-server killed, back after 1 s (relay)"))
    assert run.losses == expected
    assert run.stats["path"] == "relay" and int(str(run.stats["resumes"])) >= 1


@pytest.mark.slow
@needs_iptables
def test_training_goes_on_through_five_percent_packet_loss_with_the_same_losses(
    tmp_path, expected, chaos_report
) -> None:
    _, worker_key = new_key(tmp_path, "worker")
    _, client_key = new_key(tmp_path, "client")
    rule = ("INPUT", "-m", "statistic", "--mode", "random", "--probability", "0.05", "-j", "DROP")
    with namespace_with_veth() as ns:
        worker, ticket = worker_process(
            tmp_path, "worker", "--listen", f"{ns.root_addr}:0", "--allow-any", key=worker_key
        )
        try:

            def lossy() -> tuple[float, float]:
                ns.iptables("-A", *rule)  # stays until the namespace goes
                now = time.monotonic()
                return now, now

            run = train_through(tmp_path, str(ticket), client_key, lossy, prefix=ns.prefix)
        finally:
            worker.close()
    after = [b - a for a, b in zip(run.ends[FAULT_AT:], run.ends[FAULT_AT + 1 :], strict=False)]
    chaos_report(
        f"5% of packets dropped from step {FAULT_AT} on (direct): slowest step {max(after):.2f} s, "
        f"median {statistics.median(after):.3f} s, resumes {run.stats['resumes']}"
    )
    assert run.losses == expected


@pytest.mark.slow
def test_training_goes_on_through_a_worker_stopped_for_three_seconds_with_the_same_losses(
    tmp_path, expected, chaos_report
) -> None:
    _, worker_key = new_key(tmp_path, "worker")
    _, client_key = new_key(tmp_path, "client")
    worker, ticket = worker_process(
        tmp_path, "worker", "--listen", "127.0.0.1:0", "--allow-any", key=worker_key
    )
    try:
        run = train_through(
            tmp_path,
            str(ticket),
            client_key,
            lambda: timed(lambda: worker.signal(signal.SIGSTOP), 3.0, lambda: worker.signal(signal.SIGCONT)),
        )
    finally:
        worker.close()
    chaos_report(run.describe("worker stopped (SIGSTOP) for 3 s (direct)"))
    assert run.losses == expected


@contextmanager
def relayed_worker_in_a_namespace(
    tmp_path: Path,
) -> Iterator[tuple[Namespace, subprocess.Popen[bytes], Ticket, Path]]:
    """A network namespace with a nats-server on its host side and a worker process listening
    there both directly and through that relay; yields the namespace, the nats-server process, the
    worker's ticket and a client key. The worker and the nats-server are stopped on the way out."""
    _, worker_key = new_key(tmp_path, "worker")
    _, client_key = new_key(tmp_path, "client")
    with namespace_with_veth() as ns:
        nats, port = nats_server_on(ns.root_addr, tmp_path)
        url = f"nats://{ns.root_addr}:{port}"
        try:
            worker, ticket = worker_process(
                tmp_path,
                "worker",
                *("--listen", f"{ns.root_addr}:0", "--allow-any", "--relay", url),
                key=worker_key,
            )
            try:
                yield ns, nats, ticket, client_key
            finally:
                worker.close()
        finally:
            nats.kill()
            nats.wait(10)


@pytest.mark.slow
@needs_iptables
def test_training_moves_from_the_direct_path_to_the_relay_with_the_same_losses(
    tmp_path, expected, chaos_report
) -> None:
    with relayed_worker_in_a_namespace(tmp_path) as (ns, _, ticket, client_key):

        def block_direct() -> tuple[float, float]:
            now = time.monotonic()  # packets to the worker's tcp and gRPC ports vanish from now on
            for port in direct_ports(ticket):
                ns.iptables("-A", "OUTPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP")
            return now, now

        run = train_through(tmp_path, str(ticket), client_key, block_direct, prefix=ns.prefix)
    chaos_report(run.describe("direct path blocked for good (direct -> relay)"))
    assert run.losses == expected
    assert run.started_on == "tcp"
    assert run.stats["path"] == "relay" and int(str(run.stats["resumes"])) >= 1


def direct_ports(ticket: Ticket) -> list[int]:
    """The ports of a worker's direct addresses: raw tcp (served by default) and gRPC."""
    return [port for _, port in ticket.tcp + ticket.addrs]


@pytest.mark.slow
@needs_iptables
def test_training_moves_from_the_relay_back_to_the_direct_path_with_the_same_losses(
    tmp_path, expected, chaos_report
) -> None:
    with relayed_worker_in_a_namespace(tmp_path) as (ns, nats, ticket, client_key):
        blocks = [
            ("OUTPUT", "-p", "tcp", "--dport", str(port), "-j", "REJECT") for port in direct_ports(ticket)
        ]
        for block in blocks:
            ns.iptables("-A", *block)  # the client starts on the relay

        def relay_dies_direct_opens() -> tuple[float, float]:
            for block in blocks:
                ns.iptables("-D", *block)
            now = time.monotonic()
            nats.kill()
            return now, now

        run = train_through(tmp_path, str(ticket), client_key, relay_dies_direct_opens, prefix=ns.prefix)
    chaos_report(run.describe("relay killed, direct path open again (relay -> direct)"))
    assert run.losses == expected
    assert run.started_on == "relay"
    assert run.stats["path"] == "tcp" and int(str(run.stats["resumes"])) >= 1


CLIENTS = 64
CLIENT_STEPS = 3


@pytest.mark.slow
def test_sixty_four_clients_at_once_over_direct_and_relay_paths_get_correct_results(
    tmp_path, nats_server, chaos_report
) -> None:
    _, worker_key = new_key(tmp_path, "worker")
    worker, ticket = worker_process(
        tmp_path,
        "worker",
        "--listen",
        "127.0.0.1:0",
        "--allow-any",
        "--relay",
        nats_server.url,
        key=worker_key,
    )
    tickets = [Ticket(ticket.node_id, ticket.addrs, tcp=ticket.tcp), Ticket(ticket.node_id, (), ticket.relay)]
    with el.Device.cpu() as cpu:
        expected = [relay_training.train(cpu, CLIENT_STEPS, seed) for seed in range(CLIENTS)]
    keys = []
    for i in range(CLIENTS):
        path = tmp_path / f"client-{i}.key"
        Identity.generate(os.urandom).save(path)
        keys.append(path)
    results: dict[int, object] = {}
    paths: dict[int, str] = {}
    start = threading.Barrier(CLIENTS)

    def client(i: int) -> None:
        try:
            start.wait(30)
            with el.Device.remote(str(tickets[i % 2]), key=str(keys[i]), timeout=60) as dev:
                paths[i] = str(dev.stats()["path"])
                results[i] = relay_training.train(dev, CLIENT_STEPS, i)
        except Exception as e:  # noqa: BLE001 - reported below, per client
            results[i] = e

    began = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        worker.close()
    elapsed = time.monotonic() - began
    failed = {i: r for i, r in results.items() if r != expected[i]}
    chaos_report(
        f"{CLIENTS} clients at once, {CLIENT_STEPS} steps each: {len(results) - len(failed)} correct in "
        f"{elapsed:.1f} s ({sum(p == 'tcp' for p in paths.values())} direct, "
        f"{sum(p == 'relay' for p in paths.values())} relayed)"
    )
    assert len(results) == CLIENTS and not failed, failed
    assert sorted(set(paths.values())) == ["relay", "tcp"]
