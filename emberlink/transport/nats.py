"""The NATS relay transport; never reads a blob, never puts a client's identity on the relay.

Rules (what anyone on the relay, the relay included, can see of a session and do to it):
- Subjects: a worker takes session requests on `emberlink.node.<node-id>`; a session's messages go
  to the worker on `emberlink.w.<node-id>.<token>` and to the client on `emberlink.c.<user>.<token>`,
  where <user> is the client's relay user (its public nkey, or "anon" without credentials);
  replies to a client's requests come to `emberlink.i.<user>.…`. So NATS permissions can keep a
  worker to its own subjects and a client to its own inboxes (deploy/nats.conf).
- A session request is the version byte, 16 random bytes (the worker's inbox token), 16 random
  bytes (the client's), then <user>. Where permissions are in force only the worker can read it.
- Until the handshake has made the session's link secret, messages are open (transport/fragment.py)
  and go on the subjects of the request. Then each end binds the link to the secret: it moves to
  subjects derived from it, which nobody else can name, and tags every message with a key derived
  from it. From then on a message not tagged under the session's keys is dropped: whatever its
  subject, kind or timing, it cannot end, stall or reorder the session.
- Binding order: the worker binds once it has made Welcome, before sending it, and keeps sending on
  the request's subjects until it hears the client on the new ones; the client binds once it has
  read Welcome, before sending Auth, and moves both ways at once (the worker already listens).
  Each end subscribes to its new inbox before the other can use it, so nothing is missed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import secrets
from collections import deque

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
from emberlink.transport.nats_access import RelayAccess, open_connection, redact
from emberlink.transport.sessions import SessionSet

log = logging.getLogger("emberlink.transport.nats")

NODE_PREFIX = "emberlink.node."
TO_WORKER_PREFIX = "emberlink.w."
TO_CLIENT_PREFIX = "emberlink.c."
INBOX_PREFIX = "emberlink.i."

#: An idle link sends a heartbeat every TICK_S; a link that heard nothing for SILENCE_S is dead.
TICK_S = 0.25
SILENCE_S = 1.5

_VERSION = 2
_TOKEN_BYTES = 16
_ACCEPT = bytes([_VERSION])
_REFUSE = b"\x00"
_MAX_REQUEST = 1 + 2 * _TOKEN_BYTES + 128
_SECRET_BYTES = 32

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _token(text: str, what: str) -> str:
    if not _TOKEN.fullmatch(text):
        raise TransportError(f"{what} {text!r} cannot be a NATS subject token")
    return text


def _node_subject(node_id: str) -> str:
    return NODE_PREFIX + _token(node_id, "node id")


def _derive(secret: bytes, label: bytes) -> bytes:
    return hashlib.blake2b(b"emberlink relay v2 " + label, key=secret, digest_size=32).digest()


class NatsLink:
    """One end of a relayed session: publishes on one subject, listens on the other.

    `out_subject` and `in_subject` are the request's; `bind` moves both to the session's own.
    `initiator` is the client's end (see the binding order at the top of this module).
    """

    def __init__(
        self, nc: Client, out_subject: str, in_subject: str, peer: str, *, owns_nc: bool, initiator: bool
    ) -> None:
        self._nc = nc
        self._out = out_subject
        self._in = in_subject
        self.peer = peer
        self._owns_nc = owns_nc
        self._initiator = initiator
        self._fragmenter = Fragmenter()
        self._reassembler = Reassembler(MAX_BLOB)
        self._next_out: tuple[str, Fragmenter] | None = None
        self._epoch = 0  # 0: open; 1: bound to the session's link secret
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

    @property
    def bound(self) -> bool:
        return self._epoch > 0

    @property
    def dropped(self) -> int:
        """Messages dropped since binding: not tagged under this session's keys, or already taken."""
        return self._reassembler.dropped

    async def _attach(self) -> None:
        """Subscribe before the other side learns the subjects, so nothing it sends is missed."""
        self._sub = await self._subscribe(self._in)
        self._ticker = asyncio.get_running_loop().create_task(
            self._tick(), name=f"nats heartbeat {self.peer}"
        )

    async def _subscribe(self, subject: str) -> Subscription:
        epoch = self._epoch

        async def receive(msg: Msg) -> None:
            if epoch == self._epoch:  # a straggler of an earlier epoch is nobody's business now
                self._on_message(msg.data)

        try:
            return await self._nc.subscribe(subject, cb=receive)
        except nats.errors.Error as e:
            raise TransportError(f"cannot subscribe for session with {self.peer}: {e}") from e

    async def bind(self, secret: bytes) -> None:
        """Move the link onto subjects and keys derived from the session's link secret: from now on only
        messages tagged under them count. Called once, at the point of the handshake the module's rules
        say."""
        if self._epoch:
            raise TransportError(f"link to {self.peer} is already bound")
        if len(secret) != _SECRET_BYTES:
            raise ValueError(f"a link secret is {_SECRET_BYTES} bytes, not {len(secret)}")
        self._check_open()
        to_worker = _derive(secret, b"to worker subject")[:_TOKEN_BYTES].hex()
        to_client = _derive(secret, b"to client subject")[:_TOKEN_BYTES].hex()
        worker_key, client_key = _derive(secret, b"to worker tags"), _derive(secret, b"to client tags")
        if self._initiator:
            out_token, in_token, out_key, in_key = to_worker, to_client, worker_key, client_key
        else:
            out_token, in_token, out_key, in_key = to_client, to_worker, client_key, worker_key
        new_in = self._in.rpartition(".")[0] + "." + in_token
        new_out = self._out.rpartition(".")[0] + "." + out_token
        self._epoch += 1
        self._reassembler = Reassembler(MAX_BLOB, in_key)
        old, self._sub = self._sub, await self._subscribe(new_in)
        self._in = new_in
        self._next_out = (new_out, Fragmenter(out_key))
        if self._initiator:
            self._switch_out()
        if old is not None:
            try:
                await old.unsubscribe()
            except nats.errors.Error:
                pass

    def _switch_out(self) -> None:
        if self._next_out is not None:
            (self._out, self._fragmenter), self._next_out = self._next_out, None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, why: str) -> None:
        if self._error is None and not self._closed:
            self._error = why
            log.debug("nats link %s failed: %s", self.peer, why)
        self._wake()

    def _on_message(self, data: bytes) -> None:
        if self._error is not None or self._closed:
            return
        try:
            got = self._reassembler.feed(data)
        except FragmentError as e:
            self._fail(f"session with {self.peer} broke: {e}")
            return
        if got is None:
            return  # not tagged under this session's keys, or a number already taken: dropped
        self._last_heard = asyncio.get_running_loop().time()
        if self._epoch:
            self._switch_out()  # the peer speaks on the bound subjects: it listens on them too
        kind, blob = got
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
                        await self._publish(self._out, self._fragmenter.control(Kind.BEAT))
                except TransportError as e:
                    self._fail(str(e))
                    return
            if not stalled and now - self._last_heard > SILENCE_S and not self._peer_closed:
                self._fail(f"no word from {self.peer} for {SILENCE_S} s: the peer or the relay is gone")

    async def _publish(self, subject: str, message: bytes) -> None:
        try:
            await self._nc.publish(subject, message)
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
            # One blob, one subject and numbering, even if the link moves meanwhile. Read the limit
            # from the live connection: servers are configured differently.
            subject, fragmenter = self._out, self._fragmenter
            for message in fragmenter.fragments(blob, self._nc.max_payload):
                await self._publish(subject, message)

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
                    await self._publish(self._out, self._fragmenter.control(Kind.CLOSE))
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

    def __init__(
        self,
        url: str,
        node_id: str,
        handler: Handler,
        *,
        connect_timeout: float = 5.0,
        access: RelayAccess | None = None,
    ) -> None:
        self.url = url
        self.subject = _node_subject(node_id)
        self._inbox_base = TO_WORKER_PREFIX + node_id
        self._access = access if access is not None else RelayAccess()
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
        nc = await open_connection(self.url, self._connect_timeout, self._on_lost, self._access)
        self._links[nc] = set()
        try:
            node_sub = await nc.subscribe(self.subject, cb=self._on_request)
            await nc.flush(self._connect_timeout)  # type: ignore[arg-type]  # nats-py takes any number
        except (TimeoutError, nats.errors.Error) as e:
            await nc.close()
            raise TransportError(f"cannot subscribe on NATS relay at {redact(self.url)}: {e}") from e
        self._nc, self._node_sub = nc, node_sub
        self._lost.clear()
        self.attached.set()

    async def _on_lost(self, nc: Client) -> None:
        for link in self._links.pop(nc, ()):
            link._fail(f"lost the NATS relay at {redact(self.url)}")
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
                log.debug("re-attaching to %s failed: %s", redact(self.url), e)
                await backoff.sleep()
            else:
                log.info("re-attached to NATS relay at %s", redact(self.url))
                backoff.reset()

    async def _on_request(self, msg: Msg) -> None:
        nc = self._nc
        subjects = self._session_subjects(msg.data) if msg.reply else None
        if subjects is None:
            return  # not ours to answer; a client with another version times out with a clear message
        if nc is None or self._stopping:
            await msg.respond(_REFUSE + b"worker is shutting down")
            return
        to_client, to_worker = subjects
        link = NatsLink(
            nc, to_client, to_worker, f"nats-session:{msg.data[1:5].hex()}", owns_nc=False, initiator=False
        )
        try:
            await link._attach()
            await msg.respond(_ACCEPT)
        except (TransportError, nats.errors.Error) as e:
            log.debug("could not accept a session: %s", e)
            await link.close()
            return
        links = self._links.get(nc)
        if links is None:  # the relay went away meanwhile
            link._fail(f"lost the NATS relay at {redact(self.url)}")
        else:
            links.add(link)
        task = self._sessions.spawn(link)
        task.add_done_callback(lambda _: self._links.get(nc, set()).discard(link))

    def _session_subjects(self, data: bytes) -> tuple[str, str] | None:
        """(to client, to worker) of a well-formed session request, else None."""
        if not 1 + 2 * _TOKEN_BYTES < len(data) <= _MAX_REQUEST or data[0] != _VERSION:
            return None
        user = data[1 + 2 * _TOKEN_BYTES :].decode("ascii", errors="replace")
        if not _TOKEN.fullmatch(user):
            return None
        to_worker = f"{self._inbox_base}.{data[1 : 1 + _TOKEN_BYTES].hex()}"
        to_client = f"{TO_CLIENT_PREFIX}{user}.{data[1 + _TOKEN_BYTES : 1 + 2 * _TOKEN_BYTES].hex()}"
        return to_client, to_worker

    async def publish(self, subject: str, data: bytes) -> None:
        """Publish one message (e.g. presence) on the listener's connection; at most max_payload bytes."""
        nc = self._nc
        if nc is None:
            raise TransportError(f"not attached to NATS relay at {redact(self.url)}")
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


