"""Where a remote jitted step's time goes: timestamps on both sides of one step, by stage.

    python bench/step_trace.py [--device cuda:0] [--steps 300] [--transport grpc|tcp] [--step mlp|tiny|upload]

The small MLP step of bench/gpu_step.py, jitted, against an `emberlink worker` process on
127.0.0.1 (host batches, resident data through DataLoader(resident=True), then batches uploaded
once beforehand); or, with `--step tiny`, bench/remote_step.py's jitted
tiny step (64 B upload, sum, scalar read); with `--step upload`, its jitted 401 KB host-batch step
(`jit_upload_step`: the small MLP's batch alone, a small op, a scalar read). `--transport tcp` serves and connects over the raw TCP
transport (transport/tcp.py) instead of gRPC; the "gRPC" stages are then that transport's. The bench wraps methods of the client (in this
process) and of the worker (its process starts with the same wrappers installed) to record
`time.perf_counter_ns()` (CLOCK_MONOTONIC, shared by both processes) as each step passes, then
prints the median of each stage over the steps, in the order a step goes through them. The
wrappers cost a few microseconds each; the total is printed beside the untraced step time. Last,
the CPU time a step of the untraced run took on the client's thread, the client's I/O thread and in
the worker process (Linux: /proc; the worker's includes its wrappers), which a loaded machine
inflates less than wall time.

Finer, for the worker's captured replays (issue 11): STEP_TRACE_FINE=1 splits its Executes and
Read into their parts and prints the CPU time of each worker thread; `--local` first traces the
same parts of Device.cuda in this process (STEP_TRACE_LOCAL_SLEEP=<µs>: again, asleep that long
before each step). Experiments on the worker: STEP_TRACE_SPIN=always|<µs> (its event loop polls
instead of sleeping), STEP_TRACE_CPUS=2,3 (its threads on those cores), STEP_TRACE_GC=off,
STEP_TRACE_PROFILE=<file> (cProfile of BatchRunner.apply).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import functools
import itertools
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

import numpy as np

HERE = Path(__file__).resolve().parent
EVENTS: list[tuple[str, int]] = []
OUT_ENV = "STEP_TRACE_OUT"
TRANSPORT_ENV = "STEP_TRACE_TRANSPORT"


def mark(tag: str) -> None:
    EVENTS.append((tag, time.perf_counter_ns()))  # list.append is atomic: any thread may mark


def wrap(cls: Any, name: str, before: str | None, after: str | None = None) -> None:
    fn = getattr(cls, name)
    if asyncio.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            if before:
                mark(before)
            out = await fn(*args, **kwargs)
            if after:
                mark(after)
            return out

        setattr(cls, name, traced_async)
        return

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if before:
            mark(before)
        out = fn(*args, **kwargs)
        if after:
            mark(after)
        return out

    setattr(cls, name, traced)


def link_classes() -> tuple[Any, Any]:
    """(the client's Link class, the worker's) of the transport named by TRANSPORT_ENV."""
    if os.environ.get(TRANSPORT_ENV, "grpc") == "tcp":
        from emberlink.transport.tcp import TcpLink

        return TcpLink, TcpLink
    from emberlink.transport import grpc as g

    return g.GrpcClientLink, g.GrpcServerLink


def wrap_io(link: Any, side: str) -> None:
    """Mark a link's writes and arrivals: a TcpLink's writes go through `send_nowait` (from `send`
    or straight from a pump) or, from a user thread that owns it, `write_direct`, and its blobs
    arrive in `_deliver` (handed to a pump's callback or an owner's, or queued for `recv`); other
    links' through `send` and `recv`."""
    if hasattr(link, "send_nowait"):
        wrap(link, "send_nowait", f"{side}.write", f"{side}.written")
        if hasattr(link, "write_direct"):
            wrap(link, "write_direct", f"{side}.write", f"{side}.written")
        wrap(link, "_deliver", f"{side}.recv")
    else:
        wrap(link, "recv", None, f"{side}.recv")
    wrap(link, "send", f"{side}.write", f"{side}.written")


