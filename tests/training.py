"""The small training runs that tests compare across devices, backends and transports; plain code, no
pytest, so client subprocesses import it too."""

from __future__ import annotations

import numpy as np

import emberlink as el


def train_steps(
    dev: el.Device, model: el.nn.Module, opt: el.optim.Optimizer, x: np.ndarray, y: np.ndarray, steps: int
) -> list[float]:
    """The cross-entropy loss of each of `steps` optimizer steps on the one batch (x, y)."""
    losses = []
    for _ in range(steps):
        loss = el.nn.functional.cross_entropy(model(dev.tensor(x)), dev.tensor(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def mlp_losses(dev: el.Device, steps: int, seed: int = 0) -> list[float]:
    """A small MLP trained with Adam on fixed random data; the loss of every step."""
    nn = el.nn
    model = nn.Sequential(nn.Linear(20, 32, seed=seed), nn.ReLU(), nn.Linear(32, 5, seed=seed + 1)).to(dev)
    opt = el.optim.Adam(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 20), dtype=np.float32)
    y = rng.integers(0, 5, 64)
    return train_steps(dev, model, opt, x, y, steps)
