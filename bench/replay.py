"""Graph replay against resending the graph every step, and freeing against keeping every intermediate.

    .venv/bin/python bench/replay.py [--steps 200]

One MLP training step (bench/local_step.py's model: batch 128, 784-512-512-10, float32, ReLU,
cross-entropy, SGD) on `Device.remote(ticket)` against worker processes on loopback gRPC, each
a real `Worker` on the NumPy backend, started by this script (`--serve`) so that the keep mode
and a peak reset are available; otherwise as `emberlink worker` runs (malloc tuned, one device
thread). Three workers, one session each, so no figure mixes two sessions:

- replay: the client registers the graph once; a step is `Upload x, Upload y, Execute(gid, ids,
  bindings), Drop, Read`, which from the second step on is the previous batch with every id
  shifted, so it travels as `Repeat(id_shift, rid_shift)` with x and y inline in the same frame.
- full resend (the design before replay): the client sends `Register(gid, graph)` with every
  Execute. Switched on with the environment variable EMBERLINK_REPLAY=0 when the device is made
  (client/remote.py). The worker still finds the gid cached, so this run pays the bytes, the
  client's encoding and the worker's hash check, but not the decode and compile the previous
  design also paid every step; that cost is measured alone and shown below the table.
- keep all: a worker whose backend runs every plan compiled without frees or buffer reuse
  (`NumpyBackend(keep_intermediates=True)`), against the replay worker's free-after-last-use
  plans with buffer reuse. Peak = the worker's `peak_bytes` (every live array, exactly counted:
  graph_replay/memory.py) over the timed steps, after a reset at their start.

Bytes are what the client hands to the transport (sealed frames: 38 bytes each of header and
tag), per step, averaged over the timed steps. Non-input bytes = all bytes sent minus the data
bytes of x and y; msgpack ints grow, so the table also projects the same step once the batch seq
(and any ids the batch carries) have passed 2^16. Latency rows are medians over interleaved rounds.

Goals: a replayed step's non-input bytes at most 256 and at least 20x fewer than a full resend;
the worker's peak with frees at most 0.6x the peak keeping every intermediate.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import local_step

import emberlink as el
from emberlink.client.remote import REPLAY_ENV, RemoteExecutor
from emberlink.graph_replay import canonical
from emberlink.graph_replay.plan import compile_plan
from emberlink.protocol import messages as m
from emberlink.protocol.channel import OVERHEAD
from emberlink.protocol.identity import AllowPolicy, Identity

GOAL_NON_INPUT = 256
GOAL_FEWER = 20
GOAL_PEAK = 0.6


# -- worker side ----------------------------------------------------------------------------------


def serve(mode: str, allow_file: str) -> None:
    """A worker on 127.0.0.1:0: prints its ticket, then obeys stdin (`reset` the peak) until EOF."""
    from emberlink.graph_replay.numpy_backend import NumpyBackend
    from emberlink.server.background import BackgroundWorker
    from emberlink.transport.malloc import tune_malloc

    logging.basicConfig(level=logging.ERROR)
    tune_malloc()
    backend = NumpyBackend(keep_intermediates=mode == "keep")
    with BackgroundWorker(allow=AllowPolicy.from_file(allow_file), device="cpu", backend=backend) as w:
        print(w.ticket, flush=True)
        for line in sys.stdin:
            if line.strip() == "reset":
                w.worker.device.submit(backend.reset_peak).result()  # behind any queued work
                print("ok", flush=True)


class WorkerProcess:
    def __init__(self, mode: str, allow_file: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", mode, "--allow", str(allow_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.ticket = self.proc.stdout.readline().strip()
        if not self.ticket.startswith("emberlink://"):
            raise SystemExit(f"worker ({mode}) did not start")

    def reset_peak(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("reset\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def stop(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(30)
        self.proc.stdout.close()


@contextmanager
def workers(modes: list[str]) -> Iterator[tuple[Path, list[WorkerProcess]]]:
    """Worker processes admitting a fresh client key; yields the key file and the workers."""
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "client.key"
        client = Identity.generate(os.urandom)
        client.save(key)
        allow = Path(tmp) / "allow"
        allow.write_text(client.node_id + "\n")
        started = [WorkerProcess(mode, allow) for mode in modes]
        try:
            yield key, started
        finally:
            for w in started:
                w.stop()


# -- client side ----------------------------------------------------------------------------------


class Side:
    """One device, its model, and its per-step figures."""

    def __init__(self, name: str, ticket: str, key: Path, *, replay: bool) -> None:
        os.environ[REPLAY_ENV] = "1" if replay else "0"
        try:
            self.dev = el.Device.remote(ticket, key=str(key))
        finally:
            os.environ.pop(REPLAY_ENV, None)
        assert isinstance(self.dev._executor, RemoteExecutor) and self.dev._executor.replay is replay
        self.name = name
        self.model = local_step.EmberlinkMLP(self.dev)
        self.times: list[float] = []
        self.losses: list[float] = []
        self.sent = 0
        self.steps = 0

    def run(self, batches: list[Any], n: int, *, timed: bool = True) -> None:
        before = self.dev.stats()["bytes_sent"]
        for i in range(n):
            x, y = batches[i % len(batches)]
            t0 = time.perf_counter()
            self.losses.append(self.model.step(x, y))
            if timed:
                self.times.append(time.perf_counter() - t0)
        if timed:
            self.sent += int(self.dev.stats()["bytes_sent"]) - int(before)
            self.steps += n

    @property
    def bytes_per_step(self) -> float:
        return self.sent / self.steps

    def worker(self) -> dict[str, Any]:
        executor = self.dev._executor
        assert isinstance(executor, RemoteExecutor)
        return executor.worker_stats()


def replayed_step_parts(side: Side, batches: list[Any], input_bytes: int) -> tuple[dict[str, int], int, int]:
    """The non-input bytes of one more steady-state replayed step, by part, from what the client
    actually sent (the encoded batch, its messages by type, and the sealing of its frames); that
    step's measured non-input bytes; and how many more the same step takes once the batch seq and
    any ids in the batch have passed 2^16 (msgpack ints grow)."""
    side.run(batches, 1, timed=False)  # back to steady state after the stats request made a batch
    sent: list[m.Batch] = []
    original = m.encode_batch

    def spy(batch: m.Batch) -> bytes:
        sent.append(batch)
        return original(batch)

    m.encode_batch = spy  # type: ignore[assignment]  # the client session encodes through the module
    before = int(side.dev.stats()["bytes_sent"])
    try:
        side.run(batches, 1, timed=False)
    finally:
        m.encode_batch = original  # type: ignore[assignment]
    measured = int(side.dev.stats()["bytes_sent"]) - before - input_bytes
    batch = sent[-1]  # the batch as it went on the wire (a Repeat, or the full batch)
    head = len(original(batch))
    empty = len(original(m.Batch(batch.seq, ())))
    parts = {"batch (seq, message list)": empty}
    for msg in batch.messages:
        name = type(msg).__name__
        parts[name] = parts.get(name, 0) + len(original(m.Batch(batch.seq, (msg,)))) - empty
    sealing = measured - head
    parts[f"sealing: {sealing // OVERHEAD} frame(s) x {OVERHEAD} (header + tag)"] = sealing
    late = len(original(_shifted(batch, 1 << 17))) - head
    return parts, measured, late


def _shifted(batch: m.Batch, by: int) -> m.Batch:
    """The same batch with the seq and every id and request id `by` larger (a step late in a long
    run). A Repeat carries only shifts, which stay the same."""
    out: list[m.ClientMessage] = []
    for msg in batch.messages:
        if type(msg) is m.Upload:
            out.append(m.Upload(msg.tid + by, msg.dtype, msg.shape, msg.nbytes, msg.inline))
        elif type(msg) is m.Execute:
            out.append(m.Execute(msg.gid, tuple(i + by for i in msg.inputs), msg.bindings, msg.out_base + by))
        elif type(msg) is m.Drop:
            out.append(m.Drop(tuple(i + by for i in msg.ids)))
        elif type(msg) is m.Read:
            out.append(m.Read(msg.rid + by, msg.tid + by))
        else:
            out.append(msg)
    return m.Batch(batch.seq + by, tuple(out))


def decode_compile_us(side: Side) -> tuple[int, float]:
    """Bytes of the step's canonical graph and the median time to decode and compile it."""
    graph = max((memo.graph for memo in side.dev._memo.values()), key=lambda g: len(g.nodes))
    body = canonical.encode_graph(graph)
    samples = []
    for _ in range(200):
        t0 = time.perf_counter()
        compile_plan(canonical.decode_graph(body))
        samples.append(time.perf_counter() - t0)
    return len(body), statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per side")
    parser.add_argument("--serve", choices=["free", "keep"], help=argparse.SUPPRESS)
    parser.add_argument("--allow", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.allow)
        return

    batches = local_step._batches(8)
    rounds = 10
    per_round = max(1, args.steps // rounds)
    with workers(["free", "free", "keep"]) as (key, (w_replay, w_full, w_keep)):
        replay = Side("replay", w_replay.ticket, key, replay=True)
        full = Side("full resend", w_full.ticket, key, replay=False)
        keep = Side("keep all", w_keep.ticket, key, replay=True)
        sides = [replay, full, keep]
        for side in sides:
            side.run(batches, 5, timed=False)  # graphs built, registered, plans compiled
        w_replay.reset_peak()
        w_keep.reset_peak()
        for r in range(rounds):  # interleaved, so drifts in machine load hit every side alike,
            for side in sides[r % 3 :] + sides[: r % 3]:  # and rotated, so no side always runs first
                side.run(batches, per_round)
        stats = {side.name: side.worker() for side in sides}
        # The three remote sides ran the same math from the same start.
        worst = max(max(abs(a - b) for a, b in zip(s.losses, replay.losses, strict=True)) for s in sides)
        if worst > 1e-4:
            raise SystemExit(f"the sides disagree on the losses by {worst}")
        x, y = batches[0]
        input_bytes = x.nbytes + y.nbytes
        parts, measured, late = replayed_step_parts(replay, batches, input_bytes)
        graph_bytes, compile_us = decode_compile_us(replay)
        for side in sides:
            side.dev.close()

    r_all, f_all = replay.bytes_per_step, full.bytes_per_step
    r_non, f_non = r_all - input_bytes, f_all - input_bytes
    lat_r, lat_f = statistics.median(replay.times) * 1e3, statistics.median(full.times) * 1e3
    peak_free, peak_keep = stats["replay"]["peak_bytes"], stats["keep all"]["peak_bytes"]
    fewer = f_non / r_non

    def ok(good: bool) -> str:
        return "yes" if good else "**no**"

    print(
        f"MLP training step: batch {local_step.BATCH}, {'-'.join(map(str, local_step.SIZES))}, float32, "
        f"cross-entropy, SGD; NumPy workers over loopback gRPC; {replay.steps} timed steps a side, "
        f"{rounds} interleaved rounds"
    )
    print()
    print("| per step | replay | full resend / keep all | ratio | goal | met |")
    print("|---|---:|---:|---:|---|---|")
    print(f"| bytes sent, all | {r_all:,.0f} | {f_all:,.0f} | {r_all / f_all:.3f} | | |")
    print(f"| of which input data (x, y) | {input_bytes:,} | {input_bytes:,} | | | |")
    print(
        f"| bytes sent, non-input | {r_non:,.0f} | {f_non:,.0f} | {r_non / f_non:.3f} ({fewer:.1f}x fewer) "
        f"| replay <= {GOAL_NON_INPUT} | {ok(r_non <= GOAL_NON_INPUT)} |"
    )
    print(f"| | | | | >= {GOAL_FEWER}x fewer | {ok(fewer >= GOAL_FEWER)} |")
    print(
        f"| bytes sent, non-input, once ids pass 2^16 (projected) | {r_non + late:,.0f} | {f_non + late:,.0f} "
        f"| {(r_non + late) / (f_non + late):.3f} | replay <= {GOAL_NON_INPUT} | {ok(r_non + late <= GOAL_NON_INPUT)} |"
    )
    print(f"| step latency, median ms | {lat_r:.3f} | {lat_f:.3f} | {lat_r / lat_f:.3f} | | |")
    print(
        f"| worker peak bytes (replay worker: free after last use + reuse) | {peak_free:,} | {peak_keep:,} "
        f"| {peak_free / peak_keep:.3f} | <= {GOAL_PEAK} | {ok(peak_free / peak_keep <= GOAL_PEAK)} |"
    )
    print()
    print("Graph cache (each worker's figures for this client):")
    print()
    print("| worker | entries | size bytes | hits | misses | evictions | graphs registered by the client |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for side in sides:
        s = stats[side.name]
        print(
            f"| {side.name} | {s['cache_entries']} | {s['cache_size']:,} | {s['cache_hits']} | "
            f"{s['cache_misses']} | {s['cache_evictions']} | {side.dev.stats()['graphs_registered']} |"
        )
    print()
    print(
        f"Where the {sum(v for k, v in parts.items() if not k.startswith(' ')):,} non-input bytes of one "
        f"more replayed step go (measured for that step: {measured:,}):"
    )
    print()
    print("| part | bytes |")
    print("|---|---:|")
    for name, size in parts.items():
        print(f"| {name} | {size} |")
    print()
    print(
        f"The full resend adds a Register of the {graph_bytes}-byte canonical graph (+ its 16-byte id) "
        f"to every step. Its worker finds the id cached; the previous design also decoded and "
        f"compiled the graph every step: {compile_us:.0f} us median (measured alone, not in the "
        "latency row)."
    )
    need = (f_non - r_non) / (GOAL_FEWER - 1)
    print()
    print(
        f"{GOAL_FEWER}x fewer non-input bytes than a full resend needs a replayed step of at most "
        f"{need:.0f} bytes (the resend adds {f_non - r_non:,.0f}): one sealed frame ({OVERHEAD} bytes) "
        "holding a Repeat of the previous batch, the inputs' bytes inline after it."
    )


if __name__ == "__main__":
    main()
