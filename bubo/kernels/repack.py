"""Blocks of other ggml types repacked, exactly, into the layouts the compiled CPU matvecs read.

A Q4_K_M file holds Q4_K and Q6_K matrices, and Q5_0 / Q8_0 where a row isn't a whole number of
256-weight super-blocks (every matrix that reads a 576-wide hidden state in SmolLM2); a Q5_K_M file
Q5_K, Q6_K, Q5_1 and Q8_0. Each of these is, per run of 16 or 32 weights, an integer code times a
float32 scale (plus an offset), with scale and offset exact in float32: so they repack into the
layouts of the compiled matvecs, which then run them, the decode step included.

- Q4_K -> PackedQ4 (bubo/kernels/q4_matvec.py). A super-block (d, dmin fp16; eight 6-bit scales
  and mins; 4-bit codes) is w = d * sc_j * q - dmin * m_j for sub-block j of 32 weights:
  scale = d * sc_j and offset = -(dmin * m_j), each an 11-bit mantissa times a 6-bit integer, exact.
  4.5 bits a weight, as in the file.
- Q6_K -> PackedQ8 with 4-word blocks (bubo/kernels/q8_matvec.py): 16 sub-blocks of 16 weights,
  w = (d * sc_j) * (q - 32), q 6-bit, sc_j int8; the code q - 32 is a signed byte, the scale exact
  (11-bit mantissa times an 8-bit integer). 10 bits a weight against the file's 6.56: the bytes
  expand with two shifts where 6-bit fields would take more work per weight (the measurements
  that chose this are in the branch's notes).
- Q5_K -> PackedQ8Offset (bubo/kernels/q8_matvec.py): Q4_K's super-block with a fifth bit a code,
  so Q4_K's scale and offset; the code (0-31) a byte. 10 bits a weight against 5.5.
- Q5_0 -> PackedQ8 (8-word blocks, as Q8_0): w = d * (q - 16), q 5-bit; the code q - 16 is a
  signed byte. 9 bits a weight against 5.5, and it groups with Q8_0 matrices (`group_rows`), which
  Q4_K_M mixes with Q5_0 among the q/k/v projections.
- Q5_1 -> PackedQ8Offset (Q5_K_M's fallback, as Q5_0 is Q4_K_M's): w = d * q + m, the code q a byte,
  scale d and offset m as stored. 10 bits a weight against 6.
"""

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

from bubo.kernels.codes import tiled_by_rows
from bubo.kernels.q4_matvec import PackedQ4, nibble_words
from bubo.kernels.q8_matvec import PackedQ8, PackedQ8Offset

__all__ = ["REPACKABLE", "pack_q4_k", "pack_q5_0", "pack_q5_1", "pack_q5_k", "pack_q6_k", "repack"]

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


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K's 128 code bytes [rows, blocks, 128] -> 4-bit codes [rows, blocks * 8, 32]: four 32-byte
    chunks, chunk j's low nibbles sub-block 2j (byte i -> weight i), its high nibbles sub-block 2j + 1."""
    chunks = qs.reshape(*qs.shape[:2], 4, 1, 32)
    return torch.cat((chunks & 0x0F, chunks >> 4), dim=3).view(qs.shape[0], -1, 32)


