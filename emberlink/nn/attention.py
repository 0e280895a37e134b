"""nn.MultiheadAttention, composed from Linear, matmul and softmax; it records, it adds no op.

Parameters carry torch's names (`in_proj_weight`, `in_proj_bias`, `out_proj.weight`,
`out_proj.bias`; `q_proj_weight`, `k_proj_weight`, `v_proj_weight` when `kdim`/`vdim` differ from
`embed_dim`), so a torch state dict maps name for name. As in every emberlink Linear, a 2-D
weight is stored (in_features, out_features) and used as `x @ weight`: the transpose of torch's.
"""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np

from emberlink.client.device import Device
from emberlink.client.dtypes import dtype_name
from emberlink.client.tensor import Tensor
from emberlink.errors import ShapeError
from emberlink.nn import functional as F
from emberlink.nn.layers import Linear, _place, _rng, call_seed
from emberlink.nn.module import Module, Parameter

_OP = "MultiheadAttention"


def _xavier(rng: np.random.Generator, fan_in: int, fan_out: int, dtype: str) -> Parameter:
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return Parameter(rng.uniform(-bound, bound, (fan_in, fan_out)).astype(dtype))


class MultiheadAttention(Module):
    """Attention over `num_heads` heads of `embed_dim // num_heads` features, as torch's layer.

    `forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False)` returns `(attn_output, attn_weights or None)`.
    Inputs are (L, N, E) or with `batch_first=True` (N, L, E); unbatched (L, E) works too. The
    masks follow torch's conventions for this layer (the inverse of scaled_dot_product_attention's
    for bool masks): `attn_mask` (L, S) or (N * num_heads, L, S) and `key_padding_mask` (N, S)
    mark with True the positions that may NOT be attended to; a float mask (the query's dtype) is
    added to the scores. `is_causal=True` applies the causal mask (together with `attn_mask` if
    one is given; torch needs the mask and takes the flag as a hint). The weights returned are
    after dropout, averaged over the heads unless `average_attn_weights=False`.

    Dropout on the attention weights (`dropout`) applies in training mode only; call `k` uses
    seed `call_seed(seed, k)`, a binding, so the graph is the same every step. Initial values:
    Xavier-uniform input projections, zero biases, a Linear's default for `out_proj.weight` (as
    torch). torch's `add_bias_kv` and `add_zero_attn` are not provided.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        seed: int | None = None,
        dtype: Any = "float32",
        device: Device | None = None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(
                f"{_OP}: embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})"
            )
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"{_OP}: dropout must be in [0, 1], got {dropout}")
        rng, name = _rng(seed), dtype_name(dtype)
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.dropout, self.batch_first = dropout, batch_first
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight: Parameter | None = _xavier(rng, embed_dim, 3 * embed_dim, name)
            self.q_proj_weight: Parameter | None = None
            self.k_proj_weight: Parameter | None = None
            self.v_proj_weight: Parameter | None = None
        else:
            self.in_proj_weight = None
            self.q_proj_weight = _xavier(rng, embed_dim, embed_dim, name)
            self.k_proj_weight = _xavier(rng, self.kdim, embed_dim, name)
            self.v_proj_weight = _xavier(rng, self.vdim, embed_dim, name)
        self.in_proj_bias = Parameter(np.zeros(3 * embed_dim, name)) if bias else None
        out_seed, dropout_seed = (int(s) for s in rng.integers(0, 1 << 30, size=2))
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, seed=out_seed, dtype=name)
        if self.out_proj.bias is not None:
            self.out_proj.bias.assign(np.zeros(embed_dim, name))
        self.seed = dropout_seed
        self.calls = 0
        _place(self, device)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        self_attention = query is key and key is value
        q, k, v = self._batch_major(query, key, value)
        n, tgt, src = q.shape[0], q.shape[1], k.shape[1]
        qh, kh, vh = self._project(q, k, v, self_attention)
        masks = self._masks(
            attn_mask, key_padding_mask, is_causal, cast(Device, q.device), (n, tgt, src), query.ndim == 3
        )
        p = self.dropout if self.training else 0.0
        seed = None
        if p > 0.0:
            self.calls += 1
            seed = call_seed(self.seed, self.calls)
        weights = F._attention_weights(qh, kh, masks, p, None, seed, op=_OP)
        heads = (weights @ vh).permute(0, 2, 1, 3).reshape(n, tgt, self.embed_dim)
        out = self.out_proj(heads)
        if query.ndim == 2:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.permute(1, 0, 2)
        if not need_weights:
            return out, None
        if average_attn_weights:
            weights = weights.mean(axis=1)
        return out, weights.squeeze(0) if query.ndim == 2 else weights

    def _batch_major(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """query, key and value as (N, length, features), checked against the layer's sizes."""
        for label, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{_OP}: {label} must be a Tensor, got {type(t).__name__}")
        if query.ndim not in (2, 3) or key.ndim != query.ndim or value.ndim != query.ndim:
            raise ShapeError(
                f"{_OP}: query, key and value must all be 3-D (batched) or all 2-D (unbatched), got "
                f"{query.shape}, {key.shape}, {value.shape}"
            )
        if query.ndim == 2:
            q, k, v = (t.expand_dims(0) for t in (query, key, value))
        elif self.batch_first:
            q, k, v = query, key, value
        else:
            q = query.permute(1, 0, 2)
            k = q if key is query else key.permute(1, 0, 2)
            v = k if value is key else value.permute(1, 0, 2)
        if q.shape[2] != self.embed_dim or k.shape[2] != self.kdim or v.shape[2] != self.vdim:
            raise ShapeError(
                f"{_OP}: features of query, key, value are {q.shape[2]}, {k.shape[2]}, {v.shape[2]}; "
                f"this layer takes {self.embed_dim}, {self.kdim}, {self.vdim}"
            )
        if k.shape[:2] != v.shape[:2] or k.shape[0] != q.shape[0]:
            raise ShapeError(
                f"{_OP}: key {key.shape} and value {value.shape} must have one length, and the "
                f"query's batch size ({query.shape})"
            )
        return q, k, v

    def _project(self, q: Tensor, k: Tensor, v: Tensor, fused: bool) -> tuple[Tensor, Tensor, Tensor]:
        """The projected query, key and value split into heads: (N, num_heads, length, head_dim)."""
        e, h, d = self.embed_dim, self.num_heads, self.head_dim
        b = self.in_proj_bias
        if fused and self.in_proj_weight is not None:  # self-attention: one matmul for all three
            qkv = q @ self.in_proj_weight
            if b is not None:
                qkv = qkv + b
            parts = qkv.reshape(q.shape[0], q.shape[1], 3, h, d).permute(2, 0, 3, 1, 4)
            return parts[0], parts[1], parts[2]
        if self.in_proj_weight is not None:
            w = self.in_proj_weight
            ws = (w[:, :e], w[:, e : 2 * e], w[:, 2 * e :])
        else:
            ws = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)  # type: ignore[assignment]
        out = []
        for i, (x, wi) in enumerate(zip((q, k, v), ws, strict=True)):
            y = x @ wi
            if b is not None:
                y = y + b[i * e : (i + 1) * e]
            out.append(y.reshape(x.shape[0], x.shape[1], h, d).permute(0, 2, 1, 3))
        return out[0], out[1], out[2]

    def _masks(
        self,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        is_causal: bool,
        device: Device,
        sizes: tuple[int, int, int],
        batched: bool,
    ) -> list[tuple[Tensor, bool]]:
        """The masks as F._attention_weights takes them, each broadcastable to (N, heads, L, S)."""
        n, tgt, src = sizes
        masks: list[tuple[Tensor, bool]] = []
        if attn_mask is not None:
            heads = (n * self.num_heads, tgt, src)
            if not isinstance(attn_mask, Tensor):
                raise TypeError(f"{_OP}: attn_mask must be a Tensor, got {type(attn_mask).__name__}")
            if attn_mask.shape == heads:
                attn_mask = attn_mask.reshape(n, self.num_heads, tgt, src)
            elif attn_mask.shape != (tgt, src):
                raise ShapeError(
                    f"{_OP}: attn_mask must have shape {(tgt, src)} or {heads}, got {attn_mask.shape}"
                )
            masks.append((attn_mask, False))  # torch's layer: True = may not attend
        if key_padding_mask is not None:
            want = (n, src) if batched else (src,)
            if not isinstance(key_padding_mask, Tensor):
                raise TypeError(
                    f"{_OP}: key_padding_mask must be a Tensor, got {type(key_padding_mask).__name__}"
                )
            if key_padding_mask.shape != want:
                raise ShapeError(
                    f"{_OP}: key_padding_mask must have shape {want}, got {key_padding_mask.shape}"
                )
            masks.append((key_padding_mask.reshape(n, 1, 1, src), False))
        if is_causal:
            masks.append((F._causal_mask(device, tgt, src), True))
        return masks

    def __repr__(self) -> str:
        return (
            f"MultiheadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"dropout={self.dropout}, batch_first={self.batch_first})"
        )
