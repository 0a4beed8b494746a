"""Paged-attention decode in Triton: one query token per sequence against keys and values that lie in
the blocks of a `BlockPool` (bubo/model/block_pool.py), read in place through each sequence's block
table, with no gather into a contiguous copy.

Split-K ("flash-decoding"): a long sequence at batch 1 is only a few (sequence, KV head) pairs, far
fewer than an H100 has SMs, so each pair's positions are cut into partitions that run as separate
programs. Each program keeps an online softmax in float32 over its partition, for all the query
heads that share its KV head (GQA: the keys and values are read once for the whole group), and
writes its running maximum, normaliser and unnormalised output; a second kernel rescales and sums
the partitions. Pool layout: [kv_heads, num_blocks * block_size, head_dim]; position p of a sequence
lies at pool position table[p // block_size] * block_size + p % block_size.

Importing this module imports triton; callers import it lazily (bubo/kernels/triton_support.py).
"""

import torch
import triton
import triton.language as tl

__all__ = ["paged_attention_decode"]

# Positions per program (a power of two, so a multiple of the tile): the largest of these that still
# gives TARGET_PROGRAMS programs (two per SM of an H100/H200), so that a lone sequence with two KV heads
# fills the GPU at 32k tokens, and at 4k uses 128-position partitions rather than 16 programs.
MAX_PARTITION = 512
MIN_PARTITION = 128
TARGET_PROGRAMS = 256
# Values of one [tile, head_dim] float32 tile of keys (then of values) scored at once: 64 positions of
# a 128-wide head, 32 of the flagship's 256-wide ones (with 8 warps), so a tile stays in registers.
TILE_VALUES = 8192
# Partitions the combine step rescales and sums at once: [16, 256] float32 values over 4 warps.
COMBINE_PARTITIONS = 16
# tl.dot's smallest operand side on NVIDIA GPUs.
MIN_DOT = 16


@triton.jit
def _partition_kernel(
    q_ptr,  # [B, Hq, D]
    k_pool_ptr,  # [Hkv, positions, D]
    v_pool_ptr,
    tables_ptr,  # [B, max_blocks] int32
    lengths_ptr,  # [B] int32
    positions_ptr,  # [B, max_length] int32 when SELECTED: the positions to attend
    max_ptr,  # [B, Hq, partitions] float32
    sum_ptr,  # [B, Hq, partitions] float32
    acc_ptr,  # [B, Hq, partitions, D] float32
    scale_log2,
    stride_qb,
    stride_qh,
    stride_ph,
    stride_pp,
    stride_tb,
    stride_sb,
    num_partitions,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PART: tl.constexpr,
    TILE_N: tl.constexpr,
    PRECISION: tl.constexpr,
    SELECTED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    length = tl.load(lengths_ptr + seq)
    start = part * PART
    if start >= length:
        return

    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    k_base = k_pool_ptr + kv_head.to(tl.int64) * stride_ph
    v_base = v_pool_ptr + kv_head.to(tl.int64) * stride_ph
    end = tl.minimum(start + PART, length)
    for tile_start in range(start, end, TILE_N):
        index = tile_start + tl.arange(0, TILE_N)
        pos_ok = index < end
        if SELECTED:  # noqa: SIM108  (a constexpr branch, Triton's idiom: only one side is compiled)
            pos = tl.load(positions_ptr + seq * stride_sb + index, mask=pos_ok, other=0)
        else:
            pos = index
        block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        pool_pos = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        offsets = pool_pos[:, None] * stride_pp + dims[None, :]
        tile_ok = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_base + offsets, mask=tile_ok, other=0.0).to(tl.float32)
        # Scores in log2 units (the scale folds in log2(e)) so the softmax runs on exp2.
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores = tl.where(pos_ok[None, :], scores, float("-inf"))
        # Every tile holds at least one visible position, so the maximum is finite (padded head rows
        # score 0 against every key).
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        weights = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        v = tl.load(v_base + offsets, mask=tile_ok, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision=PRECISION)
        running_max = new_max

    row = (seq * GROUP * tl.num_programs(1) + heads) * num_partitions + part
    tl.store(max_ptr + row, running_max, mask=head_ok)
    tl.store(sum_ptr + row, running_sum, mask=head_ok)
    tl.store(acc_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_ok[:, None] & dim_ok[None, :])


