"""A CNN training step's worker peak memory: buffers freed after their last use (and reused)
against keeping every intermediate of the step.

    .venv/bin/python bench/cnn_memory.py                    # NumPy worker (cpu)
    python3 bench/cnn_memory.py --device cuda:0             # CuPy worker: eager, and captured

The step: a batch of 64 1x28x28 float32 images (uploaded every step) through
Conv2d(1, 16, 3, padding=1)-ReLU-MaxPool2d(2)-Conv2d(16, 32, 3, padding=1)-ReLU-MaxPool2d(2)-
Flatten-Linear(1568, 10), cross-entropy, backward, SGD with momentum: one graph, replayed.

Each variant is a real worker in this process (emberlink.testing, memory transport), one session,
the same model from the same seed. Its backend runs every plan either as compiled (each
intermediate freed right after its last use, elementwise results written into dying buffers) or
compiled with `keep_intermediates=True` (no frees, no reuse inside a run). Peak = the worker's
`peak_bytes` over the timed steps, after a reset at their start (so the model, its optimizer
state and the last step's outputs are in it, as they are on a worker). NumPy's figure counts
every live array exactly (graph_replay/memory.py); CuPy's is its memory pool's bytes in use,
sampled after every step of a run. On cuda the captured rows replay each plan as one CUDA graph
whose intermediates live in an arena laid out by the same liveness (keep all: by none).

Goal: freed/keep all <= 0.5. The losses of every variant must agree (they run the same math).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import emberlink as el
import emberlink.testing
from emberlink import nn
from emberlink.client.remote import RemoteExecutor
from emberlink.graph_replay.captured import CAPTURE_ENV
from emberlink.graph_replay.plan import Plan, derive_plan

F = nn.functional
GOAL = 0.5


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, seed=0),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, seed=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 10, seed=2),
    )


def keep_all(backend: Any) -> Any:
    """`backend` running every plan without frees or reuse (NumPy has this built in; CuPy gets
    the same `plan_for` here, fused as it fuses, so only the freeing differs)."""
    fusion = backend if getattr(backend, "fuse", False) else None
    variants: dict[int, tuple[Plan, Plan]] = {}

    def plan_for(plan: Plan) -> Plan:
        kept = variants.get(id(plan))
        if kept is None or kept[0] is not plan:
            kept = (plan, derive_plan(plan, keep_intermediates=True, reuse=False, fusion=fusion))
            variants[id(plan)] = kept
        return kept[1]

    backend.plan_for = plan_for
    return backend


def make_backend(device: str, keep: bool) -> Any:
    if device == "cpu":
        from emberlink.graph_replay.numpy_backend import NumpyBackend

        return NumpyBackend(keep_intermediates=keep)
    from emberlink.graph_replay.cupy_backend import CupyBackend

    backend = CupyBackend(int(device.partition(":")[2] or 0))
    return keep_all(backend) if keep else backend


def measure(
    device: str, keep: bool, capture: bool, batches: list[tuple[np.ndarray, np.ndarray]], steps: int
) -> dict[str, Any]:
    """Peak and in-use bytes of one worker over `steps` timed steps, and every step's loss."""
    os.environ[CAPTURE_ENV] = "1" if capture else "0"
    backend = make_backend(device, keep)
    with emberlink.testing.worker(device=device, backend=backend) as w:
        dev = w.device()
        net = model().to(dev)
        opt = el.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        losses: list[float] = []

        def step(x: np.ndarray, y: np.ndarray) -> None:
            loss = F.cross_entropy(net(dev.tensor(x)), dev.tensor(y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))

        for x, y in batches[:3]:  # compile, first eager run, capture
            step(x, y)
        w.worker.device.submit(backend.reset_peak).result()
        for i in range(steps):
            step(*batches[(3 + i) % len(batches)])
        executor = dev._executor
        assert isinstance(executor, RemoteExecutor)
        stats = executor.worker_stats()
        dev.close()
    return {
        "peak": int(stats["peak_bytes"]),
        "losses": losses,
        "captured": int(stats["session_captured_replays"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N (default: cpu)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((args.batch, 1, 28, 28)).astype("float32"), rng.integers(0, 10, args.batch))
        for _ in range(4)
    ]
    modes: list[tuple[str, bool]] = [("eager", False)]
    if args.device != "cpu":
        modes.append(("captured", True))
    rows: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    for name, capture in modes:
        freed = measure(args.device, False, capture, batches, args.steps)
        kept = measure(args.device, True, capture, batches, args.steps)
        rows.append((name, freed, kept))
    first = rows[0][1]["losses"]
    for name, freed, kept in rows:
        for run in (freed, kept):
            worst = max(abs(a - b) for a, b in zip(run["losses"], first, strict=True))
            if worst > 1e-4:
                raise SystemExit(f"{name}: the variants disagree on the losses by {worst}")

    def mib(n: int) -> str:
        return f"{n / 2**20:.2f}"

    print(
        f"CNN training step on {args.device}: batch {args.batch} of 1x28x28 float32, conv16-relu-pool-"
        f"conv32-relu-pool-linear10, cross-entropy, SGD momentum; worker peak over {args.steps} steps"
    )
    print()
    print(
        "| plans run | freed after last use + reuse, MiB | keep every intermediate, MiB | ratio | goal | met |"
    )
    print("|---|---:|---:|---:|---|---|")
    for name, freed, kept in rows:
        if name == "captured" and not (freed["captured"] and kept["captured"]):
            print(f"| {name} | (no captured replays: nvmath-python missing or capture refused) | | | | |")
            continue
        ratio = freed["peak"] / kept["peak"]
        met = "yes" if ratio <= GOAL else "**no**"
        print(f"| {name} | {mib(freed['peak'])} | {mib(kept['peak'])} | {ratio:.3f} | <= {GOAL} | {met} |")


if __name__ == "__main__":
    main()
