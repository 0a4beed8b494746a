"""Blocks of other ggml types repacked, exactly, into the layouts the compiled CPU matvecs read.

The K-quants (Q2_K to Q6_K) and IQ4_XS keep their super-blocks: their layout and row builder are
bubo/kernels/super_block_matvec.py's, tiled here like the rest. The other types here are, per run of 32
weights, an integer code times a scale (plus an offset), both exact in float32, so they repack into the
layouts of the Q8_0 matvec, which then runs them, the decode step included. A Q4_K_M file holds Q5_0 / Q8_0 where a row isn't a whole number of 256-weight super-blocks
(every matrix that reads a 576-wide hidden state in SmolLM2), a Q5_K_M file Q5_1.

- Q5_0 -> PackedQ8 (8-word blocks, as Q8_0): w = d * (q - 16), q 5-bit; the code q - 16 is a
  signed byte. 9 bits a weight against 5.5, and it groups with Q8_0 matrices (`group_rows`), which
  Q4_K_M mixes with Q5_0 among the q/k/v projections.
- Q5_1 -> PackedQ8Offset: w = d * q + m, the code q a byte, scale d and offset m as stored (float16).
  9 bits a weight against 6.
- Q6_K -> PackedQ6KInt8 instead where the int8 matvecs run (bubo/kernels/int8_matvec.py): its codes'
  low nibbles and high bits in words of their own, whole bytes for integer dot products.
- IQ4_NL -> PackedQ8 (8-word blocks): w = d * codebook[q], the 4-bit q indexing a table of 16 signed
  bytes (ggml's kvalues_iq4nl): the looked-up value is the byte code, so no table is read at run time.
  9 bits a weight against 4.5. A matvec that kept the 4-bit indices would have to gather from the table
  per weight: inductor leaves such a gather scalar, many times slower than this layout.

Every layout takes more memory than the file's blocks: bubo/model/quantized_linear.py checks the memory
available before it repacks a matrix.
"""

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

from bubo.gguf.quants import f16_field, iq4_nl_codes, q5_0_codes, q5_1_codes, type_size
from bubo.kernels.codes import field_words, half_if_exact, tiled_by_rows
from bubo.kernels.int8_matvec import PackedQ6KInt8, int8_matvec_enabled, q6_k_int8_rows
from bubo.kernels.q4_matvec import PackedQ4
from bubo.kernels.q8_matvec import CODE_BIAS, PackedQ8, PackedQ8Offset, with_scales
from bubo.kernels.super_block_matvec import SUPER_BLOCK_FORMATS, PackedSuperBlocks, super_block_rows

__all__ = ["REPACKABLE", "Packed", "repack"]

Q = GGMLQuantizationType
# Rows of a repacked matrix, built from one run of rows' blocks [n_blocks, block bytes], each tensor
# [rows, ...]: PackedQ8's words with their scales, the words and the scale and offset stacked, or a
# super-block layout's words and fields (the blocks are decoded by bubo/gguf/quants.py's code readers).
Rows = Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]]
# A weight repacked for the CPU's compiled matvecs.
Packed = PackedQ4 | PackedQ8 | PackedQ8Offset | PackedSuperBlocks | PackedQ6KInt8


def _biased_words(codes: torch.Tensor) -> torch.Tensor:
    """Signed codes int8 as PackedQ8 stores them: the byte words (codes.field_words) of code + CODE_BIAS,
    which is the two's complement byte with its sign bit flipped."""
    return field_words(codes.view(torch.uint8) ^ CODE_BIAS, 8)


def _iq4_nl_rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    return (
        with_scales(_biased_words(iq4_nl_codes(blocks).view(n, -1, 32)), f16_field(blocks, 0).view(n, -1)),
    )


def _q5_0_rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    return (with_scales(_biased_words(q5_0_codes(blocks).view(n, -1, 32)), f16_field(blocks, 0).view(n, -1)),)


def _q5_1_rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    words = field_words(q5_1_codes(blocks).view(n, -1, 32), 8)
    return words, torch.stack((f16_field(blocks, 0), f16_field(blocks, 2)), -1).view(n, -1, 2)


# The layout each type becomes, how a run of rows' blocks becomes that layout's tensors, and the bits a
# weight it takes (the per-block fields counted as stored: float16 only for Q5_1's, the file's own d, m).
REPACKABLE: dict[GGMLQuantizationType, tuple[type[Packed], Rows, float]] = {
    Q.Q5_0: (PackedQ8, _q5_0_rows, 9),
    Q.Q5_1: (PackedQ8Offset, _q5_1_rows, 9),
    Q.IQ4_NL: (PackedQ8, _iq4_nl_rows, 9),
} | {t: (PackedSuperBlocks, super_block_rows(t), fmt.bits_a_weight) for t, fmt in SUPER_BLOCK_FORMATS.items()}


def repack(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> Packed:
    """Blocks of a type in REPACKABLE, uint8 [out, row_bytes] -> the packed layout its matvec reads."""
    if ggml_type not in REPACKABLE:
        raise ValueError(f"no repacking for {ggml_type.name}; it takes {sorted(t.name for t in REPACKABLE)}")
    layout, rows, _ = REPACKABLE[ggml_type]
    if ggml_type == Q.Q6_K and int8_matvec_enabled():
        layout, rows = PackedQ6KInt8, q6_k_int8_rows
    out_features, size = raw.shape[0], type_size(ggml_type)
    blocks = raw.reshape(out_features, -1, size)
    tensors = tiled_by_rows(
        out_features, lambda start, stop: rows(blocks[start:stop].reshape(-1, size), stop - start)
    )
    if layout is PackedSuperBlocks:
        return PackedSuperBlocks(*tensors, out_features, ggml_type)
    if layout is PackedQ6KInt8:
        return PackedQ6KInt8(*tensors, out_features)
    if layout is not PackedQ8:  # a scale and offset beside the words: float16 where exact
        tensors = (tensors[0], half_if_exact(tensors[1]))
    return layout(*tensors, out_features)
