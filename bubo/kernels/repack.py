"""Blocks of other ggml types repacked, exactly, into the layouts the compiled CPU matvecs read.

A Q4_K_M file holds Q4_K and Q6_K matrices, and Q5_0 / Q8_0 where a row isn't a whole number of
256-weight super-blocks (every matrix that reads a 576-wide hidden state in SmolLM2); a Q5_K_M file
Q5_K, Q6_K, Q5_1 and Q8_0. Each of these is, per run of 16 or 32 weights, an integer code times a
float32 scale (plus an offset), with scale and offset exact in float32: so they repack into the
layouts of the compiled matvecs, which then run them, the decode step included. Scales and offsets
beside the codes are kept in float16 where every one of a matrix is exact in it (Q5_1's d and m), else
in float32 (the K-quants' products below, as a rule); PackedQ8 carries its scales in its words.

- Q4_K -> PackedQ4 (bubo/kernels/q4_matvec.py). A super-block (d, dmin fp16; eight 6-bit scales
  and mins; 4-bit codes) is w = d * sc_j * q - dmin * m_j for sub-block j of 32 weights:
  scale = d * sc_j and offset = -(dmin * m_j), each an 11-bit mantissa times a 6-bit integer, exact.
  6 bits a weight against the file's 4.5.
- Q6_K -> PackedQ8 with 4-word blocks (bubo/kernels/q8_matvec.py): 16 sub-blocks of 16 weights,
  w = (d * sc_j) * (q - 32), q 6-bit, sc_j int8; the code q - 32 is a signed byte, the scale exact
  (11-bit mantissa times an 8-bit integer). 10 bits a weight against the file's 6.56: a byte
  expands with one AND (stored biased, see q8_matvec) where 6-bit fields would take more work per
  weight (the measurements that chose this are in the branch's notes).
- Q5_K -> PackedQ8Offset (bubo/kernels/q8_matvec.py): Q4_K's super-block with a fifth bit a code,
  so Q4_K's scale and offset; the code (0-31) a byte. 10 bits a weight against 5.5.
- Q5_0 -> PackedQ8 (8-word blocks, as Q8_0): w = d * (q - 16), q 5-bit; the code q - 16 is a
  signed byte. 9 bits a weight against 5.5, and it groups with Q8_0 matrices (`group_rows`), which
  Q4_K_M mixes with Q5_0 among the q/k/v projections.
- Q5_1 -> PackedQ8Offset (Q5_K_M's fallback, as Q5_0 is Q4_K_M's): w = d * q + m, the code q a byte,
  scale d and offset m as stored (float16). 9 bits a weight against 6.
- Q3_K -> PackedQ4 with blocks of 16 weights (2 words): w = (d * (sc_j - 32)) * (q - 4), the 3-bit q a
  nibble, scale = d * (sc_j - 32) (an 11-bit mantissa times a 6-bit integer) and offset = -4 * scale,
  both exact. 8 bits a weight against the file's 3.44; byte codes (PackedQ8's 4-word blocks, 10 bits)
  ran 17 % slower (3072x1024, 2 threads, 24 matrices cycled: 265 against 221 µs).
- Q2_K -> PackedQ4 with blocks of 16 weights (2 words): w = (d * sc_j) * q - dmin * m_j, the 2-bit
  code q a nibble, scale and offset (4-bit sc_j, m_j times an fp16) exact in float32. 8 bits a weight
  against the file's 2.63.
- IQ4_NL / IQ4_XS -> PackedQ8 (8-word blocks): w = scale * codebook[q], the 4-bit q indexing a table of
  16 signed bytes (ggml's kvalues_iq4nl): the looked-up value is the byte code, so no table is read at
  run time. IQ4_NL's scale is its fp16 d; IQ4_XS's d * (ls_j - 32) per 32 weights (6-bit ls_j). 9 bits
  a weight against 4.5 / 4.25. A matvec that kept the 4-bit indices would have to gather from the table
  per weight: inductor leaves such a gather scalar, 16x slower than this layout's (3072x1024, 2 threads).

Every layout takes more memory than the file's blocks: bubo/model/quantized_linear.py checks the memory
available before it repacks a matrix.
"""

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

from bubo.gguf.quants import (
    f16_field,
    iq4_nl_codes,
    iq4_xs_codes,
    iq4_xs_scales,
    k_scale_min,
    q2_k_codes,
    q2_k_scale_min,
    q3_k_codes,
    q3_k_scales,
    q4_k_codes,
    q5_0_codes,
    q5_1_codes,
    q5_k_codes,
    q6_k_codes,
    q6_k_scales,
    type_size,
)
from bubo.kernels.codes import half_if_exact, tiled_by_rows
from bubo.kernels.q4_matvec import PackedQ4, nibble_words
from bubo.kernels.q8_matvec import CODE_BIAS, PackedQ8, PackedQ8Offset, with_scales