def install(side: str) -> None:
    """Wrap the methods a step passes through on one side ("client" or "worker")."""
    client_link, server_link = link_classes()

    if side == "client":
        from emberlink.client.remote import RemoteExecutor
        from emberlink.client.session import ClientSession

        wrap(RemoteExecutor, "_flush", "c.flush")
        wrap(ClientSession, "submit", "c.submit")
        wrap(ClientSession, "request_direct", "c.submit")  # no hand-off: sent by the user's thread
        wrap_io(client_link, "c")
        wrap(ClientSession, "_resolve", "c.resolve")
        return
    from emberlink.graph_replay.cupy_backend import CupyBackend
    from emberlink.graph_replay.numpy_backend import NumpyBackend
    from emberlink.server.runner import BatchRunner
    from emberlink.server.session import Session

    wrap_io(server_link, "w")
    wrap(Session, "_submit", "w.submit")
    wrap(BatchRunner, "apply", "w.apply", "w.applied")
    wrap(BatchRunner, "_execute", "w.execute", "w.executed")
    for backend in (CupyBackend, NumpyBackend):
        wrap(backend, "to_numpy", "w.read", "w.readed")
    wrap(Session, "_finished", "w.post")
    install_replay()
    if os.environ.get(CPUS_ENV):
        os.sched_setaffinity(0, {int(c) for c in os.environ[CPUS_ENV].split(",")})
    spin = os.environ.get(SPIN_ENV)
    if spin:
        keep_loop_awake(server_link, None if spin == "always" else float(spin) / 1e6)
    if os.environ.get(GC_ENV) == "off":
        import gc

        gc.disable()
    if os.environ.get(PROFILE_ENV):
        profile_apply(os.environ[PROFILE_ENV])
    out = os.environ[OUT_ENV]
    atexit.register(lambda: np.save(out, np.array([(t, n) for t, n in EVENTS], dtype=object)))


FEED_NAMES = {
    "host": "host batches",
    "host loader": "host batches from a DataLoader",
    "loader": "resident data",
    "uploaded": "batches uploaded beforehand",
}
"""The rows' names for gpu_step's feeds (HOST, HOST_LOADER: DataLoader(resident=False), LOADER:
DataLoader(resident=True), UPLOADED)."""

FINE_ENV = "STEP_TRACE_FINE"
GC_ENV = "STEP_TRACE_GC"
PROFILE_ENV = "STEP_TRACE_PROFILE"
NAP_ENV = "STEP_TRACE_LOCAL_SLEEP"  # µs: --local also runs with this sleep before each step
CPUS_ENV = "STEP_TRACE_CPUS"  # the worker's threads on these cores only, e.g. "2,3"
SPIN_ENV = "STEP_TRACE_SPIN"  # "always", or µs after each reply: the worker's event loop does not sleep


def keep_loop_awake(server_link: Any, window: float | None) -> None:
    """A callback kept ready on the worker's event loop, so that the loop polls instead of
    sleeping: always (`window` None), or for `window` seconds after each reply it sends (does a
    thread woken from sleep run the step slower?)."""
    send = server_link.send
    state = {"until": 0.0, "ticking": 0.0}

    @functools.wraps(send)
    async def awake(*args: Any, **kwargs: Any) -> Any:
        out = await send(*args, **kwargs)
        loop = asyncio.get_running_loop()
        state["until"] = time.perf_counter() + (window if window is not None else 1e9)

        def tick() -> None:
            if time.perf_counter() < state["until"]:
                loop.call_soon(tick)
            else:
                state["ticking"] = 0.0

        if not state["ticking"]:
            state["ticking"] = 1.0
            loop.call_soon(tick)
        return out

    server_link.send = awake


def profile_apply(path: str) -> None:
    """cProfile around the worker's BatchRunner.apply; the top functions written to `path` at exit."""
    import cProfile
    import pstats

    from emberlink.server.runner import BatchRunner

    prof = cProfile.Profile()
    apply = BatchRunner.apply

    @functools.wraps(apply)
    def profiled(*args: Any, **kwargs: Any) -> Any:
        prof.enable()
        try:
            return apply(*args, **kwargs)
        finally:
            prof.disable()

    BatchRunner.apply = profiled  # type: ignore[method-assign]

    def dump() -> None:
        with open(path, "a") as f:
            stats = pstats.Stats(prof, stream=f)
            stats.sort_stats("tottime").print_stats(35)
            stats.sort_stats("cumulative").print_stats(35)

    atexit.register(dump)


