"""The Triton paged-attention decode kernel against SDPA over `KVCache.read` (the torch decode path), on
sequences of ragged lengths whose blocks are scattered over one shared pool. On the CPU the kernel
runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from bubo.kernels.triton_paged_attention import COMBINE_PARTITIONS, paged_attention_decode
from bubo.model.block_pool import BlockPool
from bubo.model.state import KVCache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYER = 1


def _filled_caches(
    lengths: list[int], kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> tuple[BlockPool, list[KVCache]]:
    """One cache per length on one pool, grown a few positions at a time in turn, so that their
    blocks interleave instead of forming runs."""
    blocks = sum(-(-n // block_size) for n in lengths) + 2
    pool = BlockPool(2, kv_heads, head_dim, blocks, block_size, dtype, DEVICE)
    caches = [KVCache(2, 1, kv_heads, max(lengths), head_dim, dtype, DEVICE, pool=pool) for _ in lengths]
    step = 5
    for start in range(0, max(lengths), step):
        for cache, length in zip(caches, lengths, strict=True):
            n = min(step, length - start)
            if n <= 0:
                continue
            for layer in range(2):
                k, v = torch.randn(2, 1, kv_heads, n, head_dim, device=DEVICE).to(dtype)
                cache.update(layer, k, v)
            cache.advance(n)
    return pool, caches


def _tables(caches: list[KVCache]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(c.tables[0]) for c in caches)
    tables = torch.zeros(len(caches), width, dtype=torch.int32)
    for row, cache in enumerate(caches):
        tables[row, : len(cache.tables[0])] = torch.tensor(cache.tables[0])
    lengths = torch.tensor([c.length for c in caches], dtype=torch.int32)
    return tables.to(DEVICE), lengths.to(DEVICE)


def _reference(q: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
    rows = []
    for i, cache in enumerate(caches):
        k, v = cache.read(LAYER)
        out = F.scaled_dot_product_attention(
            q[i : i + 1, :, None].float(), k.float(), v.float(), enable_gqa=True
        )
        rows.append(out[:, :, 0])
    return torch.cat(rows)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "partition"),
    [(6, 2, 16, 8, 16), (4, 4, 24, 16, 32), (8, 1, 32, 4, None)],
)
def test_matches_sdpa_over_the_cache(
    heads: int, kv_heads: int, head_dim: int, block_size: int, partition: int | None
) -> None:
    torch.manual_seed(0)
    lengths = [1, 13, 40, 77]
    pool, caches = _filled_caches(lengths, kv_heads, head_dim, block_size, torch.float32)
    assert any(
        b + 1 != c for cache in caches for b, c in zip(cache.tables[0], cache.tables[0][1:], strict=False)
    ), "the test wants scattered blocks"
    q = torch.randn(len(lengths), heads, head_dim, device=DEVICE)
    tables, lens = _tables(caches)
    out = paged_attention_decode(
        q, pool.keys[LAYER], pool.values[LAYER], tables, lens, block_size, partition=partition
    )
    torch.testing.assert_close(out, _reference(q, caches), atol=1e-5, rtol=1e-5)


def test_more_partitions_than_the_combine_step_sums_at_once() -> None:
    """The combine step rescales and sums COMBINE_PARTITIONS partitions at a time: 34 partitions of
    16 positions take it three steps, with a one-partition sequence beside them."""
    torch.manual_seed(4)
    lengths = [1, 300, 530]
    pool, caches = _filled_caches(lengths, 2, 16, 8, torch.float32)
    assert -(-max(lengths) // 16) > 2 * COMBINE_PARTITIONS
    q = torch.randn(len(lengths), 4, 16, device=DEVICE) * 3
    tables, lens = _tables(caches)
    out = paged_attention_decode(q, pool.keys[LAYER], pool.values[LAYER], tables, lens, 8, partition=16)
    torch.testing.assert_close(out, _reference(q, caches), atol=1e-5, rtol=1e-5)


def test_shared_prefix_blocks_and_half_precision() -> None:
    """Two sequences read the same prompt blocks (share_prefix) and then their own; bfloat16 pool."""
    torch.manual_seed(1)
    kv_heads, head_dim, block_size = 2, 16, 8
    pool, (source,) = _filled_caches([20], kv_heads, head_dim, block_size, torch.bfloat16)
    follower = KVCache(2, 1, kv_heads, 40, head_dim, torch.bfloat16, DEVICE, pool=pool)
    follower.share_prefix(source, 16)
    for layer in range(2):
        k, v = torch.randn(2, 1, kv_heads, 9, head_dim, device=DEVICE).to(torch.bfloat16)
        follower.update(layer, k, v)
    follower.advance(9)
    assert follower.tables[0][:2] == source.tables[0][:2]
    q = torch.randn(2, 4, head_dim, device=DEVICE).to(torch.bfloat16)
    tables, lens = _tables([source, follower])
    out = paged_attention_decode(
        q, pool.keys[LAYER], pool.values[LAYER], tables, lens, block_size, partition=16
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(q, [source, follower]), atol=2e-2, rtol=2e-2)


def test_selected_positions_only() -> None:
    """With `positions` (QSA's selection), each row attends to the positions it lists, in any order."""
    torch.manual_seed(2)
    kv_heads, head_dim, block_size = 2, 16, 4
    lengths = [30, 45]
    pool, caches = _filled_caches(lengths, kv_heads, head_dim, block_size, torch.float32)
    count = 21
    generator = torch.Generator().manual_seed(3)
    positions = torch.stack([torch.randperm(n, generator=generator)[:count] for n in lengths]).to(DEVICE)
    q = torch.randn(2, 6, head_dim, device=DEVICE)
    tables, _ = _tables(caches)
    lens = torch.full((2,), count, dtype=torch.int32, device=DEVICE)
    out = paged_attention_decode(
        q, pool.keys[LAYER], pool.values[LAYER], tables, lens, block_size, partition=16, positions=positions
    )
    expected = []
    for i, cache in enumerate(caches):
        k, v = cache.read(LAYER)
        keep = positions[i].sort().values
        rows = F.scaled_dot_product_attention(
            q[i : i + 1, :, None], k[:, :, keep], v[:, :, keep], enable_gqa=True
        )
        expected.append(rows[:, :, 0])
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_uneven_head_groups_and_bad_partitions_are_refused() -> None:
    pool = BlockPool(1, 2, 16, 2, 8, torch.float32, DEVICE)
    q = torch.zeros(1, 3, 16, device=DEVICE)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="3 query heads"):
        paged_attention_decode(q, pool.keys[0], pool.values[0], tables, lens, 8)
    with pytest.raises(ValueError, match="partition"):
        paged_attention_decode(q[:, :2], pool.keys[0], pool.values[0], tables, lens, 8, partition=24)


def test_float16_pool_under_float32_queries() -> None:
    """`--cache-type-k/-v f16` on a float32 model: the kernel widens the float16 tiles as it loads them
    and returns float32."""
    torch.manual_seed(5)
    lengths = [3, 29]
    pool, caches = _filled_caches(lengths, 2, 16, 8, torch.float16)
    q = torch.randn(len(lengths), 4, 16, device=DEVICE)
    tables, lens = _tables(caches)
    out = paged_attention_decode(q, pool.keys[LAYER], pool.values[LAYER], tables, lens, 8, partition=16)
    assert out.dtype == torch.float32
    # TF32 products on a GPU (the pool's values are exact in it, q is not); exact in the interpreter.
    torch.testing.assert_close(out, _reference(q, caches), atol=2e-3, rtol=2e-3)
