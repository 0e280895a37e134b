"""The NATS relay transport; never reads a blob, never puts a client's identity on the relay."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections import deque
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

try:
    import nats.errors
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription
except ImportError as e:  # nats-py is an optional dependency
    raise ImportError("the NATS relay transport needs nats-py: pip install 'emberlink[nats]'") from e

from emberlink.errors import TransportError, TransportTimeout
from emberlink.transport.backoff import Backoff
from emberlink.transport.base import MAX_BLOB, Blob, Handler, check_size
from emberlink.transport.fragment import Fragmenter, FragmentError, Kind, Reassembler
from emberlink.transport.sessions import SessionSet

log = logging.getLogger("emberlink.transport.nats")

NODE_PREFIX = "emberlink.node."
SESSION_PREFIX = "emberlink.s."

#: An idle link sends a heartbeat every TICK_S; a link that heard nothing for SILENCE_S is dead.
TICK_S = 0.25
SILENCE_S = 1.5
#: How often the NATS client itself pings the server, and how many unanswered pings end it.
_PING_INTERVAL_S = 1
_MAX_OUTSTANDING_PINGS = 2

# A session request is one version byte and 16 random bytes; the reply one byte, then a reason.
_VERSION = 1
_SESSION_ID_BYTES = 16
_ACCEPT = bytes([_VERSION])
_REFUSE = b"\x00"

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _redact(url: str) -> str:
    """The url without user:password, for messages and logs."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def _node_subject(node_id: str) -> str:
    if not _TOKEN.fullmatch(node_id):
        raise TransportError(f"node id {node_id!r} cannot be a NATS subject token")
    return NODE_PREFIX + node_id


def _session_subjects(session_id: bytes) -> tuple[str, str]:
    """(client → worker, worker → client) subjects of one session."""
    base = SESSION_PREFIX + session_id.hex()
    return base + ".w", base + ".c"


async def _open(url: str, timeout: float, on_lost: Callable[[Client], Awaitable[None]]) -> Client:
    """A NATS connection that never reconnects by itself: a lost relay ends it, and `on_lost` runs."""
    nc = Client()

    async def lost() -> None:
        await on_lost(nc)

    errors_seen: list[Exception] = []

    async def error(e: Exception) -> None:
        errors_seen[:] = [e]
        log.debug("nats %s: %s: %s", _redact(url), type(e).__name__, e)

    try:
        await nc.connect(
            servers=[url],
            allow_reconnect=False,
            connect_timeout=timeout,  # type: ignore[arg-type]
            # 0 would mean "forever" to nats-py's first connect; 1 means two quick tries, then give up.
            max_reconnect_attempts=1,
            reconnect_time_wait=0.05,  # type: ignore[arg-type]
            ping_interval=_PING_INTERVAL_S,
            max_outstanding_pings=_MAX_OUTSTANDING_PINGS,
            disconnected_cb=lost,
            closed_cb=lost,
            error_cb=error,
        )
    except (OSError, TimeoutError, nats.errors.Error) as e:
        # nats-py reports "no servers" after its attempts; the last attempt's error says why.
        cause = errors_seen[0] if isinstance(e, nats.errors.NoServersError) and errors_seen else e
        await nc.close()
        what = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        raise TransportError(f"cannot reach NATS relay at {_redact(url)}: {what}") from e
    return nc


