"""Functional forms of the layers and the losses (`emberlink.nn.functional`); they only record."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from emberlink.client.autograd import no_grad
from emberlink.client.dtypes import dtype_name
from emberlink.client.tensor import Tensor, apply, norm_axis
from emberlink.errors import DTypeError, ShapeError
from emberlink.nn.spatial import avg_pool2d, conv2d, fold, max_pool2d, unfold
from emberlink.protocol.dtypes import FLOAT_DTYPES

if TYPE_CHECKING:
    from emberlink.client.device import Device

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


# -- attention ---------------------------------------------------------------------------------------
# Composed from matmul, softmax and where (docs/internals.md: no primitive until a measurement asks).


def _causal_mask(device: Device, target_len: int, source_len: int) -> Tensor:
    """The bool mask of `is_causal`, shape (L, S): query i may attend to keys 0..i (top-left aligned,
    as torch's `is_causal`). Built on the device from `arange`, so it costs no upload."""
    rows = device.arange(target_len).reshape(target_len, 1)
    return device.arange(source_len) <= rows


def _check_mask(op: str, mask: Tensor, dtype: str, scores: tuple[int, ...]) -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{op}: a mask must be a Tensor, got {type(mask).__name__}")
    if mask.dtype != "bool" and mask.dtype != dtype:
        raise DTypeError(f"{op}: a mask must be bool or {dtype} (the query's dtype), got {mask.dtype}")
    try:
        fits = np.broadcast_shapes(mask.shape, scores) == scores
    except ValueError:
        fits = False
    if not fits:
        raise ShapeError(
            f"{op}: a mask of shape {mask.shape} does not broadcast to the scores' shape {scores}"
        )


def _check_operands(op: str, **tensors: Tensor) -> None:
    """query, key (and value): float tensors of one dtype, each (..., length, features)."""
    dtype = None
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
        if t.ndim < 2:
            raise ShapeError(f"{op}: {name} needs shape (..., length, features), got {t.shape}")
        if t.dtype not in FLOAT_DTYPES:
            raise DTypeError(f"{op}: {name} must be float, got {t.dtype}")
        if dtype is not None and t.dtype != dtype:
            raise DTypeError(f"{op}: {name} is {t.dtype} but query is {dtype}")
        dtype = t.dtype


def _attention_weights(
    query: Tensor,
    key: Tensor,
    masks: Sequence[tuple[Tensor, bool]] = (),
    dropout_p: float = 0.0,
    scale: float | None = None,
    seed: int | None = None,
    *,
    op: str = "scaled_dot_product_attention",
) -> Tensor:
    """softmax(query @ key^T * scale, masked) with dropout: the (..., L, S) weights that multiply the
    values. Each mask is `(tensor, keep)`: a bool tensor keeps the scores where it equals `keep`
    (the others become -inf); a float tensor is added. `nn.MultiheadAttention` uses this to apply
    torch's inverted bool masks (True = masked) without first negating them."""
    _check_operands(op, query=query, key=key)
    if query.shape[-1] != key.shape[-1]:
        raise ShapeError(f"{op}: query features {query.shape[-1]} != key features {key.shape[-1]}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1], got {dropout_p}")
    if dropout_p > 0.0 and seed is None:
        raise ValueError(f"{op}: dropout_p > 0 needs seed= (an int; a new one each step keeps the graph)")
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    scores = (query * factor) @ key.mT
    for mask, keep in masks:
        _check_mask(op, mask, scores.dtype, scores.shape)
        if mask.dtype == "bool":
            args = (mask, scores, -math.inf) if keep else (mask, -math.inf, scores)
            scores = apply("where", args)
        else:
            scores = scores + mask
    weights = softmax(scores, axis=-1)
    if dropout_p > 0.0 and seed is not None:
        weights = dropout(weights, dropout_p, seed=seed)
    return weights


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    seed: int | None = None,
) -> Tensor:
    """softmax(query @ key^T * scale + mask) @ value, as torch's function of the same name.

    Shapes: query (..., L, E), key (..., S, E), value (..., S, Ev) -> (..., L, Ev); the leading
    axes broadcast. `scale` defaults to 1/sqrt(E).

    `attn_mask` (broadcastable to (..., L, S)): a bool mask marks with True the keys a query may
    attend to (torch's convention for this function); a float mask (the query's dtype) is added to
    the scores. `is_causal=True` lets query i attend to keys 0..i; it cannot be combined with
    `attn_mask` (as in torch). A query that may attend to no key gets NaN.

    `dropout_p` drops attention weights whenever it is above 0 (as in torch: pass 0.0 in eval).
    Dropout needs `seed=` (an int): there is no global generator, the seed is a binding, so a new
    seed each step keeps the same graph.
    """
    op = "scaled_dot_product_attention"
    _check_operands(op, query=query, key=key, value=value)
    if value.shape[-2] != key.shape[-2]:
        raise ShapeError(f"{op}: value length {value.shape[-2]} != key length {key.shape[-2]}")
    if is_causal and attn_mask is not None:
        raise ValueError(f"{op}: give attn_mask or is_causal=True, not both")
    masks: list[tuple[Tensor, bool]] = []
    if attn_mask is not None:
        masks.append((attn_mask, True))
    if is_causal:
        masks.append((_causal_mask(cast("Device", query.device), query.shape[-2], key.shape[-2]), True))
    weights = _attention_weights(query, key, masks, dropout_p, scale, seed, op=op)
    return weights @ value


def batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float | Tensor = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Normalize each channel (axis 1) of `input` (N, C, ...) by its statistics over every other
    axis, then scale by `weight` and shift by `bias` (each (C,), optional), as torch's batch_norm.

    training=True: the batch's mean and biased variance normalize; `running_mean` and
    `running_var` (if given) are then updated in place, `r = r + momentum * (batch - r)`, with the
    unbiased variance (n / (n - 1)), as torch does; the update records no gradient.
    training=False: the running statistics normalize. The result has the input's dtype (float16
    activations with float32 statistics and affine parameters stay float16).
    """
    x = input
    if not isinstance(x, Tensor) or x.ndim < 2:
        raise ShapeError(f"batch_norm: needs an input (N, C, ...), got {_describe(x)}")
    if x.dtype not in FLOAT_DTYPES:
        raise DTypeError(f"batch_norm: needs a float input, got {x.dtype}")
    c = x.shape[1]
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight),
                    ("bias", bias)):  # fmt: skip
        if t is not None and (not isinstance(t, Tensor) or t.shape != (c,)):
            raise ShapeError(f"batch_norm: {name} must be a Tensor of shape ({c},), got {_describe(t)}")
    channel = (c,) + (1,) * (x.ndim - 2)  # broadcasts against (N, C, ...)
    if training:
        axes = (0, *range(2, x.ndim))
        n = x.size // c if c else 0
        if n <= 1:
            raise ShapeError(
                f"batch_norm: expected more than 1 value per channel when training, got input {x.shape}"
            )
        mean = x.mean(axes, keepdims=True)
        centered = x - mean
        var = centered.square().mean(axes, keepdims=True)
        with no_grad():
            if running_mean is not None:
                _update_running(running_mean, mean.reshape(c), momentum)
            if running_var is not None:
                _update_running(running_var, var.reshape(c) * (n / (n - 1)), momentum)
        scale = 1.0 / (var.reshape(channel) + eps).sqrt()
        if weight is not None:
            scale = scale * weight.reshape(channel)
        y = centered * scale.astype(x.dtype)
        return y if bias is None else y + bias.reshape(channel).astype(x.dtype)
    if running_mean is None or running_var is None:
        raise ShapeError("batch_norm: running_mean and running_var are needed when not training")
    # Per-channel scale and shift first, so the full-size work is one multiply and one add.
    scale = 1.0 / (running_var + eps).sqrt()
    if weight is not None:
        scale = scale * weight
    shift = -running_mean * scale
    if bias is not None:
        shift = shift + bias
    return x * scale.reshape(channel).astype(x.dtype) + shift.reshape(channel).astype(x.dtype)


def _update_running(stat: Tensor, batch: Tensor, momentum: float | Tensor) -> None:
    """`stat` (a buffer) rebound in place to its moving average with `batch` (see Module)."""
    new = stat + (batch.astype(stat.dtype) - stat) * momentum
    stat._v = new.astype(stat.dtype)._v


def _describe(v: object) -> str:
    return f"shape {v.shape}" if isinstance(v, Tensor) else f"a {type(v).__name__}"


__all__ = [
    "avg_pool2d",
    "batch_norm",
    "conv2d",
    "cross_entropy",
    "dropout",
    "fold",
    "gelu",
    "log_softmax",
    "max_pool2d",
    "mse_loss",
    "one_hot",
    "relu",
    "scaled_dot_product_attention",
    "softmax",
    "unfold",
]
