"""Fused mixture-of-experts SwiGLU on raw ggml expert blocks (Triton).

    y = sum_j w_j * down_ej(silu(gate_ej(x)) * up_ej(x))       over the top-k experts e_j of x

The (token, slot) pairs the router picked are sorted by expert and each expert's run is padded to
whole tiles of BLOCK_M, so every row tile belongs to one expert (`group_by_expert`, on the device,
no host sync). Two launches over those tiles:
  1. gate/up: a tile's tokens times its expert's gate and up matrices (both dequantized from the
     file's blocks into tl.dot, as triton_gemm), SiLU(gate) * up written per pair;
  2. down: those rows times the expert's down matrix, scaled by the pair's routing weight.
The pairs' rows are then summed per token. A prefill reads each routed expert's weights once per
BLOCK_M of its tokens. A single token (a decode step) skips the grouping: its top_k experts are
distinct, and two GEMV-style launches (one program per expert and output tile, no 16-row dot
padding) read each of them once. Tiles past the last used one (the grid is sized for the worst padding, so
that no count has to come back to the host) return at once.
"""

from typing import Protocol

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from bubo.kernels.triton_quant import (
    Q4_K,
    check_weight,
    codebook,
    dequantize_tile,
    dot,
    dot_codes,
    dot_dtype,
    fp16_view,
    interpreting,
    q4_k_words_dot,
    tile_codes,
)

__all__ = ["ExpertBlocks", "fused_moe", "group_by_expert"]


class ExpertBlocks(Protocol):
    """An expert stack as the file holds it: uint8 [num_experts, out_features, row_bytes] blocks."""

    raw: torch.Tensor
    ggml_type: GGMLQuantizationType