def probe() -> None:
    """A fixed bit of pure-Python work, timed: how fast this thread's core runs Python right now
    (a core woken from sleep, or with cold caches, runs it slower)."""
    mark("probe")
    n = 0
    for i in range(300):
        n += i
    mark("probed")


def wrap_capture_stages() -> None:
    """Mark the stages of a captured replay (FINE_ENV): Captures.run, the replay, its staging,
    binding checks and launch, and the side stream made for an early read."""
    from emberlink.graph_replay import captured, cuda_graph
    from emberlink.graph_replay.cupy_backend import CupyBackend

    wrap(captured.Captures, "run", "w.crun", "w.cran")
    wrap(cuda_graph.CapturedPlan, "replay", "w.replay", "w.replayed")
    wrap(cuda_graph.CapturedPlan, "_stage", "w.stage", "w.staged")
    wrap(cuda_graph.CapturedPlan, "_send", "w.send", "w.sent")
    checks = getattr(cuda_graph, "check_bindings")  # noqa: B009 - not exported

    def check_bindings(*args: Any) -> Any:
        out = checks(*args)
        mark("w.checked")
        return out

    if hasattr(cuda_graph.CapturedPlan, "_check"):  # a call's checks of its inputs and bindings
        wrap(cuda_graph.CapturedPlan, "_check", None, "w.checked")
    else:
        setattr(cuda_graph, "check_bindings", check_bindings)  # noqa: B010
    wrap(CupyBackend, "_side_stream", "w.made")
    early = getattr(cuda_graph, "_EarlyCopy", None)  # the early output's host copy, where there is one
    if early is not None:
        wrap(early, "read", "w.made")


def install_replay() -> None:
    """Marks inside an Execute's captured replay (STEP_TRACE_FINE=1): where its time goes."""
    if os.environ.get(FINE_ENV) != "1":
        return
    from emberlink.server.runner import BatchRunner
    from emberlink.server.store import TensorStore

    wrap_capture_stages()
    wrap(TensorStore, "put_many", "w.put", "w.putted")
    # The probe inside the w.apply mark (in "apply the batch"): before it, it was counted in "to
    # the batch being applied", which then looked like ~15 µs of hand-off on an inline loop.
    apply = getattr(BatchRunner.apply, "__wrapped__", BatchRunner.apply)

    @functools.wraps(apply)
    def probed(*args: Any, **kwargs: Any) -> Any:
        probe()
        return apply(*args, **kwargs)

    BatchRunner.apply = probed  # type: ignore[method-assign]
    wrap(BatchRunner, "apply", "w.apply", "w.applied")


FINE_STAGES = [
    ("probe: 300 Python additions at the start of apply / of a local step", "probe", "probed"),
    ("Execute: runner before Captures.run (store, quota, takes_host)", "w.execute", "w.crun"),
    ("Execute: Captures.run to replay", "w.crun", "w.replay"),
    ("Execute: replay to _stage (device context)", "w.replay", "w.stage"),
    ("Execute: _stage checks (inputs, bindings)", "w.stage", "w.checked"),
    ("Execute: _stage rest (wait for staging, tables, outputs)", "w.checked", "w.staged"),
    ("Execute: _send (memcpyAsync)", "w.send", "w.sent"),
    ("Execute: launches, events, mark_ready", "w.sent", "w.replayed"),
    ("Execute: Captures.run after replay", "w.replayed", "w.cran"),
    ("Execute: runner after run (put_many, counters)", "w.cran", "w.executed"),
    ("  of which put_many", "w.put", "w.putted"),
    ("Read: wait for the early outputs' event", "w.read", "w.made"),
    ("Read: copy to host (from the graph's host copy, else from the device)", "w.made", "w.readed"),
]
SUMMED = {"w.execute", "w.read", "probe"} | {b for _, b, _ in FINE_STAGES}

