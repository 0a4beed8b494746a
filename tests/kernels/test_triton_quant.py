"""triton_quant.dequantize_tile against gguf's numpy dequantizers, bit for bit, on random blocks."""

import gguf
import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl

from bubo.kernels.triton_quant import (
    check_weight,
    codebook,
    dequantize_tile,
    fp16_view,
    interpreting,
)
from bubo.kernels.triton_support import TRITON_TYPES
from tests.kernels.quant_blocks import ALL_TYPES, device, ragged_width, random_blocks, reference_weight

Q = gguf.GGMLQuantizationType


@triton.jit
def _dequantize_kernel(
    w_ptr,
    h_ptr,
    lut_ptr,
    out_ptr,
    N,
    K,
    row_bytes,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    w = dequantize_tile(w_ptr, h_ptr, lut_ptr, rows, rows < N, k0, K, row_bytes, QTYPE, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], w, mask=mask)


def _dequantize(raw: torch.Tensor, qtype: Q, in_features: int) -> torch.Tensor:
    out = torch.full((raw.shape[0], in_features), float("nan"), device=raw.device)
    grid = (triton.cdiv(raw.shape[0], 8), triton.cdiv(in_features, 64))
    _dequantize_kernel[grid](
        raw,
        fp16_view(raw),
        codebook(raw.device),
        out,
        raw.shape[0],
        in_features,
        raw.shape[1],
        int(qtype),
        8,
        64,
    )
    return out


def test_the_tested_types_are_the_supported_ones() -> None:
    assert set(ALL_TYPES) == TRITON_TYPES


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_tile_matches_gguf_bit_for_bit(qtype: Q) -> None:
    in_features = ragged_width(qtype)
    # 11 rows: not a whole number of 8-row tiles; scales from zero and fp16 subnormals to 300.
    raw = random_blocks(
        qtype, 11, in_features, seed=int(qtype), magnitudes=(0.0, 1e-7, 1e-4, 1e-2, 1.0, 300.0)
    )
    got = _dequantize(torch.from_numpy(raw).to(device()), qtype, in_features).cpu()
    expected = reference_weight(raw, qtype).float()
    if interpreting():
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (
            f"{(got != expected).sum().item()} of {got.numel()} values differ"
        )
    else:
        # Compiled, a multiply-then-subtract may fuse into one FMA, which rounds once instead of
        # twice: off by at most an ulp of the block's larger term.
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        scale = expected.view(11, -1, block).abs().amax(dim=-1, keepdim=True).expand(-1, -1, block)
        assert ((got - expected).abs() <= 2**-22 * scale.reshape(11, -1)).all()


def test_check_weight_rejects_what_the_kernels_cannot_read() -> None:
    raw = torch.zeros(4, 34, dtype=torch.uint8)
    check_weight(raw, Q.Q8_0, 32)
    with pytest.raises(ValueError, match="do not read IQ2_XXS"):
        check_weight(raw, Q.IQ2_XXS, 256)
    with pytest.raises(ValueError, match="do not hold 64 weights"):
        check_weight(raw, Q.Q8_0, 64)
    with pytest.raises(ValueError, match="do not hold 48 weights"):
        check_weight(raw, Q.Q8_0, 48)
    with pytest.raises(ValueError, match="contiguous uint8"):
        check_weight(raw.float(), Q.Q8_0, 32)
    with pytest.raises(ValueError, match="contiguous uint8"):
        check_weight(torch.zeros(4, 68, dtype=torch.uint8)[:, :34], Q.Q8_0, 32)
