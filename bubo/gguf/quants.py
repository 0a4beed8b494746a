"""Dequantizers for ggml block types, in vectorized torch.

Each type packs `block_size` weights into `type_size` bytes. A dequantizer takes the raw bytes
as a uint8 tensor `[..., row_bytes]` and returns `[..., row_bytes // type_size * block_size]`.

Results are bit-exact against `gguf.quants.dequantize`. Every product below (an fp16 scale times
small integers) has at most 23 significant bits, so it is exact in float32 whatever the order;
the only rounding is the final add/subtract of a min, done in float32 as the reference does it.
(One caveat: an F16 tensor's NaNs come out as quiet NaNs, where numpy keeps the payload bits.)
Lookup tables are made on the input's device, so the same code runs on CPU and CUDA.
"""

import functools
from collections.abc import Callable

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from torch._subclasses.fake_tensor import FakeTensor

__all__ = [
    "IQ4_CODEBOOK",
    "SUPPORTED_TYPES",
    "block_size",
    "dequantize",
    "f16_field",
    "iq4_nl_codes",
    "iq4_xs_codes",
    "iq4_xs_sub_scales",
    "k_sub_scales",
    "q2_k_codes",
    "q2_k_sub_scales",
    "q3_k_codes",
    "q3_k_sub_scales",
    "q4_k_codes",
    "q5_0_codes",
    "q5_1_codes",
    "q5_k_codes",
    "q6_k_codes",
    "q6_k_sub_scales",
    "type_size",
]

T = GGMLQuantizationType

QK_K = 256
# Non-linear 4-bit codebook shared by IQ4_NL and IQ4_XS (kvalues_iq4nl in ggml).
IQ4_CODEBOOK = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def block_size(ggml_type: GGMLQuantizationType | int) -> int:
    """Number of weights in one block of `ggml_type`."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][0]


def type_size(ggml_type: GGMLQuantizationType | int) -> int:
    """Bytes in one block of `ggml_type`."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][1]


@functools.cache
def _iq4_codebook(device: torch.device) -> torch.Tensor:
    return torch.tensor(IQ4_CODEBOOK, dtype=torch.int8, device=device)


@functools.cache
def _q5_high_words(device: torch.device) -> torch.Tensor:
    """byte -> int64 word whose byte j is bit j of the byte, moved to bit 4 (Q5's fifth bit)."""
    byte = torch.arange(256, device=device).view(-1, 1)
    bits = ((byte >> torch.arange(8, device=device)) & 1) << 4
    return bits.to(torch.uint8).contiguous().view(torch.int64).view(256)


# Speed notes: on CPU a fresh large allocation costs more than the arithmetic (every page faults
# in), so each dequantizer allocates only uint8 codes and writes floats straight into `out`.
# Bit fields are unpacked eight bytes at a time on int64 words, with a per-byte mask dropping the
# bits a shift carries over from the neighbouring byte.
_BYTE_MASKS = {1: 0x0101010101010101, 2: 0x0303030303030303, 4: 0x0F0F0F0F0F0F0F0F}


