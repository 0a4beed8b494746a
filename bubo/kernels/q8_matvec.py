"""Matrix-vector products on Q8_0 weights, repacked once into 32-bit words, fused by inductor.

The Q8_0 sibling of `q4_matvec` (see there for why): `words` int32 [tiles, blocks, words + 1, TILE],
where byte s of words[t, b, w, i] (little end first) holds the code of weight 4 * words * b + 4w + s
of output row t * TILE + i, and the block's last word is the float32 bits of its scale; weight =
code * scale. Q8_0 has 8 code words (32 weights) a block, its bytes as in the file but for the sign
bit; other types whose weights are a signed code of at most 8 bits times a per-block scale are
repacked into it (bubo/kernels/repack.py: Q5_0, IQ4_NL). The scale rides in the
words so that the matvec streams one array, which measured faster than a scale array beside the words
(float16 or float32), for 2 bytes a block more. `PackedQ8Offset` keeps a per-block offset next to the scale, `scale_offset`
[tiles, blocks, 2, TILE] (float16 where exact, codes.half_if_exact), weight = code * scale + offset,
for codes with a per-block minimum (Q5_1).

PackedQ8 stores each signed code c (-128..127) as the unsigned byte c + 128 (the file's byte with its
sign bit flipped), PackedQ8Offset its codes (0..31) as they are: every byte is then an unsigned field,
which the matvec isolates with one AND in place (bubo/kernels/codes.py), where a signed byte needs two
shifts to sign-extend; the bias comes back as one term a block, 128 * scale * sum(x_b).
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
    tiled_by_rows,
    word_bits,
)
from bubo.kernels.compiled import StaticKernel
from bubo.kernels.int8_matvec import int8_matvec_enabled, int8_rows, q8_int8_matvec

__all__ = [
    "CODE_BIAS",
    "PackedQ8",
    "PackedQ8Offset",
    "pack_q8",
    "q8_matvec",
    "q8_matvec_bits",
    "q8_matvec_reference",
    "q8_offset_matvec_bits",
    "q8_unpack",
    "signed_to_biased",
    "with_scales",
]

_BYTES = 4  # per int32 word
CODE_BIAS = 128  # PackedQ8's byte = code + CODE_BIAS
# XOR with this flips the sign bit of every byte of a word: signed codes <-> biased ones.
_SIGN_BITS = int.from_bytes(bytes([0x80] * _BYTES), "little", signed=True)


def signed_to_biased(words: torch.Tensor) -> torch.Tensor:
    """int32 words of four signed byte codes -> the same codes biased by CODE_BIAS (PackedQ8's words)."""
    return words ^ _SIGN_BITS


def with_scales(words: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Code words int32 [rows, blocks, words] and scales [rows, blocks] (exact in float32) -> PackedQ8's
    rows of words [rows, blocks, words + 1], each block's scale's float32 bits last."""
    return torch.cat((words, scale.to(torch.float32).contiguous().view(torch.int32)[..., None]), dim=-1)


@dataclass(frozen=True)
class PackedQ8:
    words: torch.Tensor  # int32 [tiles, blocks, code words + 1, TILE], the scale's bits last
    out_features: int

    @property
    def in_features(self) -> int:
        return self.words.shape[1] * (self.words.shape[2] - 1) * _BYTES

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        return q8_matvec(x, self)

    def unpack(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return q8_unpack(self, start, stop, dtype)


@dataclass(frozen=True)
class PackedQ8Offset:
    words: torch.Tensor  # int32 [tiles, blocks, words, TILE]
    scale_offset: torch.Tensor  # float16 or float32 [tiles, blocks, 2, TILE]
    out_features: int

    @property
    def in_features(self) -> int:
        return self.words.shape[1] * self.words.shape[2] * _BYTES

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        return q8_offset_matvec_bits(x, word_bits(self.words), self.scale_offset, self.out_features)

    def unpack(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return q8_unpack(self, start, stop, dtype)


def pack_q8(raw: torch.Tensor) -> PackedQ8:
    """Q8_0 blocks uint8 [out, row_bytes] -> the word layout above."""
    out_features = raw.shape[0]
    blocks = raw.reshape(out_features, -1, 34)

    def rows(start: int, stop: int) -> tuple[torch.Tensor]:
        part = blocks[start:stop]
        words = signed_to_biased(part[..., 2:].contiguous().view(torch.int32))  # [rows, blocks, 8]
        scale = part[..., :2].contiguous().view(torch.float16).view(stop - start, -1)
        return (with_scales(words, scale),)

    (words,) = tiled_by_rows(out_features, rows)
    return PackedQ8(words, out_features)


def q8_unpack(
    packed: PackedQ8 | PackedQ8Offset, start: int, stop: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Weight columns start:stop, transposed: [in_features, stop - start] in `dtype` (for a prefill's
    GEMM), expanded from the words in one compiled pass per whole tile (see q4_unpack)."""
    with_offset = isinstance(packed, PackedQ8Offset)
    tiled = (word_bits(packed.words), *((packed.scale_offset,) if with_offset else ()))  # type: ignore[union-attr]
    return expand_tiles(_unpack_kernel(with_offset, dtype), tiled, start, stop)


@functools.cache
def _unpack_kernel(with_offset: bool, dtype: torch.dtype) -> StaticKernel:
    def q8_unpack_tiles(bits: torch.Tensor, *fields: torch.Tensor) -> torch.Tensor:
        # [tiles, blocks, words, TILE] -> [blocks, words, byte, tiles, TILE], the transposed weight (see
        # q4_unpack). PackedQ8's bytes are biased codes, PackedQ8Offset's the codes themselves; the
        # subtraction is exact, and without FMA contraction the rest rounds as the reference does.
        if not with_offset:
            bits, scale = bits[:, :, :-1], bits[:, :, -1].view(torch.float32)
        words = bits.view(torch.int32).permute(1, 2, 0, 3)
        shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=bits.device)[:, None, None]
        codes = ((words[:, :, None] >> shifts) & 0xFF).to(torch.float32)
        if with_offset:
            scale, offset = fields[0].to(torch.float32).unbind(2)
            weight = codes * by_block(scale) + by_block(offset)
        else:
            weight = (codes - CODE_BIAS) * by_block(scale)
        return weight.to(dtype).reshape(words.shape[0] * words.shape[1] * _BYTES, -1)

    return StaticKernel(q8_unpack_tiles)


def _matvec(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    # sum_b scale[b] * (x_b . (bytes_b - CODE_BIAS)): the inner dot product runs on the bytes alone
    # (bubo/kernels/codes.py's block_dots, the codes of several rows of x expanded once).
    words, scale = bits[:, :, :-1].view(torch.int32), bits[:, :, -1].view(torch.float32)
    sums = block_sums(x, words.shape[1])
    dots = block_dots(x, words, 8)
    return by_rows(x, [((d - CODE_BIAS * sums[r]) * scale).sum(1).view(-1) for r, d in enumerate(dots)])


def _offset_matvec(x: torch.Tensor, bits: torch.Tensor, scale_offset: torch.Tensor) -> torch.Tensor:
    # sum_b scale[b] * (x_b . codes_b) + offset[b] * sum(x_b)
    words = bits.view(torch.int32)
    scale, offset = scale_offset.to(torch.float32).unbind(2)
    sums = block_sums(x, words.shape[1])
    dots = block_dots(x, words, 8)
    return by_rows(x, [(d * scale + sums[r] * offset).sum(1).view(-1) for r, d in enumerate(dots)])


_compiled_matvec = StaticKernel(_matvec, fused=True)
_compiled_offset_matvec = StaticKernel(_offset_matvec, fused=True)


def q8_matvec(x: torch.Tensor, packed: PackedQ8) -> torch.Tensor:
    """x [in_features] (float32) -> x W^T [out_features], in one compiled pass over the codes; x [rows,
    in_features] -> [rows, out_features] (see q4_matvec)."""
    return q8_matvec_bits(x, word_bits(packed.words), packed.out_features)


def q8_matvec_bits(x: torch.Tensor, bits: torch.Tensor, out_features: int) -> torch.Tensor:
    """`q8_matvec` on the packed words as their float32 bits (see q4_matvec_bits); the int8 kernel where it
    is on (bubo/kernels/int8_matvec.py)."""
    if int8_matvec_enabled():
        return int8_rows(q8_int8_matvec, x, bits, out_features=out_features)
    out = _compiled_matvec(x, bits)
    return out if out.shape[-1] == out_features else out[..., :out_features]


def q8_offset_matvec_bits(
    x: torch.Tensor, bits: torch.Tensor, scale_offset: torch.Tensor, out_features: int
) -> torch.Tensor:
    """The matvec of a PackedQ8Offset on its tensors, the words as their float32 bits (see q4_matvec_bits)."""
    out = _compiled_offset_matvec(x, bits, scale_offset)
    return out if out.shape[-1] == out_features else out[..., :out_features]


def q8_matvec_reference(x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """The plain-torch product the kernel must match: dequantize the blocks, then a float64 matvec."""
    return dequantize(raw, GGMLQuantizationType.Q8_0).double() @ x.double()
