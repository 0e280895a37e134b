"""A worker's presence on a NATS relay: a listener serving relayed sessions with the worker's own session
handler, and the beacon publishing its presence; no session logic here.

A relay that is down at start-up or goes away later does not stop the worker: direct sessions
carry on, relayed ones fail (their clients see WorkerLost), and both the listener and the beacon
keep re-attaching until the relay is back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

from emberlink.errors import ConfigError, ProtocolError, TransportError
from emberlink.protocol.cluster import Certificate
from emberlink.protocol.ticket import Ticket
from emberlink.server.presence import PresenceSource
from emberlink.transport.backoff import Backoff
from emberlink.transport.nats import NatsListener
from emberlink.transport.nats_access import RelayAccess, redact
from emberlink.transport.presence import INTERVAL_S, Beacon

if TYPE_CHECKING:
    from emberlink.server.worker import Worker

log = logging.getLogger("emberlink.server")


def relay_ticket(ticket: Ticket, url: str) -> Ticket:
    """`ticket` with `?relay=url` (a worker that listens through the relay says so in its ticket)."""
    return dataclasses.replace(ticket, relay=url)


class RelayService:
    """Serves `worker` through the relay at `url` and publishes its presence (ticket `ticket`, and the
    worker's cluster certificate if it has one), logging in to the relay with `access`."""

    def __init__(
        self,
        worker: Worker,
        url: str,
        ticket: Ticket,
        *,
        interval: float = INTERVAL_S,
        access: RelayAccess | None = None,
        certificate: Certificate | None = None,
    ) -> None:
        try:
            Ticket(worker.node_id, (), url)
        except ProtocolError as e:
            raise ConfigError(f"--relay {url!r}: {e}") from e
        self.worker = worker
        self.url = url
        self.ticket = ticket if ticket.relay == url else relay_ticket(ticket, url)
        if certificate is not None and certificate.worker_id != worker.node_id:
            raise ConfigError(
                f"the cluster certificate is for worker {certificate.worker_id}, not this one ({worker.node_id})"
            )
        access = access if access is not None else RelayAccess()
        self.listener = NatsListener(url, worker.node_id, worker.handle, access=access)
        self.presence = PresenceSource(worker, str(self.ticket), self.listener.attached.is_set, certificate)
        self.beacon = Beacon(url, worker.node_id, self.presence, interval=interval, access=access)
        self._starter: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Attach now if the relay is up (else keep trying in the background), and start the beacon."""
        try:
            await self.listener.start()
        except TransportError as e:
            log.warning("relay %s is not reachable yet (%s); retrying in the background", redact(self.url), e)
            self._starter = asyncio.get_running_loop().create_task(self._keep_starting(), name="relay start")
        else:
            log.info("listening through the NATS relay at %s", redact(self.url))
        await self.beacon.start()

    async def _keep_starting(self) -> None:
        backoff = Backoff()  # start() failed once already: wait before the first retry
        while True:
            await backoff.sleep()
            try:
                await self.listener.start()
            except TransportError as e:
                log.debug("relay %s: still unreachable: %s", redact(self.url), e)
            else:
                log.info("listening through the NATS relay at %s", redact(self.url))
                return

    @property
    def attached(self) -> bool:
        return self.listener.attached.is_set()

    async def stop(self, grace: float | None = None) -> None:
        """Stop presence first (nobody new is sent here), then the listener and its sessions."""
        if self._starter is not None:
            self._starter.cancel()
            try:
                await self._starter
            except asyncio.CancelledError:
                pass
        await self.beacon.stop()
        await self.listener.stop(grace)


__all__ = ["RelayService", "relay_ticket"]
