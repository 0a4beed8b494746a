"""Prefill-time products y = x W^T (+ b) with W as raw ggml blocks: dequantize-into-GEMM (Triton).

Each program computes a [BLOCK_M, BLOCK_N] tile of y: per K step it loads the x tile, dequantizes
the matching [BLOCK_K, BLOCK_N] tile of W from the file's bytes in registers (triton_quant) and
feeds both to tl.dot (tensor cores; float32 accumulation). The dequantized W tile is used by all
BLOCK_M rows, which is what amortizes the unpacking; programs are ordered in groups of GROUP_M
row tiles so that neighbours share W tiles in L2. Operands go to the dot in x's dtype (see
triton_quant.dot_dtype).

`quantized_matmul` is the entry point: it sends up to MAX_GEMV_ROWS rows to the GEMV kernel.
"""

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from bubo.kernels.triton_gemv import MAX_GEMV_ROWS, quantized_gemv
from bubo.kernels.triton_quant import (
    check_weight,
    codebook,
    dequantize_tile,
    dot,
    dot_dtype,
    fp16_view,
    interpreting,
)
from bubo.kernels.triton_support import autotune_configs

__all__ = ["quantized_gemm", "quantized_matmul"]


def _configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 4})]
    # Dequantizing a tile takes registers (a pointer and a few integers per weight): compiled for
    # sm_90 with BLOCK_M <= 64 these stay within 255 registers a thread without spilling.
    shapes = [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2)]
    return autotune_configs(
        [
            triton.Config({"BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for n, k, w, s in shapes
        ]
    )


def _block_m(m: int) -> int:
    """Rows per tile: just enough for the prompt (a dot needs 16), at most 64 (more spills registers)."""
    return min(max(16, triton.next_power_of_2(m)), 64)


@triton.autotune(configs=_configs(), key=["N", "K", "QTYPE", "BLOCK_M"])
@triton.jit
def _gemm_kernel(
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
    GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in = offs_m < M
    n_in = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_in = cols < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0
        )
        w = tl.trans(
            dequantize_tile(w_ptr, h_ptr, lut_ptr, offs_n, n_in, k0, K, row_bytes, QTYPE, BLOCK_N, BLOCK_K)
        )
        acc = dot(x, w, acc, DOT_DTYPE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


def quantized_gemm(
    x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] times W^T, W = `raw` [N, row_bytes] blocks of `ggml_type`: [M, N] in x's dtype."""
    m, k = x.shape
    check_weight(raw, ggml_type, k)
    x = x if x.stride(-1) == 1 else x.contiguous()
    n = raw.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = _block_m(m)
    _gemm_kernel[lambda meta: (triton.cdiv(m, block_m) * triton.cdiv(n, meta["BLOCK_N"]),)](
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
        BLOCK_M=block_m,
        DOT_DTYPE=dot_dtype(x.dtype),
    )
    return out


def quantized_matmul(
    x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] times W^T (+ bias): the GEMV kernel for a few rows (decode), the GEMM for more."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0:
        out = x.new_empty(0, raw.shape[0])
    elif flat.shape[0] <= MAX_GEMV_ROWS:
        out = quantized_gemv(flat, raw, ggml_type, bias)
    else:
        out = quantized_gemm(flat, raw, ggml_type, bias)
    return out.view(*x.shape[:-1], raw.shape[0])
