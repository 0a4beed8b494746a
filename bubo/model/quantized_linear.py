"""Weights that stay in their ggml block format and are dequantized where they are used.

`raw` is the tensor's bytes as uint8 [rows, row_bytes] — on the CPU a view of the file's memory
map, so loading copies nothing. Every row holds whole blocks, so rows can be indexed before
dequantizing: the embedding lookup dequantizes only the looked-up rows.
"""

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from bubo.gguf.quants import dequantize

__all__ = ["QuantizedEmbedding", "QuantizedLinear"]


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W [out_features, in_features] stored quantized and dequantized per call."""

    def __init__(
        self,
        raw: torch.Tensor,
        ggml_type: GGMLQuantizationType,
        in_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("raw", raw)
        self.ggml_type = ggml_type
        self.in_features = in_features
        self.out_features = raw.shape[0]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [out_features, in_features]."""
        return dequantize(self.raw, self.ggml_type, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"type={self.ggml_type.name}, bias={self.bias is not None}"
        )


class QuantizedEmbedding(nn.Module):
    """Row lookup in a quantized [num_embeddings, embedding_dim] matrix, dequantizing only those rows."""

    def __init__(
        self, raw: torch.Tensor, ggml_type: GGMLQuantizationType, embedding_dim: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.register_buffer("raw", raw)
        self.ggml_type = ggml_type
        self.num_embeddings = raw.shape[0]
        self.embedding_dim = embedding_dim
        self.dtype = dtype  # the compute dtype; there is no float input to take it from

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return dequantize(self.raw[tokens], self.ggml_type, dtype=self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.ggml_type.name}"
