"""The worker's event loop kept polling for a while after a step's reply; no I/O, never blocks.

A worker's loop thread sleeps between a step's reply and the client's next batch: the batch's
arrival then costs the wake-up of a sleeping thread, on a core that may have gone idle, and cold
caches for every stage after it. After each step's reply written where its batch finished
(server/session.py's `_reply_now`), `Awake` keeps the loop busy for `SPIN_S` (callbacks that yield
the CPU at every turn, as a client that owns its socket polls in transport/tcp.py's `read_direct`),
until the next blob arrives, so that the next batch is taken in as it comes. Measured on the
2-core machine (client on CPU 0, worker on CPU 1), interleaved runs against the loop left to sleep:
the jitted tiny step over tcp (applied on the loop), bench/remote_step.py --tiny 3, 236 -> 170 and
222 -> 168 µs (1.56x -> 1.11x and 1.34x -> 1.04x the bare gRPC ping-pong), and bench/step_trace.py
--step tiny, from the client's write to the worker's arrival 44-57 -> 11-13 µs, for ~20 µs more of
the worker's CPU a step; the small MLP on NumPy (applied on the device thread), step_trace --step
mlp, from the client's write to the worker's arrival 70-89 -> 19-27 µs.

Rules:
- One `Awake` a loop (`shared`), whatever its sessions: a reply to any of them opens the window,
  a blob from any of them ends the spin. (One a session, each spun the loop they share, so the
  worker spun only while it served one session, and not at all in bench/remote_step.py, whose
  rows keep a session each open on one worker: the tiny step there measured the same with the
  spin and without, 1.32x the bare gRPC ping-pong both.)
- Only after a reply, and only for `SPIN_S` (`SPIN_ENV`); not again after a client took longer
  than that to send its next blob (a slow link or a slow client: the spin would not reach it),
  until one comes within it.
- A yield that takes longer than `SPIN_GAP_S` gave the CPU to another thread: the spin ends. After
  `SPIN_LATE` spins in a row ended so (a thread that wants this CPU after every reply: a client on
  the same core, whose next batch the spin only delays), the next `SPIN_BACKOFF` replies do not spin.
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref
from collections.abc import Callable

from emberlink.settings import env_microseconds

SPIN_ENV = "EMBERLINK_WORKER_SPIN_US"
"""How long, in microseconds, the loop polls without sleeping after a reply (0: never)."""
SPIN_S = 500e-6
"""The default window: longer than a client takes from a step's reply to its next step's batch
(~100 µs for the jitted tiny step on the 2-core machine, ~200 µs for the small MLP's on the H200)."""
SPIN_GAP_S = 50e-6
"""A yield that takes this long gave the CPU to another thread (on a core of its own it returns
at once): the spin ends..."""
SPIN_LATE = 3
"""...and when this many spins in a row ended so (not a passing thread of another process)..."""
SPIN_BACKOFF = 16
"""...the next this many replies do not spin. Measured with client and worker on one core (the
jitted tiny step, bench/step_trace.py --cpus same), a spin that went on regardless: 287-327 ->
329-358 µs a step; with this rule, 273-320 -> 303-347 µs traced-untraced alike within the noise."""


def spin_setting() -> float:
    """The window after a reply, in seconds (`SPIN_ENV`, else `SPIN_S`)."""
    seconds = env_microseconds(SPIN_ENV)
    return SPIN_S if seconds is None else seconds


_yield_cpu: Callable[[], None] = getattr(os, "sched_yield", lambda: None)
"""Give the CPU to any other runnable thread (where the platform can)."""


class Awake:
    """Keeps a loop polling after its sessions' replies (the module docstring's rules). Loop only."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        window: float | None = None,
        yield_cpu: Callable[[], None] = _yield_cpu,
    ) -> None:
        self._loop = loop
        self.window = spin_setting() if window is None else window
        self._yield = yield_cpu
        self.spinning = False  # a turn is scheduled
        self._until = 0.0
        self._replied_at = 0.0
        self._next = True  # the last client answered within the window
        self._late = 0  # spins in a row that ended with a long yield
        self._off = 0  # replies left that do not spin

    def arrived(self) -> None:
        """A blob came in: the spin ends (what it waited for is here; a batch applied on the
        device thread must not share the GIL with it), and whether it came within the window of
        the last reply decides whether the next reply spins."""
        self._until = 0.0
        if self._replied_at:
            self._next = time.perf_counter() - self._replied_at <= self.window
            self._replied_at = 0.0

    def replied(self) -> None:
        """A reply is written: poll until the window closes (unless the rules say not to)."""
        now = time.perf_counter()
        self._replied_at = now
        if self._off:
            self._off -= 1
            return
        if not self.window or not self._next:
            return
        self._until = now + self.window
        if self.spinning:  # polling since the last reply, never late: the spin is in nobody's way
            self._late = 0
        else:
            self.spinning = True
            self._loop.call_soon(self._turn)

    def _turn(self) -> None:
        now = time.perf_counter()
        if now >= self._until:
            self.spinning = False
            return
        self._yield()
        if time.perf_counter() - now > SPIN_GAP_S:  # the yield gave this CPU to another thread
            self._late += 1
            if self._late >= SPIN_LATE:
                self._off = SPIN_BACKOFF
            self.spinning = False
            return
        self._loop.call_soon(self._turn)


_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Awake] = weakref.WeakKeyDictionary()


def shared(loop: asyncio.AbstractEventLoop) -> Awake:
    """The loop's Awake, one for all its sessions (made on first use, its window read then)."""
    found = _SHARED.get(loop)
    if found is None:
        found = _SHARED[loop] = Awake(loop)
    return found


__all__ = ["SPIN_ENV", "Awake", "shared", "spin_setting"]