def f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block, as float32 `[n_blocks, 1]` (blocks are 2-byte aligned)."""
    return blocks.view(torch.int16)[:, start // 2 : start // 2 + 1].view(torch.float16).to(torch.float32)


def _unpack(qs: torch.Tensor, width: int) -> torch.Tensor:
    """`[..., k]` bytes -> uint8 `[..., 8 // width, k]` where field j holds bits [j*width, (j+1)*width)."""
    fields, k = 8 // width, qs.shape[-1]
    dst = torch.empty((*qs.shape[:-1], fields, k), dtype=torch.uint8, device=qs.device)
    if k % 8 == 0:
        # A fresh copy, not .contiguous(): a one-block slice counts as contiguous yet starts mid-block.
        src = qs.clone(memory_format=torch.contiguous_format).view(torch.int64)
        words, mask = dst.view(torch.int64), _BYTE_MASKS[width]
    else:
        src, words, mask = qs, dst, (1 << width) - 1
    for j in range(fields):
        field = words.select(-2, j)
        if j == 0:
            torch.bitwise_and(src, mask, out=field)
        else:
            torch.bitwise_right_shift(src, j * width, out=field)
            field.bitwise_and_(mask)
    return dst


def _f32(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # A byte copy: exact at any alignment, NaN payloads included.
    out.view(torch.uint8).copy_(blocks)


def _f16_tensor(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.view(-1).copy_(blocks.reshape(-1).view(torch.float16))


def _bf16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # bf16 is the top half of an fp32; an integer shift keeps every bit (NaN payloads included).
    bits = out.view(torch.int32).view(-1)
    bits.copy_(blocks.reshape(-1).view(torch.int16))
    bits.bitwise_left_shift_(16)


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(f16_field(blocks, 0))


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q = _unpack(blocks[:, 2:], 4).view(-1, 32).view(torch.int8).sub_(8)
    out.copy_(q)
    out.mul_(f16_field(blocks, 0))


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_unpack(blocks[:, 4:], 4).view(-1, 32))
    out.mul_(f16_field(blocks, 0)).add_(f16_field(blocks, 2))


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: 32-bit high mask (bit i -> weight i) + 16 nibble bytes -> `[n, 32]` 5-bit codes."""
    # Each qh byte holds the fifth bit of 8 weights; a table spreads it over those 8 code bytes.
    words = _q5_high_words(qh.device).index_select(0, qh.reshape(-1).to(torch.int32))
    high = words.view(torch.uint8).view(-1, 32)
    return _unpack(qs, 4).view(-1, 32).bitwise_or_(high)


def q5_0_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 (d, qh[4], qs[16]): each weight's signed code q - 16, int8 `[n, 32]`."""
    return _q5_codes(blocks[:, 2:6], blocks[:, 6:]).view(torch.int8).sub_(16)


def q5_1_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1 (d, m, qh[4], qs[16]): each weight's 5-bit code, uint8 `[n, 32]`."""
    return _q5_codes(blocks[:, 4:8], blocks[:, 8:])


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q5_0_codes(blocks))
    out.mul_(f16_field(blocks, 0))


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q5_1_codes(blocks))
    out.mul_(f16_field(blocks, 0)).add_(f16_field(blocks, 2))


def q2_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q2_K (scales[16], qs[64]: two 32-byte halves, each four 2-bit planes of 32 weights, d, dmin): the
    2-bit codes of the sixteen 16-weight groups, uint8 `[n, 16, 16]`."""
    n = blocks.shape[0]
    return _unpack(blocks[:, 16:80].reshape(n, 2, 32), 2).view(n, 16, 16)


def q2_k_sub_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q2_K: each 16-weight group's 4-bit sc and m (a scales byte's low and high nibbles), uint8 `[n, 16]`
    each: a weight is (d * sc) * q - dmin * m."""
    scales = blocks[:, :16]
    return scales & 0x0F, scales >> 4


def _q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    sc, m = q2_k_sub_scales(blocks)
    grouped = out.view(blocks.shape[0], 16, 16)
    grouped.copy_(q2_k_codes(blocks))
    grouped.mul_((f16_field(blocks, 80) * sc).unsqueeze(-1)).sub_((f16_field(blocks, 82) * m).unsqueeze(-1))


def q3_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K (hmask[32], qs[64] low 2 bits, scales[12] 16 x 6 bits, d): each weight's signed code (-4..3) in
    its 16-weight group, int8 `[n, 16, 16]`."""
    n = blocks.shape[0]
    q = _unpack(blocks[:, 32:96].reshape(n, 2, 32), 2).view(n, 16, 16).view(torch.int8)
    # A clear hmask bit means "subtract 4" (the stored bit is the complement of the offset).
    offset = _unpack(blocks[:, :32], 1).view(n, 16, 16).bitwise_xor_(1).bitwise_left_shift_(2)
    return q.sub_(offset.view(torch.int8))


def q3_k_sub_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K (scales[12]: 16 x 6 bits, stored plus 32): each 16-weight group's sc - 32, int8 `[n, 16]`: a
    weight is (d * (sc - 32)) * q."""
    n, packed = blocks.shape[0], blocks[:, 96:108]
    low = _unpack(packed[:, :8], 4).view(n, 16)
    high = _unpack(packed[:, 8:12], 2).view(n, 16)
    return low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(32)