__all__ = ["REPACKABLE", "Packed", "repack"]

Q = GGMLQuantizationType
# Rows of a repacked matrix, built from one run of rows' blocks [n_blocks, block bytes], each tensor
# [rows, ...]: PackedQ8's words with their scales, or the words and the scale and offset stacked (the
# blocks are decoded by bubo/gguf/quants.py's code readers).
Rows = Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]]
# A weight repacked for the CPU's compiled matvecs.
Packed = PackedQ4 | PackedQ8 | PackedQ8Offset


def _byte_words(codes: torch.Tensor) -> torch.Tensor:
    """Codes of 0..255 (any integer dtype) [rows, blocks, weights] -> int32 words [rows, blocks, weights
    / 4], byte s of word w holding weight 4w + s (little end first, as PackedQ8 reads them)."""
    return codes.to(torch.uint8).contiguous().view(torch.int32)


def _biased_words(codes: torch.Tensor) -> torch.Tensor:
    """Signed codes int8 as PackedQ8 stores them: `_byte_words` of code + CODE_BIAS, which is the two's
    complement byte with its sign bit flipped."""
    return _byte_words(codes.view(torch.uint8) ^ CODE_BIAS)


def _q4_k_rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    scale, low = k_scale_min(blocks)
    return nibble_words(q4_k_codes(blocks).view(n, -1, 32)), torch.stack((scale, -low), -1).view(n, -1, 2)


def _q2_k_rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    scale, low = q2_k_scale_min(blocks)
    return nibble_words(q2_k_codes(blocks).view(n, -1, 16)), torch.stack((scale, -low), -1).view(n, -1, 2)


def _q5_k_rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    scale, low = k_scale_min(blocks)
    return _byte_words(q5_k_codes(blocks).view(n, -1, 32)), torch.stack((scale, -low), -1).view(n, -1, 2)


def _q6_k_rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    return (with_scales(_biased_words(q6_k_codes(blocks).view(n, -1, 16)), q6_k_scales(blocks).view(n, -1)),)


def _q3_k_rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    scale = q3_k_scales(blocks)
    codes = q3_k_codes(blocks).view(n, -1, 16) + 4  # 0..7
    return nibble_words(codes), torch.stack((scale, -4 * scale), -1).view(n, -1, 2)


def _iq4_nl_rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    return (
        with_scales(_biased_words(iq4_nl_codes(blocks).view(n, -1, 32)), f16_field(blocks, 0).view(n, -1)),
    )


def _iq4_xs_rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    return (
        with_scales(_biased_words(iq4_xs_codes(blocks).view(n, -1, 32)), iq4_xs_scales(blocks).view(n, -1)),
    )


def _q5_0_rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    return (with_scales(_biased_words(q5_0_codes(blocks).view(n, -1, 32)), f16_field(blocks, 0).view(n, -1)),)


def _q5_1_rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    words = _byte_words(q5_1_codes(blocks).view(n, -1, 32))
    return words, torch.stack((f16_field(blocks, 0), f16_field(blocks, 2)), -1).view(n, -1, 2)


# The layout each type becomes, how a run of rows' blocks becomes that layout's tensors, and the bits a
# weight it takes (the per-block fields counted as stored: float16 only for Q5_1's, the file's own d, m).
REPACKABLE: dict[GGMLQuantizationType, tuple[type[Packed], Rows, int]] = {
    Q.Q4_K: (PackedQ4, _q4_k_rows, 6),
    Q.Q5_K: (PackedQ8Offset, _q5_k_rows, 10),
    Q.Q5_0: (PackedQ8, _q5_0_rows, 9),
    Q.Q5_1: (PackedQ8Offset, _q5_1_rows, 9),
    Q.Q6_K: (PackedQ8, _q6_k_rows, 10),
    Q.Q2_K: (PackedQ4, _q2_k_rows, 8),
    Q.Q3_K: (PackedQ4, _q3_k_rows, 8),
    Q.IQ4_NL: (PackedQ8, _iq4_nl_rows, 9),
    Q.IQ4_XS: (PackedQ8, _iq4_xs_rows, 9),
}


def repack(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> Packed:
    """Blocks of a type in REPACKABLE, uint8 [out, row_bytes] -> the packed layout its matvec reads."""
    if ggml_type not in REPACKABLE:
        raise ValueError(f"no repacking for {ggml_type.name}; it takes {sorted(t.name for t in REPACKABLE)}")
    layout, rows, _ = REPACKABLE[ggml_type]
    out_features, size = raw.shape[0], type_size(ggml_type)
    blocks = raw.reshape(out_features, -1, size)
    tensors = tiled_by_rows(
        out_features, lambda start, stop: rows(blocks[start:stop].reshape(-1, size), stop - start)
    )
    if layout is not PackedQ8:  # a scale and offset beside the words: float16 where exact
        tensors = (tensors[0], half_if_exact(tensors[1]))
    return layout(*tensors, out_features)
