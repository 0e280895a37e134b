"""Runs and tracks the handler task of each accepted session; knows nothing of any wire."""

from __future__ import annotations

import asyncio
import logging

from emberlink.errors import TransportError
from emberlink.transport.base import Handler, Link

log = logging.getLogger("emberlink.transport")


class SessionSet:
    """The live sessions of one listener: spawn a handler per link, and end them all on stop."""

    def __init__(self, handler: Handler, what: str) -> None:
        self._handler = handler
        self._what = what
        self._tasks: dict[asyncio.Task[None], Link] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, link: Link) -> asyncio.Task[None]:
        """Run the handler on `link` in its own task; the link is closed when the handler returns."""
        task = asyncio.get_running_loop().create_task(self._run(link), name=f"{self._what} {link.peer}")
        self._tasks[task] = link
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)

    async def _run(self, link: Link) -> None:
        try:
            await self._handler(link)
        except TransportError as e:
            log.debug("%s session %s ended: %s", self._what, link.peer, e)
        except Exception:
            # The handler's bug must not take the listener down with it, but it must be seen.
            log.exception("%s session handler for %s failed", self._what, link.peer)
        finally:
            await link.close()

    async def stop(self, grace: float | None) -> None:
        """Wait up to `grace` seconds for handlers to return, then close their links and cancel them."""
        if self._tasks and grace:
            await asyncio.wait(list(self._tasks), timeout=grace)
        for link in list(self._tasks.values()):
            await link.close()
        if not self._tasks:
            return
        # Closed links make a handler's recv raise; give it a moment to notice before cancelling it.
        await asyncio.wait(list(self._tasks), timeout=0.1)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