def _q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    grouped = out.view(blocks.shape[0], 16, 16)
    grouped.copy_(q3_k_codes(blocks))
    grouped.mul_((f16_field(blocks, 108) * q3_k_sub_scales(blocks)).unsqueeze(-1))


def k_sub_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K (scales[12] at byte 4: eight 6-bit scales and eight 6-bit mins): each 32-weight group's sc
    and m, uint8 `[n, 8]` each: a weight is (d * sc) * q - dmin * m."""
    d, m, md = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]
    scales = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return scales, mins


def _k_affine(blocks: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_K/Q5_K: codes `[n, 8, 32]` -> d*scale*q - dmin*min for each 32-weight group."""
    n = blocks.shape[0]
    sc, m = k_sub_scales(blocks)
    grouped = out.view(n, 8, 32)
    grouped.copy_(codes)
    grouped.mul_((f16_field(blocks, 0) * sc).unsqueeze(-1)).sub_((f16_field(blocks, 2) * m).unsqueeze(-1))


def q4_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K (d, dmin, scales[12], qs[128]: four 32-byte chunks, each low nibbles then high nibbles): the
    4-bit codes of the eight 32-weight groups, uint8 `[n, 8, 32]`."""
    n = blocks.shape[0]
    return _unpack(blocks[:, 16:].reshape(n, 4, 32), 4).view(n, 8, 32)


def q5_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K (d, dmin, scales[12], qh[32]: bit j of byte i -> group j, weight i; qs[128] as Q4_K's): the
    5-bit codes of the eight 32-weight groups, uint8 `[n, 8, 32]`."""
    n = blocks.shape[0]
    high = _unpack(blocks[:, 16:48], 1).bitwise_left_shift_(4)
    return _unpack(blocks[:, 48:].reshape(n, 4, 32), 4).view(n, 8, 32).bitwise_or_(high)


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _k_affine(blocks, q4_k_codes(blocks), out)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _k_affine(blocks, q5_k_codes(blocks), out)


def q6_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K (ql[128] low 4 bits, qh[64] high 2 bits, scales[16] int8, d): each weight's signed code
    q - 32 in its 16-weight group, int8 `[n, 16, 16]`."""
    n = blocks.shape[0]
    high = _unpack(blocks[:, 128:192].reshape(n, 2, 32), 2).view(n, 8, 32).bitwise_left_shift_(4)
    codes = _unpack(blocks[:, :128].reshape(n, 2, 64), 4).view(n, 8, 32).bitwise_or_(high)
    return codes.view(torch.int8).sub_(32).view(n, 16, 16)


def q6_k_sub_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K: each 16-weight group's sc, int8 `[n, 16]`: a weight is (d * sc) * q."""
    return blocks[:, 192:208].view(torch.int8)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    grouped = out.view(blocks.shape[0], 16, 16)
    grouped.copy_(q6_k_codes(blocks))
    grouped.mul_((f16_field(blocks, 208) * q6_k_sub_scales(blocks)).unsqueeze(-1))


