"""What a worker says about itself on the relay: builds its signed presence message; no I/O but reading
the free memory of its device."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from emberlink.graph_replay.backend import Backend
from emberlink.protocol.cluster import Certificate
from emberlink.protocol.presence import NONCE_SIZE, Presence, encode_presence

if TYPE_CHECKING:
    from emberlink.server.worker import Worker

log = logging.getLogger("emberlink.server")


def free_memory(backend: Backend) -> int:
    """Bytes free where `backend` allocates: its device's free memory (a GPU's), or the host's
    available memory for a backend on host memory; 0 when the figure cannot be read."""
    try:
        free = backend.free_bytes()
    except RuntimeError as e:  # CUDARuntimeError is a RuntimeError: report 0, keep going
        log.debug("presence: cannot read free memory of %s: %s", backend.name, e)
        return 0
    return free if free is not None else host_available_memory()


def host_available_memory() -> int:
    """The host's available memory in bytes (MemAvailable on Linux), 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def queued_work(worker: Worker) -> int:
    """Work items waiting for the device thread (batches of every session, not yet applied)."""
    return worker.device.queued()


class PresenceSource:
    """Builds the worker's current presence message each time it is called (a `transport.presence.Payload`).

    `serving()` says whether clients can reach the worker through the relay right now; while it
    is false the worker stays silent, so nobody is sent to a relay path that is not there.
    `certificate` is the worker's cluster certificate, carried in every message.
    """

    def __init__(
        self,
        worker: Worker,
        ticket: str,
        serving: Callable[[], bool] | None = None,
        certificate: Certificate | None = None,
    ) -> None:
        self._worker = worker
        self._ticket = ticket
        self._serving = serving
        self._certificate = certificate
        self._seq = itertools.count(1)

    def current(self, nonce: bytes = b"") -> Presence:
        """The worker's state now; `nonce` is a query's (answers sign it back; see protocol/presence.py)."""
        worker = self._worker
        return Presence(
            ticket=self._ticket,
            device=worker.device.spec,
            free_bytes=free_memory(worker.device.backend),
            sessions=len(worker.sessions),
            queued=queued_work(worker),
            admits_anyone=worker.allow.admits_anyone,
            draining=worker.draining,
            seq=next(self._seq),
            nonce=nonce,
            certificate=self._certificate,
        )

    def __call__(self, query: bytes = b"") -> bytes | None:
        """The signed message: periodic (`query` empty) or the answer to a query carrying a nonce;
        a query of any other size gets no answer."""
        if self._serving is not None and not self._serving():
            return None
        if len(query) not in (0, NONCE_SIZE):
            return None
        return encode_presence(self.current(bytes(query)), self._worker.identity)


__all__ = ["PresenceSource", "free_memory", "host_available_memory", "queued_work"]
