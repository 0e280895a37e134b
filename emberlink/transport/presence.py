"""Presence on a NATS relay: a worker's beacon (periodic messages, answers to queries) and the query
that collects them; carries opaque bytes only, never reads what a presence message says.

Subjects: a worker publishes on `emberlink.presence.<node-id>` every few seconds and answers a query
published on `emberlink.discover` by replying to the query's inbox. The query's payload is opaque
bytes the asker chose (a random nonce, which the answer signs back): nothing about who asks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from emberlink.errors import TransportError
from emberlink.transport.backoff import Backoff
from emberlink.transport.nats import INBOX_PREFIX, _node_subject
from emberlink.transport.nats_access import RelayAccess, open_connection, redact

log = logging.getLogger("emberlink.transport.presence")

PRESENCE_PREFIX = "emberlink.presence."
QUERY_SUBJECT = "emberlink.discover"
INTERVAL_S = 2.0
_NO_RESPONDERS = "503"

Payload = Callable[[bytes], bytes | None]
"""Builds the current presence message for a query's payload (empty for a periodic message);
None means "stay silent now" (e.g. not serving the relay, or a query it will not answer)."""


def presence_subject(node_id: str) -> str:
    return PRESENCE_PREFIX + _node_subject(node_id).rpartition(".")[2]


class Beacon:
    """Publishes `payload()` on the node's presence subject every `interval` s and answers queries.

    It holds its own NATS connection and re-attaches, with backoff, whenever the relay goes away
    (including when it is unreachable at start), until `stop()`.
    """

    def __init__(
        self,
        url: str,
        node_id: str,
        payload: Payload,
        *,
        interval: float = INTERVAL_S,
        timeout: float = 5.0,
        access: RelayAccess | None = None,
    ) -> None:
        self.url = url
        self._access = access if access is not None else RelayAccess()
        self.subject = presence_subject(node_id)
        self._payload = payload
        self._interval = interval
        self._timeout = timeout
        self._nc: Client | None = None
        self._lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.attached = asyncio.Event()

    async def start(self) -> None:
        """Start beaconing; returns at once, attaching in the background if the relay is not up yet."""
        self._lost.set()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"presence {self.subject}")

    async def _attach(self) -> None:
        nc = await open_connection(self.url, self._timeout, self._on_lost, self._access)
        try:
            await nc.subscribe(QUERY_SUBJECT, cb=self._on_query)
            await nc.flush(self._timeout)  # type: ignore[arg-type]  # nats-py takes any number
        except (TimeoutError, nats.errors.Error) as e:
            await nc.close()
            raise TransportError(f"cannot subscribe on NATS relay at {redact(self.url)}: {e}") from e
        self._nc = nc
        self._lost.clear()
        self.attached.set()

    async def _on_lost(self, nc: Client) -> None:
        if nc is self._nc:
            self._nc = None
            self.attached.clear()
            self._lost.set()

    async def _run(self) -> None:
        backoff = Backoff()
        while True:
            if self._lost.is_set():
                try:
                    await self._attach()
                except TransportError as e:
                    log.debug("presence: attaching to %s failed: %s", redact(self.url), e)
                    await backoff.sleep()
                    continue
                backoff.reset()
            await self.publish()
            try:
                await asyncio.wait_for(self._lost.wait(), self._interval)
            except TimeoutError:
                pass

    async def publish(self) -> None:
        """Publish the current presence now (e.g. right after the load changed); no-op while detached."""
        nc = self._nc
        data = self._payload(b"")
        if nc is None or data is None:
            return
        try:
            await nc.publish(self.subject, data)
        except nats.errors.Error as e:
            log.debug("presence: publish on %s failed: %s", self.subject, e)

    async def _on_query(self, msg: Msg) -> None:
        if not msg.reply:
            return
        data = self._payload(msg.data)
        if data is None:
            return
        try:
            await msg.respond(data)
        except nats.errors.Error as e:
            log.debug("presence: answering a query failed: %s", e)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        nc, self._nc = self._nc, None
        self.attached.clear()
        if nc is not None:
            await nc.close()


@dataclass(frozen=True, slots=True)
class Heard:
    """One answer to our query, as it arrived."""

    subject: str
    data: bytes


async def query(
    url: str,
    *,
    window: float,
    quiet: float,
    timeout: float = 5.0,
    payload: bytes = b"",
    access: RelayAccess | None = None,
) -> list[Heard]:
    """Ask every worker on the relay for its presence (the query carries `payload`) and collect the
    answers. (Periodic messages are not collected: an asker cannot tell when they were made.)
    `access` defaults to the client's settings in the environment.

    Returns after `window` seconds, or earlier once some worker answered and no further answer
    came for `quiet` seconds. TransportError if the relay cannot be reached.
    """
    loop = asyncio.get_running_loop()
    heard: list[Heard] = []
    last_answer: list[float] = []
    arrived = asyncio.Event()

    async def lost(_nc: Client) -> None:
        arrived.set()

    access = access if access is not None else RelayAccess.from_env()
    nc = await open_connection(url, timeout, lost, access, inbox_prefix=INBOX_PREFIX + access.user())
    inbox = nc.new_inbox()

    nobody: list[bool] = []

    async def on_answer(msg: Msg) -> None:
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            nobody.append(True)  # the server says no worker subscribes to queries: done at once
        else:
            heard.append(Heard(msg.subject, msg.data))
            last_answer[:] = [loop.time()]
        arrived.set()

    start = loop.time()
    try:
        await nc.subscribe(inbox, cb=on_answer)
        await nc.publish(QUERY_SUBJECT, payload, reply=inbox)
        await nc.flush(timeout)  # type: ignore[arg-type]  # nats-py takes any number
        while not nc.is_closed and not nobody:
            now = loop.time()
            end = start + window
            if last_answer:
                end = min(end, last_answer[0] + quiet)
            if now >= end:
                break
            arrived.clear()
            try:
                await asyncio.wait_for(arrived.wait(), end - now)
            except TimeoutError:
                pass
    except (TimeoutError, nats.errors.Error) as e:
        raise TransportError(f"cannot query presence on {redact(url)}: {type(e).__name__}: {e}") from e
    finally:
        closed = nc.is_closed
        await nc.close()
    if closed:
        raise TransportError(f"lost the NATS relay at {redact(url)} while collecting presence")
    return heard


__all__ = ["PRESENCE_PREFIX", "QUERY_SUBJECT", "Beacon", "Heard", "presence_subject", "query"]
