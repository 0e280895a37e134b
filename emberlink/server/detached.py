"""The worker's resumable sessions: their credentials, the window a detached one waits, and the links
that resume them; never reads a batch (server/session.py serves them) nor checks a proof itself
(protocol/resume.py does).

A session registers when it opens (`ResumeRegistry.open`) and is findable by its current
credential's id until it ends. A new link whose handshake carries a resume token is not a session
of its own: `carry` checks the token, and if the session accepts it, offers the link to it and
keeps the link's handler alive until the session lets the link go (the listener closes a link
when its handler returns). A valid resume of a session whose old link still looks alive (the
worker has not yet noticed it died) takes the session over: the old link is dropped.

Per client NodeId (server/limits.py): at most `max_detached` of its sessions wait detached at once
(each holds its memory and a share of the worker's budget for the whole window); when one more
detaches, the one detached longest is given up. `refusal` says why a client may not open one more
session (it has `max_open` open), for the session to answer before it is admitted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from emberlink.errors import ErrorCode, ProtocolError
from emberlink.protocol import messages as m
from emberlink.protocol.channel import MESSAGE, Channel
from emberlink.protocol.resume import Credential, parse_token
from emberlink.transport.base import Link

log = logging.getLogger("emberlink.server")

DEFAULT_RESUME_WINDOW = 30.0
"""Seconds a session whose link dropped keeps its tensors for the client to come back."""

_detach_order = itertools.count()


@dataclass(slots=True)
class Attach:
    """A link offered to a detached session: its channel, what the client already received, and
    the future the session sets when it stops using the link (its handler may then return)."""

    link: Link
    channel: Channel
    received: int
    released: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def release(self) -> None:
        if not self.released.done():
            self.released.set_result(None)


class Resumable:
    """One session's resume state on the worker: its credential and the next link offered to it."""

    def __init__(
        self, registry: ResumeRegistry, client: str, credential: Credential, takeover: Callable[[], None]
    ):
        self._registry = registry
        self.client = client
        self.credential = credential
        self.window = registry.window
        self._takeover = takeover
        self._offer: asyncio.Future[Attach | None] = asyncio.get_running_loop().create_future()
        self.attached = True
        self.detached_at = 0  # when it last detached, in `_detach_order`
        self.closed = False
        self.ended: str | None = None
        """Why the session ended while detached (its Close applied, the worker draining)."""

    @property
    def offered(self) -> bool:
        """Whether a resumed link waits to be taken up."""
        return self._offer.done() and self._offer.result() is not None

    def offer(self, attach: Attach) -> None:
        """A resumed link for this session (the credential was accepted)."""
        if self._offer.done():
            previous = self._offer.result()
            if previous is not None:  # an earlier resume not yet taken up: this one supersedes it
                previous.release()
            self._offer = asyncio.get_running_loop().create_future()
        self._offer.set_result(attach)
        if self.attached:
            self._takeover()

    async def wait(self) -> Attach | None:
        """The next link offered, or None once the window passed or the session was given up."""
        self.attached = False
        self.detached_at = next(_detach_order)
        self._registry._detached(self)
        try:
            if self.ended is not None:
                return None
            if self.window <= 0:
                return None
            try:
                attach = await asyncio.wait_for(asyncio.shield(self._offer), self.window)
            except TimeoutError:
                return None
            self._offer = asyncio.get_running_loop().create_future()
            if attach is not None:
                self.attached = True
            return attach
        finally:
            if not self.attached:
                self.close()  # the window is over: the credential resumes nothing from now on

    def give_up(self, reason: str) -> None:
        """End a detached session now (or, attached, as soon as its link drops)."""
        if self.ended is None:
            self.ended = reason
        if not self._offer.done():
            self._offer.set_result(None)

    def advance(self, credential: Credential) -> None:
        self._registry._rekey(self, credential)

    def close(self) -> None:
        """Forget the credential: nothing resumes this session any more."""
        if not self.closed:
            self.closed = True
            self._registry._forget(self)
        if self._offer.done() and (attach := self._offer.result()) is not None:
            attach.release()  # offered and never taken up


