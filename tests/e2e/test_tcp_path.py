"""Sessions over the raw TCP transport: the path a client picks, a training run that matches gRPC's
exactly, and a worker process that offers tcp in its ticket."""

from __future__ import annotations

import socket

import numpy as np

import emberlink as el
import emberlink.testing
from emberlink.client import paths
from emberlink.protocol.ticket import Ticket
from emberlink.transport.loop import io_loop

from .e2e_harness import Keys


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


def test_a_dead_tcp_address_falls_back_to_grpc() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # bound, not listening: refused
        with emberlink.testing.worker(grpc=True) as w:
            ticket = Ticket.parse(w.ticket)
            with_dead_tcp = Ticket(ticket.node_id, ticket.addrs, tcp=(("127.0.0.1", dead),))
            path, link = io_loop().call(paths.open_link(with_dead_tcp, timeout=5))
            io_loop().call(link.close())
    assert path == "grpc"


def test_worker_process_with_tcp_listen_puts_tcp_in_its_ticket_and_serves_it(
    start_worker, keys: Keys
) -> None:
    worker = start_worker("--tcp-listen", "127.0.0.1:0")
    ticket = Ticket.parse(worker.ticket)
    assert ticket.addrs and ticket.tcp and ticket.tcp[0][0] == "127.0.0.1" and ticket.tcp[0][1] != 0
    assert str(ticket).startswith(f"emberlink://{keys.worker.node_id}@tcp:127.0.0.1:")
    with el.Device.remote(worker.ticket, key=str(keys.client_key), timeout=10) as dev:
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        assert float((dev.tensor(x) @ dev.tensor(x).T).sum()) == float((x @ x.T).sum())
        assert dev.stats()["path"] == "tcp"
