"""Matrix-vector products on K-quant weights (Q2_K to Q6_K, IQ4_XS) kept in super-blocks, fused by inductor.

A K-quant super-block holds 256 weights in 8 runs of 32 or 16 runs of 16 ("sub-blocks"); a weight is
(d * sc_j) * q - dmin * m_j, with d, dmin the super-block's fp16 scales and sc_j, m_j small integers of
sub-block j (ggml's block_q4_K etc.; the codes and the integers are read by bubo/gguf/quants.py). The
layout keeps that form: the codes in 32-bit words, and per super-block the sub-blocks' integers as bytes
and d, dmin as float32, so a weight costs little more than in the file. The scale d * sc_j (an 11-bit
mantissa times an integer of at most 8 bits) is exact in float32 and is formed in the kernel, once per
sub-block: the products are those a per-sub-block float32 scale would give (the layout this replaced,
which took 6 bits a Q4_K weight against this one's 4.75, and ran no faster).

Layout (`PackedSuperBlocks`, tiled as bubo/kernels/codes.py says):
- `words` int32 [tiles, super-blocks, code words, TILE]: the stored codes, `code_bits`-bit fields packed
  fields_a_word to a word (codes.field_words), a group of weights at a time: field s of word w of group g
  holds weight g * group + w * fields_a_word + s of the super-block. A group is a sub-block where its
  codes fill whole words (2, 4, 8 bits); 3-, 5- and 6-bit codes (10, 6, 5 a word) are packed 128 weights
  at a time (the last word of each holding two to four unused fields), and a sub-block's codes may
  straddle two words.
- `fields` int32 [tiles, super-blocks, field words, TILE]: the sub-blocks' stored scale bytes (four
  a word, sub-block j at byte j % 4 of word j // 4), then as many of their min bytes where the type
  has mins.
- `factors` float32 [tiles, super-blocks, 1 or 2, TILE]: d, then dmin where the type has mins. A tensor of
  their own rather than float32 bits among the fields' words: inductor's C++ vectorizes no bit cast, and
  reinterpreting words as floats inside a kernel went lane by lane through a stack buffer, twice a
  super-block.
Stored values are unsigned (a field isolated by one AND, as the other layouts do): a signed code or scale
is stored minus its format's bias (Q6_K's code q - 32 as q, its int8 sc as sc + 128), and the kernel adds
the bias back: code_bias * scale * sum(x_j) once a sub-block, scale_bias exactly in the scale.

The matvec's loop takes one group a step. Why 128 weights for the packed widths: a whole super-block a
step (52 words of 6-bit codes) and 64 weights a step both streamed slower than 128, which kept pace with
the byte layout it replaced (benchmarks/RESULTS.md).

Bits a weight, against the file's: Q4_K 4.75 (4.5), Q5_K 6.25 (5.5), Q6_K 7.125 (6.56), Q3_K 3.875
(3.44), Q2_K 3.25 (2.63), IQ4_XS 8.375 (4.25: the codebook value as a byte, as IQ4_NL's PackedQ8 holds it,
since a kernel that looked the 4-bit index up in the table would gather per weight, which inductor leaves
scalar: many times slower). Q5_K, Q6_K and Q3_K took 8.75, 8.625 and 4.625 with their codes in bytes or nibbles.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType
from torch._inductor.inductor_prims import force_stride_order

from bubo.gguf.quants import (
    QK_K,
    f16_field,
    iq4_xs_codes,
    iq4_xs_sub_scales,
    k_sub_scales,
    q2_k_codes,
    q2_k_sub_scales,
    q3_k_codes,
    q3_k_sub_scales,
    q4_k_codes,
    q5_k_codes,
    q6_k_codes,
    q6_k_sub_scales,
)
from bubo.kernels.codes import (
    block_sums,
    by_block,
    by_rows,
    expand_tiles,
    field_words,
    fields_a_word,
    pairwise_sum,
    sub_block_dots,
    word_bits,
)
from bubo.kernels.compiled import StaticKernel
from bubo.kernels.int8_matvec import int8_matvec_enabled, int8_rows, q4_k_int8_matvec

__all__ = [
    "SUPER_BLOCK_FORMATS",
    "PackedSuperBlocks",
    "SuperBlockFormat",
    "super_block_matvec",
    "super_block_matvec_bits",
    "super_block_rows",
    "super_block_unpack",
]

Q = GGMLQuantizationType
_SCALES_A_WORD = 4  # sub-block bytes in a field word


@dataclass(frozen=True)
class SuperBlockFormat:
    """How one type's super-block is stored: weight = (d * (sc + scale_bias)) * (code + code_bias)
    - dmin * m, the last term only where `has_min`, each stored value unsigned."""

    code_bits: int  # a code's field in the words, 2 to 8 bits
    sub_blocks: int  # a super-block's runs of weights with a scale (and min) of their own
    code_bias: int
    scale_bias: int
    has_min: bool
    group: int = 0  # weights whose codes fill whole words together (0: a sub-block's)

    @property
    def sub_block_weights(self) -> int:
        return QK_K // self.sub_blocks

    @property
    def group_weights(self) -> int:
        return self.group or self.sub_block_weights

    @property
    def groups(self) -> int:
        return QK_K // self.group_weights

    @property
    def group_words(self) -> int:
        """Words holding a group's codes: fields_a_word of them a word, the last one's rest unused."""
        return -(-self.group_weights // fields_a_word(self.code_bits))

    @property
    def code_words(self) -> int:
        return self.groups * self.group_words

    @property
    def scale_words(self) -> int:
        return self.sub_blocks // _SCALES_A_WORD

    @property
    def field_words(self) -> int:
        """Scale bytes' words (and min bytes' words)."""
        return self.scale_words * self.factors

    @property
    def factors(self) -> int:
        """The super-block's float32 factors: d (and dmin)."""
        return 2 if self.has_min else 1

    @property
    def bits_a_weight(self) -> float:
        return (self.code_words + self.field_words + self.factors) * 32 / QK_K


