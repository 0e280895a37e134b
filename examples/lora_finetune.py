"""Train an MLP on digits 0-4, then LoRA-fine-tune it on digits 5-9, here or on a remote GPU.

    python examples/lora_finetune.py                          # this machine's CPU
    python examples/lora_finetune.py --quantize int8          # QLoRA: frozen weights stored as int8
    python examples/lora_finetune.py --device 'emberlink://<node-id>@gpu-box:7443'   # a worker

Task A trains every weight of a small MLP to tell scikit-learn's 8x8 digits 0-4 apart. Task B, on
the same 5-way head, tells 5-9 apart (5 is class 0, ..., 9 is class 4); it trains only rank-8
LoRA adapters (`nn.add_lora`), the base weights frozen and resident on the device: a
fine-tuning step sends the batch (uint8 pixels, cast to float32 on the device) and a few hundred
bytes of step scalars, never a weight. The script prints both tasks' test accuracy before and
after, the bytes per fine-tuning step, and checks that `nn.merge_lora` (plain Linear layers again,
for export) gives the same predictions.
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
HIDDEN = 512


def load_tasks() -> tuple[digits.Split, digits.Split]:
    """Digits 0-4 and digits 5-9, both labelled 0-4 (one 5-way head serves both tasks):
    (x_train, y_train, x_test, y_test) each, pixels as uint8 0..16."""
    x, y = digits.load_digits()
    x = x.reshape(len(x), -1)
    tasks = []
    for labels in (range(5), range(5, 10)):
        keep = np.isin(y, labels)
        tasks.append(digits.split(x[keep], y[keep] - labels[0], 0.75))
    return tasks[0], tasks[1]


def pixels(dev: el.Device, x: np.ndarray) -> el.Tensor:
    """uint8 pixels travel as bytes and become float32 in [0, 1] on the device."""
    return dev.tensor(x).astype("float32") / 16.0


def accuracy(model: nn.Module, dev: el.Device, x: np.ndarray, y: np.ndarray) -> float:
    model.eval()
    with el.no_grad():
        predicted = model(pixels(dev, x)).argmax(axis=1).numpy()
    model.train()
    return float((predicted == y).mean())


def train(
    model: nn.Module, dev: el.Device, x: np.ndarray, y: np.ndarray, epochs: int, lr: float, batch: int
) -> list[int]:
    """Adam over `model.parameters()` (frozen ones are skipped); the bytes each step sent."""
    opt = el.optim.Adam(model.parameters(), lr=lr)
    sent = []
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(len(x))
        for i in range(len(order) // batch):  # whole batches only: one graph for every step
            idx = order[i * batch : (i + 1) * batch]
            before = int(dev.stats()["bytes_sent"])
            loss = F.cross_entropy(model(pixels(dev, x[idx])), dev.tensor(y[idx]))
            loss.backward()
            opt.step()
            opt.zero_grad()
            float(loss)
            sent.append(int(dev.stats()["bytes_sent"]) - before)
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description="LoRA fine-tuning of a digits MLP with emberlink.")
    add_device_argument(parser)
    parser.add_argument("--quantize", choices=("none", "int8"), default="none", help="int8: QLoRA")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    (xa, ya, xa_test, ya_test), (xb, yb, xb_test, yb_test) = load_tasks()
    start = time.perf_counter()
    with open_device(args.device) as dev:
        model = nn.Sequential(
            nn.Linear(64, HIDDEN, seed=0),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN, seed=1),
            nn.ReLU(),
            nn.Linear(HIDDEN, 5, seed=2),
        ).to(dev)
        weight_bytes = sum(4 * p.size for name, p in model.named_parameters() if name.endswith("weight"))
        n_params = sum(p.size for p in model.parameters())
        train(model, dev, xa, ya, args.epochs, 3e-3, args.batch)
        acc_a = accuracy(model, dev, xa_test, ya_test)
        acc_b_before = accuracy(model, dev, xb_test, yb_test)
        print(f"task A (digits 0-4), all {n_params:,} parameters trained on {dev}: accuracy {acc_a:.3f}")
        print(f"task B (digits 5-9) before fine-tuning: accuracy {acc_b_before:.3f}")

        quantize = None if args.quantize == "none" else args.quantize
        nn.add_lora(model, rank=args.rank, alpha=2.0 * args.rank, quantize=quantize)
        trainable = sum(p.size for p in model.parameters() if p.requires_grad)
        sent = train(model, dev, xb, yb, args.epochs, 1e-2, args.batch)
        acc_b = accuracy(model, dev, xb_test, yb_test)
        label = "QLoRA int8" if quantize else "LoRA"
        print(
            f"task B after {label} rank {args.rank} ({trainable:,} trainable parameters, "
            f"{trainable / n_params:.1%}): accuracy {acc_b:.3f}"
        )
        steady = sent[2:] or sent
        batch_bytes = args.batch * (64 + 8)  # uint8 pixels and int64 labels
        if dev.stats()["bytes_sent"]:
            print(
                f"bytes sent per fine-tuning step after the first two: {np.mean(steady):,.0f} "
                f"(the batch is {batch_bytes:,} bytes; the base weights {weight_bytes:,} as float32)"
            )
        else:
            print("bytes sent per fine-tuning step: none, this device is local (pass a worker's ticket)")

        with el.no_grad():
            adapted = model(pixels(dev, xb_test)).argmax(axis=1).numpy()
        nn.merge_lora(model)
        with el.no_grad():
            merged = model(pixels(dev, xb_test)).argmax(axis=1).numpy()
        print(f"merge_lora: plain Linear layers again, same predictions: {bool((adapted == merged).all())}")
    print(f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
