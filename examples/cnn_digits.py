"""Train a small CNN on handwritten digits with emberlink, on this machine or on a remote GPU.

    python examples/cnn_digits.py                          # this machine's CPU
    python examples/cnn_digits.py --device cuda:0          # this machine's GPU (needs CuPy)
    python examples/cnn_digits.py --device 'emberlink://<node-id>@gpu-box:7443'   # a worker

scikit-learn's 8x8 digits (1797 images, shipped with the package, no download): 80% to train,
20% to test. The images stay on the device (`DataLoader(resident=True)`: uploaded once as uint8,
each batch gathered there by index), so a step sends only a batch's indices and its scalars.
Conv2d-BatchNorm2d-ReLU twice, a 2x2 max pool, then a linear head; Adam. Each step records
forward, backward, the batch-norm statistics and the optimizer update as one graph.
"""

from __future__ import annotations

import argparse
import time

import digits
import numpy as np
from devices import add_device_argument, open_device

import emberlink as el
from emberlink import nn

F = nn.functional


def load_data() -> digits.Split:
    """Train and test images (N, 1, 8, 8) as uint8 in 0..16, and their labels."""
    x, y = digits.load_digits()
    return digits.split(x[:, None], y)


def make_model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1, seed=0),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, seed=1),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(),
        nn.Linear(2 * width * 16, 10, seed=2),
    )


def pixels(x: el.Tensor) -> el.Tensor:
    """uint8 pixels 0..16 as float32 in [0, 1], on the device."""
    return x.astype("float32") * (1.0 / 16.0)


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a CNN on digits with emberlink.")
    add_device_argument(parser)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv layer")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    x_train, y_train, x_test, y_test = load_data()
    with open_device(args.device) as dev:
        model = make_model(args.width).to(dev)
        opt = el.optim.Adam(model.parameters(), lr=args.lr)
        train = el.data.DataLoader(
            [x_train, y_train], args.batch, shuffle=True, device=dev, resident=True, seed=0, drop_last=True
        )
        test_x = pixels(dev.tensor(x_test))
        print(
            f"training on {dev}: {len(x_train)} images, {sum(p.size for p in model.parameters())} parameters"
        )

        start = time.perf_counter()
        accuracy = 0.0
        for epoch in range(1, args.epochs + 1):
            model.train()
            losses = []
            for xb, yb in train:
                loss = F.cross_entropy(model(pixels(xb)), yb)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.read_async())  # no wait: read them all at the epoch's end
            model.eval()
            with el.no_grad():
                predicted = model(test_x).argmax(axis=1).numpy()
            accuracy = float((predicted == y_test).mean())
            mean_loss = float(np.mean([f.item() for f in losses]))
            print(f"epoch {epoch:2d}  loss {mean_loss:.4f}  test accuracy {accuracy:.3f}")

        stats = dev.stats()
        print(
            f"{time.perf_counter() - start:.1f} s; graphs built {stats['graphs_built']}, "
            f"reused {stats['graph_memo_hits']} times"
        )
        print(f"final test accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