class NatsLink:
    """One end of a relayed session: publishes on one subject, listens on the other."""

    def __init__(self, nc: Client, out_subject: str, in_subject: str, peer: str, *, owns_nc: bool) -> None:
        self._nc = nc
        self._out = out_subject
        self._in = in_subject
        self.peer = peer
        self._owns_nc = owns_nc
        self._fragmenter = Fragmenter()
        self._reassembler = Reassembler(MAX_BLOB)
        self._send_lock = asyncio.Lock()
        self._inbox: deque[bytes | memoryview] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._sub: Subscription | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._closed = False
        self._peer_closed = False
        self._error: str | None = None
        loop = asyncio.get_running_loop()
        self._last_heard = self._last_sent = loop.time()

    async def _attach(self) -> None:
        """Subscribe before the other side learns the subjects, so nothing it sends is missed."""
        try:
            self._sub = await self._nc.subscribe(self._in, cb=self._on_message)
        except nats.errors.Error as e:
            raise TransportError(f"cannot subscribe for session with {self.peer}: {e}") from e
        self._ticker = asyncio.get_running_loop().create_task(
            self._tick(), name=f"nats heartbeat {self.peer}"
        )

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, why: str) -> None:
        if self._error is None and not self._closed:
            self._error = why
            log.debug("nats link %s failed: %s", self.peer, why)
        self._wake()

    async def _on_message(self, msg: Msg) -> None:
        self._last_heard = asyncio.get_running_loop().time()
        if self._error is not None or self._closed:
            return
        try:
            kind, blob = self._reassembler.feed(msg.data)
        except FragmentError as e:
            self._fail(f"session with {self.peer} broke: {e}")
            return
        if blob is not None:
            self._inbox.append(blob)
            self._wake()
        elif kind is Kind.CLOSE:
            self._peer_closed = True
            self._wake()

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        last_tick = loop.time()
        while not self._closed and self._error is None:
            await asyncio.sleep(TICK_S)
            now = loop.time()
            # After our own loop stalled, heartbeats may be sitting unread in the socket: judge next tick.
            stalled = now - last_tick > 2 * TICK_S
            last_tick = now
            if now - self._last_sent >= TICK_S and not self._send_lock.locked():
                try:
                    async with self._send_lock:
                        await self._publish(self._fragmenter.control(Kind.BEAT))
                except TransportError as e:
                    self._fail(str(e))
                    return
            if not stalled and now - self._last_heard > SILENCE_S and not self._peer_closed:
                self._fail(f"no word from {self.peer} for {SILENCE_S} s: the peer or the relay is gone")

    async def _publish(self, message: bytes) -> None:
        try:
            await self._nc.publish(self._out, message)
        except nats.errors.Error as e:
            raise TransportError(f"send to {self.peer} failed: {type(e).__name__}: {e}") from e
        self._last_sent = asyncio.get_running_loop().time()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"link to {self.peer} is closed")
        if self._error is not None:
            raise TransportError(self._error)

    async def send(self, blob: Blob) -> None:
        check_size(blob)  # no copy: the fragmenter copies once, prepending its header
        self._check_open()
        if self._peer_closed:
            raise TransportError(f"peer {self.peer} closed the session")
        async with self._send_lock:
            # Read the limit from the live connection: servers are configured differently.
            for message in self._fragmenter.fragments(blob, self._nc.max_payload):
                await self._publish(message)

    async def recv(self) -> bytes | memoryview:
        while True:
            if self._closed:
                raise TransportError(f"link to {self.peer} is closed")
            if self._inbox:
                return self._inbox.popleft()
            if self._error is not None:
                raise TransportError(self._error)
            if self._peer_closed:
                raise TransportError(f"peer {self.peer} closed the session")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def close(self) -> None:
        if self._closed:
            return
        if self._error is None and not self._nc.is_closed:
            try:
                async with self._send_lock:
                    await self._publish(self._fragmenter.control(Kind.CLOSE))
            except TransportError:
                pass
        self._closed = True
        self._wake()
        if self._ticker is not None and self._ticker is not asyncio.current_task():
            self._ticker.cancel()
        if self._sub is not None and not self._nc.is_closed:
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error:
                pass
        if self._owns_nc:
            await self._nc.close()  # flushes what is still pending, CLOSE included


