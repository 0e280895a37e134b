"""emberlink.nn: Module, Parameter, the stock layers and `functional`."""

from emberlink.nn import functional
from emberlink.nn.attention import MultiheadAttention
from emberlink.nn.conv import AvgPool2d, BatchNorm2d, Conv2d, MaxPool2d
from emberlink.nn.layers import GELU, Dropout, Embedding, Flatten, LayerNorm, Linear, ReLU, Sequential
from emberlink.nn.lora import LoRALinear, add_lora, merge_lora
from emberlink.nn.module import Module, Parameter
from emberlink.nn.transformer import TransformerEncoderLayer

__all__ = [
    "GELU",
    "AvgPool2d",
    "BatchNorm2d",
    "Conv2d",
    "Dropout",
    "Embedding",
    "Flatten",
    "LayerNorm",
    "Linear",
    "LoRALinear",
    "MaxPool2d",
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
