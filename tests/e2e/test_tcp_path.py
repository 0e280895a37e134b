"""Sessions over the raw TCP transport: the path a client picks (tcp first, gRPC when tcp is refused
or never answers), a training run that matches gRPC's exactly, and worker processes that serve tcp by
default and put it in their ticket."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

import emberlink as el
import emberlink.testing
from emberlink.client import paths
from emberlink.client.device import Device
from emberlink.client.remote import connect_ticket
from emberlink.errors import TransportError
from emberlink.protocol.identity import Identity
from emberlink.protocol.ticket import Ticket
from emberlink.transport.loop import io_loop

from .e2e_harness import Keys, WorkerProcess, subprocess_env


def train(dev: el.Device, steps: int = 6, *, jit: bool = False) -> list[float]:
    """A small MLP trained with SGD on fixed data; every step's loss."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 20)).astype(np.float32)
    y = rng.integers(0, 5, 32).astype(np.int64)
    model = el.nn.Sequential(el.nn.Linear(20, 16, seed=1), el.nn.ReLU(), el.nn.Linear(16, 5, seed=2)).to(dev)
    opt = el.optim.SGD(model.parameters(), lr=0.1)

    def step(xb: el.Tensor, yb: el.Tensor) -> el.Tensor:
        loss = el.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    run = el.jit(step) if jit else step
    return [float(run(dev.tensor(x), dev.tensor(y))) for _ in range(steps)]


def test_training_over_tcp_gives_the_losses_of_grpc_and_says_its_path() -> None:
    with (
        emberlink.testing.worker(grpc=True, tcp=True) as w,
        w.device(transport="grpc") as over_grpc,
        w.device(transport="tcp") as over_tcp,
    ):
        assert (over_grpc.stats()["path"], over_tcp.stats()["path"]) == ("grpc", "tcp")
        for jit in (False, True):
            losses = train(over_tcp, jit=jit)
            assert losses == train(over_grpc, jit=jit)
            assert losses[-1] < losses[0]  # it trained
        big = np.random.default_rng(0).standard_normal(3 << 20).astype(np.float32)  # 12 MiB: chunked
        assert np.array_equal(over_tcp.tensor(big).numpy(), big)


def test_a_ticket_with_tcp_and_grpc_addresses_gets_a_tcp_session() -> None:
    with emberlink.testing.worker(grpc=True, tcp=True) as w:
        ticket = Ticket.parse(w.ticket)
        assert ticket.tcp and ticket.addrs
        path, link = io_loop().call(paths.open_link(ticket, timeout=5))
        io_loop().call(link.close())
        assert path == "tcp"


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A loopback port that refuses connections: bound, not listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A loopback port whose connects never answer, as behind a firewall that drops packets: a
    listener with a backlog of 0 whose one queued connection is never accepted; Linux drops the SYNs
    it has no room for, so a connect hangs until its own timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), 5):  # fills the queue
            yield port


def test_a_refused_tcp_address_falls_back_to_grpc() -> None:
    with refusing_port() as dead, emberlink.testing.worker(grpc=True) as w:
        ticket = Ticket.parse(w.ticket)
        with_dead_tcp = Ticket(ticket.node_id, ticket.addrs, tcp=(("127.0.0.1", dead),))
        path, link = io_loop().call(paths.open_link(with_dead_tcp, timeout=5))
        io_loop().call(link.close())
    assert path == "grpc"


def test_a_tcp_address_that_never_answers_does_not_hold_up_a_session_over_grpc() -> None:
    # The connect timeout is far beyond the test's own (pytest's 120 s): a client that waited for the
    # tcp attempt to time out before trying gRPC would hang here instead of passing.
    with silent_port() as silent, emberlink.testing.worker(grpc=True) as w:
        ticket = Ticket.parse(w.ticket)
        with_silent_tcp = Ticket(ticket.node_id, ticket.addrs, tcp=(("127.0.0.1", silent),))
        with Device(connect_ticket(with_silent_tcp, w.client, timeout=600), "remote") as dev:
            x = np.arange(12, dtype=np.float32).reshape(3, 4)
            assert np.array_equal((dev.tensor(x) * 2.0).numpy(), x * 2.0)
            assert dev.stats()["path"] == "grpc"