def _k_scale_offset(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's per-sub-block scale d * sc_j and offset -(dmin * m_j), float32 [rows, blocks * 8]."""
    scales, mins = _k_scales_mins(part[..., 4:16])
    scale = (_f16(part, 0)[..., None] * scales).flatten(1)
    offset = -(_f16(part, 2)[..., None] * mins).flatten(1)
    return scale, offset


def pack_q4_k(raw: torch.Tensor) -> PackedQ4:
    """Q4_K super-blocks uint8 [out, row_bytes] -> PackedQ4 (blocks of 32 weights)."""
    out_features = raw.shape[0]
    blocks = raw.reshape(out_features, -1, 144)

    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        part = blocks[start:stop]
        return (nibble_words(_k_low_nibbles(part[..., 16:])), *_k_scale_offset(part))

    words, scale, offset = tiled_by_rows(out_features, rows)
    return PackedQ4(words, scale, offset, out_features)


def pack_q5_k(raw: torch.Tensor) -> PackedQ8Offset:
    """Q5_K super-blocks uint8 [out, row_bytes] -> PackedQ8Offset (blocks of 32 weights, 8 words)."""
    out_features = raw.shape[0]
    blocks = raw.reshape(out_features, -1, 176)

    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        part = blocks[start:stop]
        n = stop - start
        low = _k_low_nibbles(part[..., 48:])
        # qh (32 bytes): bit j of byte i is the fifth bit of weight i of sub-block j.
        bits = torch.arange(8, dtype=torch.uint8)[:, None]
        high = ((part[..., None, 16:48] >> bits) & 1).view(n, -1, 32)
        return (_signed_bytes_words(low | (high << 4)), *_k_scale_offset(part))

    words, scale, offset = tiled_by_rows(out_features, rows)
    return PackedQ8Offset(words, scale, offset, out_features)


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


def _q5_codes(part: torch.Tensor, qh: int) -> torch.Tensor:
    """Q5_0 / Q5_1 blocks [rows, blocks, bytes] whose 4 qh bytes start at `qh` (then 16 qs bytes) ->
    5-bit codes [rows, blocks, 32], uint8. qs byte j holds weight j (low nibble) and j + 16 (high); bit j
    of the little-endian qh word (bit j % 8 of byte j // 8) is weight j's fifth bit."""
    qs = part[..., qh + 4 : qh + 20]
    low = torch.cat((qs & 0x0F, qs >> 4), dim=-1)
    bits = torch.arange(8, dtype=torch.uint8)
    high = ((part[..., qh : qh + 4, None] >> bits) & 1).flatten(-2)
    return low | (high << 4)


def pack_q5_0(raw: torch.Tensor) -> PackedQ8:
    """Q5_0 blocks uint8 [out, row_bytes] -> PackedQ8 (blocks of 32 weights, 8 words)."""
    out_features = raw.shape[0]
    blocks = raw.reshape(out_features, -1, 22)

    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        part = blocks[start:stop]
        return _signed_bytes_words(_q5_codes(part, 2).to(torch.int16) - 16), _f16(part, 0)

    words, scale = tiled_by_rows(out_features, rows)
    return PackedQ8(words, scale, out_features)


def pack_q5_1(raw: torch.Tensor) -> PackedQ8Offset:
    """Q5_1 blocks uint8 [out, row_bytes] -> PackedQ8Offset (blocks of 32 weights, 8 words)."""
    out_features = raw.shape[0]
    blocks = raw.reshape(out_features, -1, 24)

    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        part = blocks[start:stop]
        return _signed_bytes_words(_q5_codes(part, 4)), _f16(part, 0), _f16(part, 2)

    words, scale, offset = tiled_by_rows(out_features, rows)
    return PackedQ8Offset(words, scale, offset, out_features)


REPACKABLE: dict[GGMLQuantizationType, Callable[[torch.Tensor], PackedQ4 | PackedQ8 | PackedQ8Offset]] = {
    Q.Q4_K: pack_q4_k,
    Q.Q5_K: pack_q5_k,
    Q.Q5_0: pack_q5_0,
    Q.Q5_1: pack_q5_1,
    Q.Q6_K: pack_q6_k,
}


def repack(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> PackedQ4 | PackedQ8 | PackedQ8Offset:
    """Blocks of a type in REPACKABLE, uint8 [out, row_bytes] -> the packed layout its matvec reads."""
    pack = REPACKABLE.get(ggml_type)
    if pack is None:
        raise ValueError(f"no repacking for {ggml_type.name}; it takes {sorted(t.name for t in REPACKABLE)}")
    return pack(raw)
