"""The small training run every relay test compares against Device.cpu(); plain code, no pytest, so
client subprocesses import it too."""

from __future__ import annotations

import numpy as np

import emberlink as el

FEATURES, HIDDEN, CLASSES, BATCH = 8, 16, 3, 32


def batches(steps: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (
            rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
            rng.integers(0, CLASSES, BATCH).astype(np.int64),
        )
        for _ in range(steps)
    ]


def make_model(dev: el.Device) -> tuple[el.nn.Module, el.optim.Adam]:
    model = el.nn.Sequential(
        el.nn.Linear(FEATURES, HIDDEN, seed=1), el.nn.ReLU(), el.nn.Linear(HIDDEN, CLASSES, seed=2)
    ).to(dev)
    return model, el.optim.Adam(model.parameters(), lr=1e-2)


def step(dev: el.Device, model: el.nn.Module, opt: el.optim.Adam, x: np.ndarray, y: np.ndarray) -> float:
    loss = el.nn.functional.cross_entropy(model(dev.tensor(x)), dev.tensor(y))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def train(dev: el.Device, steps: int = 12, seed: int = 0) -> list[float]:
    """The losses of `steps` Adam steps of a small MLP on fixed random data."""
    model, opt = make_model(dev)
    return [step(dev, model, opt, x, y) for x, y in batches(steps, seed)]
