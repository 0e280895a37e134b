"""The MLP training step on a GPU: Device.cuda(0), a `--device cuda:0` worker on loopback, and the CPU.

Run on a CUDA machine (it needs CuPy):

    python bench/gpu_step.py [--steps 200]

Rows (medians over the timed steps, after warm-up): the step of bench/local_step.py (batch 128,
784-512-512-10, float32, SGD) on Device.cuda(0) in this process; the same step on Device.remote()
against an `emberlink worker --device cuda:0` process on 127.0.0.1 (handshake, sealing, gRPC and
the worker's device thread included); and on Device.cpu(). The losses of all three are checked to
agree, so the table compares the same math.
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
from emberlink.protocol.identity import Identity


@contextmanager
def cuda_worker(client_key: Path, device: str) -> Iterator[str]:
    """An `emberlink worker --device DEVICE` process admitting the client key; yields its ticket."""
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
    with local() as dev:
        rows.append((f"Device {args.device}, in process", *step_ms(dev, args.steps)))
    with tempfile.TemporaryDirectory() as tmp:
        client_key = Path(tmp) / "client.key"
        Identity.generate(os.urandom).save(client_key)
        with (
            cuda_worker(client_key, args.device) as ticket,
            el.Device.remote(ticket, key=str(client_key)) as dev,
        ):
            ms, losses = step_ms(dev, args.steps)
            stats = dev.stats()
            rows.append((f"Device.remote(worker --device {args.device}), loopback gRPC", ms, losses))
    with el.Device.cpu() as dev:
        rows.append(("Device.cpu() (NumPy)", *step_ms(dev, max(20, args.steps // 4))))

    ref = rows[0][2]
    print("| MLP step (batch 128, 784-512-512-10, SGD) | median ms | vs in process | losses agree |")
    print("|---|---:|---:|---|")
    for name, ms, losses in rows:
        agree = np.allclose(losses, ref, rtol=1e-3, atol=1e-4)
        print(f"| {name} | {ms:.3f} | {ms / rows[0][1]:.2f}x | {'yes' if agree else 'NO'} |")
    print(
        f"\nremote: {stats['bytes_sent'] / max(1, stats['round_trips']):.0f} bytes sent per round trip, "
        f"graphs registered {stats['graphs_registered']}, replays {stats['graph_replays']}"
    )


if __name__ == "__main__":
    main()
