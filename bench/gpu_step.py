"""MLP training steps on a GPU: PyTorch, hand-written CuPy, and emberlink in process and remote.

Run on a CUDA machine (CuPy; nvmath-python for captured graphs; PyTorch for its rows):

    python bench/gpu_step.py [--quick] [--only small|big] [--profile]

Two models, float32, softmax cross-entropy (mean), SGD lr=0.01, the same starting weights and
batches on every row: the small MLP (batch 128, 784-512-512-10) and a big one (batch 1024,
4096-4096-4096-10). Every step reads its loss as a Python float, except the rows marked
"read_async", which read each loss one step later (`loss.read_async()`, resolved after the next
step is on its way). "host" rows give each step a batch from host memory (`dev.tensor(x)`; "from a DataLoader":
`DataLoader(..., resident=False)`, which uploads batch k+1 right after step k's read is sent);
"resident" rows keep the data set on the device: emberlink's through `DataLoader(...,
resident=True)`, which gathers each batch with a `take` of an index tensor (after a jitted step,
folded into that step's own graph: one plan a step),
PyTorch's and CuPy's as batches uploaded beforehand. emberlink's "batches uploaded beforehand" rows
do what those do: each batch uploaded once (`dev.tensor`) before the steps, so a step is the
training step alone; compare those with PyTorch's and CuPy's resident rows.

Rows: PyTorch eager; PyTorch with the whole step captured as one `torch.cuda.CUDAGraph` (inputs
copied into its static tensors); hand-written CuPy (forward, backward and update by hand, cuBLAS
through CuPy); emberlink `Device.cuda(0)` (plans captured as CUDA graphs after their first run),
plain and with the step compiled by `emberlink.jit`; `Device.remote` against an `emberlink worker
--device cuda:0` process on 127.0.0.1 (handshake, sealing, the transport and the worker included),
plain and jitted, given the worker's whole ticket as a user is (so over the raw TCP transport,
which a worker serves by default and a client tries first; each row's notes name the path it
got), and again given only its gRPC address (rows "over gRPC"); and the jitted remote rows again,
whole ticket, against a worker with `EMBERLINK_INLINE=0`, which applies every batch on its device
thread (what applying on the event loop saves).

Times are medians over blocks of 10 steps (per step: the block's time / 10), after warm-up. Every
row's device, session and weights stay open until all are measured, and the blocks are
interleaved: 6 rounds each run a share of every row's blocks in turn, so a load that drifts
during the run (the machine is shared) weighs on every row alike. Each remote row has a worker
process to itself, as a user's training loop has: a worker applies a captured replay on its
event loop only while it serves one session (server/session.py, `_dispatch`). Measured on the
H200 when it came in, this cost the big MLP's remote rows about 3% (1.05x PyTorch eager
resident, against 1.01x-1.02x for the same tree measured one row after another with one worker),
likely the 18 worker processes' CUDA contexts; whether interleaving steadies the small MLP's
ratios from run to run, three runs could not tell (its host-batch row: 0.77x, 0.77x, and 0.87x
one row at a time).
"GPU time" is the kernel time of one step alone, measured with CUDA events around back-to-back
replays of the step's captured graph (PyTorch's, and emberlink's from `Device.cuda` jit). Each
row's first four losses, from fresh weights, are checked against the first emberlink row's.
Ratios are against PyTorch eager with host batches, and for the big MLP also against PyTorch
eager with its data already on the GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import itertools
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import emberlink as el
from emberlink.protocol.identity import Identity
from emberlink.protocol.ticket import Ticket
from emberlink.server.session import INLINE_ENV

LR = 0.01
N_BATCHES = 4
BLOCK = 10
ROUNDS = 6


@dataclass(frozen=True)
class Model:
    name: str
    batch: int
    sizes: tuple[int, ...]
    warm: int
    steps: int


SMALL = Model("small", 128, (784, 512, 512, 10), warm=30, steps=300)
BIG = Model("big", 1024, (4096, 4096, 4096, 10), warm=6, steps=60)

Step = Callable[[int], Any]
"""One step on batch `k` (of N_BATCHES); returns the loss (a float, or a future for read_async)."""

HOST, HOST_LOADER, LOADER, UPLOADED = "host", "host loader", "loader", "uploaded"
FEEDS = (HOST, HOST_LOADER, LOADER, UPLOADED)
"""Where a step's batch comes from (`ember_step`'s `feed`): uploaded from host memory each step, a
resident DataLoader (a `take` a step), or uploaded once before the steps."""


@dataclass
class Row:
    name: str
    ms: float
    losses: list[float]
    group: str = ""
    notes: list[str] = field(default_factory=list)


def batches(model: Model) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [
        (
            rng.standard_normal((model.batch, model.sizes[0]), dtype=np.float32),
            rng.integers(0, model.sizes[-1], model.batch),
        )
        for _ in range(N_BATCHES)
    ]


def start_weights(model: Model) -> list[np.ndarray]:
    """W1, b1, W2, b2, ... (W as (in, out)): emberlink's Linear initialisation, seeds 0, 1, 2."""
    with el.Device.cpu() as cpu:
        return [p.numpy() for p in ember_model(cpu, model).parameters()]