def _tile_shape(pairs: int, num_experts: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for `pairs` routed (token, slot) pairs."""
    if interpreting():
        return 16, 64, 128, 4, 1
    # Few tokens per expert (decode, short prompts): the smallest tile a dot takes, so little of
    # it is padding; many (long prefills): taller tiles that reuse each dequantized weight tile.
    # Compiled for sm_90, gate/up (two weight tiles a step) fits its registers at these shapes.
    if pairs <= 16 * num_experts:
        return 16, 64, 32, 8, 2
    return 64, 64, 32, 8, 2


def group_by_expert(
    chosen: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (flat index t * top_k + j of `chosen` [tokens, top_k]) in tiles of one expert each.

    Returns `pairs` int32 [tiles * block_m] (padding slots hold the pair count, an index past the
    end) and `tile_expert` int32 [tiles] (num_experts for the unused tiles at the end). `tiles`
    is the worst case for this many pairs, so nothing here waits on the device.
    """
    flat = chosen.reshape(-1)
    n_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    first_slot = (tile_end - tiles) * block_m
    first_rank = torch.cumsum(counts, 0) - counts
    experts = flat[order]
    slots = first_slot[experts] + torch.arange(n_pairs, device=flat.device) - first_rank[experts]
    max_tiles = triton.cdiv(n_pairs, block_m) + min(num_experts, n_pairs)
    pairs = torch.full((max_tiles * block_m,), n_pairs, dtype=torch.int32, device=flat.device)
    pairs[slots] = order.to(torch.int32)
    tile_index = torch.arange(max_tiles, device=flat.device)
    tile_expert = torch.searchsorted(tile_end, tile_index, right=True).to(torch.int32)
    return pairs, tile_expert


@triton.jit
def _gate_up_kernel(
    x_ptr,
    gate_ptr,
    gate_h_ptr,
    up_ptr,
    up_h_ptr,
    lut_ptr,
    pairs_ptr,
    tile_expert_ptr,
    act_ptr,
    n_pairs,
    num_experts,
    top_k,
    N,
    K,
    gate_row_bytes,
    up_row_bytes,
    stride_xm,
    stride_am,
    GATE_TYPE: tl.constexpr,
    UP_TYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= num_experts:
        return
    pairs = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    m_in = pairs < n_pairs
    tokens = pairs // top_k
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n < N
    rows = expert.to(tl.int64) * N + offs_n
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_in = cols < K
        x = tl.load(
            x_ptr + tokens[:, None].to(tl.int64) * stride_xm + cols[None, :],
            mask=m_in[:, None] & k_in[None, :],
            other=0.0,
        )
        w_gate = tl.trans(
            dequantize_tile(
                gate_ptr, gate_h_ptr, lut_ptr, rows, n_in, k0, K, gate_row_bytes, GATE_TYPE, BLOCK_N, BLOCK_K
            )
        )
        gate = dot(x, w_gate, gate, DOT_DTYPE)
        w_up = tl.trans(
            dequantize_tile(
                up_ptr, up_h_ptr, lut_ptr, rows, n_in, k0, K, up_row_bytes, UP_TYPE, BLOCK_N, BLOCK_K
            )
        )
        up = dot(x, w_up, up, DOT_DTYPE)
    act = gate * tl.sigmoid(gate) * up
    out = act_ptr + pairs[:, None].to(tl.int64) * stride_am + offs_n[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    down_ptr,
    down_h_ptr,
    lut_ptr,
    pairs_ptr,
    tile_expert_ptr,
    routing_ptr,
    out_ptr,
    n_pairs,
    num_experts,
    N,
    K,
    row_bytes,
    stride_am,
    stride_om,
    QTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= num_experts:
        return
    pairs = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    m_in = pairs < n_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n < N
    rows = expert.to(tl.int64) * N + offs_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_in = cols < K
        a = tl.load(
            act_ptr + pairs[:, None].to(tl.int64) * stride_am + cols[None, :],
            mask=m_in[:, None] & k_in[None, :],
            other=0.0,
        )
        w = tl.trans(
            dequantize_tile(
                down_ptr, down_h_ptr, lut_ptr, rows, n_in, k0, K, row_bytes, QTYPE, BLOCK_N, BLOCK_K
            )
        )
        acc = dot(a, w, acc, DOT_DTYPE)
    # Rounded to the output dtype before the routing weight, as the unfused path's down product is.
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(routing_ptr + pairs, mask=m_in, other=0.0).to(tl.float32)
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, (y * weight[:, None]).to(out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


def _pair_shape() -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the one-token kernels (GEMV tiles, see triton_gemv)."""
    return (16, 128, 4) if interpreting() else (16, 256, 4)


@triton.jit
def _expert_row_dot(
    x_row,
    w_ptr,
    h_ptr,
    lut_ptr,
    rows,
    n_in,
    K,
    row_bytes,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """x_row (K activations) times the weight rows `rows` [BLOCK_N]: float32 [BLOCK_N].

    Q4_K blocks are read as int32 words, one superblock a step (triton_quant.q4_k_words_dot); the
    other types byte by byte (tile_codes)."""
    acc = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    if QTYPE == Q4_K:
        row_words = (w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rows * (row_bytes // 4))[:, None]
        row_h = (h_ptr + rows * (row_bytes // 2))[:, None]
        one = tl.arange(0, 1)
        for k0 in range(0, K, 256):
            acc += q4_k_words_dot(x_row, one, one < 1, 0, row_words, row_h, n_in, k0, K, 1, BLOCK_N, 1)
    else:
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
            q, dl, ml = tile_codes(
                w_ptr, h_ptr, lut_ptr, rows, n_in, k0, K, row_bytes, QTYPE, BLOCK_N, BLOCK_K
            )
            acc += dot_codes(x, q, dl, ml, 1, BLOCK_N, BLOCK_K)
    return tl.reshape(acc, (BLOCK_N,))


@triton.jit
def _gate_up_token_kernel(
    x_ptr,
    gate_ptr,
    gate_h_ptr,
    up_ptr,
    up_h_ptr,
    lut_ptr,
    experts_ptr,
    act_ptr,
    N,
    K,
    gate_row_bytes,
    up_row_bytes,
    stride_am,
    GATE_TYPE: tl.constexpr,
    UP_TYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    expert = tl.load(experts_ptr + pair)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n < N
    rows = expert.to(tl.int64) * N + offs_n
    gate = _expert_row_dot(
        x_ptr, gate_ptr, gate_h_ptr, lut_ptr, rows, n_in, K, gate_row_bytes, GATE_TYPE, BLOCK_N, BLOCK_K
    )
    up = _expert_row_dot(
        x_ptr, up_ptr, up_h_ptr, lut_ptr, rows, n_in, K, up_row_bytes, UP_TYPE, BLOCK_N, BLOCK_K
    )
    act = gate * tl.sigmoid(gate) * up
    tl.store(act_ptr + pair * stride_am + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_in)


@triton.jit
def _down_token_kernel(
    act_ptr,
    down_ptr,
    down_h_ptr,
    lut_ptr,
    experts_ptr,
    routing_ptr,
    out_ptr,
    N,
    K,
    row_bytes,
    stride_am,
    stride_om,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    expert = tl.load(experts_ptr + pair)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n < N
    rows = expert.to(tl.int64) * N + offs_n
    acc = _expert_row_dot(
        act_ptr + pair * stride_am,
        down_ptr,
        down_h_ptr,
        lut_ptr,
        rows,
        n_in,
        K,
        row_bytes,
        QTYPE,
        BLOCK_N,
        BLOCK_K,
    )
    # Rounded to the output dtype before the routing weight, as the unfused path's down product is.
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(routing_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair * stride_om + offs_n, (y * weight).to(out_ptr.dtype.element_ty), mask=n_in)


def _one_token_moe(
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    chosen: torch.Tensor,
    gate: ExpertBlocks,
    up: ExpertBlocks,
    down: ExpertBlocks,
) -> torch.Tensor:
    """fused_moe for a single token (a decode step): its top_k experts are distinct, so one program
    row per (expert, output tile) reads each expert's weights exactly once, GEMV-style (no padding
    to a 16-row dot)."""
    for blocks in (gate, up, down):
        if blocks.ggml_type == GGMLQuantizationType.Q4_K and blocks.raw.data_ptr() % 4:
            raise ValueError("Q4_K expert blocks must start on a 4-byte boundary (they are read as int32)")
    hidden = x.shape[1]
    top_k = chosen.shape[1]
    intermediate = gate.raw.shape[1]
    block_n, block_k, warps = _pair_shape()
    experts = chosen.reshape(-1).contiguous()
    lut = codebook(x.device)
    act = torch.empty(top_k, intermediate, dtype=x.dtype, device=x.device)
    _gate_up_token_kernel[(top_k, triton.cdiv(intermediate, block_n))](
        x, gate.raw, fp16_view(gate.raw), up.raw, fp16_view(up.raw), lut, experts, act,
        intermediate, hidden, gate.raw.shape[-1], up.raw.shape[-1], act.stride(0),
        GATE_TYPE=int(gate.ggml_type), UP_TYPE=int(up.ggml_type), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    per_pair = torch.empty(top_k, hidden, dtype=x.dtype, device=x.device)
    _down_token_kernel[(top_k, triton.cdiv(hidden, block_n))](
        act, down.raw, fp16_view(down.raw), lut, experts, routing_weights.contiguous(), per_pair,
        hidden, intermediate, down.raw.shape[-1], act.stride(0), per_pair.stride(0),
        QTYPE=int(down.ggml_type), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return per_pair.sum(dim=0, keepdim=True)


def fused_moe(
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    chosen: torch.Tensor,
    gate: ExpertBlocks,
    up: ExpertBlocks,
    down: ExpertBlocks,
) -> torch.Tensor:
    """sum_j routing_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = chosen[t, j]: [tokens, hidden].

    x [tokens, hidden]; routing_weights [tokens, top_k] in x's dtype; chosen [tokens, top_k] expert
    indices. gate/up hold [num_experts, intermediate, ...] blocks, down [num_experts, hidden, ...].
    """
    tokens, hidden = x.shape
    num_experts, intermediate = gate.raw.shape[:2]
    if up.raw.shape[:2] != (num_experts, intermediate) or down.raw.shape[:2] != (num_experts, hidden):
        raise ValueError(
            f"expert stacks do not fit together: gate {tuple(gate.raw.shape)}, up {tuple(up.raw.shape)}, "
            f"down {tuple(down.raw.shape)} for hidden size {hidden}"
        )
    check_weight(gate.raw, gate.ggml_type, hidden)
    check_weight(up.raw, up.ggml_type, hidden)
    check_weight(down.raw, down.ggml_type, intermediate)
    x = x.contiguous()
    top_k = chosen.shape[1]
    n_pairs = tokens * top_k
    if n_pairs == 0:
        return torch.zeros_like(x)
    if tokens == 1:
        return _one_token_moe(x, routing_weights, chosen, gate, up, down)
    block_m, block_n, block_k, warps, stages = _tile_shape(n_pairs, num_experts)
    pairs, tile_expert = group_by_expert(chosen, num_experts, block_m)
    lut = codebook(x.device)
    act = torch.empty(n_pairs, intermediate, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(tile_expert.numel(), triton.cdiv(intermediate, block_n))](
        x,
        gate.raw,
        fp16_view(gate.raw),
        up.raw,
        fp16_view(up.raw),
        lut,
        pairs,
        tile_expert,
        act,
        n_pairs,
        num_experts,
        top_k,
        intermediate,
        hidden,
        gate.raw.shape[-1],
        up.raw.shape[-1],
        x.stride(0),
        act.stride(0),
        GATE_TYPE=int(gate.ggml_type),
        UP_TYPE=int(up.ggml_type),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(x.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    per_pair = torch.empty(n_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(tile_expert.numel(), triton.cdiv(hidden, block_n))](
        act,
        down.raw,
        fp16_view(down.raw),
        lut,
        pairs,
        tile_expert,
        routing_weights.contiguous(),
        per_pair,
        n_pairs,
        num_experts,
        hidden,
        intermediate,
        down.raw.shape[-1],
        act.stride(0),
        per_pair.stride(0),
        QTYPE=int(down.ggml_type),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(x.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return per_pair.view(tokens, top_k, hidden).sum(dim=1)
