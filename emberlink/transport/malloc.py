"""glibc malloc tuning for processes that move bulk data; a no-op off glibc. Touches no emberlink state.

Why: bulk transfers allocate and free many 1 MiB buffers (gRPC messages, sealed chunks) and a few
large arrays. With glibc's defaults those come from fresh `mmap`s that page-fault on every use;
a high `M_MMAP_THRESHOLD` keeps them in the heap, where freed pages are reused warm, and a high
`M_TRIM_THRESHOLD` stops the heap from being handed back and faulted in again every transfer.
Measured on the design machine: roughly twice the bulk throughput. The worker tunes at start-up;
a client process tunes when it opens its first remote device (64 MiB downloads on loopback:
about 1.05 GB/s untuned, 1.35–1.55 GB/s tuned), unless `EMBERLINK_TUNE_MALLOC=0`. The cost is
that freed memory up to the trim threshold stays with the process instead of going back to the OS.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 512 << 20


def tune_malloc_unless_disabled() -> bool:
    """`tune_malloc()` unless the environment says `EMBERLINK_TUNE_MALLOC=0` (for client processes)."""
    if os.environ.get("EMBERLINK_TUNE_MALLOC", "1").strip() in ("0", "false", "no", "off"):
        return False
    return tune_malloc()


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Raise glibc's mmap and trim thresholds; True if both were set, False where not applicable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt symbol in some builds), or no libc handle
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    if ok:
        log.debug("malloc tuned: mmap threshold %d, trim threshold %d", mmap_threshold, trim_threshold)
    else:
        log.debug("mallopt refused the malloc tuning; keeping the defaults")
    return ok
