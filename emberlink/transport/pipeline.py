"""Sending a long run of blobs while the next one is being made; no knowledge of what blobs hold.

A large upload or result goes out as many ~1 MiB sealed chunks. Sealed one after another on the
event loop, each chunk's encryption waits for the previous chunk's write and the other way round.
`send_blobs(..., ahead=True)` makes blob n+1 on a helper thread while the loop writes blob n:
AES-GCM releases the GIL, so where the machine has a core to spare the two overlap. On a machine
with few cores (`AHEAD_MIN_CPUS`) there is no core to spare and a thread hand-off per blob would
only add work, so callers ask `worth_ahead` first.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from emberlink.transport.base import Link

AHEAD_BYTES = 4 << 20
"""Runs shorter than this are sent as they are made: the hand-offs would cost more than they save."""
AHEAD_MIN_CPUS = 4

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def worth_ahead(nbytes: int, cpus: int | None = None) -> bool:
    """Whether a run of `nbytes` is worth making ahead on a helper thread on this machine."""
    cpus = os.cpu_count() if cpus is None else cpus
    return nbytes >= AHEAD_BYTES and (cpus or 1) >= AHEAD_MIN_CPUS


def _helpers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="emberlink-seal")
        return _pool


def _discard(fut: asyncio.Future[bytes | bytearray | None]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: an abandoned run's error is not "never retrieved"


async def send_blobs(
    link: Link, blobs: Iterator[bytes | bytearray], on_sent: Callable[[int], None], *, ahead: bool = False
) -> None:
    """Send every blob of `blobs` in order, calling `on_sent(len)` after each.

    With `ahead`, the first blob is made here (on the loop: callers may touch loop-owned state
    until their first yield) and every later one on a helper thread while the one before is
    written. The iterator is advanced by one thread at a time, in order; if a send fails or the
    task is cancelled, the blob being made is finished and dropped, and the iterator abandoned.
    """
    if not ahead:
        for each in blobs:
            await link.send(each)
            on_sent(len(each))
        return
    first = next(blobs, None)
    if first is None:
        return
    loop = asyncio.get_running_loop()
    helpers = _helpers()
    blob: bytes | bytearray | None = first
    pending = loop.run_in_executor(helpers, next, blobs, None)
    try:
        while blob is not None:
            await link.send(blob)
            on_sent(len(blob))
            blob = await pending
            if blob is not None:
                pending = loop.run_in_executor(helpers, next, blobs, None)
    finally:
        pending.add_done_callback(_discard)  # a no-op once awaited; else the abandoned blob's outcome
