"""Random blocks of the types bubo/kernels/repack.py repacks, and Q8_0 (gguf's numpy code can't quantize to
K-quants)."""

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES

Q = gguf.GGMLQuantizationType

# Byte offsets of each type's fp16 fields: random bytes are a valid block once these are finite.
FP16_FIELDS = {
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}


def random_blocks(qtype: Q, rows: int, in_features: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes] of random bytes (every code, every 6-bit or int8 sub-scale), the fp16
    fields normal(0, 0.01), of both signs."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, in_features // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for offset in FP16_FIELDS[qtype]:
        scales = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw
