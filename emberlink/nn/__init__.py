"""emberlink.nn: Module, Parameter, the stock layers and `functional`."""

from emberlink.nn import functional
from emberlink.nn.attention import MultiheadAttention
from emberlink.nn.layers import GELU, Dropout, Embedding, LayerNorm, Linear, ReLU, Sequential
from emberlink.nn.lora import LoRALinear, add_lora, merge_lora
from emberlink.nn.module import Module, Parameter
from emberlink.nn.transformer import TransformerEncoderLayer

__all__ = [
    "GELU",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "LoRALinear",
    "Module",
    "MultiheadAttention",
    "Parameter",
    "ReLU",
    "Sequential",
    "TransformerEncoderLayer",
    "add_lora",
    "functional",
    "merge_lora",
]