async def connect(
    url: str, node_id: str, *, timeout: float = 10.0, access: RelayAccess | None = None
) -> NatsLink:
    """Open a session through the relay at `url` to the worker listening as `node_id`; `access` (default:
    the client's settings in the environment, see transport/nats_access.py) says how to log in."""
    subject = _node_subject(node_id)
    access = access if access is not None else RelayAccess.from_env()
    user = access.user()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    link: NatsLink | None = None

    async def lost(_nc: Client) -> None:
        if link is not None:
            link._fail(f"lost the NATS relay at {redact(url)}")

    nc = await open_connection(url, timeout, lost, access, inbox_prefix=INBOX_PREFIX + user)
    worker_token, client_token = secrets.token_bytes(_TOKEN_BYTES), secrets.token_bytes(_TOKEN_BYTES)
    to_worker = f"{TO_WORKER_PREFIX}{node_id}.{worker_token.hex()}"
    to_client = f"{TO_CLIENT_PREFIX}{user}.{client_token.hex()}"
    link = NatsLink(nc, to_worker, to_client, f"nats:{node_id}@{redact(url)}", owns_nc=True, initiator=True)
    request = bytes([_VERSION]) + worker_token + client_token + user.encode()
    try:
        await link._attach()
        remaining = max(deadline - loop.time(), 0.001)
        reply = await nc.request(subject, request, timeout=remaining)
    except nats.errors.NoRespondersError:
        await link.close()
        raise TransportError(f"no worker {node_id} is listening on NATS relay {redact(url)}") from None
    except TimeoutError:
        await link.close()
        raise TransportTimeout(
            f"worker {node_id} did not answer on NATS relay {redact(url)} within {timeout} s"
        ) from None
    except (TransportError, nats.errors.Error) as e:
        await link.close()
        raise TransportError(f"cannot open a session with {node_id} on {redact(url)}: {e}") from e
    except BaseException:
        await link.close()
        raise
    if reply.data != _ACCEPT:
        await link.close()
        reason = reply.data[1:].decode(errors="replace") or "no reason given"
        raise TransportError(f"worker {node_id} on NATS relay {redact(url)} refused the session: {reason}")
    return link


async def collect(
    url: str, subject: str, *, window: float, timeout: float = 5.0, access: RelayAccess | None = None
) -> list[tuple[str, bytes]]:
    """Every message published on `subject` (wildcards allowed) during `window` seconds, e.g. presence."""
    got: list[tuple[str, bytes]] = []

    async def lost(_nc: Client) -> None:
        return None

    nc = await open_connection(url, timeout, lost, access if access is not None else RelayAccess.from_env())

    async def keep(msg: Msg) -> None:
        got.append((msg.subject, msg.data))

    try:
        await nc.subscribe(subject, cb=keep)
        await asyncio.sleep(window)
    except nats.errors.Error as e:
        raise TransportError(f"cannot subscribe to {subject} on {redact(url)}: {e}") from e
    finally:
        await nc.close()
    return got


__all__ = ["NatsLink", "NatsListener", "RelayAccess", "collect", "connect"]