SUPER_BLOCK_FORMATS: dict[GGMLQuantizationType, SuperBlockFormat] = {
    Q.Q4_K: SuperBlockFormat(code_bits=4, sub_blocks=8, code_bias=0, scale_bias=0, has_min=True),
    Q.Q5_K: SuperBlockFormat(code_bits=5, sub_blocks=8, code_bias=0, scale_bias=0, has_min=True, group=128),
    Q.Q6_K: SuperBlockFormat(
        code_bits=6, sub_blocks=16, code_bias=-32, scale_bias=-128, has_min=False, group=128
    ),
    Q.Q3_K: SuperBlockFormat(
        code_bits=3, sub_blocks=16, code_bias=-4, scale_bias=-32, has_min=False, group=128
    ),
    Q.Q2_K: SuperBlockFormat(code_bits=2, sub_blocks=16, code_bias=0, scale_bias=0, has_min=True),
    Q.IQ4_XS: SuperBlockFormat(code_bits=8, sub_blocks=8, code_bias=-128, scale_bias=-32, has_min=False),
}


@dataclass(frozen=True)
class _SuperBlocks:
    """One run of super-blocks decoded: codes [n, sub-blocks, weights] and sub-block integers [n,
    sub-blocks] as the format multiplies them (signed), d and dmin float32 [n, 1]."""

    codes: torch.Tensor
    scales: torch.Tensor
    d: torch.Tensor
    mins: torch.Tensor | None = None
    dmin: torch.Tensor | None = None


def _q4_k(blocks: torch.Tensor) -> _SuperBlocks:
    sc, m = k_sub_scales(blocks)
    return _SuperBlocks(q4_k_codes(blocks), sc, f16_field(blocks, 0), m, f16_field(blocks, 2))


def _q5_k(blocks: torch.Tensor) -> _SuperBlocks:
    sc, m = k_sub_scales(blocks)
    return _SuperBlocks(q5_k_codes(blocks), sc, f16_field(blocks, 0), m, f16_field(blocks, 2))


def _q6_k(blocks: torch.Tensor) -> _SuperBlocks:
    return _SuperBlocks(q6_k_codes(blocks), q6_k_sub_scales(blocks), f16_field(blocks, 208))


def _q3_k(blocks: torch.Tensor) -> _SuperBlocks:
    return _SuperBlocks(q3_k_codes(blocks), q3_k_sub_scales(blocks), f16_field(blocks, 108))


def _q2_k(blocks: torch.Tensor) -> _SuperBlocks:
    sc, m = q2_k_sub_scales(blocks)
    return _SuperBlocks(q2_k_codes(blocks), sc, f16_field(blocks, 80), m, f16_field(blocks, 82))


def _iq4_xs(blocks: torch.Tensor) -> _SuperBlocks:
    return _SuperBlocks(iq4_xs_codes(blocks), iq4_xs_sub_scales(blocks), f16_field(blocks, 0))


_READERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], _SuperBlocks]] = {
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.Q3_K: _q3_k,
    Q.Q2_K: _q2_k,
    Q.IQ4_XS: _iq4_xs,
}


