"""LoRA and QLoRA: low-rank adapters around frozen Linear layers, and folding them back; no I/O.

`add_lora(model)` follows PEFT's LoRA (Hu et al. 2021): every parameter of the model is frozen
(`requires_grad=False`: still listed by `parameters()`, given no gradient and skipped by the
optimizers, so it gets no optimizer state), and each chosen `Linear` becomes a `LoRALinear`
computing `x @ W + b + (x @ A @ B) * (alpha / rank)` where only `A` and `B` train. `A` starts
Kaiming-uniform (PEFT's default, bound 1/sqrt(in_features)) and `B` at zero, so the adapted model
starts equal to the base one. emberlink's `Linear.weight` is (in_features, out_features), so `A`
is (in_features, rank) and `B` (rank, out_features): PEFT's matrices transposed, the same product.

The frozen weights stay where they are: on a device they were uploaded once and every step only
names them, so a fine-tuning step sends the batch and the adapters' scalars, never a base weight.

`quantize="int8"` (QLoRA with int8 instead of NF4) stores each frozen `W` as int8 with one scale
per output channel (absmax / 127 in the weight's dtype, float32 for a float32 model; values rounded
half away from zero), quantized on the device the weight is on. The forward is
`(x @ W_q) * scale`: the matmul widens `W_q` to the compute dtype only for its own duration (a
transient the worker frees right after), so no float copy of `W` persists.

4-bit NF4 is not offered: the IR has no bitwise or integer-division ops, so unpacking two nibbles
a byte would compose from float casts (several transient full-size arrays per matmul and again in
backward); it wants a dequantize primitive on the backends, added when a measurement asks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from emberlink.client.autograd import no_grad
from emberlink.client.device import Device
from emberlink.client.functions import where
from emberlink.client.tensor import Tensor
from emberlink.client.value import HostValue
from emberlink.errors import DTypeError
from emberlink.nn.layers import Linear, _kaiming_uniform
from emberlink.nn.module import Module, Parameter

QUANTIZE = (None, "int8")
"""What `add_lora(quantize=...)` accepts."""

_INT8_MAX = 127

M = TypeVar("M", bound=Module)


class LoRALinear(Module):
    """A frozen Linear plus a trainable low-rank update: `x @ W + b + (x @ lora_A @ lora_B) * scaling`.

    Made by `add_lora`, which freezes `base`'s parameters and takes them over (`weight`, `bias`);
    with `quantize="int8"` the weight is replaced by an int8 `weight` and a `weight_scale` of shape
    (out_features,) in the weight's float dtype.
    """

    def __init__(
        self,
        base: Linear,
        rank: int,
        alpha: float,
        *,
        quantize: str | None = None,
        seed: int | Sequence[int] = 0,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.scaling = rank, float(alpha), float(alpha) / rank
        self.quantized = quantize is not None
        weight = base.weight
        dtype = weight.dtype
        if quantize is None:
            weight.requires_grad = False
            self.weight = weight
            self.weight_scale: Parameter | None = None
        else:
            self.weight, self.weight_scale = quantize_int8(weight)
        if base.bias is not None:
            base.bias.requires_grad = False
        self.bias = base.bias
        rng = np.random.default_rng(seed)
        lora_a = _kaiming_uniform(rng, self.in_features, (self.in_features, rank), dtype)
        lora_b = np.zeros((rank, self.out_features), dtype)
        device = weight._v.dev
        if isinstance(device, Device):
            self.lora_A = Parameter(device.tensor(lora_a))
            self.lora_B = Parameter(device.tensor(lora_b))
        else:
            self.lora_A, self.lora_B = Parameter(lora_a), Parameter(lora_b)

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.weight
        if self.weight_scale is not None:
            y = y * self.weight_scale
        if self.bias is not None:
            y = y + self.bias
        return y + ((x @ self.lora_A) @ self.lora_B) * self.scaling

    def merged_weight(self) -> Tensor | np.ndarray:
        """`W + (lora_A @ lora_B) * scaling` (W dequantized first), the weight `merge_lora` exports
        (a NumPy array while the layer is still on the host)."""
        merged: Tensor | np.ndarray = _compute(
            _merged, self.weight, self.weight_scale, self.lora_A, self.lora_B, self.scaling
        )[0]
        return merged

    def __repr__(self) -> str:
        q = ", quantize='int8'" if self.quantized else ""
        return (
            f"LoRALinear({self.in_features}, {self.out_features}, rank={self.rank}, "
            f"alpha={self.alpha}, bias={self.bias is not None}{q})"
        )


def add_lora(
    model: M,
    rank: int = 8,
    alpha: float = 16.0,
    targets: str | Sequence[str] | None = None,
    quantize: str | None = None,
    *,
    seed: int = 0,
) -> M:
    """Freeze `model` and wrap its chosen `Linear` layers with rank-`rank` LoRA adapters (in place).

    `targets`: None wraps every Linear; a list of names wraps the Linears whose dotted name equals
    one of them or ends with "." + one of them (PEFT's `target_modules`: `["0", "2"]` in a
    Sequential, `["q", "v"]` in attention blocks); a single string is a regular expression the
    whole name must match. `quantize="int8"` stores the frozen weights of the wrapped layers as
    int8 with per-output-channel scales (QLoRA, see the module docstring). Adapter `i` (in
    module order) starts from `numpy.random.default_rng((seed, i))`.

    Returns `model` (a bare Linear cannot be replaced in place: wrap it, e.g. in a Sequential).
    An optimizer made from `model.parameters()` afterwards updates only the adapters.
    """
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"add_lora: rank must be a positive int, got {rank!r}")
    if quantize not in QUANTIZE:
        raise DTypeError(f"add_lora: quantize must be None or 'int8', got {quantize!r}")
    if not isinstance(model, Module) or isinstance(model, Linear):
        raise TypeError(f"add_lora takes a model holding Linear layers, got a {type(model).__name__}")
    if any(isinstance(m, LoRALinear) for _, m in model.named_modules()):
        raise ValueError("add_lora: the model already has LoRA adapters; merge_lora(model) first")
    chosen = [
        (name, m) for name, m in model.named_modules() if isinstance(m, Linear) and _wanted(name, targets)
    ]
    if not chosen:
        linears = [name or "<model>" for name, m in model.named_modules() if isinstance(m, Linear)]
        raise ValueError(
            f"add_lora: targets {targets!r} match no Linear layer; the Linear layers are {linears}"
        )
    for p in model.parameters():
        p.requires_grad = False
    for i, (name, linear) in enumerate(chosen):
        _replace(model, name, LoRALinear(linear, rank, alpha, quantize=quantize, seed=(seed, i)))
    return model


def merge_lora(model: M) -> M:
    """Fold every LoRALinear back into a plain Linear with weight `W + (A @ B) * scaling` (in place).

    Quantized weights are dequantized first, so the result is float (the adapters' dtype). The
    merged parameters require grad again, as a freshly made Linear's do; other parameters that
    `add_lora` froze stay frozen. Returns `model`.
    """
    if isinstance(model, LoRALinear):
        raise TypeError("merge_lora takes the model holding LoRALinear layers, not a LoRALinear itself")
    for name, m in list(model.named_modules()):
        if isinstance(m, LoRALinear):
            linear = Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=m.lora_A.dtype)
            linear.weight = Parameter(m.merged_weight())
            if m.bias is not None:
                linear.bias = Parameter(m.bias)
            _replace(model, name, linear)
    return model


def quantize_int8(weight: Tensor) -> tuple[Parameter, Parameter]:
    """Per-output-channel int8 of a (in_features, out_features) weight: `(W_q, scale)` with
    `W ~= W_q * scale`, `scale = max|W[:, j]| / 127` in W's dtype (1 for an all-zero column), both
    frozen, computed where the weight is (on its device, or on the host for an unplaced parameter)."""
    if weight.ndim != 2:
        raise ValueError(f"quantize_int8: needs a 2-D weight, got shape {weight.shape}")
    q, scale = _compute(_quantized, weight)
    return Parameter(q, requires_grad=False), Parameter(scale, requires_grad=False)


# -- helpers ----------------------------------------------------------------------------------------


def _quantized(w: Tensor) -> tuple[Tensor, Tensor]:
    wide = w.astype("float32") if w.dtype == "float16" else w
    scale = (wide.abs().max(axis=0) / _INT8_MAX).astype(w.dtype)  # in the weight's dtype, as its bias
    scale = where(scale == 0.0, 1.0, scale)
    ratio = wide / scale
    # Round half away from zero: astype truncates, so add +-0.5 first (|ratio| <= 127: int8 holds it).
    return (ratio + ratio.sign() * 0.5).astype("int8"), scale


def _merged(
    weight: Tensor, scale: Tensor | None, lora_a: Tensor, lora_b: Tensor, scaling: float
) -> tuple[Tensor]:
    w = weight.astype(lora_a.dtype) if scale is None else weight.astype(lora_a.dtype) * scale
    return (w + (lora_a @ lora_b) * scaling,)


def _compute(fn: Callable[..., tuple[Tensor, ...]], *args: Any) -> tuple[Any, ...]:
    """`fn(*args)` without autograd, on the device of the tensor args; for parameters still on the
    host, on a temporary CPU device, giving NumPy arrays (which become host parameters)."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    with no_grad():
        if not any(isinstance(t._v, HostValue) for t in tensors):
            return fn(*args)
        with Device.cpu() as cpu:
            moved = [cpu.tensor(a.numpy()) if isinstance(a, Tensor) else a for a in args]
            return tuple(t.numpy() for t in fn(*moved))


def _wanted(name: str, targets: str | Sequence[str] | None) -> bool:
    if targets is None:
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def _replace(model: Module, name: str, new: Module) -> None:
    """Put `new` where the submodule `name` (not the root) is."""
    parent_name, _, child = name.rpartition(".")
    setattr(dict(model.named_modules())[parent_name], child, new)


__all__ = ["QUANTIZE", "LoRALinear", "add_lora", "merge_lora", "quantize_int8"]