def test_an_unreachable_worker_is_reported_with_every_address_that_failed() -> None:
    with silent_port() as silent, refusing_port() as refused_tcp, refusing_port() as refused_grpc:
        ticket = Ticket(
            Identity.generate(os.urandom).node_id,
            (("127.0.0.1", refused_grpc),),
            tcp=(("127.0.0.1", silent), ("127.0.0.1", refused_tcp)),
        )
        with pytest.raises(TransportError) as raised:
            io_loop().call(paths.open_link(ticket, timeout=1))
    message = str(raised.value)
    assert f"no answer from tcp worker at 127.0.0.1:{silent} within 1 s" in message
    assert f"cannot connect to tcp worker at 127.0.0.1:{refused_tcp}" in message
    assert f"grpc worker at 127.0.0.1:{refused_grpc}" in message
    assert message.startswith(f"cannot reach worker {ticket.node_id}: ")


def test_a_worker_process_serves_raw_tcp_by_default_and_its_ticket_carries_both(
    start_worker, keys: Keys
) -> None:
    worker = start_worker()
    ticket = Ticket.parse(worker.ticket)
    assert ticket.addrs and ticket.tcp and ticket.tcp[0][0] == "127.0.0.1" and ticket.tcp[0][1] != 0
    assert ticket.tcp[0][1] != ticket.addrs[0][1]
    assert str(ticket).startswith(f"emberlink://{keys.worker.node_id}@tcp:127.0.0.1:")
    with el.Device.remote(worker.ticket, key=str(keys.client_key), timeout=10) as dev:
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        assert float((dev.tensor(x) @ dev.tensor(x).T).sum()) == float((x @ x.T).sum())
        assert dev.stats()["path"] == "tcp"
    grpc_only = Ticket(ticket.node_id, ticket.addrs)  # what a client too old to know tcp: is given
    with el.Device.remote(str(grpc_only), key=str(keys.client_key), timeout=10) as dev:
        assert float(dev.tensor(x).sum()) == float(x.sum()) and dev.stats()["path"] == "grpc"


def test_a_worker_process_with_tcp_listen_serves_tcp_there(start_worker, keys: Keys) -> None:
    with refusing_port() as port:
        pass  # free again: a port no one listens on
    worker = start_worker("--tcp-listen", f"127.0.0.1:{port}")
    assert Ticket.parse(worker.ticket).tcp == (("127.0.0.1", port),)
    with el.Device.remote(worker.ticket, key=str(keys.client_key), timeout=10) as dev:
        assert float(dev.tensor([1.0, 2.0]).sum()) == 3.0 and dev.stats()["path"] == "tcp"


def test_a_worker_process_with_tcp_listen_off_serves_grpc_only(start_worker, keys: Keys) -> None:
    worker = start_worker("--tcp-listen", "off")
    ticket = Ticket.parse(worker.ticket)
    assert ticket.addrs and not ticket.tcp
    with el.Device.remote(worker.ticket, key=str(keys.client_key), timeout=10) as dev:
        assert float(dev.tensor([1.0, 2.0]).sum()) == 3.0 and dev.stats()["path"] == "grpc"


def free_port_pair() -> int:
    """A loopback port P with P + 1 free too (both released again)."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port: int = a.getsockname()[1]
            if port < 65535 and b.connect_ex(("127.0.0.1", port + 1)) != 0:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise AssertionError("no two free ports side by side on 127.0.0.1")


def test_a_worker_process_takes_the_listen_port_plus_one_for_raw_tcp(keys: Keys, tmp_path) -> None:
    port = free_port_pair()
    args = ["--listen", f"127.0.0.1:{port}", "--key", str(keys.worker_key), "--allow", str(keys.allow)]
    worker = WorkerProcess(args, subprocess_env(), tmp_path / "worker.log")
    try:
        ticket = Ticket.parse(worker.ticket)
        assert (ticket.tcp, ticket.addrs) == ((("127.0.0.1", port + 1),), (("127.0.0.1", port),))
    finally:
        worker.close()


def test_a_busy_default_tcp_port_stops_the_worker_saying_what_to_pass(keys: Keys) -> None:
    port = free_port_pair()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 1))
        busy.listen()
        done = subprocess.run(
            [sys.executable, "-m", "emberlink", "worker", "--listen", f"127.0.0.1:{port}"]
            + ["--key", str(keys.worker_key), "--allow-any"],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2 and done.stdout == ""
    assert f"cannot serve raw TCP on 127.0.0.1:{port + 1}" in done.stderr
    assert "Address already in use" in done.stderr
    assert "--tcp-listen HOST:PORT" in done.stderr and "--tcp-listen off" in done.stderr
    assert "Traceback" not in done.stderr