@dataclass(frozen=True)
class PackedSuperBlocks:
    words: torch.Tensor  # int32 [tiles, super-blocks, code words, TILE]
    fields: torch.Tensor  # int32 [tiles, super-blocks, field words, TILE]
    factors: torch.Tensor  # float32 [tiles, super-blocks, d (and dmin), TILE]
    out_features: int
    ggml_type: GGMLQuantizationType

    @property
    def in_features(self) -> int:
        return self.words.shape[1] * QK_K

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        return super_block_matvec(x, self)

    def unpack(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return super_block_unpack(self, start, stop, dtype)


def super_block_rows(
    ggml_type: GGMLQuantizationType,
) -> Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]]:
    """How one run of n rows' super-blocks of a type in SUPER_BLOCK_FORMATS, uint8 [n_blocks, block bytes],
    becomes the layout's rows: (words [n, super-blocks, code words], fields [n, super-blocks, field
    words], factors [n, super-blocks, 1 or 2]), which bubo/kernels/repack.py tiles."""
    fmt, read = SUPER_BLOCK_FORMATS[ggml_type], _READERS[ggml_type]

    def rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        parts = read(blocks)
        codes = _unsigned(parts.codes, fmt.code_bias)
        fields = [field_words(_unsigned(parts.scales, fmt.scale_bias), 8)]
        if fmt.has_min:
            assert parts.mins is not None
            fields.append(field_words(parts.mins, 8))
        factors = [parts.d] if parts.dmin is None else [parts.d, parts.dmin]
        words = field_words(codes.view(n, -1, fmt.groups, fmt.group_weights), fmt.code_bits)
        return (
            words.view(n, -1, fmt.code_words),
            torch.cat(fields, dim=-1).view(n, -1, fmt.field_words),
            torch.stack(factors, dim=-1).to(torch.float32).view(n, -1, fmt.factors),
        )

    return rows


def _unsigned(values: torch.Tensor, bias: int) -> torch.Tensor:
    """values - bias, uint8: a format's codes or sub-block integers with its bias taken off, which puts them
    in 0..255, computed in uint8 modulo 256 (an int8 viewed as uint8 is its value modulo 256) rather than
    widened to int16 and narrowed again: two passes over every code fewer."""
    values = values.view(torch.uint8) if values.dtype == torch.int8 else values
    return values if bias == 0 else values + (-bias) % 256


def _scale_offset(
    fmt: SuperBlockFormat, field_bits: torch.Tensor, factors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every sub-block's scale d * (sc + scale_bias), and its offset -dmin * m where the format has mins
    (else None): float32 [tiles, super-blocks, sub-blocks, TILE], from the fields (codes.word_bits) and
    the factors."""
    fields = field_bits.view(torch.int32)
    tiles, n_super, _, lanes = fields.shape
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=fields.device)[:, None]
    n = fmt.scale_words

    def sub_block_bytes(first: int) -> torch.Tensor:
        words = fields[:, :, first : first + n, None, :]
        return ((words >> shifts) & 0xFF).to(torch.float32).view(tiles, n_super, fmt.sub_blocks, lanes)

    scale = factors[:, :, 0, None, :] * (sub_block_bytes(0) + fmt.scale_bias)
    if not fmt.has_min:
        return scale, None
    return scale, -(factors[:, :, 1, None, :] * sub_block_bytes(n))


def _group_words(fmt: SuperBlockFormat, bits: torch.Tensor) -> torch.Tensor:
    """The code words' float32 bits [tiles, super-blocks, code words, TILE] -> int32 [tiles, groups, words
    a group, TILE]: a view, a group's words (whole words of codes) together."""
    tiles, n_super, _, lanes = bits.shape
    return bits.view(torch.int32).view(tiles, n_super * fmt.groups, fmt.group_words, lanes)


@functools.cache
def _matvec_kernel(fmt: SuperBlockFormat) -> StaticKernel:
    def super_block_matvec_tiles(
        x: torch.Tensor, bits: torch.Tensor, field_bits: torch.Tensor, factors: torch.Tensor
    ) -> torch.Tensor:
        # sum_j scale_j * (x_j . codes_j + code_bias * sum(x_j)) + offset_j * sum(x_j) over every sub-block
        # j: the dot products run on the stored codes alone (codes.sub_block_dots, several rows of x at once).
        tiles, n_super, _, lanes = bits.shape
        n_groups, runs = n_super * fmt.groups, fmt.group_weights // fmt.sub_block_weights
        scale, offset = _scale_offset(fmt, field_bits, factors)
        if fmt.code_bias:
            offset = fmt.code_bias * scale if offset is None else fmt.code_bias * scale + offset
        # Per group of whole words, [tiles, groups, runs of a group, TILE]: one step of the loop a group.
        scale = scale.view(tiles, n_groups, runs, lanes)
        offset = None if offset is None else offset.view(tiles, n_groups, runs, lanes)
        dots = sub_block_dots(x, _group_words(fmt, bits), fmt.code_bits, fmt.sub_block_weights)
        sums = block_sums(x, n_super * fmt.sub_blocks).view(-1, 1, n_groups, runs)
        outputs = []
        for r, row_dots in enumerate(dots):
            terms = []
            for j, dot in enumerate(row_dots):
                term = dot * scale[:, :, j]
                terms.append(term if offset is None else term + sums[r][:, :, j, None] * offset[:, :, j])
            outputs.append(pairwise_sum(terms).sum(1).view(-1))
        return by_rows(x, outputs)

    return StaticKernel(super_block_matvec_tiles, fused=True)


