"""`emberlink ping`: how long a handshake and a round trip to a worker take; no protocol logic here."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

from emberlink.client.remote import connect_ticket, load_client_identity
from emberlink.protocol.ticket import Ticket


@dataclass(frozen=True)
class PingResult:
    worker: str
    path: str
    handshake_s: float
    round_trips_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.round_trips_s)


def ping(
    ticket: str, *, key: str | os.PathLike[str] | None = None, count: int = 10, timeout: float = 10.0
) -> PingResult:
    """Connect (handshake plus the admission round trip), then time `count` empty round trips."""
    parsed = Ticket.parse(ticket)
    identity = load_client_identity(key)
    t0 = time.perf_counter()
    executor = connect_ticket(parsed, identity, timeout=timeout)
    handshake = time.perf_counter() - t0
    try:
        samples = []
        for _ in range(max(count, 1)):
            t = time.perf_counter()
            executor.sync()
            samples.append(time.perf_counter() - t)
        path = str(executor.stats()["path"])
    finally:
        executor.close()
    return PingResult(parsed.node_id, path, handshake, tuple(samples))
