"""Optimizers: SGD and Adam/AdamW. A step records its updates and rebinds each Parameter to the
result, without a flush, so forward, backward and update run as one graph.

Per-step scalars (learning rate, Adam's bias corrections) are Python floats, hence bindings: a
schedule that changes the learning rate, or the growing step count, does not change the graph.
Structure-changing hyperparameters (momentum on or off, weight decay on or off) are fixed when
the optimizer is made.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from emberlink.client.autograd import no_grad
from emberlink.client.tensor import Tensor
from emberlink.nn.module import Parameter


class Optimizer:
    """Holds the parameters; `step()` updates those with a gradient, `zero_grad()` clears them."""

    def __init__(self, params: Iterable[Parameter], lr: float) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        for p in self.params:
            if not isinstance(p, Parameter):
                raise TypeError(f"optimizers update Parameters, got a {type(p).__name__}")
        if not lr >= 0.0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        self.lr = float(lr)
        self.state: dict[int, dict[str, Any]] = {}

    def zero_grad(self) -> None:
        """Forget the gradients (set to None, so the next backward does not add to them)."""
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        with no_grad():
            for p in self.params:
                if p.grad is not None:
                    new = self._update(p, p.grad, self.state.setdefault(id(p), {}))
                    p._v = new._v

    def _update(self, p: Parameter, g: Tensor, state: dict[str, Any]) -> Tensor:
        raise NotImplementedError


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum (torch's form), Nesterov and weight decay."""

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        super().__init__(params, lr)
        if momentum < 0.0 or weight_decay < 0.0:
            raise ValueError("momentum and weight_decay must be >= 0")
        if nesterov and momentum == 0.0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        self.momentum, self.weight_decay, self.nesterov = float(momentum), float(weight_decay), nesterov

    def _update(self, p: Parameter, g: Tensor, state: dict[str, Any]) -> Tensor:
        if self.weight_decay:
            g = g + p * self.weight_decay
        if self.momentum:
            buf = state.get("momentum")
            buf = g if buf is None else buf * self.momentum + g
            state["momentum"] = buf
            g = g + buf * self.momentum if self.nesterov else buf
        return p - g * self.lr


class Adam(Optimizer):
    """Adam with bias correction; `weight_decay` adds `wd * p` to the gradient (L2, as torch's Adam)."""

    decoupled = False

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, lr)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        self.betas, self.eps, self.weight_decay = (float(b1), float(b2)), float(eps), float(weight_decay)

    def _update(self, p: Parameter, g: Tensor, state: dict[str, Any]) -> Tensor:
        b1, b2 = self.betas
        t = state["step"] = state.get("step", 0) + 1
        if self.weight_decay and not self.decoupled:
            g = g + p * self.weight_decay
        m: Tensor | None = state.get("m")
        v: Tensor | None = state.get("v")
        m = g * (1.0 - b1) if m is None else m * b1 + g * (1.0 - b1)
        v = (g * g) * (1.0 - b2) if v is None else v * b2 + (g * g) * (1.0 - b2)
        state["m"], state["v"] = m, v
        # Bias corrections are Python floats: bindings, so step t+1 replays step t's graph.
        step_size: float = self.lr / (1.0 - b1**t)
        denom = v.sqrt() * (1.0 / math.sqrt(1.0 - b2**t)) + self.eps
        base: Tensor = p
        if self.weight_decay and self.decoupled:
            base = p * (1.0 - self.lr * self.weight_decay)
        return base - (m / denom) * step_size


class AdamW(Adam):
    """Adam with decoupled weight decay (default 0.01): `p -= lr * wd * p` before the Adam step."""

    decoupled = True

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)