class ResumeRegistry:
    """Every resumable session of one worker, by credential id; on the worker's event loop only."""

    def __init__(
        self,
        window: float = DEFAULT_RESUME_WINDOW,
        *,
        max_open: int | None = None,
        max_detached: int | None = None,
    ) -> None:
        if window < 0:
            raise ValueError(f"the resume window must be at least 0 s, got {window}")
        self.window = window
        self.max_open, self.max_detached = max_open, max_detached
        self._by_id: dict[bytes, Resumable] = {}
        self._by_client: dict[str, list[Resumable]] = {}  # each client's sessions, oldest first
        self.resumed = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def open(self, client: str, secret: bytes, takeover: Callable[[], None]) -> Resumable:
        """Register a new session, resumable with the credential its opening handshake gave."""
        resumable = Resumable(self, client, Credential(secret), takeover)
        self._by_id[resumable.credential.id] = resumable
        self._by_client.setdefault(client, []).append(resumable)
        return resumable

    def refusal(self, client: str) -> str | None:
        """Why `client` may not open another session now (it has `max_open` open), else None."""
        mine = self._by_client.get(client, ())
        if self.max_open is not None and len(mine) >= self.max_open:
            return (
                f"client {client} has {len(mine)} sessions open or detached, the most this worker "
                f"allows one client (--max-client-sessions {self.max_open}); close one first"
            )
        return None

    def sessions_of(self, client: str) -> tuple[int, int]:
        """How many sessions of `client` are registered, and how many of them wait detached."""
        mine = self._by_client.get(client, ())
        return len(mine), sum(1 for r in mine if not r.attached)

    def _detached(self, resumable: Resumable) -> None:
        """One of a client's sessions detached: past `max_detached`, its oldest detached one ends."""
        if self.max_detached is None:
            return
        waiting = [
            r
            for r in self._by_client.get(resumable.client, ())
            if not r.attached and r.ended is None and r.window > 0
        ]
        for oldest in sorted(waiting, key=lambda r: r.detached_at)[
            : max(0, len(waiting) - self.max_detached)
        ]:
            log.info(
                "client %s has more than %d sessions detached: the one detached longest ends",
                resumable.client,
                self.max_detached,
            )
            oldest.give_up(
                f"the client has more than {self.max_detached} sessions detached "
                "(--max-client-detached): the one detached longest ends"
            )

    def _rekey(self, resumable: Resumable, credential: Credential) -> None:
        self._by_id.pop(resumable.credential.id, None)
        resumable.credential = credential
        if not resumable.closed:
            self._by_id[credential.id] = resumable

    def _forget(self, resumable: Resumable) -> None:
        if self._by_id.get(resumable.credential.id) is resumable:
            del self._by_id[resumable.credential.id]
        mine = self._by_client.get(resumable.client)
        if mine is not None and resumable in mine:
            mine.remove(resumable)
            if not mine:
                del self._by_client[resumable.client]

    def accept(self, client: str, token: bytes, transcript: bytes, secret: bytes) -> Resumable:
        """The session `token` resumes, its credential consumed and the next one taken; ProtocolError
        (nothing consumed) if the token is malformed, unknown, another client's, or does not verify."""
        request = parse_token(token)
        resumable = self._by_id.get(request.id)
        if resumable is None:
            raise ProtocolError(
                "no session to resume: it ended, its resume window "
                f"({self.window:g} s) passed, or this credential was used already"
            )
        if resumable.ended is not None:
            raise ProtocolError(f"the session is ending ({resumable.ended})")
        if resumable.client != client:
            raise ProtocolError(f"client {client} presented the resume credential of another client")
        if not resumable.credential.proves(request, transcript):
            raise ProtocolError("the resume credential does not verify")
        resumable.advance(resumable.credential.after(secret))
        return resumable

    async def carry(
        self, link: Link, channel: Channel, client: str, token: bytes, transcript: bytes, secret: bytes
    ) -> None:
        """Serve a link whose handshake asked to resume a session: offer it to that session and
        return when the session lets it go; refuse it (an Error ending it) if the token resumes nothing."""
        try:
            resumable = self.accept(client, token, transcript, secret)
        except ProtocolError as e:
            self.refused += 1
            log.warning("refused to resume a session for client %s from %s: %s", client, link.peer, e)
            refusal = m.Reply(0, (m.Error(0, ErrorCode.WORKER_LOST, f"cannot resume: {e}"),))
            try:
                await link.send(channel.seal(m.encode_reply(refusal), MESSAGE))
            except Exception as send_error:  # noqa: BLE001 - the link may be dead already; nothing to do
                log.debug("could not send the refusal to %s: %s", link.peer, send_error)
            return
        self.resumed += 1
        attach = Attach(link, channel, parse_token(token).received)
        resumable.offer(attach)
        await attach.released


__all__ = ["DEFAULT_RESUME_WINDOW", "Attach", "Resumable", "ResumeRegistry"]
