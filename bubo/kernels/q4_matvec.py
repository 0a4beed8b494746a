"""Matrix-vector products on Q4_0 / Q4_1 weights, repacked once into 32-bit words, fused by inductor.

Decode multiplies one activation row by every weight, so its cost is reading and expanding the
weights. Dequantizing a whole matrix per token (then F.linear) writes and re-reads 8 bytes of
float per weight; here one compiled loop reads the 4-bit codes and accumulates as it expands
them, vectorized over output rows, never materializing a float weight.

Layout (made by `pack_q4`, same bytes as the file's blocks, tiled as bubo/kernels/codes.py says):
`words` int32 [tiles, blocks, 4, TILE], where nibble s of words[t, b, w, i] is the code of weight
32b + 8w + s of output row t * TILE + i; `scale_offset` [tiles, blocks, 2, TILE], the block's scale
and offset, so that weight = code * scale + offset. Q4_1 stores exactly that (d, m); Q4_0 stores
w = d * (code - 8), i.e. offset = -8d. Both are float16 (5 bits a weight, as in the file) unless a
value would not survive it (codes.half_if_exact), then float32.
Output rows are innermost so that every load is a full-width vector; inductor's CPU code generator
falls back to slow partial loads for 8-wide uint8 vectors, which is why the codes travel as int32
words.
"""

import functools
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from bubo.gguf.quants import dequantize
from bubo.kernels.codes import (
    block_dots,
    block_sums,
    by_block,
    by_rows,
    expand_tiles,
    field_words,
    half_if_exact,
    tiled_by_rows,
    word_bits,
)
from bubo.kernels.compiled import StaticKernel
from bubo.kernels.int8_matvec import int8_matvec_enabled, int8_rows, q4_int8_matvec

__all__ = [
    "PACKABLE_Q4",
    "PackedQ4",
    "pack_q4",
    "q4_matvec",
    "q4_matvec_bits",
    "q4_matvec_reference",
    "q4_unpack",
]

PACKABLE_Q4 = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1})
_NIBBLES = 8  # per int32 word


@dataclass(frozen=True)
class PackedQ4:
    words: torch.Tensor  # int32 [tiles, blocks, 4, TILE]
    scale_offset: torch.Tensor  # float16 or float32 [tiles, blocks, 2, TILE]
    out_features: int

    @property
    def in_features(self) -> int:
        return self.words.shape[1] * self.words.shape[2] * _NIBBLES

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        return q4_matvec(x, self)

    def unpack(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return q4_unpack(self, start, stop, dtype)


def pack_q4(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> PackedQ4:
    """Q4_0 / Q4_1 blocks uint8 [out, row_bytes] -> the word layout above (4.5 / 5 bits per weight)."""
    if ggml_type not in PACKABLE_Q4:
        raise ValueError(f"pack_q4 takes Q4_0 or Q4_1 blocks, not {ggml_type.name}")
    header = 2 if ggml_type == GGMLQuantizationType.Q4_0 else 4
    out_features = raw.shape[0]
    blocks = raw.reshape(out_features, -1, header + 16)

    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        part = blocks[start:stop]
        halves = part[..., header:]
        # A block's byte j holds weight j (low nibble) and weight j + 16 (high nibble).
        words = field_words(torch.cat((halves & 0x0F, halves >> 4), dim=-1), 4)
        fields = part[..., :header].contiguous().view(torch.float16).to(torch.float32)
        scale = fields[..., 0]
        offset = -8 * scale if ggml_type == GGMLQuantizationType.Q4_0 else fields[..., 1]
        return words, torch.stack((scale, offset), dim=-1)

    words, scale_offset = tiled_by_rows(out_features, rows)
    return PackedQ4(words, half_if_exact(scale_offset), out_features)


def q4_unpack(packed: PackedQ4, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weight columns start:stop, transposed: [in_features, stop - start] in `dtype` (for a prefill's
    GEMM), expanded from the words in one compiled pass per whole tile."""
    tiled = (word_bits(packed.words), packed.scale_offset)
    return expand_tiles(_unpack_kernel(dtype), tiled, start, stop)


@functools.cache
def _unpack_kernel(dtype: torch.dtype) -> StaticKernel:
    def q4_unpack_tiles(bits: torch.Tensor, scale_offset: torch.Tensor) -> torch.Tensor:
        # [tiles, blocks, words, TILE] -> [blocks, words, nibble, tiles, TILE]: weight 8w + s of block b
        # of every output row, rows innermost, so the result is the transposed weight with no copy. Compiled
        # without FMA contraction: code * scale + offset rounds as the reference dequantizer's does.
        words = bits.view(torch.int32).permute(1, 2, 0, 3)
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=bits.device)[:, None, None]
        codes = ((words[:, :, None] >> shifts) & 0x0F).to(torch.float32)
        scale, offset = scale_offset.to(torch.float32).unbind(2)
        weight = codes * by_block(scale) + by_block(offset)
        return weight.to(dtype).reshape(words.shape[0] * words.shape[1] * _NIBBLES, -1)

    return StaticKernel(q4_unpack_tiles)


def _matvec(x: torch.Tensor, bits: torch.Tensor, scale_offset: torch.Tensor) -> torch.Tensor:
    # sum_b scale[b] * (x_b . codes_b) + offset[b] * sum(x_b): the inner dot product runs on codes alone.
    words = bits.view(torch.int32)
    sums = block_sums(x, words.shape[1])
    scale, offset = scale_offset.to(torch.float32).unbind(2)
    dots = block_dots(x, words, 4)
    return by_rows(x, [(d * scale + sums[r] * offset).sum(1).view(-1) for r, d in enumerate(dots)])


_compiled_matvec = StaticKernel(_matvec, fused=True)


def q4_matvec(x: torch.Tensor, packed: PackedQ4) -> torch.Tensor:
    """x [in_features] (float32) -> x W^T [out_features], in one compiled pass over the codes; x [rows,
    in_features] (a few rows) -> [rows, out_features], the codes expanded once for all rows."""
    return q4_matvec_bits(x, word_bits(packed.words), packed.scale_offset, packed.out_features)


def q4_matvec_bits(
    x: torch.Tensor, bits: torch.Tensor, scale_offset: torch.Tensor, out_features: int
) -> torch.Tensor:
    """`q4_matvec` on the packed tensors, the words as their float32 bits (`word_bits`): the form in
    which a compiled graph that contains the matvec takes them as inputs. The int8 kernel where it is on
    (bubo/kernels/int8_matvec.py), which reads the bits as they are, or the int32 words themselves."""
    if int8_matvec_enabled():
        return int8_rows(q4_int8_matvec, x, bits, scale_offset, out_features=out_features)
    out = _compiled_matvec(x, bits, scale_offset)
    return out if out.shape[-1] == out_features else out[..., :out_features]


def q4_matvec_reference(x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """The plain-torch product the kernel must match: dequantize the blocks, then a float64 matvec."""
    return dequantize(raw, ggml_type).double() @ x.double()
