"""emberlink.nn: Module, Parameter, the stock layers and `functional`."""

from emberlink.client.nn import functional
from emberlink.client.nn.attention import MultiheadAttention
from emberlink.client.nn.layers import GELU, Dropout, Embedding, LayerNorm, Linear, ReLU, Sequential
from emberlink.client.nn.module import Module, Parameter
from emberlink.client.nn.transformer import TransformerEncoderLayer

__all__ = [
    "GELU",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "Module",
    "MultiheadAttention",
    "Parameter",
    "ReLU",
    "Sequential",
    "TransformerEncoderLayer",
    "functional",
]
