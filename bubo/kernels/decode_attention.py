"""Attention of one new position over a sequence's cached keys and values, compiled for every length.

A decode step attends one query per head over the T positions cached so far. On the CPU torch's
scaled_dot_product_attention spends most of that call on its own machinery: choosing a backend,
transposes and buffers, then a flash-attention loop built for many queries, which for one query runs
small GEMMs per head and block. In the default model's compiled decode step this kernel is level with
SDPA up to ~900 positions and ahead past it (benchmarks/RESULTS.md).

Here it is one inductor kernel (bubo/kernels/compiled.py's DynamicKernel: T and the cache's strides
are read from the arguments, so one compile serves every length and every cache layout): the scores of
a query head against its KV head's keys (grouped-query attention: heads h*G .. h*G + G - 1 share KV
head h, as SDPA's enable_gqa and repeat_interleave order them), a softmax whose normalization is
applied once to the weighted sum of values rather than to every weight (one division per output
instead of one per position), in q's dtype (float32) throughout. Keys and values stored narrower
(a float16 cache: `bubo serve --cache-type-k/-v`) are widened as they are loaded, so the kernel reads
half the bytes, and takes about a third less time when the cache is not in the CPU's caches.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from bubo.kernels.compiled import DynamicKernel

__all__ = ["decode_attention", "decode_attention_kernel", "decode_attention_reference"]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    kv_heads, dim = keys.shape[1], keys.shape[3]
    grouped = q.view(kv_heads, -1, dim) * dim**-0.5  # [kv_heads, G, D]
    k, v = keys[0].to(q.dtype), values[0].to(q.dtype)  # [kv_heads, T, D]
    scores = (k[:, None] * grouped[:, :, None, :]).sum(-1)  # [kv_heads, G, T]
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    out = (weights[..., None] * v[:, None]).sum(2) / weights.sum(-1)[..., None]
    return out.view(q.shape)


def _attend_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    # M queries at the last M of the T positions (a verify pass's tokens): query i sees positions up to
    # T - M + i. The length enters only as an extent and in the mask's comparison.
    kv_heads, length, dim = keys.shape[1], keys.shape[2], keys.shape[3]
    queries = q.shape[2]
    grouped = q.view(kv_heads, -1, queries, dim) * dim**-0.5  # [kv_heads, G, M, D]
    k, v = keys[0].to(q.dtype), values[0].to(q.dtype)
    scores = (k[:, None, None] * grouped[:, :, :, None, :]).sum(-1)  # [kv_heads, G, M, T]
    last_seen = length - queries + torch.arange(queries, device=q.device)
    seen = torch.arange(length, device=q.device)[None, :] <= last_seen[:, None]  # [M, T]
    scores = torch.where(seen, scores, float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    out = (weights[..., None] * v[:, None, None]).sum(3) / weights.sum(-1)[..., None]
    return out.view(q.shape)


_kernel = DynamicKernel(_attend, dynamic={1: (2,), 2: (2,)})
_causal_kernel = DynamicKernel(_attend_causal, dynamic={1: (2,), 2: (2,)})


def _kernel_for_queries(q: torch.Tensor) -> DynamicKernel:
    """One query (a decode step's) needs no mask; several (a verify pass's) the causal kernel."""
    return _kernel if q.shape[2] == 1 else _causal_kernel


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [1, heads, M, D] over keys and values [1, kv_heads, T, D] (heads a multiple of kv_heads; any
    strides but a unit one for D; q's dtype or narrower) -> [1, heads, M, D], as
    `decode_attention_reference` computes it. The M queries are the last M positions (a decode step's
    one, or a verify pass's few), each attending to itself and the positions before it."""
    return _kernel_for_queries(q)(q, keys, values)


def decode_attention_kernel(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The compiled kernel `decode_attention` runs on arguments laid out as these, for any length: a caller
    whose layouts never change between calls (a decode step's layer) can keep it and skip the lookup."""
    return _kernel_for_queries(q).kernel_for(q, keys, values)


def decode_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The plain-torch result the kernel must match: SDPA on keys and values widened to q's dtype, scale
    1/sqrt(D), the queries at the last positions under a causal mask."""
    queries, length = q.shape[2], keys.shape[2]
    seen = torch.ones(queries, length, dtype=torch.bool).tril(length - queries)
    return F.scaled_dot_product_attention(
        q, keys.to(q.dtype), values.to(q.dtype), attn_mask=seen, enable_gqa=True
    )
