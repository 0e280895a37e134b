"""The stock layers: Linear, ReLU, GELU, Sequential, Dropout, Embedding, LayerNorm, Flatten.

Initial values are drawn on the host from a NumPy generator seeded by `seed` (default: the next
number of a per-process counter, so one program builds the same model every run), and reach a
device with `module.to(device)`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from emberlink.client.device import Device
from emberlink.client.dtypes import dtype_name
from emberlink.client.tensor import Tensor, norm_axis
from emberlink.errors import ShapeError
from emberlink.nn import functional as F
from emberlink.nn.module import Module, Parameter

_SEEDS = itertools.count()


def _rng(seed: int | None) -> np.random.Generator:
    return np.random.default_rng(next(_SEEDS) if seed is None else seed)


def module_seed(seed: int | None) -> int:
    """A dropout-bearing module's base seed: `seed`, or the next number of the per-process counter."""
    return (next(_SEEDS) if seed is None else seed) % (1 << 30)


def call_seed(base: int, call: int) -> int:
    """The dropout seed of call number `call` of the module with base seed `base` (a binding, so
    the graph is the same every step; distinct across modules and calls)."""
    return (base << 32) + call


def _place(module: Module, device: Device | None) -> None:
    if device is not None:
        module.to(device)


class Linear(Module):
    """`y = x @ weight + bias`, with `weight` of shape (in_features, out_features).

    Both start uniform in +-1/sqrt(in_features) (torch's Kaiming-uniform default).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        seed: int | None = None,
        dtype: Any = "float32",
        device: Device | None = None,
    ) -> None:
        super().__init__()
        rng, name = _rng(seed), dtype_name(dtype)
        bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(rng.uniform(-bound, bound, (in_features, out_features)).astype(name))
        self.bias = Parameter(rng.uniform(-bound, bound, (out_features,)).astype(name)) if bias else None
        _place(self, device)

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.weight
        return y if self.bias is None else y + self.bias

    def __repr__(self) -> str:
        return f"Linear({self.in_features}, {self.out_features}, bias={self.bias is not None})"


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.relu()


class GELU(Module):
    """GELU with the tanh approximation."""

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x)


class Sequential(Module):
    """Modules applied one after another; parameters are named "0.weight", "1.bias", ..."""

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise TypeError(f"Sequential takes Modules, argument {i} is a {type(m).__name__}")
            setattr(self, str(i), m)

    def forward(self, x: Any) -> Any:
        for m in self.__dict__["_modules"].values():
            x = m(x)
        return x

    def __getitem__(self, i: int) -> Module:
        return list(self.__dict__["_modules"].values())[i]  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return len(self.__dict__["_modules"])

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self.__dict__["_modules"].values()))


class Flatten(Module):
    """Axes `start_dim` to `end_dim` (inclusive, negative from the end) merged into one (torch's
    Flatten: by default everything but the batch axis)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: Tensor) -> Tensor:
        start = norm_axis("Flatten", self.start_dim, max(x.ndim, 1))
        end = norm_axis("Flatten", self.end_dim, max(x.ndim, 1))
        if x.ndim == 0:
            return x.reshape(1)
        if start > end:
            raise ShapeError(f"Flatten: start_dim {self.start_dim} comes after end_dim {self.end_dim}")
        return x.reshape(*x.shape[:start], math.prod(x.shape[start : end + 1]), *x.shape[end + 1 :])

    def __repr__(self) -> str:
        return f"Flatten(start_dim={self.start_dim}, end_dim={self.end_dim})"


class Dropout(Module):
    """Zeroes each element with probability `p` while training (identity in eval mode).

    Call `k` uses seed `call_seed(seed, k)` as a binding, so the graph is the same every step.
    """

    def __init__(self, p: float = 0.5, *, seed: int | None = None) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1], got {p}")
        self.p = p
        self.seed = module_seed(seed)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        self.calls += 1
        return F.dropout(x, self.p, seed=call_seed(self.seed, self.calls), training=True)


class Embedding(Module):
    """Rows of `weight` (num_embeddings, dim), picked by integer indices; starts N(0, 1)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        seed: int | None = None,
        dtype: Any = "float32",
        device: Device | None = None,
    ) -> None:
        super().__init__()
        rng = _rng(seed)
        self.weight = Parameter(
            rng.standard_normal((num_embeddings, embedding_dim)).astype(dtype_name(dtype))
        )
        _place(self, device)

    def forward(self, indices: Tensor) -> Tensor:
        return self.weight.take(indices, axis=0)


class LayerNorm(Module):
    """Normalize over the last axes (`normalized_shape`), then scale and shift (starting 1 and 0).

    `bias=False` keeps the scale and drops the shift (torch's `bias` argument).
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        dtype: Any = "float32",
        device: Device | None = None,
    ) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.normalized_shape, self.eps = shape, eps
        name = dtype_name(dtype)
        self.weight = Parameter(np.ones(shape, name)) if elementwise_affine else None
        self.bias = Parameter(np.zeros(shape, name)) if elementwise_affine and bias else None
        _place(self, device)

    def forward(self, x: Tensor) -> Tensor:
        axes = tuple(range(x.ndim - len(self.normalized_shape), x.ndim))
        centered = x - x.mean(axes, keepdims=True)
        var = centered.square().mean(axes, keepdims=True)
        y = centered / (var + self.eps).sqrt()
        if self.weight is not None:
            y = y * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y
