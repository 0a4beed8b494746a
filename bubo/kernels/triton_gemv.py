"""Decode-time products y = x W^T (+ b) for a few rows of x, W read as raw ggml blocks (Triton).

A decode step multiplies one activation row (a handful with batched slots) by every weight, so
the cost is reading W once: each program owns BLOCK_N output rows and walks K in BLOCK_K steps,
unpacking its [BLOCK_N, BLOCK_K] tile of codes in registers (triton_quant.tile_codes) and reducing
it against all M rows of x at once, in float32, with each block's scale applied once per run of
weights that shares it (not per weight). Nothing but the file's bytes is read, nothing float is written
but y. On CUDA the tile shape is autotuned per (N, K, type); the interpreter gets one small shape.

Q4_K, the most common decode type, has its own kernel that reads the blocks as int32 words (a Q4_K block
is 144 bytes with its codes at byte 16, so every word is 4-byte aligned): one load brings 8 weights
instead of one byte load per weight, which is what lets a GPU stream near its memory bandwidth.
--no-triton-autotune (triton_support.autotune_configs) makes every kernel use its first config.
"""

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from bubo.kernels.triton_quant import (
    check_weight,
    codebook,
    dot_codes,
    fp16_view,
    interpreting,
    q4_k_words_dot,
    tile_codes,
)
from bubo.kernels.triton_support import autotune_configs

__all__ = ["MAX_GEMV_ROWS", "fitting_configs", "quantized_gemv"]

# Rows of x one launch reduces together; the [M, BLOCK_N, BLOCK_K] products live in registers,
# so beyond a few rows the tensor-core GEMM (triton_gemm) is the better kernel.
MAX_GEMV_ROWS = 4
# Products held per thread at most (of the [BLOCK_M, BLOCK_N, BLOCK_K] tile). Compiled for sm_90,
# tiles up to this take 50-210 registers a thread without spilling; at 64 most types spill.
PRODUCTS_PER_THREAD = 32


def _configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 128})]
    # Few output rows per program keeps enough programs to fill the GPU's SMs on the narrow
    # matrices (N = 1-4k); long K tiles keep each warp's loads wide.
    shapes = [(16, 256, 4), (8, 256, 4), (8, 512, 8), (16, 512, 8), (32, 256, 8), (64, 128, 8)]
    return autotune_configs([triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in shapes])


def _q4_k_configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_N": 4, "SUPERBLOCKS": 2})]
    # Each program streams BLOCK_N x SUPERBLOCKS x 144 bytes a step: 2-9 KB in flight per program,
    # and 16-row programs still give 256 programs on a 4096-row matrix (132 SMs).
    shapes = [(16, 2, 4), (8, 4, 4), (16, 4, 8), (32, 2, 8), (8, 8, 8), (4, 8, 4)]
    return autotune_configs(
        [triton.Config({"BLOCK_N": n, "SUPERBLOCKS": b}, num_warps=w) for n, b, w in shapes]
    )


def fitting_q4_k_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The Q4_K word-kernel configs whose product tile fits PRODUCTS_PER_THREAD (else the smallest)."""

    def products(config: triton.Config) -> int:
        return kwargs["BLOCK_M"] * config.kwargs["BLOCK_N"] * config.kwargs["SUPERBLOCKS"] * 256

    fitting = [c for c in configs if products(c) <= PRODUCTS_PER_THREAD * 32 * c.num_warps]
    return fitting or [min(configs, key=products)]


def fitting_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The configs whose product tile fits PRODUCTS_PER_THREAD for this many rows (else the smallest)."""

    def products(config: triton.Config) -> int:
        return kwargs["BLOCK_M"] * config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_K"]

    fitting = [c for c in configs if products(c) <= PRODUCTS_PER_THREAD * 32 * c.num_warps]
    return fitting or [min(configs, key=products)]


@triton.autotune(
    configs=_configs(),
    key=["N", "K", "QTYPE", "BLOCK_M"],
    prune_configs_by={"early_config_prune": fitting_configs},
)
@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    lut_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    row_bytes,
    stride_xm,
    stride_om,
    QTYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_in = offs_n < N
    m_in = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_in = cols < K
        q, dl, ml = tile_codes(w_ptr, h_ptr, lut_ptr, offs_n, n_in, k0, K, row_bytes, QTYPE, BLOCK_N, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0
        ).to(tl.float32)
        acc += dot_codes(x, q, dl, ml, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


@triton.autotune(
    configs=_q4_k_configs(),
    key=["N", "K", "BLOCK_M"],
    prune_configs_by={"early_config_prune": fitting_q4_k_configs},
)
@triton.jit
def _gemv_q4_k_kernel(
    x_ptr,
    words_ptr,
    h_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    row_bytes,
    stride_xm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUPERBLOCKS: tl.constexpr,
):
    """The GEMV for Q4_K weights read as int32 words (`words_ptr`: the bytes viewed as int32).

    Each step reads SUPERBLOCKS blocks of BLOCK_N rows (triton_quant.q4_k_words_dot).
    """
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_in = offs_n < N
    m_in = offs_m < M
    row_words = (words_ptr + offs_n.to(tl.int64) * (row_bytes // 4))[:, None]
    row_h = (h_ptr + offs_n.to(tl.int64) * (row_bytes // 2))[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, SUPERBLOCKS * 256):
        acc += q4_k_words_dot(
            x_ptr, offs_m, m_in, stride_xm, row_words, row_h, n_in, k0, K, BLOCK_M, BLOCK_N, SUPERBLOCKS
        )
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


def _word_aligned(raw: torch.Tensor) -> bool:
    return raw.data_ptr() % 4 == 0 and raw.shape[-1] % 4 == 0


def quantized_gemv(
    x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] (M <= MAX_GEMV_ROWS) times W^T, W = `raw` [N, row_bytes] blocks of `ggml_type`: [M, N] in x's dtype."""
    m, k = x.shape
    if not 1 <= m <= MAX_GEMV_ROWS:
        raise ValueError(f"quantized_gemv takes 1 to {MAX_GEMV_ROWS} rows, got {m}")
    check_weight(raw, ggml_type, k)
    x = x if x.stride(-1) == 1 else x.contiguous()
    n = raw.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if ggml_type == GGMLQuantizationType.Q4_K and _word_aligned(raw):
        _gemv_q4_k_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            x,
            raw.view(torch.int32),
            fp16_view(raw),
            out if bias is None else bias,
            out,
            m,
            n,
            k,
            raw.shape[1],
            x.stride(0),
            out.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=triton.next_power_of_2(m),
        )
        return out
    _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
        x,
        raw,
        fp16_view(raw),
        codebook(x.device),
        out if bias is None else bias,
        out,
        m,
        n,
        k,
        raw.shape[1],
        x.stride(0),
        out.stride(0),
        QTYPE=int(ggml_type),
        HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m),
    )
    return out
