"""Layers built on ``minitransformer.functional``, with PyTorch's Module conventions."""

from .attention import KVCache, MultiHeadAttention
from .embedding import Embedding, PositionalEncoding
from .layers import Dropout, LayerNorm, Linear
from .module import Module, ModuleList, Parameter
from .transformer import (
    DECODER_STARTS, INITS, Decoder, DecoderLayer, Encoder, EncoderLayer, PositionwiseFeedForward, Transformer,
    TransformerConfig, expected_num_parameters,
)

__all__ = [
    "DECODER_STARTS", "INITS", "Decoder", "DecoderLayer", "Dropout", "Embedding", "Encoder", "EncoderLayer",
    "LayerNorm", "KVCache", "Linear", "Module", "ModuleList", "MultiHeadAttention", "Parameter", "PositionalEncoding",
    "PositionwiseFeedForward", "Transformer", "TransformerConfig", "expected_num_parameters",
]
