"""One decode step of attention read straight from the block pool by the Triton paged-attention kernel
(bubo/kernels/triton_paged_attention.py), for the CUDA path of `Attention`: the new keys and values go
into each sequence's blocks, then one kernel call attends every sequence over its own blocks, with no
gather of scattered blocks into a contiguous copy and one launch for all the rows of a CacheBatch."""

from collections.abc import Sequence

import torch

from bubo.model.state import KVCache

__all__ = ["paged_decode_attention"]


def paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    caches: Sequence[KVCache],
    layer: int,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, heads, 1, D], k and v [B, kv_heads, 1, D] of one new token per sequence; the sequences are
    the rows of `caches` in order (one cache of B rows, or B single-row caches of a CacheBatch). Stores
    k, v at each cache's `length` in `layer` and returns the attention output [B, heads, 1, D] over
    every cached position (the new one included), or over `positions` [B, n] alone (QSA's selection;
    one cache only)."""
    from bubo.kernels.triton_paged_attention import paged_attention_decode

    row = 0
    for cache in caches:
        cache.write(layer, k[row : row + cache.batch], v[row : row + cache.batch])
        row += cache.batch
    # The server's slots share one pool: one call for all rows. Caches on separate pools: one each.
    shared = all(cache.pool is caches[0].pool for cache in caches)
    groups = [list(caches)] if shared else [[cache] for cache in caches]
    outputs, row = [], 0
    for group in groups:
        rows = sum(cache.batch for cache in group)
        pool = group[0].pool
        tables, lengths = _block_tables(group, q.device)
        if positions is not None:
            lengths = torch.full_like(lengths, positions.shape[1])
        out = paged_attention_decode(
            q[row : row + rows, :, 0],
            pool.keys[layer],
            pool.values[layer],
            tables,
            lengths,
            pool.block_size,
            positions=positions,
        )
        outputs.append(out)
        row += rows
    return torch.cat(outputs)[:, :, None]


# The last tables sent to the device, (key, tensors): every attention layer of a decode step reads
# the same tables (the first layer's write took any new block), so they are copied over once per step.
# One tuple, replaced whole, so concurrent slots at worst copy their own again.
_last_tables: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None


def _block_tables(caches: Sequence[KVCache], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's block table, zero-padded to the longest, and its length after this step's token."""
    global _last_tables
    tables = [tuple(table) for cache in caches for table in cache.tables]
    lengths = [cache.length + 1 for cache in caches for _ in cache.tables]
    key = (device, *tables, *lengths)
    last = _last_tables
    if last is not None and last[0] == key:
        return last[1]
    width = max(len(table) for table in tables)
    padded = [table + (0,) * (width - len(table)) for table in tables]
    on_device = (
        torch.tensor(padded, dtype=torch.int32).to(device),
        torch.tensor(lengths, dtype=torch.int32).to(device),
    )
    _last_tables = (key, on_device)
    return on_device
