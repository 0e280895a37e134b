"""What a remote device's address opens: a ticket its worker, a relay URL the worker discovery picks;
no session logic (client/remote.py) and no choice of worker (client/discovery.py)."""

from __future__ import annotations

import os

from emberlink.client.discovery import open_discovered
from emberlink.client.remote import RemoteExecutor, connect_ticket, load_client_identity
from emberlink.protocol.ticket import Ticket


def open_remote(
    address: str,
    *,
    key: str | os.PathLike[str] | None = None,
    timeout: float = 30.0,
    resume_window: float | None = None,
) -> RemoteExecutor:
    """Connect to a worker: `address` is a ticket (`emberlink://<node-id>@host:port[...]`) or
    `nats://host:port` (discovery on the relay). Returns the Executor of a remote Device."""
    if address.startswith("nats://"):
        executor = open_discovered(address, key=key, timeout=timeout)
        if resume_window is not None:
            executor.set_resume_window(resume_window)
        return executor
    identity = load_client_identity(key)
    return connect_ticket(Ticket.parse(address), identity, timeout=timeout, resume_window=resume_window)


__all__ = ["open_remote"]
