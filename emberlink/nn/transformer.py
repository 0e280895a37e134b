"""nn.TransformerEncoderLayer, composed from the stock layers and MultiheadAttention; no math of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from emberlink.client.device import Device
from emberlink.client.dtypes import dtype_name
from emberlink.client.tensor import Tensor
from emberlink.nn import functional as F
from emberlink.nn.attention import MultiheadAttention
from emberlink.nn.layers import Dropout, LayerNorm, Linear, _place, _rng
from emberlink.nn.module import Module

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "gelu": F.gelu}


class TransformerEncoderLayer(Module):
    """Self-attention and a feed-forward block, each with a residual connection and a LayerNorm,
    as torch's layer (same arguments, same submodule names: self_attn, linear1, dropout, linear2,
    norm1, norm2, dropout1, dropout2; so a torch state dict maps name for name, each 2-D weight
    transposed as for every emberlink Linear).

    `forward(src, src_mask=None, src_key_padding_mask=None, is_causal=False)`; the masks and
    `is_causal` mean what they mean for `MultiheadAttention` (bool True = may not attend).
    `norm_first=True` normalizes before each block (pre-LN), else after (post-LN, torch's default).
    `activation` is "relu", "gelu" (emberlink's gelu: the tanh approximation, torch's
    `approximate="tanh"`) or a function of one Tensor. The dropouts apply in training mode only.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        *,
        seed: int | None = None,
        dtype: Any = "float32",
        device: Device | None = None,
    ) -> None:
        super().__init__()
        if isinstance(activation, str):
            if activation not in _ACTIVATIONS:
                raise ValueError(
                    f"TransformerEncoderLayer: activation must be 'relu', 'gelu' or a function, got {activation!r}"
                )
            self.activation = _ACTIVATIONS[activation]
        elif callable(activation):
            self.activation = activation
        else:
            raise TypeError(
                f"TransformerEncoderLayer: activation must be a str or a function, got {activation!r}"
            )
        name = dtype_name(dtype)
        seeds = [int(s) for s in _rng(seed).integers(0, 1 << 30, size=6)]
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout, bias, batch_first=batch_first, seed=seeds[0], dtype=name
        )
        self.linear1 = Linear(d_model, dim_feedforward, bias, seed=seeds[1], dtype=name)
        self.dropout = Dropout(dropout, seed=seeds[2])
        self.linear2 = Linear(dim_feedforward, d_model, bias, seed=seeds[3], dtype=name)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, layer_norm_eps, bias=bias, dtype=name)
        self.norm2 = LayerNorm(d_model, layer_norm_eps, bias=bias, dtype=name)
        self.dropout1 = Dropout(dropout, seed=seeds[4])
        self.dropout2 = Dropout(dropout, seed=seeds[5])
        _place(self, device)

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self._ff_block(x))  # type: ignore[no-any-return]

    def _sa_block(
        self, x: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None, is_causal: bool
    ) -> Tensor:
        out, _ = self.self_attn(
            x,
            x,
            x,
            attn_mask=attn_mask,
            key_padding_mask=key_padding_mask,
            need_weights=False,
            is_causal=is_causal,
        )
        return self.dropout1(out)  # type: ignore[no-any-return]

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))  # type: ignore[no-any-return]
