"""Functional forms of the layers and the losses (`emberlink.nn.functional`); they only record."""

from __future__ import annotations

import math
from typing import Any

from emberlink.client.dtypes import dtype_name
from emberlink.client.tensor import Tensor, apply, norm_axis
from emberlink.errors import ShapeError

_GELU_C = math.sqrt(2.0 / math.pi)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    return apply("softmax", (x,), (("axis", norm_axis("softmax", axis, x.ndim)),))


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    return apply("log_softmax", (x,), (("axis", norm_axis("log_softmax", axis, x.ndim)),))


def cross_entropy(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """Softmax cross-entropy of `logits` [N, C] against integer class `labels` [N] (fused, stable).

    `reduction`: "mean" (default), "sum" or "none" (one loss per row). A label outside [0, C)
    gives NaN.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return apply("cross_entropy", (logits, labels), (("reduction", reduction),))


def mse_loss(pred: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """Squared error, averaged ("mean"), summed ("sum") or per element ("none")."""
    if pred.shape != target.shape:
        raise ShapeError(f"mse_loss: pred shape {pred.shape} != target shape {target.shape}")
    err = (pred - target).square()
    if reduction == "mean":
        return err.mean()
    if reduction == "sum":
        return err.sum()
    if reduction == "none":
        return err
    raise ValueError(f"mse_loss: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def one_hot(labels: Tensor, num_classes: int, dtype: Any = "float32") -> Tensor:
    return apply("one_hot", (labels,), (("dtype", dtype_name(dtype)), ("num_classes", int(num_classes))))


def relu(x: Tensor) -> Tensor:
    return x.relu()


def gelu(x: Tensor) -> Tensor:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    inner = (x + (x * x * x) * 0.044715) * _GELU_C
    return (x * 0.5) * (inner.tanh() + 1.0)


def dropout(x: Tensor, p: float = 0.5, *, seed: int, training: bool = True) -> Tensor:
    """Zero each element with probability `p` and scale the rest by 1/(1-p).

    The mask comes from `rand(seed=seed)`; `seed` is a binding, so a new seed every step keeps
    the same graph.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    keep = x.device.rand(x.shape, seed=seed, dtype=x.dtype if x.dtype != "float16" else "float32") >= p
    return apply("where", (keep, x * (1.0 / (1.0 - p)), 0))