STAGES = [
    ("client: step until the batch is handed over (jit replay, recording, flush)", "c.step", "c.flush"),
    ("client: hand-off to the I/O thread", "c.flush", "c.submit"),
    ("client: encode, seal, pack", "c.submit", "c.write"),
    ("client: grpc write returns", "c.write", "c.written"),
    ("gRPC to the worker (from the start of the write)", "c.write", "w.recv"),
    ("worker: open, decode, expand, uploads", "w.recv", "w.submit"),
    ("  pipelined (several blobs): client's first write to its last write returns", "c.write", "c.written$"),
    ("  pipelined: the worker's last blob arrived to the batch whole", "w.recv$", "w.submit"),
    ("  pipelined: the client's last write returns to the batch whole", "c.written$", "w.submit"),
    ("worker: to the batch being applied (inline: 0; else the device thread)", "w.submit", "w.apply"),
    ("worker: apply the batch", "w.apply", "w.applied"),
    ("  of which Executes (stage, copy, launch)", "w.execute", "w.executed"),
    ("  of which the Read (wait for the GPU, copy back)", "w.read", "w.readed"),
    ("worker: to the reply being queued", "w.applied", "w.post"),
    ("worker: reply queued to grpc write (wake the sender, seal)", "w.post", "w.write"),
    ("worker: grpc write returns", "w.write", "w.written"),
    ("gRPC to the client (from the start of the write)", "w.write", "c.recv"),
    ("client: open, decode, resolve the read", "c.recv", "c.resolve"),
    ("client: the user's thread wakes with the loss", "c.resolve", "c.done"),
    ("the whole step, traced", "c.step", "c.done"),
]


LAST = "$"
"""A stage's mark with this after it is the mark's last time in the step, not its first (a host
batch pipelined over tcp goes in several blobs: client/session.py's `Pipelined`)."""


def durations(events: list[tuple[str, int]], warm: int) -> dict[str, list[float]]:
    """Per step (between consecutive c.step marks): each stage's µs; summed where a stage happens
    several times in a step (two Executes)."""
    events = sorted(events, key=lambda e: e[1])
    starts = [i for i, (t, _) in enumerate(events) if t == "c.step"]
    out: dict[str, list[float]] = {name: [] for name, _, _ in STAGES + FINE_STAGES}
    for a, b in itertools.pairwise(starts[warm:]):
        window = events[a:b]
        first: dict[str, int] = {}  # each mark's first time in the step; "mark$": its last (LAST)
        for t, n in window:
            first.setdefault(t, n)
            first[t + LAST] = n
        for name, begin, end in STAGES + FINE_STAGES:
            if begin in SUMMED:
                total = 0
                opened = None
                for t, n in window:
                    if t == begin:
                        opened = n
                    elif t == end and opened is not None:
                        total += n - opened
                        opened = None
                if total:
                    out[name].append(total / 1e3)
            elif begin in first and end in first:
                out[name].append((first[end] - first[begin]) / 1e3)
    return out


