"""Would a second thread that seals a host batch's chunks while this one writes them shorten the upload? Loopback TCP, no worker.

    python bench/seal_ahead.py [--repeats 2000] [--cpus any|one]

The client's pipelined upload (client/session.py's `Pipelined`): a 401 KB host batch sealed in
64 KiB AES-GCM frames, each written as soon as it is sealed. `cryptography` releases the GIL inside
`encrypt_into`, and os.writev releases it in the kernel, so a helper thread could seal frame i+1
while this thread writes frame i. This times, from the first seal to the last write returning
(the client's part of the critical path), with a reader that drains the socket between samples
(so every write finds room, as when the worker keeps up):
- one thread: `Channel.seal_chunks` and a write per frame, as the client does today;
- one thread, the same frames sealed by hand (`AESGCM.encrypt_into` into a fresh bytearray);
- shared: a helper thread and this one take the next frame to seal in turn (itertools.count),
  this one writes them in order as each is ready (a lock per frame);
- helper: the helper seals every frame, this thread only writes them.
Each sample sleeps 300 µs first (a step's wait), and the variants take turns. `--cpus one` pins the
process to one CPU (as bench/remote_step.py's `--cpus split` pins the client), where a helper can
only cost. Measured on the 2-core machine (medians of 1,800 after 200 warm-up rounds, this tree):
unpinned, two runs: today 116 and 109 µs, by hand 92 and 86, shared 119 and 113 (the helper
sealed 3.3 of the 7 frames), helper 123 and 115; pinned: 110, 87, 111, 114. The threaded
variants seal as "by hand" does, so that is their baseline: a second thread cost 23-37 µs, as
each hand-over of the GIL between the threads costs more than sealing a 64 KiB frame (~5-10
µs) saves. ("By hand" beats today's path by ~7 µs of the channel's bookkeeping and ~6-7 µs of
frames allocated as bytes through ctypes rather than as bytearrays, each measured apart.) Meant
for a run on a machine with idle cores (the H200's 16), where the 2-core machine cannot say.
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from emberlink.protocol.channel import HEADER_SIZE, TAG_SIZE, Channel
from emberlink.transport.malloc import tune_malloc
from emberlink.transport.tcp import PIPELINE_CHUNK

BATCH = 128 * 784 * 4
_PREFIX = struct.Struct(">I")


class Wire:
    """A loopback TCP connection with large buffers; `drain` empties the far end."""

    def __init__(self) -> None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        self.near = socket.create_connection(listener.getsockname())
        self.far, _ = listener.accept()
        listener.close()
        self.near.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.near.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        self.far.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.far.setblocking(False)
        self.fd = self.near.fileno()

    def write(self, frame: bytes | bytearray) -> None:
        os.writev(self.fd, (_PREFIX.pack(len(frame)), frame))

    def drain(self) -> None:
        try:
            while self.far.recv(1 << 22):
                pass
        except BlockingIOError:
            pass


class Frames:
    """The batch's frames sealed by hand: what `Channel._seal_new` does, in any order."""

    def __init__(self, data: memoryview, chunk: int) -> None:
        self.data = data
        self.chunk = chunk
        self.count = -(-len(data) // chunk)
        self.aead = AESGCM(bytes(32))
        self.header = bytes(HEADER_SIZE)

    def seal(self, k: int) -> bytearray:
        plaintext = self.data[k * self.chunk : (k + 1) * self.chunk]
        frame = bytearray(HEADER_SIZE + len(plaintext) + TAG_SIZE)
        out = memoryview(frame)
        out[:HEADER_SIZE] = self.header
        self.aead.encrypt_into(k.to_bytes(12, "big"), plaintext, out[:HEADER_SIZE], out[HEADER_SIZE:])
        out.release()
        return frame


class Helper:
    """A thread that seals frames for the writing thread: the jobs it is given, in order."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.sealed = 0
        threading.Thread(target=self._run, daemon=True, name="sealer").start()

    def _run(self) -> None:
        while True:
            self.jobs.get()()


def _slots(n: int) -> tuple[list[bytearray | None], list[threading.Lock]]:
    """`n` empty places for sealed frames, and a held lock for each, released once it is filled."""
    ready = [threading.Lock() for _ in range(n)]
    for lock in ready:
        lock.acquire()
    return [None] * n, ready


def shared(frames: Frames, wire: Wire, helper: Helper) -> None:
    """The helper and this thread take the next frame to seal in turn; this one writes in order."""
    n = frames.count
    sealed, ready = _slots(n)
    claims = itertools.count()

    def work() -> None:
        while (k := next(claims)) < n:
            sealed[k] = frames.seal(k)
            helper.sealed += 1
            ready[k].release()

    helper.jobs.put(work)
    for i in range(n):
        while sealed[i] is None:
            k = next(claims)
            if k >= n:
                ready[i].acquire()  # the helper has it in hand
                break
            sealed[k] = frames.seal(k)
            ready[k].release()
        frame = sealed[i]
        assert frame is not None
        wire.write(frame)


def helper_seals(frames: Frames, wire: Wire, helper: Helper) -> None:
    """The helper seals every frame; this thread writes each once it is sealed."""
    n = frames.count
    sealed, ready = _slots(n)

    def work() -> None:
        for k in range(n):
            sealed[k] = frames.seal(k)
            ready[k].release()

    helper.jobs.put(work)
    for i in range(n):
        ready[i].acquire()
        frame = sealed[i]
        assert frame is not None
        wire.write(frame)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--cpus", choices=("any", "one"), default="any")
    args = parser.parse_args()
    if args.cpus == "one":
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    tune_malloc()
    print(f"placement: {args.cpus}; CPUs this process may use: {sorted(os.sched_getaffinity(0))}")
    data = np.random.default_rng(0).standard_normal(BATCH // 4).astype(np.float32)
    view = memoryview(data).cast("B")
    wire = Wire()
    channel, _ = Channel.pair(bytes(8), bytes(32), bytes(range(32)))
    frames = Frames(view, PIPELINE_CHUNK)
    helper = Helper()

    def today() -> None:
        for frame in channel.seal_chunks(view, PIPELINE_CHUNK):
            wire.write(frame)

    def by_hand() -> None:
        for k in range(frames.count):
            wire.write(frames.seal(k))

    variants: dict[str, Callable[[], None]] = {
        "one thread: Channel.seal_chunks, a write per frame (today)": today,
        "one thread: sealed by hand": by_hand,
        "shared: helper and this thread seal in turn, this one writes": lambda: shared(frames, wire, helper),
        "helper: the helper seals all, this thread writes": lambda: helper_seals(frames, wire, helper),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, run in variants.items():
            time.sleep(300e-6)
            t0 = time.perf_counter_ns()
            run()
            samples[name].append((time.perf_counter_ns() - t0) / 1e3)
            wire.drain()
    kept = {name: values[len(values) // 10 :] for name, values in samples.items()}  # (warm-up)
    base = statistics.median(kept[next(iter(variants))])
    print(
        f"\n| {BATCH // 1000} KB in {frames.count} frames of {PIPELINE_CHUNK} B: first seal to last write | median µs | x today |"
    )
    print("|---|---:|---:|")
    for name, values in kept.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.0f} | {median / base:.2f} |")
    print(
        f"\nthe helper sealed {helper.sealed / args.repeats:.1f} of {frames.count} frames a batch when shared"
    )


if __name__ == "__main__":
    main()
