"""The GGUF file: memory-mapped reader and torch dequantizers."""

from bubo.gguf.quants import dequantize
from bubo.gguf.reader import GGUFError, GGUFFile, GGUFTensor

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "dequantize"]