def ember_model(dev: el.Device, model: Model) -> el.nn.Module:
    layers: list[el.nn.Module] = []
    for k, (n_in, n_out) in enumerate(itertools.pairwise(model.sizes)):
        if k:
            layers.append(el.nn.ReLU())
        layers.append(el.nn.Linear(n_in, n_out, seed=k))
    return el.nn.Sequential(*layers).to(dev)


# -- timing ------------------------------------------------------------------------------------------


@dataclass
class Case:
    """A row being measured: its step, open (its device, session, weights) until the table is made."""

    name: str
    group: str
    step: Step
    pipelined: bool = False  # the step returns a read future, resolved one step later
    after: Callable[[], list[str]] | None = None  # its notes, once measured
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)


def block(case: Case, n: int = BLOCK) -> float:
    """Run `n` steps of `case`; seconds per step. A pipelined step's read future is resolved one
    step later, and the last one at the end of the block."""
    t0 = time.perf_counter()
    pending: Any = None
    for i in range(n):
        out = case.step(i % N_BATCHES)
        if case.pipelined:
            if pending is not None:
                pending.item()
            pending = out
    if pending is not None:
        pending.item()
    return (time.perf_counter() - t0) / n


def first_losses(case: Case) -> list[float]:
    """The first N_BATCHES losses, from fresh weights: the ones every row must agree on."""
    losses: list[float] = []
    pending: Any = None
    for k in range(N_BATCHES):
        out = case.step(k)
        if case.pipelined:
            if pending is not None:
                losses.append(float(pending.item()))
            pending = out
        else:
            losses.append(float(out))
    if pending is not None:
        losses.append(float(pending.item()))
    return losses


