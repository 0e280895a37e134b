"""Optimizers: SGD and Adam/AdamW. A step records its updates and rebinds each Parameter to the
result, without a flush, so forward, backward and update run as one graph.

State is updated in place too: a momentum buffer or Adam's moments keep their Tensor objects and
only their values are rebound (`t._v = new._v`), and Adam's step count is a tensor on the device
(torch's `capturable=True`) from which the bias corrections are computed there. So nothing that
changes from step to step lives in Python, and a step replayed by `emberlink.jit` updates the same
state as an eager one, with the same numbers. The learning rate is a Python float, hence a
binding: a schedule that changes it does not change the graph. Structure-changing
hyperparameters (momentum on or off, weight decay on or off) are fixed when the optimizer is made.
"""

from __future__ import annotations

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
            buf: Tensor | None = state.get("momentum")
            if buf is None:
                buf = state["momentum"] = g.detach()  # its own Tensor object: rebound in place below
            else:
                buf._v = (buf * self.momentum + g)._v
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
        if self.weight_decay and not self.decoupled:
            g = g + p * self.weight_decay
        m: Tensor | None = state.get("m")
        v: Tensor | None = state.get("v")
        t: Tensor | None = state.get("step")
        if m is None or v is None or t is None:  # the first step makes the state
            m, v = g * (1.0 - b1), (g * g) * (1.0 - b2)
            # float32 for float16 parameters: float16 counts exactly only up to 2048
            t = p.device.ones((), "float32" if p.dtype == "float16" else p.dtype)
            state["m"], state["v"], state["step"] = m, v, t
        else:
            m._v = (m * b1 + g * (1.0 - b1))._v
            v._v = (v * b2 + (g * g) * (1.0 - b2))._v
            t._v = (t + 1.0)._v
        # Bias corrections from the step count on the device: the same graph every step, and no
        # Python number that a replayed step would leave stale.
        step_size = self.lr / (1.0 - b1**t).astype(p.dtype)
        denom = v.sqrt() / (1.0 - b2**t).sqrt().astype(p.dtype) + self.eps
        base: Tensor = p
        if self.weight_decay and self.decoupled:
            base = p - (p * self.weight_decay) * self.lr  # lr stays a binding (no Python product)
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
