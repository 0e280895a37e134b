"""Optimizers against their update rules written out in NumPy (torch's conventions)."""

from __future__ import annotations

import numpy as np
import pytest

import emberlink as el
from emberlink import Device

Parameter = el.nn.Parameter

TARGET = np.array([[0.5, -1.0, 2.0], [1.5, 0.0, -0.5]])
START = np.array([[1.0, 2.0, -1.0], [0.0, 0.5, 1.0]])


def grad_of(w: np.ndarray) -> np.ndarray:
    grad: np.ndarray = 2 * (w - TARGET) * np.arange(1, 4)  # loss = sum((w - t)^2 * [1, 2, 3])
    return grad


def run(dev: Device, opt_cls, steps: int, **kw) -> np.ndarray:
    w = Parameter(START.copy()).to_(dev)
    opt = opt_cls([w], **kw)
    target, scale = dev.tensor(TARGET), dev.tensor(np.arange(1.0, 4.0))
    for _ in range(steps):
        (((w - target) ** 2) * scale).sum().backward()
        opt.step()
        opt.zero_grad()
        assert w.grad is None
    return w.numpy()


def reference_sgd(steps, lr, momentum=0.0, weight_decay=0.0, nesterov=False):
    w, buf = START.copy(), None
    for _ in range(steps):
        g = grad_of(w) + weight_decay * w
        if momentum:
            buf = g if buf is None else momentum * buf + g
            g = g + momentum * buf if nesterov else buf
        w = w - lr * g
    return w


def reference_adam(steps, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
    w, m, v = START.copy(), 0.0, 0.0
    b1, b2 = betas
    for t in range(1, steps + 1):
        g = grad_of(w)
        if weight_decay and not decoupled:
            g = g + weight_decay * w
        if weight_decay and decoupled:
            w = w * (1 - lr * weight_decay)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat, vhat = m / (1 - b1**t), v / (1 - b2**t)
        w = w - lr * mhat / (np.sqrt(vhat) + eps)
    return w


@pytest.mark.parametrize(
    "kw",
    [
        {"lr": 0.05},
        {"lr": 0.02, "momentum": 0.9},
        {"lr": 0.02, "momentum": 0.9, "nesterov": True},
        {"lr": 0.05, "weight_decay": 0.1},
    ],
)
def test_sgd_matches_its_update_rule(dev: Device, kw) -> None:
    got = run(dev, el.optim.SGD, 6, **kw)
    np.testing.assert_allclose(got, reference_sgd(6, **kw), rtol=1e-12)


def test_sgd_learning_rate_schedule_changes_no_graph(dev: Device) -> None:
    schedule = lambda i: 0.05 / (1 + i)
    w = Parameter(START.copy()).to_(dev)
    opt = el.optim.SGD([w], lr=0.05)
    target = dev.tensor(TARGET)
    for i in range(5):
        opt.lr = schedule(i)
        ((w - target) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
        float(w.sum())
    expected = START.copy()
    for i in range(5):
        expected = expected - schedule(i) * 2 * (expected - TARGET)
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-12)
    assert dev.stats()["graphs_built"] == 1


@pytest.mark.parametrize(
    ("cls", "kw", "decoupled"),
    [
        (el.optim.Adam, {"lr": 0.1}, False),
        (el.optim.Adam, {"lr": 0.1, "betas": (0.8, 0.99), "weight_decay": 0.05}, False),
        (el.optim.AdamW, {"lr": 0.1, "weight_decay": 0.05}, True),
    ],
)
def test_adam_and_adamw_match_their_update_rules(dev: Device, cls, kw, decoupled: bool) -> None:
    got = run(dev, cls, 7, **kw)
    np.testing.assert_allclose(got, reference_adam(7, decoupled=decoupled, **kw), rtol=1e-10)


def test_adam_steps_after_the_first_share_one_graph(dev: Device) -> None:
    w = Parameter(START.copy()).to_(dev)
    opt = el.optim.Adam([w], lr=0.1)
    target = dev.tensor(TARGET)
    for _ in range(5):
        ((w - target) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
        float(w.sum())
    # step 1 creates the moments; the step count only changes bindings afterwards
    assert dev.stats()["graphs_built"] == 2


def test_step_skips_parameters_without_a_gradient(dev: Device) -> None:
    a, b = Parameter(np.ones(2)).to_(dev), Parameter(np.ones(2)).to_(dev)
    opt = el.optim.SGD([a, b], lr=1.0)
    (a * 3.0).sum().backward()
    opt.step()
    np.testing.assert_array_equal(a.numpy(), [-2.0, -2.0])
    np.testing.assert_array_equal(b.numpy(), [1.0, 1.0])


def test_optimizer_argument_errors() -> None:
    p = Parameter(np.ones(2))
    with pytest.raises(ValueError, match="empty"):
        el.optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match="learning rate"):
        el.optim.SGD([p], lr=-1.0)
    with pytest.raises(ValueError, match="Nesterov"):
        el.optim.SGD([p], lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        el.optim.Adam([p], betas=(1.0, 0.9))
    with pytest.raises(TypeError, match="Parameters"):
        el.optim.SGD([np.ones(2)], lr=0.1)  # type: ignore[list-item]
