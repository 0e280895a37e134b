"""One end of a relayed session on NATS: fragments, heartbeats, and the binding to the session's keys;
never reads a blob.

Rules (everything that decides what a message on a session's subjects can do to it):
- Until the handshake has made the session's link secret, messages are open (transport/fragment.py)
  and go on the subjects of the session request (transport/nats.py). Then each end binds the
  link to the secret: it moves to subjects derived from it, which nobody else can name, and tags
  every message with a key derived from it, one key per direction. From then on a message not
  tagged under the session's keys is dropped: whatever its subject, kind or timing, it cannot
  end, stall or reorder the session. Only silence (the relay or the peer gone) or a verified gap
  (the relay lost messages) fails a bound link.
- Binding order: the worker binds once it has made Welcome, before sending it, and keeps sending on
  the request's subjects until it hears the client on the new ones; the client binds once it has
  read Welcome, before sending Auth, and moves both ways at once (the worker already listens).
  Each end subscribes to its new inbox before the other can use it, so nothing is missed. Until
  the peer is heard on the new subjects the handshake's own timeout, not silence, ends a wait.
- One blob goes out whole on one subject under one numbering, even if the link moves meanwhile.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import deque

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from emberlink.errors import TransportError
from emberlink.transport.base import MAX_BLOB, Blob, check_size
from emberlink.transport.fragment import Fragmenter, FragmentError, Kind, Reassembler

log = logging.getLogger("emberlink.transport.nats")

#: An idle link sends a heartbeat every TICK_S; a link that heard nothing for SILENCE_S is dead.
TICK_S = 0.25
SILENCE_S = 1.5

SECRET_BYTES = 32
TOKEN_BYTES = 16
"""A session subject's last token is this many random (or derived) bytes, in hex."""


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
        self._waiting_for_bound_peer = False  # bound, and the peer not yet heard on the new subjects
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
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a link secret is {SECRET_BYTES} bytes, not {len(secret)}")
        self._check_open()
        to_worker = _derive(secret, b"to worker subject")[:TOKEN_BYTES].hex()
        to_client = _derive(secret, b"to client subject")[:TOKEN_BYTES].hex()
        worker_key, client_key = _derive(secret, b"to worker tags"), _derive(secret, b"to client tags")
        if self._initiator:
            out_token, in_token, out_key, in_key = to_worker, to_client, worker_key, client_key
        else:
            out_token, in_token, out_key, in_key = to_client, to_worker, client_key, worker_key
        new_in = self._in.rpartition(".")[0] + "." + in_token
        new_out = self._out.rpartition(".")[0] + "." + out_token
        self._epoch += 1
        self._waiting_for_bound_peer = True
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
            self._waiting_for_bound_peer = False
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
            # Between binding and the peer's first word on the new subjects the handshake is under
            # way (its own timeout applies), and the peer's heartbeats still go where we no longer listen.
            waiting = self._waiting_for_bound_peer
            if not stalled and not waiting and now - self._last_heard > SILENCE_S and not self._peer_closed:
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


__all__ = ["SECRET_BYTES", "SILENCE_S", "TICK_S", "TOKEN_BYTES", "NatsLink"]
