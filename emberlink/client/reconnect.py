"""Resuming a remote session on a new link after its link dropped: link attempts on every path the
connect function knows, a full new handshake carrying the session's one-time resume credential, the
worker's answer; no batches (client/session.py resends them) and no choice of path of its own.

While the window lasts, a new link attempt starts every `STAGGER_S` while earlier ones still hang
(a SYN lost to a cut link is retried by the kernel only after 1, 3, 7 s, so a later attempt gets
through first once the link is back), or `RETRY_S` after all of them failed at once (connection
refused, network unreachable). The first link up is used; the others are abandoned.

The credential the worker holds is the one it last accepted. When a link drops after the Auth went
out but before the worker's answer came, the client cannot know whether the worker took it: it
tries the credential that acceptance would have made first, then the old one (each is one-time,
so at most one of them still resumes anything).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from emberlink.errors import ConfigError, EmberlinkError, ProtocolError, TransportError, WorkerLost
from emberlink.protocol import messages as m
from emberlink.protocol.channel import MESSAGE, Channel, split_frames
from emberlink.protocol.handshake import ClientHandshake
from emberlink.protocol.identity import Identity
from emberlink.protocol.resume import Credential
from emberlink.settings import env_number
from emberlink.transport.base import Link, bind

log = logging.getLogger("emberlink.client")

RESUME_WINDOW_ENV = "EMBERLINK_RESUME_WINDOW"
"""Seconds a remote device keeps trying to resume its session after its link dropped (0: never)."""
DEFAULT_RESUME_WINDOW = 30.0
STAGGER_S = 0.25
"""A new link attempt starts this often while earlier ones still hang..."""
MAX_ATTEMPTS = 4
"""...with at most this many in flight."""
RETRY_S = 0.1
"""The pause after every attempt in flight failed."""
HANDSHAKE_TIMEOUT_S = 5.0
"""How long a new link may take to answer the Hello."""
DIRECT_HEAD_START_S = 0.2
"""When resuming, the direct path's head start over the relay (client/paths.py): shorter than when
connecting, since the path that just failed may be the direct one."""
_MAX_CANDIDATES = 3

Connect = Callable[[float], Coroutine[Any, Any, tuple[str, Link]]]
"""Opens a new link to the worker within the timeout given: (path, Link)."""


def resume_window_setting(value: float | None = None) -> float:
    """The client's resume window: `value` if given, else $EMBERLINK_RESUME_WINDOW, else 30 s."""
    if value is None:
        value = env_number(RESUME_WINDOW_ENV, float, "seconds")
        if value is None:
            return DEFAULT_RESUME_WINDOW
    if not 0 <= value <= 86400:
        raise ConfigError(f"the resume window must be 0..86400 seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class Resumed:
    """A session resumed on a new link: the path, link and channel, and the last batch the worker applied."""

    path: str
    link: Link
    channel: Channel
    applied: int


class _Refused(EmberlinkError):
    """The worker answered the resume with an Error: this credential resumes nothing there."""


class Resumer:
    """Brings one session back on new links, credential after credential; on the I/O loop only."""

    def __init__(
        self,
        connect: Connect,
        worker_node_id: str,
        identity: Identity,
        credential: Credential,
        window: float,
    ) -> None:
        self._connect = connect
        self._worker = worker_node_id
        self._identity = identity
        self._candidates = [credential]
        self.window = window

    async def resume(self, received: int, why: str) -> Resumed:
        """A new link on which the worker took the session back; WorkerLost when the window passes or
        the worker refuses (the session is gone there: its window passed, or the worker restarted).
        `why` says what was lost and names the worker ("lost worker X: ..."); errors start with it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.window
        last = why
        while True:
            try:
                path, link = await self._open(deadline)
            except TransportError as e:
                raise WorkerLost(
                    f"{why}; no new link within the resume window of {self.window:g} s ({e})"
                ) from e
            credential = self._candidates[0]
            try:
                channel, applied = await self._present(link, credential, received, deadline)
            except _Refused as e:
                await link.close()
                self._candidates.remove(credential)
                if not self._candidates:
                    raise WorkerLost(f"{why}; {e}") from None
                last = str(e)
                continue
            except (TransportError, ProtocolError, TimeoutError) as e:
                await link.close()
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                log.info("resuming with worker %s over %s failed: %s", self._worker, path, last)
                if loop.time() >= deadline:
                    raise WorkerLost(f"{why}; not resumed within {self.window:g} s ({last})") from e
                continue
            return Resumed(path, link, channel, applied)

    async def _present(
        self, link: Link, credential: Credential, received: int, deadline: float
    ) -> tuple[Channel, int]:
        """Handshake on `link` presenting `credential`; (channel, last applied batch) once accepted."""
        loop = asyncio.get_running_loop()
        hs = ClientHandshake(
            self._identity, self._worker, os.urandom, token_for=lambda th2: credential.token(th2, received)
        )
        await link.send(hs.hello())
        timeout = max(min(HANDSHAKE_TIMEOUT_S, deadline - loop.time()), 0.05)
        welcome = bytes(await asyncio.wait_for(link.recv(), timeout))
        auth, channel, _limits = hs.receive_welcome(welcome)
        # From the moment the Auth leaves, the worker may have taken this credential: if no answer
        # comes, the next attempt tries the one that acceptance made first (see the module docstring).
        await bind(link, hs.link_secret)  # before Auth, as at connect: see transport/nats.py's rules
        following = credential.after(hs.resume_secret)
        self._candidates = [following, *(c for c in self._candidates if c.id != following.id)]
        self._candidates = self._candidates[:_MAX_CANDIDATES]
        await link.send(auth)
        # The worker first finishes every batch it received on the old link: wait as long as the window.
        answer = await asyncio.wait_for(link.recv(), max(deadline - loop.time(), 0.05) + HANDSHAKE_TIMEOUT_S)
        frames = split_frames(answer)
        if len(frames) != 1:
            raise ProtocolError(f"the worker answered a resume with {len(frames)} frames in one blob")
        kind, plaintext = channel.open(frames[0])
        if kind is not MESSAGE:
            raise ProtocolError(f"the worker answered a resume with a {kind.name} frame")
        reply = m.decode_reply(plaintext)
        for msg in reply.messages:
            if type(msg) is m.Error and msg.rid == 0:
                self._candidates.remove(following)
                raise _Refused(msg.message)
        if reply.messages:
            raise ProtocolError("the worker's answer to a resume carries messages")
        self._candidates = [following]
        return channel, reply.ack

    async def _open(self, deadline: float) -> tuple[str, Link]:
        """The first new link that comes up before `deadline` (TransportError naming the last failure)."""
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Task[tuple[str, Link]]] = set()
        last = "no attempt finished"
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise TransportError(last)
                if len(pending) < MAX_ATTEMPTS:
                    pending.add(loop.create_task(self._connect(left), name=f"resume {self._worker}"))
                done, _ = await asyncio.wait(
                    pending, timeout=min(STAGGER_S, left), return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    pending.discard(task)
                    error = task.exception()
                    if error is None:
                        return task.result()
                    if not isinstance(error, EmberlinkError):
                        raise error
                    last = str(error)
                if done and not pending:
                    await asyncio.sleep(min(RETRY_S, max(deadline - loop.time(), 0)))
        finally:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
                for task in pending:
                    if not task.cancelled() and task.exception() is None:
                        await task.result()[1].close()  # came up too late: not needed


__all__ = [
    "DEFAULT_RESUME_WINDOW",
    "DIRECT_HEAD_START_S",
    "RESUME_WINDOW_ENV",
    "Connect",
    "Resumed",
    "Resumer",
    "resume_window_setting",
]
