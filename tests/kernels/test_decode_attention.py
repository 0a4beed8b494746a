"""The compiled single-query attention against SDPA in float64, over cache views of every length."""

import pytest
import torch

from bubo.kernels import decode_attention as module
from bubo.kernels.decode_attention import decode_attention, decode_attention_reference


def _cache_views(
    kv_heads: int, length: int, dim: int, capacity: int, start: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence as the decode step sees them: positions start.. of a layer's
    block pool [kv_heads, capacity, D], viewed as [1, kv_heads, length, D]."""
    pools = [torch.randn(kv_heads, capacity, dim, generator=g) for _ in range(2)]
    keys, values = (p[None, :, start : start + length] for p in pools)
    return keys, values


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32)])
@pytest.mark.parametrize("length", [1, 2, 17, 530])
def test_matches_sdpa_in_float64(heads: int, kv_heads: int, dim: int, length: int) -> None:
    g = torch.Generator().manual_seed(length)
    q = torch.randn(1, heads, 1, dim, generator=g)
    keys, values = _cache_views(kv_heads, length, dim, capacity=length + 40, start=7, g=g)
    with torch.inference_mode():
        got = decode_attention(q, keys, values)
    expected = decode_attention_reference(q.double(), keys.double(), values.double())
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("key_dtype", "value_dtype"), [(torch.float16, torch.float16), (torch.bfloat16, torch.float16)]
)
def test_narrower_keys_and_values_are_widened_as_they_are_read(
    key_dtype: torch.dtype, value_dtype: torch.dtype
) -> None:
    # A float16 (or bfloat16) KV cache under float32 queries: the result is the float32 attention over
    # the stored values, not a half-precision one.
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 9, 1, 64, generator=g)
    keys, values = _cache_views(3, 300, 64, capacity=400, start=20, g=g)
    keys, values = keys.to(key_dtype), values.to(value_dtype)
    with torch.inference_mode():
        got = decode_attention(q, keys, values)
    expected = decode_attention_reference(q.double(), keys.double(), values.double())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_contiguous_keys_and_other_capacities_take_the_same_kernel() -> None:
    # A sequence whose blocks are not one run gathers its keys into a contiguous copy; other caches have
    # other capacities: every layout runs the one compiled kernel, and right.
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 9, 1, 64, generator=g)
    # 5000 positions: past the 4096 up to which inductor sums a reduction without its cascade helper.
    for capacity, start, length in ((64, 0, 64), (4096, 100, 300), (333, 5, 11), (5100, 3, 5000)):
        keys, values = _cache_views(3, length, 64, capacity, start, g)
        for k, v in ((keys, values), (keys.contiguous(), values.contiguous())):
            with torch.inference_mode():
                got = decode_attention(q, k, v)
            expected = decode_attention_reference(q.double(), k.double(), v.double())
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    # Compiled, not the plain function DynamicKernel falls back to (which is right too, and slow).
    assert module._kernel._compiled and all(
        k is not module._attend for k in module._kernel._compiled.values()
    )


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize(("queries", "length"), [(2, 2), (4, 9), (4, 530)])
def test_several_queries_each_see_the_positions_up_to_their_own(
    heads: int, kv_heads: int, queries: int, length: int
) -> None:
    # A verify pass's queries are the last positions: query i attends to positions 0 .. T - M + i.
    g = torch.Generator().manual_seed(queries * length)
    q = torch.randn(1, heads, queries, 64, generator=g)
    keys, values = _cache_views(kv_heads, length, 64, capacity=length + 40, start=7, g=g)
    with torch.inference_mode():
        got = decode_attention(q, keys, values)
        # Each query alone over its own prefix: the single-query kernel.
        alone = [
            decode_attention(
                q[:, :, i : i + 1],
                keys[:, :, : length - queries + i + 1],
                values[:, :, : length - queries + i + 1],
            )
            for i in range(queries)
        ]
    expected = decode_attention_reference(q.double(), keys.double(), values.double())
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, torch.cat(alone, dim=2), rtol=1e-5, atol=1e-6)
    assert module._causal_kernel._compiled and all(
        k is not module._attend_causal for k in module._causal_kernel._compiled.values()
    )
