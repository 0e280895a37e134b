"""The NATS relay transport: session requests, the listener and connect; never reads a blob, never puts a
client's identity on the relay.

Rules (what the relay and anyone on it can see of a session's setting up):
- Subjects: a worker takes session requests on `emberlink.node.<node-id>`; a session's messages go
  to the worker on `emberlink.w.<node-id>.<token>` and to the client on `emberlink.c.<user>.<token>`,
  where <user> is the client's relay user (its public nkey, or "anon" without credentials);
  replies to a client's requests come to `emberlink.i.<user>.…`. So NATS permissions can keep a
  worker to its own subjects and a client to its own inboxes (transport/nats_permissions.py).
- A session request is the version byte, 16 random bytes (the worker's inbox token), 16 random
  bytes (the client's), then <user>; the worker answers it with its version byte, or a refusal.
  Where permissions are in force only the worker can read it.
- Once the handshake is done the session leaves these subjects for ones derived from its keys
  (transport/nats_link.py has those rules).
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets

try:
    import nats.errors
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription
except ImportError as e:  # nats-py is an optional dependency
    raise ImportError("the NATS relay transport needs nats-py: pip install 'emberlink[nats]'") from e

from emberlink.errors import TransportError, TransportTimeout
from emberlink.transport.backoff import Backoff
from emberlink.transport.base import Handler
from emberlink.transport.nats_access import RelayAccess, open_connection, redact
from emberlink.transport.nats_link import SILENCE_S, TICK_S, TOKEN_BYTES, NatsLink
from emberlink.transport.sessions import SessionSet

log = logging.getLogger("emberlink.transport.nats")

NODE_PREFIX = "emberlink.node."
TO_WORKER_PREFIX = "emberlink.w."
TO_CLIENT_PREFIX = "emberlink.c."
INBOX_PREFIX = "emberlink.i."

_VERSION = 2
_ACCEPT = bytes([_VERSION])
_REFUSE = b"\x00"
_MAX_REQUEST = 1 + 2 * TOKEN_BYTES + 128

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _token(text: str, what: str) -> str:
    if not _TOKEN.fullmatch(text):
        raise TransportError(f"{what} {text!r} cannot be a NATS subject token")
    return text


def _node_subject(node_id: str) -> str:
    return NODE_PREFIX + _token(node_id, "node id")


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
        if not 1 + 2 * TOKEN_BYTES < len(data) <= _MAX_REQUEST or data[0] != _VERSION:
            return None
        user = data[1 + 2 * TOKEN_BYTES :].decode("ascii", errors="replace")
        if not _TOKEN.fullmatch(user):
            return None
        to_worker = f"{self._inbox_base}.{data[1 : 1 + TOKEN_BYTES].hex()}"
        to_client = f"{TO_CLIENT_PREFIX}{user}.{data[1 + TOKEN_BYTES : 1 + 2 * TOKEN_BYTES].hex()}"
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
    worker_token, client_token = secrets.token_bytes(TOKEN_BYTES), secrets.token_bytes(TOKEN_BYTES)
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


__all__ = ["SILENCE_S", "TICK_S", "NatsLink", "NatsListener", "RelayAccess", "collect", "connect"]
