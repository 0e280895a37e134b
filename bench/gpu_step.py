"""The MLP training step on a GPU: Device.cuda(0) and a `--device cuda:0` worker, eager and captured.

Run on a CUDA machine (it needs CuPy; nvmath-python for the captured rows):

    python bench/gpu_step.py [--steps 200]

Rows (medians over the timed steps, after warm-up): the step of bench/local_step.py (batch 128,
784-512-512-10, float32, SGD, the loss read every step, the batch from host memory) in PyTorch
eager when `torch` imports; on Device.cuda(0) in this process with every plan run eagerly
(`EMBERLINK_CAPTURE=0`) and with plans replayed as captured CUDA graphs; the same two on
Device.remote() against an `emberlink worker --device cuda:0` process on 127.0.0.1 (handshake,
sealing, gRPC and the worker's device thread included); and Device.cpu(). The losses of every row
are checked to agree with the first emberlink row, so the table compares the same math.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import local_step

import emberlink as el
from emberlink.graph_replay.captured import CAPTURE_ENV
from emberlink.protocol.identity import Identity


@contextmanager
def capture(on: bool) -> Iterator[None]:
    """Devices and workers made inside replay captured graphs (`on`) or run every plan eagerly."""
    old = os.environ.get(CAPTURE_ENV)
    os.environ[CAPTURE_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[CAPTURE_ENV]
        else:
            os.environ[CAPTURE_ENV] = old


@contextmanager
def cuda_worker(client_key: Path, device: str) -> Iterator[str]:
    """An `emberlink worker --device DEVICE` process admitting the client key; yields its ticket.
    It inherits this process's environment, `EMBERLINK_CAPTURE` included."""
    client = Identity.load(client_key)
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "worker.key"
        Identity.generate(os.urandom).save(key)
        allow = Path(tmp) / "allow"
        allow.write_text(client.node_id + "\n")
        cmd = [sys.executable, "-m", "emberlink", "worker", "--listen", "127.0.0.1:0", "--key", str(key)]
        cmd += ["--allow", str(allow), "--device", device]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            ticket = proc.stdout.readline().strip()
            if not ticket.startswith("emberlink://"):
                raise SystemExit(f"the worker did not start (exit {proc.wait(30)})")
            yield ticket
        finally:
            proc.terminate()
            proc.wait(30)


def step_ms(dev: el.Device, steps: int) -> tuple[float, list[float]]:
    model = local_step.EmberlinkMLP(dev)
    batches = local_step._batches(4)
    losses = [model.step(*batches[i]) for i in range(4)]  # the first steps of a fresh model: comparable
    local_step._time(model.step, batches, 6, [])
    times: list[float] = []
    local_step._time(model.step, batches, steps, times)
    return statistics.median(times) * 1e3, losses


def torch_step_ms(steps: int) -> tuple[float, list[float]] | str:
    """The same step in PyTorch eager on cuda:0 (same weights, batches copied from host memory),
    or why there is no such row."""
    try:
        import torch
    except ImportError as e:
        return f"torch does not import here ({e})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    with el.Device.cpu() as cpu:
        start = local_step.EmberlinkMLP(cpu).params()  # the weights every emberlink row starts from
    params = [torch.tensor(p, device="cuda", requires_grad=True) for p in start]

    def step(x: np.ndarray, y: np.ndarray) -> float:
        w1, b1, w2, b2, w3, b3 = params
        xb, yb = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()
        h = torch.relu(xb @ w1 + b1)
        h = torch.relu(h @ w2 + b2)
        loss = torch.nn.functional.cross_entropy(h @ w3 + b3, yb)
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= local_step.LR * p.grad
                p.grad = None
        return float(loss)

    batches = local_step._batches(4)
    losses = [step(*batches[i]) for i in range(4)]
    local_step._time(step, batches, 6, [])
    times: list[float] = []
    local_step._time(step, batches, steps, times)
    return statistics.median(times) * 1e3, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu to try the script without a GPU")
    args = parser.parse_args()
    local = (
        el.Device.cpu
        if args.device == "cpu"
        else lambda: el.Device.cuda(int(args.device.partition(":")[2] or 0))
    )

    rows: list[tuple[str, float, list[float]]] = []
    notes: list[str] = []
    ref_torch = torch_step_ms(args.steps)
    if isinstance(ref_torch, str):
        notes.append(f"no PyTorch row: {ref_torch}")
    else:
        rows.append(("PyTorch eager, cuda:0", *ref_torch))
    for on in (False, True):
        with capture(on), local() as dev:
            ms, losses = step_ms(dev, args.steps)
            replays = dev.stats().get("captured_replays", 0)
        rows.append((f"Device {args.device}, in process, {'captured' if on else 'eager'}", ms, losses))
        notes.append(f"Device {args.device} {'captured' if on else 'eager'}: {replays} captured replays")
    with tempfile.TemporaryDirectory() as tmp:
        client_key = Path(tmp) / "client.key"
        Identity.generate(os.urandom).save(client_key)
        for on in (False, True):
            with (
                capture(on),
                cuda_worker(client_key, args.device) as ticket,
                el.Device.remote(ticket, key=str(client_key)) as dev,
            ):
                ms, losses = step_ms(dev, args.steps)
                stats = dev.stats()
                worker = dev._executor.worker_stats()  # type: ignore[attr-defined]
            kind = "captured" if on else "eager"
            rows.append((f"Device.remote(worker --device {args.device}), loopback gRPC, {kind}", ms, losses))
            notes.append(
                f"remote {kind}: {int(stats['bytes_sent']) / max(1, int(stats['round_trips'])):.0f} bytes sent per round "
                f"trip, graphs registered {stats['graphs_registered']}, replays {stats['graph_replays']}, "
                f"captured replays on the worker {worker.get('session_captured_replays', 0)}"
            )
    with el.Device.cpu() as dev:
        rows.append(("Device.cpu() (NumPy)", *step_ms(dev, max(20, args.steps // 4))))

    base = rows[0][1]
    ref = next(losses for name, _, losses in rows if name.startswith("Device"))
    print(f"| MLP step (batch 128, 784-512-512-10, SGD) | median ms | vs {rows[0][0]} | losses agree |")
    print("|---|---:|---:|---|")
    for name, ms, losses in rows:
        agree = np.allclose(losses, ref, rtol=1e-3, atol=1e-4)
        print(f"| {name} | {ms:.3f} | {ms / base:.2f}x | {'yes' if agree else 'NO'} |")
    print()
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
