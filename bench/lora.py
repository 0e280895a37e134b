"""Fine-tuning through a worker: full fine-tuning against LoRA and int8 QLoRA, bytes and memory per step.

    .venv/bin/python bench/lora.py [--steps 20] [--device cpu|cuda:0]

A "pretrained" MLP (784-1024-1024-10, float32, ReLU; batch 64, cross-entropy, Adam) is fine-tuned
on `Device.remote(ticket)` over loopback gRPC, three ways, each against a fresh in-process worker
(one session each, so no figure mixes two):

- full: every parameter trains (gradients and Adam state for all of it).
- LoRA: `nn.add_lora(model, rank=8, alpha=16)`: every Linear wrapped, base weights frozen.
- QLoRA: the same with `quantize="int8"`: frozen weights quantized on the host before the upload
  (the flow of loading a checkpoint, quantizing, uploading), stored as int8 with per-channel scales.

Bytes are what the client handed to the transport (sealed frames). Worker memory is the worker's
`dev.memory_stats()`: exact live arrays on the NumPy backend (graph_replay/memory.py), the memory
pool's use on CuPy. "Base weights" = the model's resident bytes after the upload, less its biases
and adapters (the weight matrices alone); "peak" is over the timed steps, after a reset at their
start. The weights' values do not change any figure.

Goals (issue 14): after the first step a LoRA step sends no base weights (its bytes per step
besides the batch are under 1% of the base weights' bytes); QLoRA's base weights take at most 0.3x
their float32 bytes on the worker.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import emberlink as el
from emberlink import nn
from emberlink.protocol.identity import AllowPolicy, Identity
from emberlink.server.background import BackgroundWorker

SIZES = (784, 1024, 1024, 10)
BATCH = 64
RANK, ALPHA = 8, 16.0
GOAL_SENT = 0.01
GOAL_QLORA = 0.3
MODES = ("full", "LoRA", "QLoRA int8")


def build(mode: str) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
        layers += [nn.Linear(a, b, seed=i), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    if mode != "full":
        nn.add_lora(model, rank=RANK, alpha=ALPHA, quantize="int8" if mode == "QLoRA int8" else None)
    return model


def nbytes(params: list[nn.Parameter]) -> int:
    return sum(p.size * np.dtype(p.dtype).itemsize for p in params)


class Run:
    """One mode against its own fresh worker: set up (upload, first two steps), then timed steps."""

    def __init__(self, mode: str, device: str, client: Identity, key: Path) -> None:
        rng = np.random.default_rng(0)
        self.batches = [
            (rng.standard_normal((BATCH, SIZES[0]), dtype=np.float32), rng.integers(0, SIZES[-1], BATCH))
            for _ in range(4)
        ]
        self.mode = mode
        self.per_step: list[int] = []
        self.times: list[float] = []
        self.worker = BackgroundWorker(allow=AllowPolicy.of([client.node_id]), device=device)
        self.dev = el.Device.remote(self.worker.ticket, key=str(key))
        self.model = build(mode)
        params = self.model.parameters()
        self.trainable = sum(p.size for p in params if p.requires_grad)
        self.model.to(self.dev)
        self.dev.sync()
        self.upload = int(self.dev.stats()["bytes_sent"])
        named = list(self.model.named_parameters())
        biases = [p for name, p in named if name.endswith("bias")]
        adapters = [p for name, p in named if "lora_" in name]
        self.base_weights = self.dev.memory_stats()["in_use_bytes"] - nbytes(biases) - nbytes(adapters)
        self.opt = el.optim.Adam(params, lr=1e-3)
        self.first_step = self.step(0)
        self.step(1)  # Adam's steady-state graph (its state exists now) is registered here
        gc.collect()
        self.dev.sync()
        backend = self.worker.worker.device.backend
        self.worker.worker.device.submit(backend.reset_peak).result()
        self.registered = int(self.dev.stats()["graphs_registered"])

    def step(self, k: int) -> int:
        """One fine-tuning step; the bytes it sent."""
        x, y = self.batches[k % len(self.batches)]
        before = int(self.dev.stats()["bytes_sent"])
        loss = nn.functional.cross_entropy(self.model(self.dev.tensor(x)), self.dev.tensor(y))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        float(loss)
        return int(self.dev.stats()["bytes_sent"]) - before

    def timed(self, k: int) -> None:
        t0 = time.perf_counter()
        self.per_step.append(self.step(k))
        self.times.append(time.perf_counter() - t0)

    def finish(self) -> None:
        self.new_graphs = int(self.dev.stats()["graphs_registered"]) - self.registered
        gc.collect()
        self.dev.sync()
        stats = self.dev.memory_stats()
        self.after, self.peak = stats["in_use_bytes"], stats["peak_bytes"]
        self.dev.close()
        self.worker.stop()


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu", help="the worker's device: cpu or cuda:N")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    client = Identity.generate(os.urandom)
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "client.key"
        client.save(key)
        order = [Run(mode, args.device, client, key) for mode in MODES]
        for k in range(args.steps):  # interleaved, so the machine's load hits every mode alike
            for run in order:
                run.timed(k)
        for run in order:
            run.finish()
    full, lora, qlora = order
    batch_bytes = BATCH * SIZES[0] * 4 + BATCH * 8
    f32_weights = full.base_weights

    def row(name: str, fmt: Callable[[float], str], values: list[float]) -> None:
        cells = [fmt(v) for v in values]
        ratios = [f"{v / values[0]:.3f}" if values[0] else "" for v in values[1:]]
        print(f"| {name} | {' | '.join(cells)} | {' | '.join(ratios)} |")

    print(
        f"Fine-tuning an MLP {'-'.join(map(str, SIZES))} (float32, batch {BATCH}, Adam) through a worker on "
        f"{args.device}, loopback gRPC; LoRA rank {RANK}, alpha {ALPHA:g}; {args.steps} timed steps a mode"
    )
    print()
    print("| per fine-tuning step | full | LoRA | QLoRA int8 | LoRA / full | QLoRA / full |")
    print("|---|---:|---:|---:|---:|---:|")
    row("trainable parameters", lambda v: f"{v:,.0f}", [r.trainable for r in order])
    row("model upload, once (bytes sent)", lambda v: f"{v:,.0f}", [r.upload for r in order])
    row("base weights on the worker", mib, [r.base_weights for r in order])
    row("bytes sent, first step", lambda v: f"{v:,.0f}", [r.first_step for r in order])
    row("bytes sent per step after it", lambda v: f"{v:,.0f}", [statistics.mean(r.per_step) for r in order])
    row(
        "of which not the batch",
        lambda v: f"{v:,.0f}",
        [statistics.mean(r.per_step) - batch_bytes for r in order],
    )
    row("worker memory after the steps", mib, [r.after for r in order])
    row("worker peak during the steps", mib, [r.peak for r in order])
    row("step time (median)", lambda v: f"{v * 1e3:.1f} ms", [statistics.median(r.times) for r in order])
    print()
    sent = (max(max(lora.per_step), max(qlora.per_step)) - batch_bytes) / f32_weights
    q = qlora.base_weights / f32_weights
    new_graphs = sum(r.new_graphs for r in order)
    print(f"The batch is {batch_bytes:,} bytes; the float32 base weights {f32_weights:,} bytes.")
    print(f"Graphs registered during the timed steps: {new_graphs} (every timed step replayed one graph).")
    print()
    print("| goal | measured | met |")
    print("|---|---:|---|")
    print(
        f"| a (Q)LoRA step after the first sends no base weights: its bytes besides the batch < "
        f"{GOAL_SENT:.0%} of theirs | {sent:.5f}x | {'yes' if sent < GOAL_SENT else '**no**'} |"
    )
    print(
        f"| QLoRA base weights on the worker <= {GOAL_QLORA}x float32 | {q:.3f}x | "
        f"{'yes' if q <= GOAL_QLORA else '**no**'} |"
    )


if __name__ == "__main__":
    main()
