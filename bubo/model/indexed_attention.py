"""QSA indexed sparse attention: the attention layers of qwen4exp (Qwen3.8-Flash-Next).

The layer is Qwen3.5's gated attention (per-head query|gate rows in attn_q, q/k RMSNorm, partial
interleaved mRoPE, GQA, sigmoid output gate) whose queries see only the tokens a small indexer picks:

    iq = RoPE(rms(indexer.q_proj x) * q_norm)               per indexer head, at the query's position
    rk_t = indexer.k_proj x_t                                raw key of every token (one head)
    K_b = RoPE(rms(mean of rk over block b) * k_norm)        block b = tokens b*r .. b*r + r - 1,
                                                             roped at the position of its first token
    score_b = sum over heads of relu(iq_h . K_b) / sqrt(Di)

A query at position p sees n = p + 1 tokens: ⌊n/r⌋ complete blocks and a tail of n mod r tokens
(which holds p itself when it is not empty). It attends to the top budget/r complete blocks by
score plus the whole tail; with at most budget/r complete blocks it attends to everything.

This follows transformers (Qwen4ExpTextQSAIndexer), the reference, not llama.cpp, which takes a
fixed top_k + r - 1 tokens by a token-level top-k and so also attends r - 1 - tail tokens of the
next-best block whenever the last block is incomplete by fewer than r - 1 tokens (spec section 5.1).

GGUF tensors of layer N (spec section 3.5), in torch order:
    attn_q.weight [2*Nq*Dh, H], attn_k.weight / attn_v.weight [Nkv*Dh, H], attn_output.weight [H, Nq*Dh],
    attn_q_norm.weight / attn_k_norm.weight [Dh],
    indexer.q_proj.weight [Ni*Di, H], indexer.k_proj.weight [Di, H]  (the converter's split of
        transformers' fused index_qk_proj: query rows first, then the single key head),
    indexer.q_norm.weight / indexer.k_norm.weight [Di].
Every norm gamma is used as stored: the converter folds transformers' (1 + w) into it (spec section 3.6).
Hyper-parameters: Ni = `attention.indexer.head_count`, Di = `attention.indexer.key_length`, the token
budget = `attention.indexer.top_k`, r = `attention.compress_ratios[N]` (0 there means llama.cpp runs
plain causal attention, spec section 2.3: use Attention with output_gate for such a file).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from bubo.gguf.model_config import ModelConfig, RopeStyle
from bubo.kernels.triton_support import triton_enabled
from bubo.model.attention import Attention
from bubo.model.layers import RMSNorm, apply_rotary
from bubo.model.paged_decode import paged_decode_attention
from bubo.model.state import IndexerState, KVCache

__all__ = ["IndexedAttention", "QSAIndexer"]


class QSAIndexer(nn.Module):
    """Picks, for every query, the key blocks its attention may use (see the module docstring).

    q_proj: indexer.q_proj ([Ni*Di, H]); k_proj: indexer.k_proj ([Di, H]); q_norm / k_norm: RMSNorm
    over Di with the GGUF's (+1-folded) gammas; budget: tokens of complete blocks kept per query
    (`attention.indexer.top_k`, a multiple of compress_ratio).
    """

    def __init__(
        self,
        q_proj: nn.Module,
        k_proj: nn.Module,
        q_norm: RMSNorm,
        k_norm: RMSNorm,
        num_heads: int,
        compress_ratio: int,
        budget: int,
        rope_style: RopeStyle,
    ) -> None:
        super().__init__()
        if compress_ratio < 1 or budget < compress_ratio or budget % compress_ratio:
            raise ValueError(
                f"QSA budget {budget} must be a positive multiple of the compress ratio {compress_ratio}"
            )
        self.q_proj, self.k_proj, self.q_norm, self.k_norm = q_proj, k_proj, q_norm, k_norm
        self.num_heads = num_heads
        self.head_dim = q_norm.weight.shape[0]
        self.compress_ratio = compress_ratio
        self.block_budget = budget // compress_ratio
        self.rope_style = rope_style
        # The block scores pass through this identity so that a forward hook on it (the research
        # trace's indexer_scores site) sees them as computed; without hooks it is a no-op call.
        self.score_probe = nn.Identity()

    def new_state(
        self,
        batch: int,
        max_len: int,
        rope_pairs: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> IndexerState:
        """An empty state for `batch` sequences of up to `max_len` tokens (rope_pairs = rope_dim / 2)."""
        return IndexerState(batch, max_len, self.head_dim, self.compress_ratio, rope_pairs, dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: IndexerState
    ) -> torch.Tensor:
        """x [B, T, H] at positions state.length .. state.length + T - 1, cos/sin [T, rope_dim / 2] of
        those positions -> bool [B, T, state.length + T]: which keys each query attends to (causal
        included). Appends the T tokens to `state`."""
        batch, length, _ = x.shape
        r, start = self.compress_ratio, state.length
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)
        q = apply_rotary(self.q_norm(q).transpose(1, 2), cos, sin, self.rope_style)  # [B, Ni, T, Di]
        block_keys = self._append_keys(self.k_proj(x), cos, sin, state)  # [B, NB, Di]
        num_blocks = block_keys.shape[1]

        positions = torch.arange(start, start + length, device=x.device)
        visible_blocks = (positions + 1) // r  # complete blocks each query sees
        selected = torch.arange(num_blocks, device=x.device) < visible_blocks[:, None]  # dense: all visible
        selected = selected.expand(batch, length, num_blocks)
        if num_blocks > self.block_budget:
            scores = torch.matmul(q.float(), block_keys.float().transpose(1, 2)[:, None])
            scores = scores.relu().sum(1) / math.sqrt(self.head_dim)  # [B, T, NB]
            scores = self.score_probe(scores.masked_fill(~selected, float("-inf")))
            top = scores.topk(self.block_budget, dim=-1)
            chosen = torch.zeros_like(selected).scatter(-1, top.indices, True)
            sparse = visible_blocks > self.block_budget
            selected = torch.where(sparse[:, None], chosen, selected)
            # relu makes exact-zero scores common; where the last kept block ties at zero, break the tie
            # as transformers does: topk over that query's visible scores alone. A decode step's one
            # query sees every block (num_blocks == visible), so its topk above already is that one, and
            # skipping the check keeps the step free of a host sync.
            ties = (sparse & (top.values[..., -1] == 0)).nonzero().tolist() if length > 1 else []
            for b, t in ties:
                visible = scores[b, t, : visible_blocks[t]]
                selected[b, t] = False
                selected[b, t, visible.topk(self.block_budget).indices] = True

        # Token j belongs to block j // r; tokens after the last complete block (the tail, up to the
        # query) are always kept. The padding column stands for the incomplete block.
        tokens = torch.arange(start + length, device=x.device)
        in_blocks = F.pad(selected, (0, 1))[..., tokens // r]
        in_tail = (tokens >= visible_blocks[:, None] * r) & (tokens <= positions[:, None])
        return in_blocks | in_tail

    def _append_keys(
        self, raw: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: IndexerState
    ) -> torch.Tensor:
        """Fold the new raw keys [B, T, Di] into `state`; return the keys of all complete blocks."""
        r, pending = self.compress_ratio, state.tail_len
        if raw.shape[0] != state.block_keys.shape[0]:
            raise ValueError(f"indexer state holds {state.block_keys.shape[0]} sequences, got {raw.shape[0]}")
        raw = torch.cat((state.tail_keys[:, :pending], raw), dim=1)
        cos = torch.cat((state.tail_cos[:pending], cos))
        sin = torch.cat((state.tail_sin[:pending], sin))
        new = raw.shape[1] // r
        first = state.num_blocks
        if first + new > state.block_keys.shape[1]:
            raise ValueError(f"indexer state full: {first + new} blocks exceed {state.block_keys.shape[1]}")
        if new:
            # The mean in float32, as transformers pools.
            pooled = raw[:, : new * r].unflatten(1, (new, r)).float().mean(2).to(raw.dtype)
            starts = slice(0, new * r, r)
            keys = apply_rotary(self.k_norm(pooled), cos[starts], sin[starts], self.rope_style)
            state.block_keys[:, first : first + new] = keys
            state.num_blocks += new
        rest = raw.shape[1] - new * r
        state.tail_keys[:, :rest] = raw[:, new * r :]
        state.tail_cos[:rest], state.tail_sin[:rest] = cos[new * r :], sin[new * r :]
        state.tail_len = rest
        return state.block_keys[:, : state.num_blocks]


class IndexedAttention(Attention):
    """Gated attention (Attention with output_gate) restricted per query to the indexer's selection.

    Same weights and KV slot as Attention; the indexer's compressed keys live in an IndexerState
    passed alongside the KVCache, which must be at the same length.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        q_proj: nn.Module,
        k_proj: nn.Module,
        v_proj: nn.Module,
        o_proj: nn.Module,
        q_norm: RMSNorm,
        k_norm: RMSNorm,
        indexer: QSAIndexer,
    ) -> None:
        super().__init__(
            config, layer_index, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, output_gate=True
        )
        if config.rope_dim > indexer.head_dim:
            raise ValueError(f"rope_dim {config.rope_dim} exceeds the indexer head dim {indexer.head_dim}")
        self.indexer = indexer

    def forward(  # type: ignore[override]  # the indexer state rides along with the KV cache
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, state: IndexerState
    ) -> torch.Tensor:
        """x [B, T, hidden] at positions cache.length .. cache.length + T - 1 -> [B, T, hidden]."""
        if state.length != cache.length:
            raise ValueError(f"indexer state at {state.length} tokens, KV cache at {cache.length}")
        mask = self.indexer(x, cos, sin, state)
        # Attention's projections, norms, rope and gate; only the mask passed to SDPA differs.
        q, k, v, gate = self.project(x, cos, sin)
        if x.shape[1] == 1 and triton_enabled(q.device):
            # A decode step on CUDA: the paged kernel reads the selected positions' blocks alone.
            selected = self.selected_count(cache.length + 1)
            positions = None
            if selected <= cache.length:
                # Every row selects exactly `selected` positions; their order doesn't matter to softmax.
                positions = mask[:, 0].to(torch.int32).topk(selected, dim=-1).indices
            out = paged_decode_attention(q, k, v, [cache], self.layer_index, positions)
            return self.output(out.transpose(1, 2), gate)
        return self.attend(q, k, v, gate, cache, mask[:, None])

    def selected_count(self, visible: int) -> int:
        """How many of `visible` tokens a query keeps: all of them while they make at most the budget's
        complete blocks, else the budget's blocks and the tail."""
        r, budget = self.indexer.compress_ratio, self.indexer.block_budget
        if visible // r <= budget:
            return visible
        return budget * r + visible % r
