"""The CNN layers: Conv2d, MaxPool2d, AvgPool2d and BatchNorm2d; they hold parameters and buffers
and call nn.functional, nothing more.

Initial values follow torch's and are drawn on the host from a NumPy generator seeded by `seed`
(as nn.Linear's), reaching a device with `module.to(device)`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from emberlink.client.autograd import no_grad
from emberlink.client.device import Device
from emberlink.client.dtypes import dtype_name
from emberlink.client.tensor import Tensor
from emberlink.errors import ShapeError
from emberlink.nn import functional as F
from emberlink.nn.layers import _place, _rng
from emberlink.nn.module import Module, Parameter
from emberlink.nn.spatial import IntPair, pair


class Conv2d(Module):
    """2-D convolution (torch's Conv2d): `weight` (out_channels, in_channels / groups, kh, kw),
    `bias` (out_channels,). Both start uniform in +-1/sqrt(fan_in), fan_in = in_channels / groups
    * kh * kw (torch's kaiming_uniform with a=sqrt(5), and its bias rule)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntPair,
        stride: IntPair = 1,
        padding: IntPair | str = 0,
        dilation: IntPair = 1,
        groups: int = 1,
        bias: bool = True,
        *,
        seed: int | None = None,
        dtype: Any = "float32",
        device: Device | None = None,
    ) -> None:
        super().__init__()
        if groups < 1 or in_channels % groups or out_channels % groups:
            raise ShapeError(
                f"Conv2d: in_channels {in_channels} and out_channels {out_channels} must be divisible "
                f"by groups {groups}"
            )
        kh, kw = pair("Conv2d", "kernel_size", kernel_size, 1)
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = (kh, kw)
        self.stride = pair("Conv2d", "stride", stride, 1)
        self.padding: tuple[int, int] | str = (
            padding if isinstance(padding, str) else pair("Conv2d", "padding", padding, 0)
        )
        self.dilation = pair("Conv2d", "dilation", dilation, 1)
        rng, name = _rng(seed), dtype_name(dtype)
        fan_in = in_channels // groups * kh * kw
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        shape = (out_channels, in_channels // groups, kh, kw)
        self.weight = Parameter(rng.uniform(-bound, bound, shape).astype(name))
        self.bias = Parameter(rng.uniform(-bound, bound, (out_channels,)).astype(name)) if bias else None
        _place(self, device)

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def __repr__(self) -> str:
        return (
            f"Conv2d({self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
            f"bias={self.bias is not None})"
        )


class MaxPool2d(Module):
    """The maximum of each window (torch's MaxPool2d); stride defaults to kernel_size."""

    def __init__(
        self,
        kernel_size: IntPair,
        stride: IntPair | None = None,
        padding: IntPair = 0,
        dilation: IntPair = 1,
        ceil_mode: bool = False,
    ) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.dilation, self.ceil_mode = dilation, ceil_mode

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)

    def __repr__(self) -> str:
        return (
            f"MaxPool2d(kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
            f"dilation={self.dilation}, ceil_mode={self.ceil_mode})"
        )


class AvgPool2d(Module):
    """The mean of each window (torch's AvgPool2d); stride defaults to kernel_size."""

    def __init__(
        self,
        kernel_size: IntPair,
        stride: IntPair | None = None,
        padding: IntPair = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
    ) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.ceil_mode, self.count_include_pad = ceil_mode, count_include_pad
        self.divisor_override = divisor_override

    def forward(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(
            x,
            self.kernel_size,
            self.stride,
            self.padding,
            self.ceil_mode,
            self.count_include_pad,
            self.divisor_override,
        )

    def __repr__(self) -> str:
        return (
            f"AvgPool2d(kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
            f"ceil_mode={self.ceil_mode}, count_include_pad={self.count_include_pad})"
        )


class BatchNorm2d(Module):
    """Batch normalization over (N, C, H, W) per channel (torch's BatchNorm2d).

    Training mode (`train()`) normalizes by the batch's statistics and, with
    `track_running_stats`, updates the buffers `running_mean`, `running_var` (in place, unbiased
    variance) and `num_batches_tracked`; eval mode (`eval()`) normalizes by the running ones.
    `momentum=None` makes the running statistics a cumulative average (factor 1 / batches seen).
    `weight` starts at 1 and `bias` at 0 (`affine=False`: neither).
    """

    running_mean: Tensor | None
    running_var: Tensor | None
    num_batches_tracked: Tensor | None

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        dtype: Any = "float32",
        device: Device | None = None,
    ) -> None:
        super().__init__()
        name = dtype_name(dtype)
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        self.weight = Parameter(np.ones(num_features, name)) if affine else None
        self.bias = Parameter(np.zeros(num_features, name)) if affine else None
        if track_running_stats:
            self.register_buffer("running_mean", np.zeros(num_features, name))
            self.register_buffer("running_var", np.ones(num_features, name))
            self.register_buffer("num_batches_tracked", np.zeros((), "int64"))
        else:
            for buffer in ("running_mean", "running_var", "num_batches_tracked"):
                self.register_buffer(buffer, None)
        _place(self, device)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 4:
            raise ShapeError(f"BatchNorm2d: needs a 4-D input (N, C, H, W), got shape {x.shape}")
        factor: float | Tensor = 0.0 if self.momentum is None else self.momentum
        tracked = self.num_batches_tracked
        if self.training and tracked is not None:
            with no_grad():
                tracked._v = (tracked + 1)._v  # in place, as the running statistics
            if self.momentum is None:
                factor = 1.0 / tracked.astype(x.dtype)
        batch_stats = self.training or self.running_mean is None
        return F.batch_norm(
            x,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight,
            self.bias,
            batch_stats,
            factor,
            self.eps,
        )

    def __repr__(self) -> str:
        return (
            f"BatchNorm2d({self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.affine}, track_running_stats={self.track_running_stats})"
        )