def measure(cases: list[Case], model: Model) -> list[Row]:
    """Every case's median ms per step, its blocks interleaved: after each case's first losses and
    warm-up, ROUNDS rounds run a share of every case's timed blocks in turn (each share after one
    untimed step). On a shared machine the load drifts over seconds; measured one row after the
    other, a drift lands on some rows and not others and moves their ratios (two back-to-back
    runs on the H200 put one row at 0.41 and 0.54 ms), while interleaved every row samples the
    whole run."""
    for c in cases:
        c.losses = first_losses(c)
        for _ in range(max(1, model.warm // BLOCK)):
            block(c)
    blocks = max(1, model.steps // BLOCK)
    rounds = min(ROUNDS, blocks)
    for r in range(rounds):
        for c in cases:
            block(c, 1)
            for _ in range(blocks // rounds + (r < blocks % rounds)):
                c.times.append(block(c))
    return [
        Row(c.name, statistics.median(c.times) * 1e3, c.losses, c.group, c.after() if c.after else [])
        for c in cases
    ]


# -- PyTorch ------------------------------------------------------------------------------------------


def torch_cases(
    model: Model, start: list[np.ndarray], data: list[tuple[np.ndarray, np.ndarray]]
) -> list[Case]:
    import torch

    dev = torch.device("cuda:0")
    host = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in data]
    resident = [(x.to(dev), y.to(dev)) for x, y in host]

    def fresh() -> list[Any]:
        return [torch.tensor(p, device=dev, requires_grad=True) for p in start]

    def loss_of(params: list[Any], x: Any, y: Any) -> Any:
        h = x
        for k in range(0, len(params), 2):
            h = h @ params[k] + params[k + 1]
            if k + 2 < len(params):
                h = torch.relu(h)
        return torch.nn.functional.cross_entropy(h, y)

    def eager(use: list[tuple[Any, Any]], move: bool) -> Step:
        params = fresh()

        def step(k: int) -> float:
            x, y = use[k]
            if move:
                x, y = x.to(dev), y.to(dev)
            loss = loss_of(params, x, y)
            loss.backward()
            with torch.no_grad():
                for p in params:
                    p -= LR * p.grad
                    p.grad = None
            return float(loss)

        return step

    def graphed(move: bool) -> tuple[Step, Callable[[], float]]:
        """The whole step (forward, backward, update) as one CUDA graph; `(step, gpu ms)`."""
        params = fresh()
        static_x, static_y = (t.clone() for t in resident[0])

        def body() -> Any:
            loss = loss_of(params, static_x, static_y)
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    p.sub_(LR * g)
            return loss

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = body()
        with torch.no_grad():  # back to the starting weights: the warm-up trained them
            for p, w in zip(params, start, strict=True):
                p.copy_(torch.from_numpy(w))

        def step(k: int) -> float:
            x, y = host[k] if move else resident[k]
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
            return float(static_loss)

        def gpu_ms() -> float:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            saved = [p.detach().clone() for p in params]
            begin.record()
            for _ in range(20):
                graph.replay()
            end.record()
            end.synchronize()
            with torch.no_grad():
                for p, w in zip(params, saved, strict=True):
                    p.copy_(w)
            return float(begin.elapsed_time(end)) / 20

        return step, gpu_ms

    host_graph, _ = graphed(True)
    resident_graph, gpu_ms = graphed(False)
    return [
        Case("PyTorch eager, host batches", "torch", eager(host, True)),
        Case("PyTorch eager, resident", "torch", eager(resident, False)),
        Case("PyTorch, whole step one CUDA graph, host batches", "torch", host_graph),
        Case(
            "PyTorch, whole step one CUDA graph, resident",
            "torch",
            resident_graph,
            after=lambda: [f"GPU time of PyTorch's captured step: {gpu_ms():.3f} ms"],
        ),
    ]


# -- hand-written CuPy -------------------------------------------------------------------------------


def cupy_cases(
    model: Model, start: list[np.ndarray], data: list[tuple[np.ndarray, np.ndarray]]
) -> list[Case]:
    import cupy as cp

    def make(resident: bool) -> Step:
        params = [cp.asarray(p) for p in start]
        on_device = [(cp.asarray(x), cp.asarray(y)) for x, y in data] if resident else []
        lr = np.float32(LR)

        def step(k: int) -> float:
            x, y = on_device[k] if resident else (cp.asarray(data[k][0]), cp.asarray(data[k][1]))
            n = x.shape[0]
            acts, pres = [x], []
            h = x
            for j in range(0, len(params), 2):
                z = h @ params[j] + params[j + 1]
                if j + 2 < len(params):
                    pres.append(z)
                    h = cp.maximum(z, np.float32(0))
                    acts.append(h)
                else:
                    h = z
            shifted = h - h.max(axis=1, keepdims=True)
            e = cp.exp(shifted)
            s = e.sum(axis=1, keepdims=True)
            rows = cp.arange(n)
            loss = -(shifted - cp.log(s))[rows, y].sum() / np.float32(n)
            d = e / s
            d[rows, y] -= np.float32(1)
            d /= np.float32(n)
            grads: list[Any] = [None] * len(params)
            for j in range(len(params) - 2, -1, -2):
                a = acts[j // 2]
                grads[j], grads[j + 1] = a.T @ d, d.sum(axis=0)
                if j:
                    d = (d @ params[j].T) * (pres[j // 2 - 1] > 0)
            for j, g in enumerate(grads):
                params[j] = params[j] - g * lr
            return float(loss)

        return step

    return [
        Case("hand-written CuPy, host batches", "cupy", make(False)),
        Case("hand-written CuPy, resident", "cupy", make(True)),
    ]


# -- emberlink ----------------------------------------------------------------------------------------


def ember_step(
    dev: el.Device,
    model: Model,
    data: list[tuple[np.ndarray, np.ndarray]],
    *,
    jit: bool,
    feed: str,
    lazy: bool,
) -> Step:
    """A step on `dev`: the batch uploaded each step (`feed` HOST, `dev.tensor`; HOST_LOADER, by a
    host-data DataLoader, which sends batch k+1 while step k runs), gathered from a resident
    DataLoader (LOADER) or uploaded once before the steps (UPLOADED); the step compiled
    with `emberlink.jit` or recorded each time; the loss read at once, or (`lazy`) its read started
    and its future returned."""
    if feed not in FEEDS:
        raise ValueError(f"feed must be one of {FEEDS}, not {feed!r}")
    net = ember_model(dev, model)
    opt = el.optim.SGD(net.parameters(), lr=LR)

    def train(x: el.Tensor, y: el.Tensor) -> el.Tensor:
        loss = el.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    fn = el.jit(train) if jit else train
    loaded: Iterator[Any] | None = None
    if feed in (LOADER, HOST_LOADER):
        # An epoch of the 4 batches over and over (so the losses agree with the other rows'), up to
        # 64 batches or 64 MiB: an epoch's first and last steps differ in form from the others
        # (which tensors are dropped when), so a 4-batch epoch would make every other step one.
        laps = max(1, min(16, (64 << 20) // sum(x.nbytes for x, _ in data)))
        xs = np.concatenate([x for x, _ in data] * laps)
        ys = np.concatenate([y for _, y in data] * laps)
        loader = el.data.DataLoader((xs, ys), batch_size=model.batch, device=dev, resident=feed == LOADER)
        loaded = itertools.chain.from_iterable(itertools.repeat(loader))
    uploaded = [(dev.tensor(x), dev.tensor(y)) for x, y in data] if feed == UPLOADED else []

    def step(k: int) -> Any:
        if loaded is not None:
            x, y = next(loaded)  # the loader's batches in order: batch k on the first steps
        elif uploaded:
            x, y = uploaded[k]
        else:
            x, y = dev.tensor(data[k][0]), dev.tensor(data[k][1])
        loss = fn(x, y)
        return loss.read_async() if lazy else float(loss)

    return step


def captured_gpu_ms(dev: el.Device) -> float | None:
    """Kernel time of the largest plan `dev` replays as a captured graph, launched alone 20 times
    back to back between CUDA events (a bench-only look at Device.cuda's executor)."""
    captures = getattr(dev._executor, "_captures", None)
    if captures is None:
        return None
    import cupy as cp

    found = [e.captured for e in captures._entries.values() if e.captured is not None]
    if not found:
        return None
    plan = max(found, key=lambda c: len(c.plan.steps))
    stream = cp.cuda.get_current_stream()
    begin, end = cp.cuda.Event(), cp.cuda.Event()
    begin.record(stream)
    for _ in range(20):
        plan.launch(stream)
    end.record(stream)
    end.synchronize()
    return float(cp.cuda.get_elapsed_time(begin, end)) / 20


def local_cases(
    model: Model, data: list[tuple[np.ndarray, np.ndarray]], profile: bool, device: str, stack: ExitStack
) -> list[Case]:
    """The remote rows' cases on Device.cuda (each its own device, open on `stack`), but for
    reading late from batches uploaded beforehand."""
    out: list[Case] = []
    for name, jit, feed, lazy in REMOTE_CASES:
        if feed == UPLOADED and lazy:
            continue
        dev = stack.enter_context(
            el.Device.cpu() if device == "cpu" else el.Device.cuda(int(device.partition(":")[2] or 0))
        )
        step = ember_step(dev, model, data, jit=jit, feed=feed, lazy=lazy)
        gpu_time = jit and feed == LOADER and not lazy
        after = functools.partial(local_notes, dev, step, model, f"Device.cuda {name}", gpu_time, profile)
        out.append(Case(f"Device.cuda {name}", "cuda", step, lazy, after))
    return out


def local_notes(
    dev: el.Device, step: Step, model: Model, name: str, gpu_time: bool, profile: bool
) -> list[str]:
    notes = [f"{dev.stats().get('captured_replays', 0)} captured replays"]
    if gpu_time:
        gpu = captured_gpu_ms(dev)
        if gpu is not None:
            notes.append(f"GPU time of emberlink's captured step: {gpu:.3f} ms")
        if profile:
            print(f"\n## cProfile: {model.name} MLP, {name}, {model.steps} steps")
            prof = cProfile.Profile()
            prof.enable()
            for i in range(model.steps):
                step(i % N_BATCHES)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return notes


@contextmanager
def cuda_workers(
    client_key: Path, device: str, envs: list[dict[str, str]], profile_to: Path | None = None
) -> Iterator[list[str]]:
    """An `emberlink worker --device DEVICE` process for each of `envs` (its environment's
    additions), admitting the client key, all started at once; yields their tickets (each serves
    raw tcp too, by default: port 0 beside port 0). With `profile_to` (one worker), it runs under
    cProfile (its event loop thread), saved there at exit."""
    client = Identity.load(client_key)
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        allow = Path(tmp) / "allow"
        allow.write_text(client.node_id + "\n")
        try:
            for n, env in enumerate(envs):
                key = Path(tmp) / f"worker{n}.key"
                Identity.generate(os.urandom).save(key)
                cmd = [sys.executable] + (["-m", "cProfile", "-o", str(profile_to)] if profile_to else [])
                cmd += ["-m", "emberlink", "worker", "--listen", "127.0.0.1:0", "--key", str(key)]
                cmd += ["--allow", str(allow), "--device", device]
                procs.append(
                    subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
                )
            tickets = []
            for proc in procs:
                assert proc.stdout is not None
                ticket = proc.stdout.readline().strip()
                if not ticket.startswith("emberlink://"):
                    raise SystemExit(f"a worker did not start (exit {proc.wait(30)})")
                tickets.append(ticket)
            yield tickets
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)


def only(ticket: str, transport: str) -> str:
    """The worker's ticket with only its `transport` ("grpc" or "tcp") address."""
    t = Ticket.parse(ticket)
    if not (t.tcp if transport == "tcp" else t.addrs):
        raise SystemExit(f"the worker's ticket has no {transport} address: {ticket}")
    return str(Ticket(t.node_id, (), tcp=t.tcp) if transport == "tcp" else Ticket(t.node_id, t.addrs))


def remote_cases(
    model: Model,
    data: list[tuple[np.ndarray, np.ndarray]],
    tickets: list[str],
    key: Path,
    tag: str,
    cases: list[Any],
    stack: ExitStack,
    profile: bool = False,
) -> list[Case]:
    """The `cases` on `Device.remote`, each a session (open on `stack`) to a worker of its own (its
    ticket from `tickets`, in order)."""
    out: list[Case] = []
    for (name, jit, feed, lazy), ticket in zip(cases, tickets, strict=True):
        dev = stack.enter_context(el.Device.remote(ticket, key=str(key)))
        step = ember_step(dev, model, data, jit=jit, feed=feed, lazy=lazy)
        full = f"Device.remote{tag}, {name}"
        out.append(
            Case(
                full,
                "remote",
                step,
                lazy,
                functools.partial(remote_notes, dev, step, lazy, model, full, profile),
            )
        )
    return out


def remote_notes(dev: el.Device, step: Step, lazy: bool, model: Model, name: str, profile: bool) -> list[str]:
    """A block more of `step`, counted (and profiled, with `profile`): bytes a step, captured
    replays, where the worker applied its batches."""
    before = dev.stats()
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    for i in range(BLOCK):
        out = step(i % N_BATCHES)
        float(out.item() if lazy else out)
    if prof is not None:
        prof.disable()
        print(f"\n## cProfile, client main thread: {model.name} MLP, {name}, {BLOCK} steps")
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    after = dev.stats()
    worker = dev._executor.worker_stats()  # type: ignore[attr-defined]
    batches = max(1, int(worker.get("session_batches", 0)))
    sent = (int(after["bytes_sent"]) - int(before["bytes_sent"])) // BLOCK
    replays = worker.get("session_captured_replays", 0)
    on_loop = int(worker.get("session_applied_on_loop", 0)) * 100 // batches
    note = f"path {after['path']}, {sent} bytes sent a step, {replays} captured replays, "
    return [note + f"{on_loop}% of batches applied on the loop"]


def profile_worker(model: Model, data: list[tuple[np.ndarray, np.ndarray]], key: Path, device: str) -> None:
    """The remote jitted steps against a worker under cProfile: where the worker's loop spends its
    time (applying batches too, when it applies them on the loop) and the client's main thread."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "worker.prof"
        with cuda_workers(key, device, [{INLINE_ENV: "1"}], profile_to=out) as (ticket,):
            rows: list[Row] = []
            for case in (c for c in REMOTE_CASES if c[1] and not c[3]):  # one session at a time
                with ExitStack() as stack:
                    tag = " (worker under cProfile)"
                    rows += measure(remote_cases(model, data, [ticket], key, tag, [case], stack, True), model)
        for r in rows:
            print(f"- {r.name}: {r.ms:.3f} ms a step; {'; '.join(r.notes)}")
        print(f"\n## cProfile, worker's main thread (event loop): {model.name} MLP, the rows above")
        pstats.Stats(str(out)).sort_stats("tottime").print_stats(30)


REMOTE_CASES = [
    ("eager (recorded each step), host batches", False, HOST, False),
    ("jit, host batches", True, HOST, False),
    ("jit, host batches, read_async", True, HOST, True),
    ("jit, host batches from a DataLoader", True, HOST_LOADER, False),
    ("jit, resident", True, LOADER, False),
    ("jit, resident, read_async", True, LOADER, True),
    ("jit, batches uploaded beforehand", True, UPLOADED, False),
    ("jit, batches uploaded beforehand, read_async", True, UPLOADED, True),
]
OVER_GRPC = " over gRPC"
"""The tag of the rows given only the worker's gRPC address; the plain rows get its whole ticket."""
DEVICE_THREAD_CASES = [
    ("jit, host batches", True, HOST, False),
    ("jit, resident", True, LOADER, False),
]


# -- the table ----------------------------------------------------------------------------------------


def table(model: Model, rows: list[Row], notes: list[str]) -> None:
    base = next((r for r in rows if r.name == "PyTorch eager, host batches"), None)
    resident = next((r for r in rows if r.name == "PyTorch eager, resident"), None)
    ref = next(r.losses for r in rows if r.group in ("cuda", "remote"))
    sizes = "-".join(map(str, model.sizes))
    head = f"| {model.name} MLP (batch {model.batch}, {sizes}) | median ms | vs PyTorch eager, host |"
    line = "|---|---:|---:|"
    if model is BIG:
        head += " vs PyTorch eager, resident |"
        line += "---:|"
    print(head + " losses agree |")
    print(line + "---|")
    for r in rows:
        agree = np.allclose(r.losses, ref, rtol=2e-3, atol=1e-4)
        cells = [r.name, f"{r.ms:.3f}", f"{r.ms / base.ms:.2f}x" if base else "-"]
        if model is BIG:
            cells.append(f"{r.ms / resident.ms:.2f}x" if resident else "-")
        cells.append(
            "yes" if agree else f"NO {[round(x, 5) for x in r.losses]} vs {[round(x, 5) for x in ref]}"
        )
        print("| " + " | ".join(cells) + " |")
    print()
    for r in rows:
        for n in r.notes:
            print(f"- {r.name}: {n}")
    for n in notes:
        print(f"- {n}")
    print()


def goals(small: list[Row], big: list[Row]) -> None:
    def ms(rows: list[Row], name: str) -> float | None:
        return next((r.ms for r in rows if r.name == name), None)

    # "Data on the worker": the DataLoader row (a take a step) and the row with each batch
    # uploaded beforehand, as PyTorch's resident rows have theirs; each line names its row.
    checks = [
        (small, "Device.remote, jit, host batches", "PyTorch eager, host batches", 0.85),
        (small, "Device.remote, jit, host batches from a DataLoader", "PyTorch eager, host batches", 0.85),
        (small, "Device.remote, jit, resident", "PyTorch eager, host batches", 0.40),
        (small, "Device.remote, jit, batches uploaded beforehand", "PyTorch eager, host batches", 0.40),
        (small, "Device.cuda jit, host batches", "PyTorch eager, host batches", 0.25),
        (big, "Device.remote, jit, resident", "PyTorch eager, resident", 1.05),
        (big, "Device.remote, jit, batches uploaded beforehand", "PyTorch eager, resident", 1.05),
        (big, "Device.remote, jit, resident, read_async", "PyTorch eager, resident", 1.05),
    ]
    grpc = [  # the same lines for gRPC, which a ticket without tcp: (or --tcp-listen off) gets
        (r, n.replace("Device.remote,", f"Device.remote{OVER_GRPC},"), a, g)
        for r, n, a, g in checks
        if "remote" in n
    ]
    for title, lines in (
        ("goal (issue 11; `Device.remote` as a ticket gives it: raw TCP)", checks),
        ("the same lines over gRPC (a ticket without a tcp address; for reference)", grpc),
    ):
        print(f"| {title} | ratio | met |")
        print("|---|---:|---|")
        for rows, name, against, goal in lines:
            a, b = ms(rows, name), ms(rows, against)
            if a is None or b is None:
                continue
            which = "small" if rows is small else "big"
            met = "yes" if a / b <= goal else "no"
            print(f"| {which} MLP {name} ≤ {goal}x {against} | {a / b:.2f}x | {met} |")
        print()


def run_model(model: Model, args: argparse.Namespace, key: Path, tickets: list[str]) -> list[Row]:
    """The model's rows; `tickets`: a worker for each remote row, the plain rows' (inline), the
    gRPC rows' (inline), then the device-thread rows' (`INLINE_ENV`=0)."""
    n = len(REMOTE_CASES)
    data = batches(model)
    start = start_weights(model)
    cases: list[Case] = []
    notes: list[str] = []
    try:
        import torch

        if args.device == "cpu" or not torch.cuda.is_available():
            raise ImportError("torch sees no CUDA device")
        cases += torch_cases(model, start, data)
    except ImportError as e:
        notes.append(f"no PyTorch rows: torch does not import here ({e})")
    if args.device != "cpu":
        cases += cupy_cases(model, start, data)
    with ExitStack() as stack:  # every row's device and session open until all are measured
        cases += local_cases(model, data, args.profile, args.device, stack)
        cases += remote_cases(model, data, tickets[:n], key, "", REMOTE_CASES, stack)
        cases += remote_cases(
            model, data, [only(t, "grpc") for t in tickets[n : 2 * n]], key, OVER_GRPC, REMOTE_CASES, stack
        )
        cases += remote_cases(
            model, data, tickets[2 * n :], key, f" ({INLINE_ENV}=0)", DEVICE_THREAD_CASES, stack
        )
        rows = measure(cases, model)
    table(model, rows, notes)
    if args.profile:
        profile_worker(model, data, key, args.device)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the steps (a smoke run)")
    parser.add_argument("--only", choices=("small", "big"), help="one model")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile the jitted steps: Device.cuda, and a remote worker",
    )
    parser.add_argument(
        "--device", default="cuda:0", help="the workers' device (cpu: a smoke run without a GPU)"
    )
    args = parser.parse_args()
    models = [m for m in (SMALL, BIG) if args.only in (None, m.name)]
    if args.quick:
        models = [Model(m.name, m.batch, m.sizes, BLOCK, BLOCK * 2) for m in models]
    print(f"python {sys.version.split()[0]}, emberlink bench/gpu_step.py {' '.join(sys.argv[1:])}")
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "client.key"
        Identity.generate(os.urandom).save(key)
        # A worker process for every remote row, as a user's loop has one to itself: a worker
        # applies captured replays on its event loop only while it serves a single session.
        envs = [{INLINE_ENV: "1"}] * (2 * len(REMOTE_CASES)) + [{INLINE_ENV: "0"}] * len(DEVICE_THREAD_CASES)
        with cuda_workers(key, args.device, envs) as tickets:
            results = {m.name: run_model(m, args, key, tickets) for m in models}
    if "small" in results and "big" in results:
        goals(results["small"], results["big"])


if __name__ == "__main__":
    main()
