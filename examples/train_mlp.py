"""Train a small MLP on handwritten digits with emberlink, on this machine or on a remote GPU.

    python examples/train_mlp.py                          # this machine's CPU
    python examples/train_mlp.py --device cuda:0          # this machine's GPU (needs CuPy)
    python examples/train_mlp.py --device 'emberlink://<node-id>@gpu-box:7443'   # a worker

The same code runs everywhere: only the Device changes. Each step records forward, backward and
the optimizer update as one graph; after the first step only new batches and bindings travel,
and `float(loss)` is the one read (the one round trip on a remote device).
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import digits
import numpy as np
from devices import add_device_argument, open_device

import emberlink as el
from emberlink import nn

F = nn.functional


def load_data() -> digits.Split:
    """scikit-learn's 8x8 digits (1797 images, 10 classes), flattened and scaled to [0, 1]; synthetic
    (random, so in no particular order) if scikit-learn is missing."""
    if importlib.util.find_spec("sklearn") is not None:
        images, y = digits.load_digits()
        x = images.reshape(len(images), -1) / 16.0
    else:
        rng = np.random.default_rng(0)
        centers = rng.uniform(0, 1, (10, 64))
        y = rng.integers(0, 10, 1800)
        x = np.clip(centers[y] + rng.normal(0, 0.15, (1800, 64)), 0, 1)
    return digits.split(x.astype("float32"), y.astype("int64"))


def main() -> None:
    parser = argparse.ArgumentParser(description="Train an MLP on digits with emberlink.")
    add_device_argument(parser)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    x_train, y_train, x_test, y_test = load_data()
    with open_device(args.device) as dev:
        model = nn.Sequential(
            nn.Linear(64, 128, seed=0),
            nn.ReLU(),
            nn.Dropout(0.1, seed=0),
            nn.Linear(128, 10, seed=1),
        ).to(dev)
        opt = el.optim.Adam(model.parameters(), lr=args.lr)
        print(
            f"training on {dev}: {len(x_train)} images, {sum(p.size for p in model.parameters())} parameters"
        )

        start = time.perf_counter()
        for epoch in range(1, args.epochs + 1):
            model.train()
            order = np.random.default_rng(epoch).permutation(len(x_train))
            total = 0.0
            batches = len(order) // args.batch  # whole batches only: one graph for every step
            for i in range(batches):
                idx = order[i * args.batch : (i + 1) * args.batch]
                loss = F.cross_entropy(model(dev.tensor(x_train[idx])), dev.tensor(y_train[idx]))
                loss.backward()
                opt.step()
                opt.zero_grad()
                total += float(loss)
            model.eval()
            with el.no_grad():
                predicted = model(dev.tensor(x_test)).argmax(axis=1).numpy()
            accuracy = (predicted == y_test).mean()
            print(f"epoch {epoch:2d}  loss {total / batches:.4f}  test accuracy {accuracy:.3f}")

        stats = dev.stats()
        print(
            f"{time.perf_counter() - start:.1f} s; graphs built {stats['graphs_built']}, "
            f"reused {stats['graph_memo_hits']} times"
        )


if __name__ == "__main__":
    main()