@triton.jit
def _combine_kernel(
    max_ptr,
    sum_ptr,
    acc_ptr,
    lengths_ptr,
    out_ptr,  # [B, Hq, D]
    num_heads,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PART: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    used = tl.cdiv(tl.load(lengths_ptr + seq), PART)
    parts = tl.arange(0, BLOCK_P)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    first = (seq * num_heads + head) * num_partitions
    # BLOCK_P partitions at a time with a running maximum, so that the live [BLOCK_P, BLOCK_D] tile
    # stays in registers however many partitions a long context has.
    overall = float("-inf")
    total = 0.0
    out = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, used, BLOCK_P):
        part_ok = start + parts < used
        row = first + start + parts
        maxima = tl.load(max_ptr + row, mask=part_ok, other=float("-inf"))
        new_max = tl.maximum(overall, tl.max(maxima, 0))
        rescale = tl.exp2(overall - new_max)
        weights = tl.where(part_ok, tl.exp2(maxima - new_max), 0.0)
        total = total * rescale + tl.sum(weights * tl.load(sum_ptr + row, mask=part_ok, other=0.0), 0)
        acc = tl.load(
            acc_ptr + row[:, None] * HEAD_DIM + dims[None, :],
            mask=part_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        out = out * rescale + tl.sum(acc * weights[:, None], 0)
        overall = new_max
    out = out / total
    tl.store(
        out_ptr + (seq * num_heads + head) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok
    )


def paged_attention_decode(
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    partition: int | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ · scale) v for one query token per sequence, over each sequence's first `lengths[b]`
    cached positions, or with `positions` [B, n] (int, any order) over positions[b, :lengths[b]] only
    (QSA's selection).

    q [B, Hq, D]; key_pool / value_pool [Hkv, num_blocks * block_size, D] (one layer of a BlockPool);
    block_tables [B, max_blocks] int32 (row b's block ids, padded anyhow past its last block); lengths
    [B] int32, each at least 1. Query head h reads KV head h // (Hq / Hkv), as SDPA's enable_gqa.
    `scale` defaults to 1/sqrt(D). `partition`: positions per program, a power of two of at least 16
    (default: chosen from the batch and length). Returns [B, Hq, D] in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = key_pool.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads can't share {num_kv_heads} KV heads evenly")
    if key_pool.stride(-1) != 1 or value_pool.stride() != key_pool.stride():
        raise ValueError("the key and value pools must share one layout with contiguous head dims")
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out_dtype = q.dtype
    q = q.float().contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    lengths = lengths.to(torch.int32).contiguous()
    if positions is not None:
        positions = positions.to(torch.int32).contiguous()
    max_len = block_tables.shape[1] * block_size if positions is None else positions.shape[1]
    if partition is None:
        partition = MAX_PARTITION
        while (
            partition > MIN_PARTITION
            and batch * num_kv_heads * triton.cdiv(max_len, partition) < TARGET_PROGRAMS
        ):
            partition //= 2
    if partition < MIN_DOT or partition & (partition - 1):
        raise ValueError(f"partition must be a power of two of at least {MIN_DOT}, not {partition}")
    num_partitions = triton.cdiv(max_len, partition)

    stats = torch.empty(2, batch, num_heads, num_partitions, dtype=torch.float32, device=q.device)
    acc = torch.empty(batch, num_heads, num_partitions, head_dim, dtype=torch.float32, device=q.device)
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    # Tiles are widened to float32 before their products (Triton's interpreter multiplies bfloat16
    # wrongly, and the widening keeps the kernel the one the CPU tests check). A float32 pool gets exact
    # products; a half-precision one TF32 tensor cores, whose 10-bit mantissa holds its values exactly.
    precision = "ieee" if key_pool.dtype == torch.float32 else "tf32"
    _partition_kernel[(batch, num_kv_heads, num_partitions)](
        q,
        key_pool,
        value_pool,
        block_tables,
        lengths,
        block_tables if positions is None else positions,
        stats[0],
        stats[1],
        acc,
        scale * 1.4426950408889634,
        q.stride(0),
        q.stride(1),
        key_pool.stride(0),
        key_pool.stride(1),
        block_tables.stride(0),
        0 if positions is None else positions.stride(0),
        num_partitions,
        GROUP=group,
        GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        PART=partition,
        TILE_N=min(partition, max(MIN_DOT, TILE_VALUES // block_d)),
        PRECISION=precision,
        SELECTED=positions is not None,
        num_warps=8 if block_d >= 256 else 4,
    )
    out = torch.empty(batch, num_heads, head_dim, dtype=out_dtype, device=q.device)
    _combine_kernel[(batch, num_heads)](
        stats[0],
        stats[1],
        acc,
        lengths,
        out,
        num_heads,
        num_partitions,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_P=min(COMBINE_PARTITIONS, triton.next_power_of_2(num_partitions)),
        PART=partition,
    )
    return out
