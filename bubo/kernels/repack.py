"""Blocks of other ggml types repacked, exactly, into the layouts the compiled CPU matvecs read.

A Q4_K_M file holds Q4_K and Q6_K matrices, and Q5_0 / Q8_0 where a row isn't a whole number of
256-weight super-blocks (every matrix that reads a 576-wide hidden state in SmolLM2). Each of these
is, per run of 16 or 32 weights, an integer code times a float32 scale (plus an offset), with scale
and offset exact in float32: so they repack into the existing layouts and run through the existing
kernels, the decode step included, with no new kernel to compile.

- Q4_K -> PackedQ4 (bubo/kernels/q4_matvec.py). A super-block (d, dmin fp16; eight 6-bit scales
  and mins; 4-bit codes) is w = d * sc_j * q - dmin * m_j for sub-block j of 32 weights:
  scale = d * sc_j and offset = -(dmin * m_j), each an 11-bit mantissa times a 6-bit integer, exact.
  4.5 bits a weight, as in the file.
- Q6_K -> PackedQ8 with 4-word blocks (bubo/kernels/q8_matvec.py): 16 sub-blocks of 16 weights,
  w = (d * sc_j) * (q - 32), q 6-bit, sc_j int8; the code q - 32 is a signed byte, the scale exact
  (11-bit mantissa times an 8-bit integer). 10 bits a weight against the file's 6.56: the bytes
  expand with two shifts where 6-bit fields would take more work per weight (the measurements
  that chose this are in the branch's notes).
- Q5_0 -> PackedQ8 (8-word blocks, as Q8_0): w = d * (q - 16), q 5-bit; the code q - 16 is a
  signed byte. 9 bits a weight against 5.5, and it groups with Q8_0 matrices (`group_rows`), which
  Q4_K_M mixes with Q5_0 among the q/k/v projections.
"""

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

from bubo.kernels.codes import tiled_by_rows
from bubo.kernels.q4_matvec import PackedQ4, nibble_words
from bubo.kernels.q8_matvec import PackedQ8

__all__ = ["REPACKABLE", "pack_q4_k", "pack_q5_0", "pack_q6_k", "repack"]

Q = GGMLQuantizationType


def _f16(part: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of every block of `part` [rows, blocks, bytes], as float32."""
    return part[..., offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)[..., 0]


def _signed_bytes_words(codes: torch.Tensor) -> torch.Tensor:
    """Signed codes (-128..127, any integer dtype) [rows, blocks, weights] -> int32 words [rows, blocks,
    weights / 4], byte s of word w holding weight 4w + s (little end first, as PackedQ8 reads them)."""
    return codes.to(torch.int8).contiguous().view(torch.int32)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes [..., 12] -> eight 6-bit scales and eight 6-bit mins, float32 [..., 8] each: the
    first four in the low 6 bits of bytes 0-3 / 4-7, the last four from the nibbles of bytes 8-11 with
    their top 2 bits in the top bits of bytes 0-3 / 4-7."""
    low_scales, low_mins, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat((low_scales & 0x3F, (rest & 0x0F) | ((low_scales >> 2) & 0x30)), dim=-1)
    mins = torch.cat((low_mins & 0x3F, (rest >> 4) | ((low_mins >> 2) & 0x30)), dim=-1)
    return scales.to(torch.float32), mins.to(torch.float32)


def pack_q4_k(raw: torch.Tensor) -> PackedQ4:
    """Q4_K super-blocks uint8 [out, row_bytes] -> PackedQ4 (blocks of 32 weights)."""
    out_features = raw.shape[0]
    blocks = raw.reshape(out_features, -1, 144)

    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        part = blocks[start:stop]
        n = stop - start
        # Four 32-byte chunks: chunk j's low nibbles are sub-block 2j (byte i -> weight i), its high
        # nibbles sub-block 2j + 1.
        qs = part[..., 16:].reshape(n, -1, 4, 1, 32)
        codes = torch.cat((qs & 0x0F, qs >> 4), dim=3).view(n, -1, 32)
        scales, mins = _k_scales_mins(part[..., 4:16])
        scale = (_f16(part, 0)[..., None] * scales).view(n, -1)
        offset = -(_f16(part, 2)[..., None] * mins).view(n, -1)
        return nibble_words(codes), scale, offset

    words, scale, offset = tiled_by_rows(out_features, rows)
    return PackedQ4(words, scale, offset, out_features)


def pack_q6_k(raw: torch.Tensor) -> PackedQ8:
    """Q6_K super-blocks uint8 [out, row_bytes] -> PackedQ8 with blocks of 16 weights (4 words)."""
    out_features = raw.shape[0]
    blocks = raw.reshape(out_features, -1, 210)

    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        part = blocks[start:stop]
        n = stop - start
        # Two halves of 128 weights: ql (64 bytes) gives the low 4 bits of weights 0-63 (low nibbles)
        # and 64-127 (high nibbles); qh (32 bytes) the high 2 bits of weights 32k + i in bits 2k of byte i.
        ql = part[..., :128].reshape(n, -1, 2, 64)
        qh = part[..., 128:192].reshape(n, -1, 2, 32)
        low = torch.cat((ql & 0x0F, ql >> 4), dim=-1)
        high = torch.cat([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=-1)
        codes = (low | (high << 4)).to(torch.int16) - 32
        words = _signed_bytes_words(codes.view(n, -1, 16))
        sub_scales = part[..., 192:208].contiguous().view(torch.int8).to(torch.float32)
        scale = (_f16(part, 208)[..., None] * sub_scales).view(n, -1)
        return words, scale

    words, scale = tiled_by_rows(out_features, rows)
    return PackedQ8(words, scale, out_features)


def pack_q5_0(raw: torch.Tensor) -> PackedQ8:
    """Q5_0 blocks uint8 [out, row_bytes] -> PackedQ8 (blocks of 32 weights, 8 words)."""
    out_features = raw.shape[0]
    blocks = raw.reshape(out_features, -1, 22)

    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        part = blocks[start:stop]
        # qs byte j holds weight j (low nibble) and j + 16 (high); bit j of the little-endian qh word
        # (bit j % 8 of byte j // 8) is weight j's fifth bit.
        qs = part[..., 6:]
        low = torch.cat((qs & 0x0F, qs >> 4), dim=-1)
        bits = torch.arange(8, dtype=torch.uint8)
        high = ((part[..., 2:6, None] >> bits) & 1).flatten(-2)
        codes = (low | (high << 4)).to(torch.int16) - 16
        return _signed_bytes_words(codes), _f16(part, 0)

    words, scale = tiled_by_rows(out_features, rows)
    return PackedQ8(words, scale, out_features)


REPACKABLE: dict[GGMLQuantizationType, Callable[[torch.Tensor], PackedQ4 | PackedQ8]] = {
    Q.Q4_K: pack_q4_k,
    Q.Q5_0: pack_q5_0,
    Q.Q6_K: pack_q6_k,
}


def repack(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> PackedQ4 | PackedQ8:
    """Blocks of a type in REPACKABLE, uint8 [out, row_bytes] -> the packed layout its matvec reads."""
    pack = REPACKABLE.get(ggml_type)
    if pack is None:
        raise ValueError(f"no repacking for {ggml_type.name}; it takes {sorted(t.name for t in REPACKABLE)}")
    return pack(raw)
