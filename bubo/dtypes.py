"""The compute and KV cache dtypes by the names the CLI and `bubo.load` take."""

import torch

__all__ = ["CACHE_TYPES", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV cache storage types, by llama.cpp's names for them (`--cache-type-k/-v`).
CACHE_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
