"""Keeps a worker's event loop polling, not sleeping, for a while after each reply it sends; does no
I/O of its own and never delays a callback.

A client in a training loop sends its next step a few hundred microseconds after the reply to the
last one. An event loop that slept meanwhile pays a wake-up of an idle CPU, with cold caches, before
it reads that step; one that kept polling reads it the moment it lands. So after each reply the
loop keeps a callback of ours ready (asyncio then polls its sockets with no timeout) for
`settings.spin_seconds` (2 ms on a machine with the cores for it, none on fewer: measured there),
where the loop is its process's main thread (`emberlink worker`): a worker on a loop thread shares
its process with clients (`emberlink.testing`), which a polling loop would keep from the GIL.
Past that window with no new reply it sleeps as before, so an idle worker costs no CPU. One keeper
a loop, shared by its sessions.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref

from emberlink.settings import spin_seconds


class Awake:
    """The polling window of one event loop: `poke()` after a reply opens (or extends) it."""

    __slots__ = ("__weakref__", "_loop", "_ticking", "_until", "window")

    def __init__(self, loop: asyncio.AbstractEventLoop, window: float) -> None:
        self._loop = loop
        self.window = window  # seconds; 0: the loop sleeps whenever it has nothing to do
        self._until = 0.0
        self._ticking = False

    @property
    def polling(self) -> bool:
        """Whether the loop is being kept polling now."""
        return self._ticking

    def poke(self) -> None:
        """On the loop: keep it polling for `window` from now."""
        if not self.window:
            return
        self._until = time.perf_counter() + self.window
        if not self._ticking:
            self._ticking = True
            self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        if time.perf_counter() < self._until and not self._loop.is_closed():
            self._loop.call_soon(self._tick)
        else:
            self._ticking = False


_KEEPERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Awake] = weakref.WeakKeyDictionary()


def keeper(loop: asyncio.AbstractEventLoop) -> Awake:
    """The loop's keeper (made on first use, from the loop's thread: its window is read then)."""
    found = _KEEPERS.get(loop)
    if found is None:
        alone = threading.current_thread() is threading.main_thread()
        found = _KEEPERS[loop] = Awake(loop, spin_seconds(0.0, alone=alone))
    return found


__all__ = ["Awake", "keeper"]
