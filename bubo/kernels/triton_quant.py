"""In-kernel dequantization of ggml blocks, read straight from the file's bytes, for the Triton kernels.

`dequantize_tile` turns a [BLOCK_N, BLOCK_K] tile of a quantized matrix (uint8 [rows, row_bytes],
blocks as the GGUF file stores them, nothing repacked) into float32 weights. Each weight finds its
code byte(s) by address arithmetic; neighbouring weights of a row read neighbouring bytes of the
same block, so a warp's code loads coalesce into a few wide transactions (the file's layout is
already contiguous per row, which is why no repacking is needed). Scale fields are loaded once per
run of 16 or 32 weights that share them: `tile_codes` returns codes and per-run scale / offset
(the GEMV applies them per run), `dequantize_tile` the weights (broadcast through a reshape).
The arithmetic mirrors bubo.gguf.quants (the same products in the same order), so under the
interpreter a tile is bit-exact against gguf's dequantizers; compiled, a multiply-then-subtract may
fuse into one FMA (one rounding instead of two: within an ulp).

The layouts, per block (offsets in bytes; "nibble i" of a 32-byte run: low nibbles give weights
0-31 of a group, high nibbles the next 32; for the 32-weight types, byte j holds weights j and j+16):
    Q8_0  (32 w, 34 B)  d f16 @0, qs int8[32] @2                       w = d*q
    Q4_0  (32 w, 18 B)  d @0, qs[16] @2                                w = d*(q-8)
    Q4_1  (32 w, 20 B)  d @0, m @2, qs[16] @4                          w = d*q + m
    Q5_0  (32 w, 22 B)  d @0, qh u32 @2 (bit i: 5th bit of weight i), qs @6     w = d*(q-16)
    Q5_1  (32 w, 24 B)  d @0, m @2, qh @4, qs @8                       w = d*q + m
    IQ4_NL(32 w, 18 B)  d @0, qs[16] @2                                w = d*codebook[q]
    Q2_K  (256 w, 84 B) scales[16] @0 (lo: scale, hi: min), qs[64] @16 (2-bit planes), d @80, dmin @82
    Q3_K  (256 w, 110 B) hmask[32] @0, qs[64] @32, 16 6-bit scales @96, d @108
    Q4_K  (256 w, 144 B) d @0, dmin @2, 8 6-bit scales + 8 6-bit mins @4, qs[128] @16
    Q5_K  (256 w, 176 B) as Q4_K with qh[32] @16 (bit g of byte j: 5th bit of weight 32g+j), qs @48
    Q6_K  (256 w, 210 B) ql[128] @0, qh[64] @128, scales int8[16] @192, d @208
    IQ4_XS(256 w, 136 B) d @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8 (8 groups of 16 bytes)
"""

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from bubo.gguf.quants import IQ4_CODEBOOK, block_size, type_size
from bubo.kernels.triton_support import TRITON_TYPES

__all__ = [
    "TRITON_TYPES",
    "check_weight",
    "codebook",
    "dequantize_tile",
    "dot",
    "dot_codes",
    "dot_dtype",
    "fp16_view",
    "interpreting",
    "q4_k_scale_min_words",
    "q4_k_words_dot",
    "tile_codes",
]

T = GGMLQuantizationType

# The ggml type ids, as compile-time constants the kernels branch on.
Q4_0: tl.constexpr = tl.constexpr(int(T.Q4_0))
Q4_1: tl.constexpr = tl.constexpr(int(T.Q4_1))
Q5_0: tl.constexpr = tl.constexpr(int(T.Q5_0))
Q5_1: tl.constexpr = tl.constexpr(int(T.Q5_1))
Q8_0: tl.constexpr = tl.constexpr(int(T.Q8_0))
Q2_K: tl.constexpr = tl.constexpr(int(T.Q2_K))
Q3_K: tl.constexpr = tl.constexpr(int(T.Q3_K))
Q4_K: tl.constexpr = tl.constexpr(int(T.Q4_K))
Q5_K: tl.constexpr = tl.constexpr(int(T.Q5_K))
Q6_K: tl.constexpr = tl.constexpr(int(T.Q6_K))
IQ4_NL: tl.constexpr = tl.constexpr(int(T.IQ4_NL))
IQ4_XS: tl.constexpr = tl.constexpr(int(T.IQ4_XS))

