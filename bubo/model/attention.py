"""Causal self-attention with grouped KV heads, rotary positions and a KV cache."""

import torch
import torch.nn.functional as F
from torch import nn

from bubo.gguf.model_config import ModelConfig
from bubo.kernels.decode_attention import decode_attention
from bubo.kernels.triton_support import triton_enabled
from bubo.model.layers import RMSNorm, apply_rotary
from bubo.model.paged_decode import paged_decode_attention
from bubo.model.quantized_linear import project_rows
from bubo.model.state import CacheBatch, KVCache
from bubo.model.step_ops import in_compiled_step

__all__ = ["Attention", "causal_mask"]


def causal_mask(start: int, length: int, device: torch.device) -> torch.Tensor:
    """Boolean [length, start + length]: query i (at position start + i) may see keys 0..start + i."""
    query_pos = torch.arange(start, start + length, device=device)
    key_pos = torch.arange(start + length, device=device)
    return key_pos[None, :] <= query_pos[:, None]


class Attention(nn.Module):
    """q/k/v projections (optionally biased), optional per-head q/k RMSNorm, rope, SDPA, output projection.

    With `output_gate` (the full-attention layers of Qwen3-Next and Qwen3.5), q_proj yields per head
    [query | gate] (2 * head_dim rows per head) and the attention output is multiplied by
    sigmoid(gate) before o_proj, which lets a head switch its output off rather than park its
    softmax on a sink token.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        q_proj: nn.Module,
        k_proj: nn.Module,
        v_proj: nn.Module,
        o_proj: nn.Module,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        output_gate: bool = False,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index  # which slot of the KV cache is ours
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rope_style = config.rope_style
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.output_gate = output_gate

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | CacheBatch,
        last_only: bool = False,
    ) -> torch.Tensor:
        """x [B, T, hidden] at positions cache.length .. cache.length + T - 1 -> [B, T, hidden].

        With a CacheBatch, row i continues caches[i] (at its own length): the projections run on the
        whole batch, attention row by row over each row's cache. A decode step on CUDA with triton
        installed runs the paged-attention kernel over every row at once instead.

        With `last_only` (a KVCache, T > 1) keys and values still reach the cache for all T positions, but the
        query, attention and output projection run for the last position alone: [B, 1, hidden]. That
        query sees every cached key, so it needs no mask.
        """
        if last_only and isinstance(cache, KVCache) and x.shape[1] > 1:
            q, k, v, gate = self.project(x, cos, sin, queries_from=x.shape[1] - 1)
            return self.attend(q, k, v, gate, cache, None)
        q, k, v, gate = self.project(x, cos, sin)
        if in_compiled_step():
            # A compiled or captured step's state attends each row over its own cache, causally (`attend`).
            return self.attend(q, k, v, gate, cache, None)
        if x.shape[1] == 1 and triton_enabled(q.device):
            # One token per sequence on CUDA: the paged kernel reads every row's blocks in place.
            caches = cache.caches if isinstance(cache, CacheBatch) else [cache]
            out = paged_decode_attention(q, k, v, caches, self.layer_index)
            return self.output(out.transpose(1, 2), gate)
        if isinstance(cache, CacheBatch):
            rows = [
                self.attend(
                    q[i : i + 1], k[i : i + 1], v[i : i + 1], None, row, *_mask(row, x), project=False
                )
                for i, row in enumerate(cache.caches)
            ]
            return self.output(torch.cat(rows), gate)
        return self.attend(q, k, v, gate, cache, *_mask(cache, x))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, queries_from: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rotated q, k and v [B, heads, T, head_dim], and the output gate [B, T, heads, head_dim] if any;
        q and the gate only for positions queries_from onwards."""
        batch, length, _ = x.shape
        if queries_from:
            q = self.q_proj(x[:, queries_from:])
            k, v = project_rows(x, self.k_proj, self.v_proj)
        else:
            q, k, v = project_rows(x, self.q_proj, self.k_proj, self.v_proj)
        queries = length - queries_from
        gate = None
        if self.output_gate:
            # Hugging Face interleaves query and gate rows per head, and llama.cpp's converter keeps
            # that layout (it splits per-head views of one matmul), so the split is within each head.
            q, gate = q.view(batch, queries, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        else:
            q = q.view(batch, queries, self.num_heads, self.head_dim)
        k = k.view(batch, length, self.num_kv_heads, self.head_dim)
        v = v.view(batch, length, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)

        # [B, heads, T, head_dim] from here on: the layout SDPA and the cache use.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q_cos, q_sin = cos[..., queries_from:, :], sin[..., queries_from:, :]
        return (
            apply_rotary(q, q_cos, q_sin, self.rope_style),
            apply_rotary(k, cos, sin, self.rope_style),
            v,
            gate,
        )

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        gate: torch.Tensor | None,
        cache: KVCache,
        mask: torch.Tensor | None,
        is_causal: bool = False,
        project: bool = True,
    ) -> torch.Tensor:
        """Store k, v in the cache, attend over everything cached (under `mask`), then gate and project
        out — or, with `project` False, return the heads' outputs [B, T, heads, head_dim] as they are."""
        if in_compiled_step():
            # The cache grows every step: a compiled or captured step's state writes it and attends over
            # it for each of the step's rows in a form its graph can hold (bubo/model/step_ops.py).
            out = cache.step_attention(self.layer_index, q, k, v).transpose(1, 2)
            return self.output(out, gate) if project else out
        keys, values = cache.update(self.layer_index, k, v)
        narrower = keys.dtype != q.dtype or values.dtype != q.dtype
        if narrower and q.shape[:3] == (1, self.num_heads, 1) and mask is None and q.device.type == "cpu":
            # One query over a narrower cache (float16 keys and values, say): the decode kernel widens
            # them as it loads them, where SDPA would need a widened copy of the whole cache.
            out = decode_attention(q, keys, values)
        else:
            # `.to` returns the cache's own views when it is in q's dtype already.
            out = F.scaled_dot_product_attention(
                q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, is_causal=is_causal, enable_gqa=True
            )
        out = out.transpose(1, 2)
        return self.output(out, gate) if project else out

    def probabilities(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, queries_from: int = 0
    ) -> torch.Tensor:
        """The attention weights [B, heads, queries, keys] of x's queries (positions `queries_from`
        onwards) over every cached key up to x's last position, once `forward` has stored x's keys:
        the reference path of a research trace (bubo/model/trace.py), in float32, since the forward's
        fused attention never forms them."""
        q = self.project(x, cos, sin, queries_from)[0].float()
        start, length = cache.length, x.shape[1]
        keys = cache.read(self.layer_index, start + length)[0].float()
        keys = keys.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)  # SDPA's enable_gqa
        scores = (q @ keys.transpose(-1, -2)) * self.head_dim**-0.5
        mask = causal_mask(start + queries_from, length - queries_from, x.device)
        return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)

    def output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The heads' outputs [B, T, heads, head_dim], gated, through o_proj -> [B, T, hidden]."""
        batch, length = out.shape[:2]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(batch, length, self.num_heads * self.head_dim))


def _mask(cache: KVCache, x: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """SDPA's attn_mask and is_causal for x's T new positions after the cache's `length`."""
    start, length = cache.length, x.shape[1]
    if start == 0:
        return None, length > 1  # plain prefill: SDPA's own (top-left aligned) causal mask
    if length == 1:
        return None, False  # one new token sees the whole cache
    return causal_mask(start, length, x.device), False