@contextmanager
def traced_worker(key: Path, device: str, out: Path) -> Iterator[tuple[str, int]]:
    from emberlink.protocol.identity import Identity

    client = Identity.load(key)
    with tempfile.TemporaryDirectory() as tmp:
        wkey = Path(tmp) / "worker.key"
        Identity.generate(os.urandom).save(wkey)
        allow = Path(tmp) / "allow"
        allow.write_text(client.node_id + "\n")
        argv = [
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--key",
            str(wkey),
            "--allow",
            str(allow),
            "--device",
            device,
        ]
        tcp = os.environ.get(TRANSPORT_ENV, "grpc") == "tcp"
        if tcp:
            argv += ["--tcp-listen", "127.0.0.1:0"]
        code = (
            f"import sys; sys.path.insert(0, {str(HERE)!r}); import step_trace; step_trace.install('worker'); "
            f"from emberlink.cli import main; raise SystemExit(main({argv!r}))"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, OUT_ENV: str(out)},
        )
        import bare

        bare.place_server(proc.pid)
        try:
            assert proc.stdout is not None
            ticket = proc.stdout.readline().strip()
            if not ticket.startswith("emberlink://"):
                raise SystemExit(f"the worker did not start (exit {proc.wait(30)})")
            from emberlink.protocol.ticket import Ticket

            parsed = Ticket.parse(ticket)  # only the address of the transport asked for
            only = Ticket(parsed.node_id, (), tcp=parsed.tcp) if tcp else Ticket(parsed.node_id, parsed.addrs)
            yield str(only), proc.pid
        finally:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--transport", choices=("grpc", "tcp"), default="grpc")
    parser.add_argument("--step", choices=("mlp", "tiny", "upload"), default="mlp")
    parser.add_argument("--local", action="store_true", help="also trace Device.cuda's replays in-process")
    parser.add_argument(
        "--cpus", choices=("split", "same", "any"), default="any", help="as bench/remote_step.py's --cpus"
    )
    args = parser.parse_args()
    os.environ[TRANSPORT_ENV] = args.transport  # the worker process inherits it
    sys.path.insert(0, str(HERE))
    import bare

    print(bare.place(args.cpus))
    import gpu_step

    import emberlink as el
    from emberlink.protocol.identity import Identity

    model = gpu_step.SMALL
    data = gpu_step.batches(model)
    if args.local:
        trace_local(gpu_step, model, data, args.steps, 0.0)
        nap = float(os.environ.get(NAP_ENV, "0")) / 1e6
        if nap:
            trace_local(gpu_step, model, data, args.steps, nap)
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "client.key"
        Identity.generate(os.urandom).save(key)
        for feed in (gpu_step.HOST,) if args.step in ("tiny", "upload") else gpu_step.FEEDS:
            out = Path(tmp) / f"worker_{feed}.npy"
            with (
                traced_worker(key, args.device, out) as (ticket, pid),
                el.Device.remote(ticket, key=str(key)) as dev,
            ):
                step: gpu_step.Step
                if args.step in ("tiny", "upload"):
                    import remote_step

                    make = remote_step.jit_tiny_step if args.step == "tiny" else remote_step.jit_upload_step
                    tiny = make(dev)

                    def tiny_step(_: int, run: Any = tiny) -> Any:
                        return run()

                    step = tiny_step
                else:
                    step = gpu_step.ember_step(dev, model, data, jit=True, feed=feed, lazy=False)
                for i in range(30):
                    step(i % gpu_step.N_BATCHES)
                cpu0 = cpu_ns(pid)
                threads0 = thread_cpu_ns(pid)
                t0 = time.perf_counter()
                for i in range(args.steps):
                    step(i % gpu_step.N_BATCHES)
                plain = (time.perf_counter() - t0) / args.steps * 1e6
                cpu = {k: (v - cpu0[k]) / args.steps / 1e3 for k, v in cpu_ns(pid).items()}
                threads = {
                    k: (v - threads0.get(k, 0)) / args.steps / 1e3 for k, v in thread_cpu_ns(pid).items()
                }
                install("client")
                rebind(dev)
                EVENTS.clear()
                for i in range(args.steps):
                    mark("c.step")
                    step(i % gpu_step.N_BATCHES)
                    mark("c.done")
                mark("c.step")
                client_events = list(EVENTS)
                uninstall_client()
                rebind(dev)
            worker_events = [(str(t), int(n)) for t, n in np.load(out, allow_pickle=True)]
            stages = durations(client_events + worker_events, warm=10)
            what = {"tiny": "tiny step", "upload": "401 KB host batch step"}.get(
                args.step, f"small MLP, {FEED_NAMES[feed]}"
            )
            print(f"\n| {what}, Device.remote jit over {args.transport}: stage | median µs |")
            print("|---|---:|")
            for name, _, _ in STAGES + (FINE_STAGES if os.environ.get(FINE_ENV) == "1" else []):
                values = stages[name]
                print(f"| {name} | {statistics.median(values):.0f} |" if values else f"| {name} | - |")
            print(f"| the whole step, untraced | {plain:.0f} |")
            print(f"\n| {what}, untraced: CPU time a step, by thread | µs |")
            print("|---|---:|")
            for name, us in cpu.items():
                print(f"| {name} | {us:.0f} |")
            for name, us in sorted(threads.items(), key=lambda kv: -kv[1]):
                if us >= 1:
                    print(f"| worker thread {name} | {us:.0f} |")


def cpu_ns(worker_pid: int) -> dict[str, int]:
    """CPU time so far (ns) of the client's thread, the client's I/O loop thread and the whole
    worker process (every thread, from /proc/<pid>/task/*/schedstat). Less noisy than wall time on
    a loaded machine: waiting for a core is not counted."""
    from emberlink.transport.loop import io_loop

    worker = 0
    for stat in Path(f"/proc/{worker_pid}/task").glob("*/schedstat"):
        try:
            worker += int(stat.read_text().split()[0])
        except (OSError, ValueError):
            pass  # a thread that ended meanwhile
    io_thread = io_loop()._thread.ident
    assert io_thread is not None
    return {
        "client: the user's thread": time.thread_time_ns(),
        "client: the I/O loop thread": time.clock_gettime_ns(time.pthread_getcpuclockid(io_thread)),
        "worker: all its threads": worker,
    }


