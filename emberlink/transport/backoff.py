"""The delays between attempts to reach a relay that is away: exponential, capped; no I/O but sleeping."""

from __future__ import annotations

import asyncio

FIRST_S = 0.1
"""The first delay after a failed attempt."""
MAX_S = 2.0
"""The longest delay: a relay that comes back is found again within about this long."""


class Backoff:
    """Sleeps `first` seconds after the first failure, twice as long after each further one (at
    most `most`), and `first` again after `reset()` (call it once an attempt succeeded)."""

    def __init__(self, first: float = FIRST_S, most: float = MAX_S) -> None:
        self.first = first
        self.most = most
        self.delay = first

    async def sleep(self) -> None:
        """Wait the current delay, then double it (up to `most`) for the next failure."""
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, self.most)

    def reset(self) -> None:
        self.delay = self.first


__all__ = ["FIRST_S", "MAX_S", "Backoff"]
