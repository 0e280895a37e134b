"""`emberlink demo`: a worker and a client in this process, training a digits classifier through it.

Everything a real deployment has is here, on loopback: fresh key pairs in a temporary folder, an
allow file naming the client, a gRPC listener on a free port, the ticket, and `Device.remote`.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

import numpy as np

from emberlink.protocol.identity import AllowPolicy, Identity
from emberlink.server.background import BackgroundWorker
from emberlink.transport.malloc import tune_malloc

EPOCHS = 30
BATCH = 64
HIDDEN = 128
LR = 0.1


def load_digits_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits (shipped with it, no download), scaled to [0, 1], split 80/20."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise SystemExit("emberlink demo needs scikit-learn: pip install 'emberlink[demo]'") from e
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(len(x) * 0.8)
    return x[:cut], y[:cut], x[cut:], y[cut:]


def run_demo(*, epochs: int = EPOCHS, out: TextIO | None = None) -> dict[str, float]:
    """Train through an in-process worker; returns accuracy, median step seconds and bytes sent per step."""
    import emberlink as el

    stream = out if out is not None else sys.stdout
    tune_malloc()
    x_train, y_train, x_test, y_test = load_digits_split()
    with tempfile.TemporaryDirectory(prefix="emberlink-demo-") as tmp:
        worker_id = Identity.generate(os.urandom)
        client_id = Identity.generate(os.urandom)
        client_key = Path(tmp) / "client.key"
        client_id.save(client_key)
        allow_file = Path(tmp) / "allow"
        allow_file.write_text(f"# the demo client\n{client_id.node_id}\n")
        with BackgroundWorker(worker_id, AllowPolicy.from_file(allow_file), device="cpu") as worker:
            print(f"worker ticket: {worker.ticket}", file=stream)
            print(f"client NodeId: {client_id.node_id} (on the worker's allow list)", file=stream)
            with el.Device.remote(worker.ticket, key=str(client_key)) as dev:
                result = _train(el, dev, x_train, y_train, x_test, y_test, epochs)
    print(f"test accuracy: {result['accuracy']:.3f}", file=stream)
    print(f"median step time: {result['step_s'] * 1e3:.2f} ms", file=stream)
    print(f"bytes sent per step: {result['bytes_per_step']:.0f}", file=stream)
    return result


def _train(
    el: object,
    dev: object,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    epochs: int,
) -> dict[str, float]:
    from tqdm import tqdm

    nn = el.nn  # type: ignore[attr-defined]
    model = nn.Sequential(nn.Linear(64, HIDDEN, seed=1), nn.ReLU(), nn.Linear(HIDDEN, 10, seed=2)).to(dev)
    opt = el.optim.SGD(model.parameters(), lr=LR)  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    steps_per_epoch = len(x_train) // BATCH
    times: list[float] = []
    sent: list[int] = []
    bar = tqdm(total=epochs * steps_per_epoch, desc="training", unit="step")
    for _ in range(epochs):
        order = rng.permutation(len(x_train))
        for i in range(steps_per_epoch):
            idx = order[i * BATCH : (i + 1) * BATCH]
            before = dev.stats()["bytes_sent"]  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            logits = model(dev.tensor(x_train[idx]))  # type: ignore[attr-defined]
            loss = nn.functional.cross_entropy(logits, dev.tensor(y_train[idx]))  # type: ignore[attr-defined]
            loss.backward()
            opt.step()
            opt.zero_grad()
            value = float(loss)
            times.append(time.perf_counter() - t0)
            sent.append(int(dev.stats()["bytes_sent"]) - int(before))  # type: ignore[attr-defined]
            bar.set_postfix(loss=f"{value:.3f}", refresh=False)
            bar.update()
    bar.close()
    with el.no_grad():  # type: ignore[attr-defined]
        predicted = model(dev.tensor(x_test)).argmax(axis=1).numpy()  # type: ignore[attr-defined]
    return {
        "accuracy": float((predicted == y_test).mean()),
        "step_s": statistics.median(times),
        "bytes_per_step": statistics.median(sent),
        "final_loss": value,
    }