class NatsListener:
    """Serves `handler` for every session requested on `emberlink.node.<node_id>` through a relay.

    The listener holds one NATS connection. When it is lost, every session on it fails at once and
    the listener keeps trying to re-attach, with backoff, until `stop()`.
    """

    def __init__(self, url: str, node_id: str, handler: Handler, *, connect_timeout: float = 5.0) -> None:
        self.url = url
        self.subject = _node_subject(node_id)
        self._connect_timeout = connect_timeout
        self._sessions = SessionSet(handler, "nats")
        self._links: dict[Client, set[NatsLink]] = {}
        self._nc: Client | None = None
        self._node_sub: Subscription | None = None
        self._lost = asyncio.Event()
        self.attached = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> str:
        """Attach to the relay (raises TransportError if it is unreachable now); returns the subject."""
        await self._attach()
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name="nats listener")
        return self.subject

    async def _attach(self) -> None:
        nc = await _open(self.url, self._connect_timeout, self._on_lost)
        self._links[nc] = set()
        try:
            node_sub = await nc.subscribe(self.subject, cb=self._on_request)
            await nc.flush(self._connect_timeout)  # type: ignore[arg-type]  # nats-py takes any number
        except (TimeoutError, nats.errors.Error) as e:
            await nc.close()
            raise TransportError(f"cannot subscribe on NATS relay at {_redact(self.url)}: {e}") from e
        self._nc, self._node_sub = nc, node_sub
        self._lost.clear()
        self.attached.set()

    async def _on_lost(self, nc: Client) -> None:
        for link in self._links.pop(nc, ()):
            link._fail(f"lost the NATS relay at {_redact(self.url)}")
        if nc is self._nc:
            self._nc = None
            self.attached.clear()
            self._lost.set()

    async def _supervise(self) -> None:
        backoff = Backoff()
        while not self._stopping:
            await self._lost.wait()
            if self._stopping:
                return
            try:
                await self._attach()
            except TransportError as e:
                log.debug("re-attaching to %s failed: %s", _redact(self.url), e)
                await backoff.sleep()
            else:
                log.info("re-attached to NATS relay at %s", _redact(self.url))
                backoff.reset()

    async def _on_request(self, msg: Msg) -> None:
        nc = self._nc
        data = msg.data
        if not msg.reply or len(data) != 1 + _SESSION_ID_BYTES or data[0] != _VERSION:
            return  # not ours to answer; a client with another version times out with a clear message
        if nc is None or self._stopping:
            await msg.respond(_REFUSE + b"worker is shutting down")
            return
        to_worker, to_client = _session_subjects(data[1:])
        link = NatsLink(nc, to_client, to_worker, f"nats-session:{data[1:5].hex()}", owns_nc=False)
        try:
            await link._attach()
            await msg.respond(_ACCEPT)
        except (TransportError, nats.errors.Error) as e:
            log.debug("could not accept a session: %s", e)
            await link.close()
            return
        links = self._links.get(nc)
        if links is None:  # the relay went away meanwhile
            link._fail(f"lost the NATS relay at {_redact(self.url)}")
        else:
            links.add(link)
        task = self._sessions.spawn(link)
        task.add_done_callback(lambda _: self._links.get(nc, set()).discard(link))

    async def publish(self, subject: str, data: bytes) -> None:
        """Publish one message (e.g. presence) on the listener's connection; at most max_payload bytes."""
        nc = self._nc
        if nc is None:
            raise TransportError(f"not attached to NATS relay at {_redact(self.url)}")
        try:
            await nc.publish(subject, data)
        except nats.errors.Error as e:
            raise TransportError(f"publish on {subject} failed: {type(e).__name__}: {e}") from e

    async def stop(self, grace: float | None = None) -> None:
        """Stop taking sessions, give running ones `grace` seconds, then close them and the connection."""
        self._stopping = True
        nc = self._nc
        if nc is not None and not nc.is_closed and self._node_sub is not None:
            # Unsubscribe from the node subject first: new clients get "no responders" at once.
            try:
                await self._node_sub.unsubscribe()
            except nats.errors.Error:
                pass
        await self._sessions.stop(grace)
        self._lost.set()
        if self._supervisor is not None:
            self._supervisor.cancel()
            try:
                await self._supervisor
            except asyncio.CancelledError:
                pass
        if nc is not None:
            await nc.close()
        self.attached.clear()


async def connect(url: str, node_id: str, *, timeout: float = 10.0) -> NatsLink:
    """Open a session through the relay at `url` to the worker listening as `node_id`."""
    subject = _node_subject(node_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    link: NatsLink | None = None

    async def lost(_nc: Client) -> None:
        if link is not None:
            link._fail(f"lost the NATS relay at {_redact(url)}")

    nc = await _open(url, timeout, lost)
    session_id = secrets.token_bytes(_SESSION_ID_BYTES)
    to_worker, to_client = _session_subjects(session_id)
    link = NatsLink(nc, to_worker, to_client, f"nats:{node_id}@{_redact(url)}", owns_nc=True)
    try:
        await link._attach()
        remaining = max(deadline - loop.time(), 0.001)
        reply = await nc.request(subject, bytes([_VERSION]) + session_id, timeout=remaining)
    except nats.errors.NoRespondersError:
        await link.close()
        raise TransportError(f"no worker {node_id} is listening on NATS relay {_redact(url)}") from None
    except TimeoutError:
        await link.close()
        raise TransportTimeout(
            f"worker {node_id} did not answer on NATS relay {_redact(url)} within {timeout} s"
        ) from None
    except (TransportError, nats.errors.Error) as e:
        await link.close()
        raise TransportError(f"cannot open a session with {node_id} on {_redact(url)}: {e}") from e
    except BaseException:
        await link.close()
        raise
    if reply.data != _ACCEPT:
        await link.close()
        reason = reply.data[1:].decode(errors="replace") or "no reason given"
        raise TransportError(f"worker {node_id} on NATS relay {_redact(url)} refused the session: {reason}")
    return link


async def collect(url: str, subject: str, *, window: float, timeout: float = 5.0) -> list[tuple[str, bytes]]:
    """Every message published on `subject` (wildcards allowed) during `window` seconds, e.g. presence."""
    got: list[tuple[str, bytes]] = []

    async def lost(_nc: Client) -> None:
        return None

    nc = await _open(url, timeout, lost)

    async def keep(msg: Msg) -> None:
        got.append((msg.subject, msg.data))

    try:
        await nc.subscribe(subject, cb=keep)
        await asyncio.sleep(window)
    except nats.errors.Error as e:
        raise TransportError(f"cannot subscribe to {subject} on {_redact(url)}: {e}") from e
    finally:
        await nc.close()
    return got


__all__ = ["NatsLink", "NatsListener", "collect", "connect"]