@functools.cache
def _unpack_kernel(fmt: SuperBlockFormat, dtype: torch.dtype) -> StaticKernel:
    def super_block_unpack_tiles(
        bits: torch.Tensor, field_bits: torch.Tensor, factors: torch.Tensor
    ) -> torch.Tensor:
        # [tiles, super-blocks, words, TILE] -> [sub-blocks, weights, 1, tiles, TILE]: the
        # transposed weight (see q4_matvec's unpacking). Compiled without FMA contraction, and in the reference
        # dequantizer's order, (code + code_bias) * scale + offset, the first product and sum exact: bit for
        # bit its result.
        tiles, n_super, _, lanes = bits.shape
        words = _group_words(fmt, bits).permute(1, 2, 0, 3)
        per_word = fields_a_word(fmt.code_bits)
        shifts = torch.arange(
            0, per_word * fmt.code_bits, fmt.code_bits, dtype=torch.int32, device=bits.device
        )
        fields = (words[:, :, None] >> shifts[:, None, None]) & ((1 << fmt.code_bits) - 1)
        codes = fields.reshape(n_super * fmt.groups, -1, tiles, lanes)[:, : fmt.group_weights]
        # A sub-block's codes as one of codes.by_block's blocks.
        codes = codes.reshape(-1, fmt.sub_block_weights, 1, tiles, lanes).to(torch.float32)
        scale, offset = _scale_offset(fmt, field_bits, factors)
        # Stored once: left as expressions, inductor would take each sub-block's bytes apart again for
        # every one of its weights.
        scale = force_stride_order(scale, scale.stride())
        weight = (codes + fmt.code_bias) * by_block(scale.reshape(tiles, -1, lanes))
        if offset is not None:
            offset = force_stride_order(offset, offset.stride())
            weight = weight + by_block(offset.reshape(tiles, -1, lanes))
        return weight.to(dtype).reshape(-1, tiles * lanes)

    return StaticKernel(super_block_unpack_tiles)


def super_block_matvec(x: torch.Tensor, packed: PackedSuperBlocks) -> torch.Tensor:
    """x [in_features] (float32) -> x W^T [out_features], in one compiled pass over the codes; x [rows,
    in_features] (a few rows) -> [rows, out_features], the codes expanded once for all rows."""
    tensors = (word_bits(packed.words), word_bits(packed.fields), packed.factors)
    return super_block_matvec_bits(x, *tensors, packed.out_features, packed.ggml_type)


def super_block_matvec_bits(
    x: torch.Tensor,
    bits: torch.Tensor,
    field_bits: torch.Tensor,
    factors: torch.Tensor,
    out_features: int,
    ggml_type: GGMLQuantizationType,
) -> torch.Tensor:
    """`super_block_matvec` on the packed tensors as their float32 bits (codes.word_bits): the form in
    which a compiled graph that contains the matvec takes them as inputs. Q4_K runs the int8 kernel where
    it is on (bubo/kernels/int8_matvec.py)."""
    if ggml_type == Q.Q4_K and int8_matvec_enabled():
        return int8_rows(q4_k_int8_matvec, x, bits, field_bits, factors, out_features=out_features)
    out = _matvec_kernel(SUPER_BLOCK_FORMATS[ggml_type])(x, bits, field_bits, factors)
    return out if out.shape[-1] == out_features else out[..., :out_features]


def super_block_unpack(
    packed: PackedSuperBlocks, start: int, stop: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Weight columns start:stop, transposed: [in_features, stop - start] in `dtype` (for a prefill's
    GEMM), expanded from the words in one compiled pass per whole tile."""
    kernel = _unpack_kernel(SUPER_BLOCK_FORMATS[packed.ggml_type], dtype)
    tensors = (word_bits(packed.words), word_bits(packed.fields), packed.factors)
    return expand_tiles(kernel, tensors, start, stop)