_codebooks: dict[torch.device, torch.Tensor] = {}


def codebook(device: torch.device) -> torch.Tensor:
    """The IQ4 codebook as float32 on `device` (every kernel takes it; only the IQ4 types read it)."""
    table = _codebooks.get(device)
    if table is None:
        table = _codebooks[device] = torch.tensor(IQ4_CODEBOOK, dtype=torch.float32, device=device)
    return table


def fp16_view(raw: torch.Tensor) -> torch.Tensor:
    """The same bytes as float16, which is how the kernels load a block's fp16 fields."""
    if raw.shape[-1] % 2:
        raise ValueError(f"a row of ggml blocks has an even number of bytes, got {raw.shape[-1]}")
    return raw.view(torch.float16)


@triton.jit
def _byte(row_w, offset, mask):
    """The bytes at `offset` of the rows starting at `row_w`, as int32."""
    return tl.load(row_w + offset, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(row_h, offset, mask):
    # Every fp16 field sits at an even offset of a block, and every block size is even.
    return tl.load(row_h + offset // 2, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _nibble(row_w, offset, high, mask):
    byte = _byte(row_w, offset, mask)
    return tl.where(high, byte >> 4, byte & 0x0F)


@triton.jit
def _q4_k_scale_min(row_w, base, g, mask):
    """Q4_K / Q5_K: the 6-bit scale and min of group g (0-7), packed in the 12 bytes s[] at base + 4.

    g < 4: scale = s[g] & 63, min = s[g+4] & 63; g >= 4: the low four bits of both come from
    s[g+4], the top two of the scale from s[g-4] and of the min from s[g].
    """
    s_g = _byte(row_w, base + 4 + g, mask)
    s_g4 = _byte(row_w, base + 8 + g, mask)
    s_gm4 = _byte(row_w, base + g, mask)  # s[g-4] where g >= 4 (ignored below that)
    low = g < 4
    scale = tl.where(low, s_g & 0x3F, (s_g4 & 0x0F) | ((s_gm4 >> 6) << 4))
    minimum = tl.where(low, s_g4 & 0x3F, (s_g4 >> 4) | ((s_g >> 6) << 4))
    return scale, minimum


@triton.jit
def q4_k_scale_min_words(s0, s1, s2, g):
    """Q4_K / Q5_K: the 6-bit scale and min of group g (0-7) from the 12 scale bytes s[] as three
    little-endian int32 words (s0 = s[0..3], s1 = s[4..7], s2 = s[8..11]); see `_q4_k_scale_min`."""
    low = g < 4
    at = (g % 4) * 8
    s_g = (tl.where(low, s0, s1) >> at) & 0xFF  # s[g]
    s_g4 = (tl.where(low, s1, s2) >> at) & 0xFF  # s[g+4]
    s_gm4 = (s0 >> at) & 0xFF  # s[g-4] where g >= 4
    scale = tl.where(low, s_g & 0x3F, (s_g4 & 0x0F) | ((s_gm4 >> 6) << 4))
    minimum = tl.where(low, s_g4 & 0x3F, (s_g4 >> 4) | ((s_g >> 6) << 4))
    return scale, minimum


@triton.jit
def q4_k_words_dot(
    x_ptr,
    offs_m,
    m_in,
    stride_xm,
    row_words,
    row_h,
    n_in,
    k0,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUPERBLOCKS: tl.constexpr,
):
    """Rows `offs_m` of x (float [M, K] at x_ptr) times Q4_K weights k0 .. k0 + 256 * SUPERBLOCKS - 1
    of the matrix rows whose int32 words start at `row_words` [BLOCK_N, 1] (fp16 view: `row_h`),
    transposed: float32 [BLOCK_M, BLOCK_N]. k0 and K are multiples of 256.

    A 144-byte block is 36 words: d and dmin (word 0), the 12 bytes of 6-bit scales and mins (words
    1-3), then 32 words of codes in 4 runs of 8 words. Byte j of run p holds weight 64p + j in its
    low nibble (group 2p) and 64p + 32 + j in its high nibble (group 2p + 1): each run of words
    expands in registers to two 32-weight groups whose x columns are contiguous, and each group's
    scale and min are applied once to its dot product.
    """
    RUNS: tl.constexpr = SUPERBLOCKS * 4
    run = tl.arange(0, RUNS)  # superblock run // 4, pair run % 4
    word = tl.arange(0, 8)
    shifts = tl.arange(0, 4) * 8
    t = tl.arange(0, 32)
    block = k0 // 256 + run // 4
    block_in = n_in[:, None] & (block < K // 256)[None, :]  # [BLOCK_N, RUNS]
    codes_at = (block * 36 + 4 + (run % 4) * 8)[None, :, None] + word[None, None, :]
    packed = tl.load(row_words[:, :, None] + codes_at, mask=block_in[:, :, None], other=0)  # [N, RUNS, 8]
    bytes_ = packed[:, :, :, None] >> shifts[None, None, None, :]
    low = tl.reshape(bytes_ & 0x0F, (BLOCK_N, RUNS, 32)).to(tl.float32)
    high = tl.reshape((bytes_ >> 4) & 0x0F, (BLOCK_N, RUNS, 32)).to(tl.float32)
    # The scale words of each run's block, loaded once per run (the repeats hit L1).
    block_words = row_words + (block * 36)[None, :]
    s0 = tl.load(block_words + 1, mask=block_in, other=0)
    s1 = tl.load(block_words + 2, mask=block_in, other=0)
    s2 = tl.load(block_words + 3, mask=block_in, other=0)
    d = tl.load(row_h + (block * 72)[None, :], mask=block_in, other=0.0).to(tl.float32)
    dmin = tl.load(row_h + (block * 72 + 1)[None, :], mask=block_in, other=0.0).to(tl.float32)
    group = (run % 4)[None, :] * 2
    scale_low, min_low = q4_k_scale_min_words(s0, s1, s2, group)
    scale_high, min_high = q4_k_scale_min_words(s0, s1, s2, group + 1)
    cols = k0 + run[:, None] * 64 + t[None, :]  # [RUNS, 32]: the low nibbles' columns
    x_at = x_ptr + offs_m[:, None, None] * stride_xm + cols[None, :, :]
    x_mask = m_in[:, None, None] & (cols < K)[None, :, :]
    x_low = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)  # [BLOCK_M, RUNS, 32]
    x_high = tl.load(x_at + 32, mask=x_mask, other=0.0).to(tl.float32)
    dot_low = tl.sum(x_low[:, None, :, :] * low[None, :, :, :], axis=3)  # [BLOCK_M, BLOCK_N, RUNS]
    dot_high = tl.sum(x_high[:, None, :, :] * high[None, :, :, :], axis=3)
    per_run = (
        dot_low * (d * scale_low.to(tl.float32))[None]
        - tl.sum(x_low, axis=2)[:, None, :] * (dmin * min_low.to(tl.float32))[None]
        + dot_high * (d * scale_high.to(tl.float32))[None]
        - tl.sum(x_high, axis=2)[:, None, :] * (dmin * min_high.to(tl.float32))[None]
    )
    return tl.sum(per_run, axis=2)


@triton.jit
def _runs(n_in, k0, K, size, WEIGHTS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """For each GROUP-weight run of the tile (blocks of WEIGHTS weights, `size` bytes): the offset
    of its block in the row, the index of its first weight in the block, whether it is in the matrix."""
    first = k0 + tl.arange(0, BLOCK_K // GROUP) * GROUP
    inside = n_in[:, None] & (first < K)[None, :]
    return (first // WEIGHTS)[None, :] * size, (first % WEIGHTS)[None, :], inside


@triton.jit
def tile_codes(
    w_ptr,
    h_ptr,
    lut_ptr,
    rows,
    n_in,
    k0,
    K,
    row_bytes,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Weights k0 .. k0 + BLOCK_K - 1 of matrix rows `rows` [BLOCK_N], factored per run of R = 16
    or 32 weights that share scale fields: (codes float32 [BLOCK_N, BLOCK_K], scale and offset
    float32 [BLOCK_N, BLOCK_K // R]); weight = code * scale - offset (offset 0 for the types
    without a min). R is BLOCK_K // scale.shape[1]; BLOCK_K is a multiple of 32.

    w_ptr: the matrix's bytes (uint8, row-major, `row_bytes` per row); h_ptr: the same bytes as
    fp16; lut_ptr: the IQ4 codebook. Rows where `n_in` is false and weights past K read as 0.
    """
    # Addresses are a row pointer [BLOCK_N, 1] plus an int32 offset within the row [1, BLOCK_K]: the
    # offset arithmetic is done once per column, not per weight.
    row_w = (w_ptr + rows.to(tl.int64) * row_bytes)[:, None]
    row_h = (h_ptr + rows.to(tl.int64) * (row_bytes // 2))[:, None]
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = n_in[:, None] & (cols < K)[None, :]
    # Chains of == rather than `in`: triton's compiler has no `in` operator.
    if QTYPE == Q8_0 or QTYPE == Q4_0 or QTYPE == Q4_1 or QTYPE == Q5_0 or QTYPE == Q5_1 or QTYPE == IQ4_NL:  # noqa: SIM109
        if QTYPE == Q8_0:
            size = 34
        elif QTYPE == Q4_0 or QTYPE == IQ4_NL:  # noqa: SIM109
            size = 18
        elif QTYPE == Q4_1:
            size = 20
        elif QTYPE == Q5_0:
            size = 22
        else:
            size = 24
        base = (cols // 32)[None, :] * size
        i = (cols % 32)[None, :]
        block_base, _, block_mask = _runs(n_in, k0, K, size, 32, 32, BLOCK_K)
        d = _half(row_h, block_base, block_mask)
        if QTYPE == Q8_0:
            codes = (_byte(row_w, base + 2 + i, mask) ^ 0x80) - 0x80
            tile_q, tile_dl, tile_ml = codes.to(tl.float32), d, tl.zeros_like(d)
        elif QTYPE == Q4_0:
            codes = _nibble(row_w, base + 2 + i % 16, i >= 16, mask) - 8
            tile_q, tile_dl, tile_ml = codes.to(tl.float32), d, tl.zeros_like(d)
        elif QTYPE == IQ4_NL:
            values = tl.load(lut_ptr + _nibble(row_w, base + 2 + i % 16, i >= 16, mask))
            tile_q, tile_dl, tile_ml = values, d, tl.zeros_like(d)
        elif QTYPE == Q4_1:
            codes = _nibble(row_w, base + 4 + i % 16, i >= 16, mask)
            # q*d + m, written as q*d - (-m): the same float (negation is exact).
            m = _half(row_h, block_base + 2, block_mask)
            tile_q, tile_dl, tile_ml = codes.to(tl.float32), d, -m
        else:
            qh_at = 2 if QTYPE == Q5_0 else 4
            high = (_byte(row_w, base + qh_at + i // 8, mask) >> (i % 8)) & 1
            codes = _nibble(row_w, base + qh_at + 4 + i % 16, i >= 16, mask) | (high << 4)
            if QTYPE == Q5_0:
                tile_q, tile_dl, tile_ml = (codes - 16).to(tl.float32), d, tl.zeros_like(d)
            else:
                m = _half(row_h, block_base + 2, block_mask)
                tile_q, tile_dl, tile_ml = codes.to(tl.float32), d, -m
    else:
        if QTYPE == Q4_K:
            size = 144
        elif QTYPE == Q5_K:
            size = 176
        elif QTYPE == Q6_K:
            size = 210
        elif QTYPE == Q2_K:
            size = 84
        elif QTYPE == Q3_K:
            size = 110
        else:
            tl.static_assert(QTYPE == IQ4_XS, "dequantize_tile: unsupported ggml type")
            size = 136
        base = (cols // 256)[None, :] * size
        i = (cols % 256)[None, :]
        if QTYPE == Q4_K or QTYPE == Q5_K or QTYPE == IQ4_XS:  # noqa: SIM109
            group_base, gi, group_mask = _runs(n_in, k0, K, size, 256, 32, BLOCK_K)
        else:
            group_base, gi, group_mask = _runs(n_in, k0, K, size, 256, 16, BLOCK_K)
        if QTYPE == Q4_K or QTYPE == Q5_K:  # noqa: SIM109
            g = i // 32
            if QTYPE == Q4_K:
                codes = _nibble(row_w, base + 16 + (g // 2) * 32 + i % 32, (g % 2) == 1, mask)
            else:
                high = (_byte(row_w, base + 16 + i % 32, mask) >> g) & 1
                codes = _nibble(row_w, base + 48 + (g // 2) * 32 + i % 32, (g % 2) == 1, mask) | (high << 4)
            scale, minimum = _q4_k_scale_min(row_w, group_base, gi // 32, group_mask)
            dl = _half(row_h, group_base, group_mask) * scale.to(tl.float32)
            ml = _half(row_h, group_base + 2, group_mask) * minimum.to(tl.float32)
            tile_q, tile_dl, tile_ml = codes.to(tl.float32), dl, ml
        elif QTYPE == Q6_K:
            half = i // 128
            low = _nibble(row_w, base + half * 64 + i % 64, ((i % 128) // 64) == 1, mask)
            high = (_byte(row_w, base + 128 + half * 32 + i % 32, mask) >> (2 * ((i % 128) // 32))) & 3
            scale = _byte(row_w, group_base + 192 + gi // 16, group_mask)
            dl = _half(row_h, group_base + 208, group_mask) * ((scale ^ 0x80) - 0x80).to(tl.float32)
            tile_q, tile_dl, tile_ml = ((low | (high << 4)) - 32).to(tl.float32), dl, tl.zeros_like(dl)
        elif QTYPE == Q2_K:
            codes = (_byte(row_w, base + 16 + (i // 128) * 32 + i % 32, mask) >> (2 * ((i % 128) // 32))) & 3
            scale = _byte(row_w, group_base + gi // 16, group_mask)
            dl = _half(row_h, group_base + 80, group_mask) * (scale & 0x0F).to(tl.float32)
            ml = _half(row_h, group_base + 82, group_mask) * (scale >> 4).to(tl.float32)
            tile_q, tile_dl, tile_ml = codes.to(tl.float32), dl, ml
        elif QTYPE == Q3_K:
            low = (_byte(row_w, base + 32 + (i // 128) * 32 + i % 32, mask) >> (2 * ((i % 128) // 32))) & 3
            # A clear hmask bit means "subtract 4".
            set_bit = (_byte(row_w, base + i % 32, mask) >> (i // 32)) & 1
            s = gi // 16
            scale_low = (_byte(row_w, group_base + 96 + s % 8, group_mask) >> (4 * (s // 8))) & 0x0F
            scale_high = (_byte(row_w, group_base + 104 + s % 4, group_mask) >> (2 * (s // 4))) & 3
            dl = _half(row_h, group_base + 108, group_mask) * ((scale_low | (scale_high << 4)) - 32).to(
                tl.float32
            )
            tile_q, tile_dl, tile_ml = (low - 4 * (1 - set_bit)).to(tl.float32), dl, tl.zeros_like(dl)
        else:
            g = gi // 32
            scale_low = (_byte(row_w, group_base + 4 + g // 2, group_mask) >> (4 * (g % 2))) & 0x0F
            scale_high = (_byte(row_w, group_base + 2 + g // 4, group_mask) >> (2 * (g % 4))) & 3
            dl = _half(row_h, group_base, group_mask) * ((scale_low | (scale_high << 4)) - 32).to(tl.float32)
            values = tl.load(
                lut_ptr + _nibble(row_w, base + 8 + (i // 32) * 16 + i % 16, (i % 32) >= 16, mask)
            )
            tile_q, tile_dl, tile_ml = values, dl, tl.zeros_like(dl)
    return tile_q, tile_dl, tile_ml


@triton.jit
def dequantize_tile(
    w_ptr,
    h_ptr,
    lut_ptr,
    rows,
    n_in,
    k0,
    K,
    row_bytes,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """float32 [BLOCK_N, BLOCK_K]: weights k0 .. k0 + BLOCK_K - 1 of matrix rows `rows` [BLOCK_N]
    (see `tile_codes` for the arguments): code * scale - offset per run of weights."""
    q, dl, ml = tile_codes(w_ptr, h_ptr, lut_ptr, rows, n_in, k0, K, row_bytes, QTYPE, BLOCK_N, BLOCK_K)
    grouped = tl.reshape(q, (BLOCK_N, dl.shape[1], BLOCK_K // dl.shape[1])) * dl[:, :, None] - ml[:, :, None]
    return tl.reshape(grouped, (BLOCK_N, BLOCK_K))


@triton.jit
def dot_codes(x, q, dl, ml, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] (float32) times the weights `tile_codes` gave, transposed: [BLOCK_M, BLOCK_N].

    Per run of weights sharing a scale: (x . codes) * scale - sum(x) * offset, so the scale is
    applied once per run rather than once per weight.
    """
    runs: tl.constexpr = dl.shape[1]
    x_runs = tl.reshape(x, (BLOCK_M, runs, BLOCK_K // runs))
    q_runs = tl.reshape(q, (BLOCK_N, runs, BLOCK_K // runs))
    dots = tl.sum(x_runs[:, None, :, :] * q_runs[None, :, :, :], axis=3)
    x_sums = tl.sum(x_runs, axis=2)
    return tl.sum(dots * dl[None, :, :] - x_sums[:, None, :] * ml[None, :, :], axis=2)


def interpreting() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1: the tests)."""
    return bool(triton.knobs.runtime.interpret)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The operand type of the tensor-core dot for activations of `dtype`.

    The activations' own type on a GPU. Triton's interpreter computes a bfloat16 dot on the raw
    bits (garbage), so there bfloat16 operands are widened to float32 instead.
    """
    if dtype not in _TL_DTYPES:
        raise ValueError(f"the Triton kernels take float32, float16 or bfloat16 activations, not {dtype}")
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return _TL_DTYPES[dtype]


@triton.jit
def dot(x, w, acc, DOT_DTYPE: tl.constexpr):
    """acc + x @ w with both operands cast to DOT_DTYPE; float32 as IEEE float32 (no TF32: a
    float32 model asked for float32 numerics)."""
    if DOT_DTYPE == tl.float32:  # noqa: SIM300  (a constexpr against a dtype, not a Yoda condition)
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc)


def check_weight(raw: torch.Tensor, ggml_type: GGMLQuantizationType, in_features: int) -> None:
    """Raise ValueError unless `raw` holds `in_features`-wide rows of `ggml_type` blocks the kernels can read."""
    if ggml_type not in TRITON_TYPES:
        raise ValueError(f"the Triton kernels do not read {ggml_type.name} blocks")
    weights, size = block_size(ggml_type), type_size(ggml_type)
    if raw.dtype != torch.uint8 or not raw.is_contiguous():
        raise ValueError(f"quantized weights must be contiguous uint8 blocks, got {raw.dtype}")
    if in_features % weights or raw.shape[-1] != in_features // weights * size:
        raise ValueError(
            f"{ggml_type.name}: rows of {raw.shape[-1]} bytes do not hold {in_features} weights "
            f"({weights} per {size}-byte block)"
        )
