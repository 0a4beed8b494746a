"""Bubo: a pure-PyTorch LLM runtime for GGUF files."""

__version__ = "0.1.0"
