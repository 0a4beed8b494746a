"""Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 / Q2_K / Q3_K / IQ4_NL / IQ4_XS blocks repacked for the compiled
matvecs (the K-quants and IQ4_XS as super-blocks), against gguf's numpy dequantizer (bit for bit) and a
float64 matvec on it: random blocks, and the real tensors of Gemma 3 270M Q4_K_M. The float matvecs, with
the int8 ones off (those are tests/kernels/test_int8_matvec.py's)."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from bubo.gguf import GGUFFile
from bubo.kernels import codes
from bubo.kernels.q8_matvec import PackedQ8, PackedQ8Offset
from bubo.kernels.repack import REPACKABLE, repack
from bubo.kernels.super_block_matvec import PackedSuperBlocks
from tests.kernels.k_blocks import random_blocks

Q = gguf.GGMLQuantizationType


# The float matvecs, exact activations (tests/conftest.py); the int8 ones: tests/kernels/test_int8_matvec.py.
pytestmark = pytest.mark.usefixtures("float_matvecs")


LAYOUT = {
    Q.Q4_K: PackedSuperBlocks,
    Q.Q5_K: PackedSuperBlocks,
    Q.Q6_K: PackedSuperBlocks,
    Q.Q5_0: PackedQ8,
    Q.Q5_1: PackedQ8Offset,
    Q.Q2_K: PackedSuperBlocks,
    Q.Q3_K: PackedSuperBlocks,
    Q.IQ4_NL: PackedQ8,
    Q.IQ4_XS: PackedSuperBlocks,
}


def _assert_unpacks_exactly(raw: np.ndarray, qtype: Q) -> None:
    packed = repack(torch.from_numpy(raw), qtype)
    assert isinstance(packed, LAYOUT[qtype])
    weight = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    rows = raw.shape[0]
    assert packed.out_features == rows and packed.in_features == weight.shape[1]
    assert torch.equal(packed.unpack(0, rows).T, weight)
    assert torch.equal(packed.unpack(3, rows - 2).T, weight[3 : rows - 2])
    assert torch.equal(packed.unpack(3, rows - 2, torch.bfloat16).T, weight[3 : rows - 2].to(torch.bfloat16))
    # Q5_1's scales and offsets are the file's fp16 d and m: stored as float16.
    assert qtype != Q.Q5_1 or packed.scale_offset.dtype == torch.float16


@pytest.mark.parametrize("qtype", list(REPACKABLE))
def test_unpack_is_bit_exact(qtype: Q) -> None:
    _assert_unpacks_exactly(random_blocks(qtype, 2 * codes.TILE + 3, 512, seed=1), qtype)


# One compiled shape per layout: 19 rows (a padded last tile), two super-blocks a row.
@pytest.mark.parametrize("qtype", list(REPACKABLE))
def test_matvec_matches_float64_reference(qtype: Q) -> None:
    raw = random_blocks(qtype, 19, 512, seed=2)
    packed = repack(torch.from_numpy(raw), qtype)
    x = torch.randn(512, generator=torch.Generator().manual_seed(3))
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float64)) @ x.double()
    with torch.inference_mode():
        got = packed.matvec(x)
    assert got.shape == (19,)
    # float32 sums of 512 products in another order than float64's: a few ulps of |y| (up to ~100).
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


# How a super-block format's rows share the expanded codes: runs within words (Q4_K, Q2_K, IQ4_XS) and
# straddling them (Q5_K), with mins (Q4_K, Q5_K, Q2_K) and biases (IQ4_XS); and Q5_1's PackedQ8Offset.
# Every format's codes are test_matvec_matches_float64_reference's; Q6_K's and Q3_K's several-row graphs
# (the other straddling widths) add no path of their own and take about a minute each to compile on a
# slow CPU.
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q2_K, Q.IQ4_XS, Q.Q5_1])
def test_matvec_of_several_rows_is_each_rows_matvec(qtype: Q) -> None:
    # A verify pass multiplies its few tokens' rows in one pass over the codes: each row's result is the
    # one its own matvec gives, bit for bit (a speculative round's greedy tokens are plain decoding's).
    raw = random_blocks(qtype, 19, 512, seed=4)
    packed = repack(torch.from_numpy(raw), qtype)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5))
    expected = x.double() @ torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float64)).T
    with torch.inference_mode():
        got = packed.matvec(x)
        rows = [packed.matvec(row) for row in x]
    assert got.shape == (3, 19)
    # float32 sums of 512 products: errors relative to the largest output (random Q6_K rows reach ~1000).
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-6 * expected.abs().max().item())
    for row, alone in zip(got, rows, strict=True):
        assert torch.equal(row, alone)


@pytest.mark.parametrize("qtype", list(REPACKABLE))
def test_packing_in_row_steps_matches_the_blocks(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codes, "PACK_ROWS", 2 * codes.TILE)
    _assert_unpacks_exactly(random_blocks(qtype, 5 * codes.TILE + 3, 256, seed=4), qtype)


@pytest.mark.parametrize("qtype", list(REPACKABLE))
def test_bits_a_weight_are_what_the_layout_holds(qtype: Q) -> None:
    # The loader's memory check counts REPACKABLE's bits (quantized_linear.PACKED_BITS): they must be the truth.
    rows = 4 * codes.TILE
    packed = repack(torch.from_numpy(random_blocks(qtype, rows, 1024, seed=6)), qtype)
    held = sum(t.numel() * t.element_size() for t in vars(packed).values() if isinstance(t, torch.Tensor))
    assert held * 8 / (rows * 1024) == REPACKABLE[qtype][2]


def test_rejects_other_types() -> None:
    with pytest.raises(ValueError, match="no repacking for F16"):
        repack(torch.zeros(2, 512, dtype=torch.uint8), Q.F16)


def test_real_k_quant_tensors_unpack_exactly(gemma3_path: Path) -> None:
    # Layer 0 of Gemma 3 270M Q4_K_M: attn_output Q4_K, ffn_down Q6_K, attn_q Q5_0 (trained weights).
    names = {
        Q.Q4_K: "blk.0.attn_output.weight",
        Q.Q6_K: "blk.0.ffn_down.weight",
        Q.Q5_0: "blk.0.attn_q.weight",
    }
    with GGUFFile(gemma3_path) as model:
        for qtype, name in names.items():
            tensor = model.tensors[name]
            assert tensor.ggml_type == qtype, name
            _assert_unpacks_exactly(tensor.raw.numpy().reshape(tensor.shape[0], -1), qtype)
