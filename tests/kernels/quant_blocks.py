"""Random ggml blocks and float64 references for the Triton kernel tests (gguf's numpy dequantizers).

Test modules import this after `pytest.importorskip("triton")`: it imports the kernels.
"""

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from bubo.kernels.triton_quant import interpreting

ALL_TYPES = [
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q8_0,
    Q.Q2_K,
    Q.Q3_K,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
    Q.IQ4_NL,
    Q.IQ4_XS,
]

# Byte offsets of each type's fp16 fields in a block: random bytes are a valid block once these
# are finite (every other bit pattern is a legal code or sub-scale).
FP16_FIELDS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}  # fmt: skip


def device() -> torch.device:
    """CPU under the interpreter; CUDA when the kernels are compiled (TRITON_INTERPRET=0 on a GPU)."""
    return torch.device("cpu" if interpreting() else "cuda")


def ragged_width(qtype: Q) -> int:
    """An in_features that is whole blocks but not whole kernel tiles (3 blocks, or 2 super-blocks)."""
    return 96 if GGML_QUANT_SIZES[qtype][0] == 32 else 512


def random_blocks(
    qtype: Q, rows: int, in_features: int, seed: int, magnitudes: tuple[float, ...] = (0.01,)
) -> np.ndarray:
    """uint8 [rows, row_bytes] of random blocks whose fp16 fields are normal(0, 1) * a magnitude
    drawn from `magnitudes` per block (zeros, subnormals and large scales if asked)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, in_features // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for offset in FP16_FIELDS[qtype]:
        magnitude = rng.choice(magnitudes, size=blocks.shape[0])
        scales = (rng.standard_normal(blocks.shape[0]) * magnitude).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


def reference_weight(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """gguf's numpy dequantization of `raw`, as float64."""
    return torch.from_numpy(gguf_quants.dequantize(raw, qtype).astype(np.float64))


def assert_product_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rel: float) -> None:
    """|got - x W^T| <= rel * (|x| |W|^T) elementwise, in float64: the bound a float32 sum meets
    whatever its order, so `rel` is about the precision of the operands and the sum, not luck."""
    x64, w64 = x.double().cpu(), weight.double().cpu()
    expected = x64 @ w64.T
    bound = rel * (x64.abs() @ w64.abs().T) + 1e-30
    error = (got.double().cpu() - expected).abs()
    assert got.shape == expected.shape
    assert (error <= bound).all(), f"worst error {(error / bound).max().item():.2f}x the bound"
