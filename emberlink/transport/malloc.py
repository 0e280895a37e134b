"""glibc malloc tuning for processes that move bulk data; a no-op off glibc. Touches no emberlink state.

Why: bulk transfers allocate and free many 1 MiB buffers (gRPC messages, sealed chunks) and a few
large arrays. With glibc's defaults those come from fresh `mmap`s that page-fault on every use;
a high `M_MMAP_THRESHOLD` keeps them in the heap, where freed pages are reused warm, and a high
`M_TRIM_THRESHOLD` stops the heap from being handed back and faulted in again every transfer,
and `M_ARENA_MAX=1` puts every thread on that one heap: otherwise the I/O thread that receives a
result allocates in an arena of its own, whose heaps top out at 64 MiB, so a large result is a
fresh, page-faulting mapping every time. Measured on this 2-core machine, 64 MiB downloads on
loopback gRPC: 0.85–1.1 GB/s untuned; thresholds alone: bimodal, 0.3–0.45 or 1.1–1.8 GB/s;
thresholds with one arena: 1.6–2.2 GB/s (after the first transfer). The worker tunes at start-up;
a client process tunes before it starts its I/O thread (transport/loop.py), unless
`EMBERLINK_TUNE_MALLOC=0`.
The costs: freed memory up to the trim threshold stays with the process instead of going back to
the OS, and threads that allocate heavily at the same time share one arena's lock. So a worker
hands the heap's free pages back (`release_free_memory`) when a session that held much ends.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 512 << 20


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc `malloc_trim(0)`); False where not glibc."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def tune_malloc_unless_disabled() -> bool:
    """`tune_malloc()` unless the environment says `EMBERLINK_TUNE_MALLOC=0` (for client processes)."""
    if os.environ.get("EMBERLINK_TUNE_MALLOC", "1").strip() in ("0", "false", "no", "off"):
        return False
    return tune_malloc()


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Raise glibc's mmap and trim thresholds and use one arena; True if all three were set, False
    where not applicable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt symbol in some builds), or no libc handle
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(
        mallopt(option, value)
        for option, value in (
            (_M_MMAP_THRESHOLD, mmap_threshold),
            (_M_TRIM_THRESHOLD, trim_threshold),
            (_M_ARENA_MAX, 1),
        )
    )
    if ok:
        log.debug(
            "malloc tuned: mmap threshold %d, trim threshold %d, one arena", mmap_threshold, trim_threshold
        )
    else:
        log.debug("mallopt refused the malloc tuning; keeping the defaults")
    return ok
