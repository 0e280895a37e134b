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

import numpy as np

import emberlink as el
from emberlink import nn

F = nn.functional


def open_device(spec: str) -> el.Device:
    """`cpu`, `cuda` or `cuda:N`, or a worker's ticket / a `nats://` relay address."""
    if spec == "cpu":
        return el.Device.cpu()
    if spec.startswith("cuda"):
        return el.Device.cuda(int(spec.partition(":")[2] or 0))
    return el.Device.remote(spec)


def load_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Train and test images (N, 1, 8, 8) as uint8 in 0..16, and their labels."""
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        raise SystemExit("this example needs scikit-learn: pip install scikit-learn") from None
    data = sk_digits()
    x, y = data.images.astype(np.uint8)[:, None], data.target.astype(np.int64)
    order = np.random.default_rng(1).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


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
    parser.add_argument("--device", default="cpu", help="cpu, cuda:N, or a worker ticket (default: cpu)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv layer")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    x_train, y_train, x_test, y_test = load_digits()
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