@functools.cache
def _iq4_nibble_values(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The IQ4 codebook value of every byte's low nibble and of its high nibble, int8 `[256]` each: one
    lookup a byte in each, rather than unpacking the nibbles first."""
    table, byte = _iq4_codebook(device), torch.arange(256, device=device)
    return table[byte & 0x0F], table[byte >> 4]


def _iq4_codes(qs: torch.Tensor) -> torch.Tensor:
    """IQ4 nibble bytes `[..., 16]` -> each weight's codebook value, int8 `[..., 32]` (byte j holds weights
    j and j + 16)."""
    index = qs.reshape(-1).to(torch.int32)
    low, high = (torch.index_select(t, 0, index).view(qs.shape) for t in _iq4_nibble_values(qs.device))
    return torch.cat((low, high), -1)


def iq4_nl_codes(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_NL (d, qs[16]): each weight's codebook value, int8 `[n, 32]` (a weight is d times it)."""
    return _iq4_codes(blocks[:, 2:])


def iq4_xs_codes(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS (d, scales_h, scales_l[4], qs[128]: 8 groups of 16 bytes): each weight's codebook value in
    its 32-weight group, int8 `[n, 8, 32]`."""
    return _iq4_codes(blocks[:, 8:].reshape(-1, 8, 16))


def iq4_xs_sub_scales(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS: each 32-weight group's ls - 32, ls 6 bits (scales_l's nibble, scales_h's 2 bits above it),
    int8 `[n, 8]`: a weight is (d * (ls - 32)) * codebook[q]."""
    n = blocks.shape[0]
    high = _unpack(blocks[:, 2:4], 2).transpose(1, 2).reshape(n, 8)
    low = _unpack(blocks[:, 4:8], 4).transpose(1, 2).reshape(n, 8)
    return low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(32)


def _iq4_nl(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(iq4_nl_codes(blocks))
    out.mul_(f16_field(blocks, 0))


def _iq4_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    grouped = out.view(blocks.shape[0], 8, 32)
    grouped.copy_(iq4_xs_codes(blocks))
    grouped.mul_((f16_field(blocks, 0) * iq4_xs_sub_scales(blocks)).unsqueeze(-1))


_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.F32: _f32,
    T.F16: _f16_tensor,
    T.BF16: _bf16,
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_DEQUANTIZERS)


def dequantize(
    raw: torch.Tensor,
    ggml_type: GGMLQuantizationType | int,
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize uint8 blocks `[..., row_bytes]` of `ggml_type` to `[..., n_weights_per_row]` of `dtype`.

    Computed in float32 (bit-exact against gguf.quants.dequantize) and then cast to `dtype`; the
    result never shares memory with `raw`. `out` (contiguous, of `dtype` and the result's shape)
    receives the result instead of a new tensor, which lets a caller reuse one buffer.
    """
    qtype = GGMLQuantizationType(ggml_type)
    fn = _DEQUANTIZERS.get(qtype)
    if fn is None:
        raise NotImplementedError(f"no dequantizer for ggml type {qtype.name}")
    if raw.dtype != torch.uint8 or raw.dim() == 0:
        raise ValueError(
            f"raw must be a uint8 tensor with at least one dimension, got {raw.dtype} {tuple(raw.shape)}"
        )
    bs, ts = GGML_QUANT_SIZES[qtype]
    row_bytes = raw.shape[-1]
    if row_bytes % ts:
        raise ValueError(
            f"{qtype.name}: a row of {row_bytes} bytes is not a whole number of {ts}-byte blocks"
        )
    shape = (*raw.shape[:-1], row_bytes // ts * bs)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=raw.device)
    elif out.shape != shape or out.dtype != dtype or out.device != raw.device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {shape} on {raw.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    n_blocks = raw.numel() // ts
    if n_blocks:
        result = out if dtype == torch.float32 else torch.empty(shape, dtype=torch.float32, device=raw.device)
        blocks = raw.reshape(n_blocks, ts)
        if not isinstance(blocks, FakeTensor) and blocks.data_ptr() % 8:
            # Word views need aligned blocks; file data always is, an arbitrary slice may not be. (A fake
            # tensor, traced into a compiled kernel, has no address: the kernel's buffers are aligned.)
            blocks = blocks.clone(memory_format=torch.contiguous_format)
        fn(blocks, result.view(n_blocks, bs))
        if result is not out:
            out.copy_(result)
    return out