def thread_cpu_ns(pid: int) -> dict[str, int]:
    """CPU time so far (ns) of each of a process's threads, summed by thread name."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = f"{(task / 'comm').read_text().strip()} {task.name}"
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            continue
        out[name] = ns
    return out


def trace_local(gpu_step: Any, model: Any, data: Any, steps: int, nap: float) -> None:
    """The same replay marks on Device.cuda in this process (each of gpu_step's feeds); with
    `nap` seconds of sleep before each step (as a worker sleeps while the client's round trip goes
    on)."""
    import emberlink as el
    from emberlink.graph_replay.cupy_backend import CupyBackend

    os.environ[FINE_ENV] = "1"
    from emberlink.graph_replay import captured, cuda_graph

    saved = {
        (cls, name): getattr(cls, name)
        for cls, name in [
            (captured.Captures, "run"),
            (cuda_graph.CapturedPlan, "replay"),
            (cuda_graph.CapturedPlan, "_stage"),
            (cuda_graph.CapturedPlan, "_send"),
            *([(cuda_graph.CapturedPlan, "_check")] if hasattr(cuda_graph.CapturedPlan, "_check") else []),
            (CupyBackend, "_side_stream"),
            (CupyBackend, "to_numpy"),
            *([(cuda_graph._EarlyCopy, "read")] if hasattr(cuda_graph, "_EarlyCopy") else []),
        ]
    }
    checks = getattr(cuda_graph, "check_bindings")  # noqa: B009 - restored after
    wrap_capture_stages()
    wrap(CupyBackend, "to_numpy", "w.read", "w.readed")
    try:
        for feed in gpu_step.FEEDS:
            with el.Device.cuda(0) as dev:
                step = gpu_step.ember_step(dev, model, data, jit=True, feed=feed, lazy=False)
                for i in range(30):
                    step(i % gpu_step.N_BATCHES)
                EVENTS.clear()
                t0 = time.perf_counter()
                for i in range(steps):
                    if nap:
                        time.sleep(nap)
                    mark("c.step")
                    probe()
                    step(i % gpu_step.N_BATCHES)
                plain = (time.perf_counter() - t0) / steps * 1e6 - nap * 1e6
                mark("c.step")
                stages = durations(list(EVENTS), warm=10)
            slept = f", {nap * 1e6:.0f} µs asleep before each step" if nap else ""
            print(
                f"\n| small MLP, {FEED_NAMES[feed]}, Device.cuda jit (in-process{slept}): stage | median µs |"
            )
            print("|---|---:|")
            for name, _, _ in FINE_STAGES:
                values = stages[name]
                if values:
                    print(f"| {name} | {statistics.median(values):.1f} |")
            print(f"| the whole step, traced | {plain:.0f} |")
    finally:
        for (cls, name), fn in saved.items():
            setattr(cls, name, fn)
        setattr(cuda_graph, "check_bindings", checks)  # noqa: B010
        EVENTS.clear()


_ORIGINALS: dict[tuple[Any, str], Any] = {}


def uninstall_client() -> None:
    from emberlink.client.remote import RemoteExecutor
    from emberlink.client.session import ClientSession

    client_link, _ = link_classes()
    for cls, name in [
        (RemoteExecutor, "_flush"),
        (ClientSession, "submit"),
        (ClientSession, "request_direct"),
        (client_link, "write_direct"),
        (client_link, "send"),
        (client_link, "recv"),
        (client_link, "send_nowait"),
        (client_link, "_deliver"),
        (ClientSession, "_resolve"),
    ]:
        fn = getattr(cls, name, None)
        if fn is not None:
            setattr(cls, name, getattr(fn, "__wrapped__", fn))


def rebind(dev: Any) -> None:
    """The client session keeps its link's `send_nowait` bound from the start: bind it again (after
    `install` or `uninstall_client`), so that its writes are seen as they are."""
    session = dev._executor._session
    if getattr(session, "_nowait", None) is not None:
        session._nowait = session._link.send_nowait


if __name__ == "__main__":
    main()
