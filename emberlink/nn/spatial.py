"""2-D convolution and pooling over (N, C, H, W) tensors, composed on the client from the `unfold`
and `fold` primitives (graph_replay/ops.py) and ordinary ops; they only record, never compute.

torch.nn.functional's names, arguments and output sizes. Gradients need nothing of their own:
unfold's is fold and fold's is unfold, and the rest are matmul, reductions and shape ops.

- `conv2d` = unfold, then one (grouped) matmul with the weight as a (O, C/g kh kw) matrix.
- Pooling: unfold, then max or mean over the kernel axis. When the windows tile the input
  exactly (stride = kernel, no padding or dilation) a reshape replaces unfold: the same values
  without copying the input. `max_pool2d` pads with -inf (the dtype's least value for ints), as
  torch does, by concatenating fill rows and columns; `ceil_mode`'s extra windows read fill too.
  `avg_pool2d`'s divisor is the window size unless padding or `ceil_mode` make windows differ;
  then it is computed on the device from `arange`, so it is part of the graph (no upload a step).
- A gradient through `max` is shared equally between tied maxima (emberlink's `max` rule), where
  torch gives it all to the first; the two agree wherever the maximum of a window is unique.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from emberlink.client.functions import concat, maximum, minimum
from emberlink.client.tensor import Tensor, apply
from emberlink.errors import DTypeError, ShapeError
from emberlink.protocol.dtypes import KIND_OF_DTYPE

IntPair = int | Sequence[int]
Pair = tuple[int, int]


def pair(op: str, name: str, value: object, least: int) -> Pair:
    """An int or two ints (torch's `_pair`) as a pair of ints >= `least`; ShapeError otherwise."""
    items: list[object] = (
        [value, value] if _is_int(value) else list(value) if isinstance(value, Sequence) else []
    )
    if len(items) != 2 or not all(_is_int(v) and int(v) >= least for v in items):  # type: ignore[call-overload]
        raise ShapeError(f"{op}: {name} must be an int or two ints, each >= {least}; got {value!r}")
    return int(items[0]), int(items[1])  # type: ignore[call-overload]


def _is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _window_attrs(kernel: Pair, dilation: Pair, padding: Pair, stride: Pair) -> tuple[Any, ...]:
    return (("dilation", dilation), ("kernel_size", kernel), ("padding", padding), ("stride", stride))


def _batched(op: str, x: Tensor, ranks: tuple[int, int]) -> tuple[Tensor, bool]:
    """`x` with a batch axis (added when it has the smaller of `ranks`), and whether one was added."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: input must be a Tensor, got a {type(x).__name__}")
    if x.ndim == ranks[1]:
        return x, False
    if x.ndim == ranks[0]:
        return x.expand_dims(0), True
    raise ShapeError(f"{op}: needs a {ranks[0]}-D or {ranks[1]}-D input, got shape {x.shape}")


def unfold(
    input: Tensor, kernel_size: IntPair, dilation: IntPair = 1, padding: IntPair = 0, stride: IntPair = 1
) -> Tensor:
    """Sliding windows as columns: (N, C, H, W) -> (N, C kh kw, L), or (C, H, W) -> (C kh kw, L)."""
    x, added = _batched("unfold", input, (3, 4))
    attrs = _window_attrs(
        pair("unfold", "kernel_size", kernel_size, 1),
        pair("unfold", "dilation", dilation, 1),
        pair("unfold", "padding", padding, 0),
        pair("unfold", "stride", stride, 1),
    )
    out = apply("unfold", (x,), attrs)
    return out.squeeze(0) if added else out


def fold(
    input: Tensor,
    output_size: IntPair,
    kernel_size: IntPair,
    dilation: IntPair = 1,
    padding: IntPair = 0,
    stride: IntPair = 1,
) -> Tensor:
    """Columns back into an image, overlapping entries summed: (N, C kh kw, L) -> (N, C, H, W)
    with (H, W) = `output_size`, or (C kh kw, L) -> (C, H, W). The adjoint of `unfold`."""
    x, added = _batched("fold", input, (2, 3))
    attrs = (
        *_window_attrs(
            pair("fold", "kernel_size", kernel_size, 1),
            pair("fold", "dilation", dilation, 1),
            pair("fold", "padding", padding, 0),
            pair("fold", "stride", stride, 1),
        ),
        ("output_size", pair("fold", "output_size", output_size, 0)),
    )
    out = apply("fold", (x,), tuple(sorted(attrs)))
    return out.squeeze(0) if added else out


def _pad(x: Tensor, low: Pair, high: Pair, value: float) -> Tensor:
    """`x` (N, C, H, W) with `low`/`high` rows and columns of `value` before/after its last two axes."""
    for axis, lo, hi in ((2, low[0], high[0]), (3, low[1], high[1])):
        parts = []
        for count in (lo, hi):
            shape = tuple(count if i == axis else d for i, d in enumerate(x.shape))
            parts.append(x.device.full(shape, value, dtype=x.dtype) if count else None)
        if parts[0] is not None or parts[1] is not None:
            x = concat([t for t in (parts[0], x, parts[1]) if t is not None], axis=axis)
    return x


def _same_padding(op: str, kernel: Pair, dilation: Pair, stride: Pair) -> tuple[Pair, Pair]:
    """padding="same": (low, high) so the output has the input's size (the odd one goes high)."""
    if stride != (1, 1):
        raise ShapeError(f"{op}: padding='same' needs stride 1 (as in torch), got stride {stride}")
    total = tuple(d * (k - 1) for k, d in zip(kernel, dilation, strict=True))
    low = (total[0] // 2, total[1] // 2)
    return low, (total[0] - low[0], total[1] - low[1])


def conv2d(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: IntPair = 1,
    padding: IntPair | str = 0,
    dilation: IntPair = 1,
    groups: int = 1,
) -> Tensor:
    """2-D cross-correlation (torch's conv2d): input (N, C, H, W) or (C, H, W), weight
    (O, C / groups, kh, kw), bias (O,); padding an int, two ints, "valid" (0) or "same"."""
    op = "conv2d"
    x, added = _batched(op, input, (3, 4))
    if not isinstance(weight, Tensor) or weight.ndim != 4:
        raise ShapeError(
            f"{op}: weight must be a 4-D Tensor (O, C / groups, kh, kw), got {_describe(weight)}"
        )
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ShapeError(f"{op}: groups must be an int >= 1, got {groups!r}")
    n, c = x.shape[:2]
    o, cg, kh, kw = weight.shape
    if c != cg * groups or o % groups:
        raise ShapeError(
            f"{op}: input of shape {x.shape} ({c} channels) and weight of shape {weight.shape} do not "
            f"fit groups={groups}: need channels = {cg} * {groups} and {o} output channels divisible by it"
        )
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (o,)):
        raise ShapeError(f"{op}: bias must be a Tensor of shape ({o},), got {_describe(bias)}")
    kernel, s, d = (kh, kw), pair(op, "stride", stride, 1), pair(op, "dilation", dilation, 1)
    if isinstance(padding, str):
        if padding not in ("same", "valid"):
            raise ShapeError(f"{op}: padding must be an int, two ints, 'same' or 'valid'; got {padding!r}")
        low, high = _same_padding(op, kernel, d, s) if padding == "same" else ((0, 0), (0, 0))
        if low != high:  # zeros: padding the odd row or column first, then symmetrically, is the same
            x = _pad(x, (0, 0), (high[0] - low[0], high[1] - low[1]), 0)
        p = low
    else:
        p = pair(op, "padding", padding, 0)
    cols = apply("unfold", (x,), _window_attrs(kernel, d, p, s))  # (N, C kh kw, L)
    oh = (x.shape[2] + 2 * p[0] - d[0] * (kh - 1) - 1) // s[0] + 1
    ow = (x.shape[3] + 2 * p[1] - d[1] * (kw - 1) - 1) // s[1] + 1
    k = cg * kh * kw
    if groups == 1:
        out = weight.reshape(o, k) @ cols  # (N, O, L)
    else:
        out = weight.reshape(groups, o // groups, k) @ cols.reshape(n, groups, k, oh * ow)
    out = out.reshape(n, o, oh, ow)
    if bias is not None:
        out = out + bias.reshape(o, 1, 1)
    return out.squeeze(0) if added else out


def _describe(v: object) -> str:
    return f"shape {v.shape}" if isinstance(v, Tensor) else f"a {type(v).__name__}"


# -- pooling ---------------------------------------------------------------------------------------


def _pool_size(op: str, size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's pooling output size along one axis."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1  # the last window would start in the padding past the end
    if out < 1:
        raise ShapeError(f"{op}: input size {size} is too small for kernel {k} (dilation {d}, padding {p})")
    return out


class _Pool:
    """The geometry of one pooling call: kernel, stride, padding, dilation, output size, and the
    fill rows/columns `ceil_mode` adds past the end."""

    def __init__(
        self,
        op: str,
        x: Tensor,
        kernel_size: IntPair,
        stride: IntPair | None,
        padding: IntPair,
        dilation: IntPair,
        ceil_mode: bool,
    ) -> None:
        if x.dtype == "bool":
            raise DTypeError(f"{op}: needs a numeric input, got bool")
        self.k = pair(op, "kernel_size", kernel_size, 1)
        self.s = self.k if stride is None or stride == [] else pair(op, "stride", stride, 1)
        self.p = pair(op, "padding", padding, 0)
        self.d = pair(op, "dilation", dilation, 1)
        if any(2 * self.p[i] > self.k[i] for i in range(2)):  # torch's rule, dilation aside
            raise ShapeError(f"{op}: padding {self.p} must be at most half the kernel size {self.k}")
        h, w = x.shape[2:]
        self.out = tuple(
            _pool_size(op, size, self.k[i], self.s[i], self.p[i], self.d[i], ceil_mode)
            for i, size in enumerate((h, w))
        )
        need = [(self.out[i] - 1) * self.s[i] + self.d[i] * (self.k[i] - 1) + 1 for i in range(2)]
        self.extra = (max(0, need[0] - h - 2 * self.p[0]), max(0, need[1] - w - 2 * self.p[1]))

    @property
    def tiles(self) -> bool:
        """Whether the windows tile the input without overlap, gaps or padding."""
        return self.s == self.k and self.d == (1, 1) and self.p == (0, 0) and self.extra == (0, 0)

    def reduce(self, x: Tensor, how: str, fill: float) -> Tensor:
        """(N, C, oh, ow): `how` ("max", "sum" or "mean") of each window, padding read as `fill`."""
        n, c = x.shape[:2]
        (kh, kw), (oh, ow) = self.k, self.out
        if self.tiles:  # a view of the input: (N, C, oh, kh, ow, kw), reduced over kh and kw
            if x.shape[2:] != (oh * kh, ow * kw):
                x = x[:, :, : oh * kh, : ow * kw]
            return getattr(x.reshape(n, c, oh, kh, ow, kw), how)(axis=(3, 5))  # type: ignore[no-any-return]
        if fill == 0:  # unfold pads with zeros itself; only ceil_mode's overhang is added here
            x = _pad(x, (0, 0), self.extra, 0)
            attrs = _window_attrs(self.k, self.d, self.p, self.s)
        else:
            x = _pad(x, self.p, (self.p[0] + self.extra[0], self.p[1] + self.extra[1]), fill)
            attrs = _window_attrs(self.k, self.d, (0, 0), self.s)
        windows = apply("unfold", (x,), attrs).reshape(n, c, kh * kw, oh * ow)
        return getattr(windows, how)(axis=2).reshape(n, c, oh, ow)  # type: ignore[no-any-return]


def _lowest(dtype: str) -> float | int:
    return -float("inf") if KIND_OF_DTYPE[dtype] == "float" else int(np.iinfo(dtype).min)


def max_pool2d(
    input: Tensor,
    kernel_size: IntPair,
    stride: IntPair | None = None,
    padding: IntPair = 0,
    dilation: IntPair = 1,
    ceil_mode: bool = False,
) -> Tensor:
    """The maximum of each window (torch's max_pool2d); stride defaults to kernel_size, padding
    reads as -inf."""
    x, added = _batched("max_pool2d", input, (3, 4))
    pool = _Pool("max_pool2d", x, kernel_size, stride, padding, dilation, ceil_mode)
    out = pool.reduce(x, "max", _lowest(x.dtype))
    return out.squeeze(0) if added else out


def avg_pool2d(
    input: Tensor,
    kernel_size: IntPair,
    stride: IntPair | None = None,
    padding: IntPair = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> Tensor:
    """The mean of each window (torch's avg_pool2d). Padding counts in the divisor when
    `count_include_pad`; `ceil_mode`'s overhang past the padding never does; `divisor_override`
    replaces the divisor."""
    op = "avg_pool2d"
    x, added = _batched(op, input, (3, 4))
    if KIND_OF_DTYPE[x.dtype] != "float":
        raise DTypeError(f"{op}: needs a float input, got {x.dtype} (cast it with .astype('float32'))")
    pool = _Pool(op, x, kernel_size, stride, padding, 1, ceil_mode)
    if divisor_override is not None:
        if (
            isinstance(divisor_override, bool)
            or not isinstance(divisor_override, int)
            or divisor_override < 1
        ):
            raise ShapeError(f"{op}: divisor_override must be an int >= 1, got {divisor_override!r}")
        out = pool.reduce(x, "sum", 0) / float(divisor_override)
    elif pool.extra == (0, 0) and (count_include_pad or pool.p == (0, 0)):
        out = pool.reduce(x, "mean", 0)
    else:
        out = pool.reduce(x, "sum", 0) / _divisor(x, pool, count_include_pad)
    return out.squeeze(0) if added else out


def _divisor(x: Tensor, pool: _Pool, count_include_pad: bool) -> Tensor:
    """(oh, ow): how many of each window's positions count, recorded on the device (no upload)."""
    counts = []
    for i, size in enumerate(x.shape[2:]):
        k, s, p, n = pool.k[i], pool.s[i], pool.p[i], pool.out[i]
        lo, hi = (-p, size + p) if count_include_pad else (0, size)
        start = x.device.arange(n, dtype="int64") * s - p
        counts.append(minimum(start + k, hi) - maximum(start, lo))
    return (counts[0].reshape(-1, 1) * counts[1].reshape(1, -1)).astype(x.dtype)


__all__ = ["avg_pool2d", "conv2d", "fold", "max_pool2d", "pair", "unfold"]
