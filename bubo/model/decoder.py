"""The decoder-only transformer shared by llama, qwen2, qwen3 and qwen3moe.

The model is assembled from the config: `build_layer` picks each layer's parts (attention with
or without biases and q/k norms; by `config.mlp_kind`, a dense MLP or a sparse mixture of
experts) and asks a `WeightSource` for their weights by GGUF tensor name. The source decides how a
weight is held (plain parameter or quantized blocks), so the modules here are the same for every
file. A new architecture adds a config mapping and, where
its layers really differ, a new part chosen in `build_layer` — not a new model class.
"""

from typing import Protocol

import torch
from torch import nn

from bubo.engine.kv_cache import KVCache
from bubo.gguf.config import MlpKind, ModelConfig
from bubo.model.attention import Attention
from bubo.model.layers import MLP, RMSNorm, RotaryEmbedding
from bubo.model.moe import Experts, SparseMoE

__all__ = ["Decoder", "DecoderLayer", "WeightSource", "build_layer"]


class WeightSource(Protocol):
    """Hands out weights by GGUF tensor name, checked against the expected torch-order shape."""

    dtype: torch.dtype  # compute dtype
    device: torch.device

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A plain tensor in the compute dtype (norm weights)."""
        ...

    def linear(self, name: str, shape: tuple[int, int], bias: str | None = None) -> nn.Module:
        """A module computing x W^T (+ b) for the [out, in] weight `name` and optional bias tensor `bias`."""
        ...

    def embedding(self, name: str, shape: tuple[int, int]) -> nn.Module:
        """A module mapping token ids [...] to rows [..., dim] of the [vocab, dim] matrix `name`."""
        ...

    def experts(self, name: str, shape: tuple[int, int, int]) -> Experts:
        """The [num_experts, out, in] stack of expert matrices `name`, applied one expert at a time."""
        ...


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + mlp(norm(x))."""

    def __init__(self, attn_norm: RMSNorm, attention: Attention, ffn_norm: RMSNorm, mlp: nn.Module) -> None:
        super().__init__()
        self.attn_norm = attn_norm
        self.attention = attention
        self.ffn_norm = ffn_norm
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), cos, sin, cache)
        return x + self.mlp(self.ffn_norm(x))


def _attention(config: ModelConfig, i: int, weights: WeightSource) -> Attention:
    p = f"blk.{i}."
    hidden, head_dim = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * head_dim, config.num_kv_heads * head_dim

    def bias(name: str) -> str | None:
        return p + name + ".bias" if config.attention_bias else None

    q_norm = k_norm = None
    if config.qk_norm:
        q_norm = RMSNorm(weights.tensor(p + "attn_q_norm.weight", (head_dim,)), config.rms_norm_eps)
        k_norm = RMSNorm(weights.tensor(p + "attn_k_norm.weight", (head_dim,)), config.rms_norm_eps)
    return Attention(
        config,
        layer_index=i,
        q_proj=weights.linear(p + "attn_q.weight", (q_out, hidden), bias=bias("attn_q")),
        k_proj=weights.linear(p + "attn_k.weight", (kv_out, hidden), bias=bias("attn_k")),
        v_proj=weights.linear(p + "attn_v.weight", (kv_out, hidden), bias=bias("attn_v")),
        o_proj=weights.linear(p + "attn_output.weight", (hidden, q_out)),
        q_norm=q_norm,
        k_norm=k_norm,
    )


def _mlp(config: ModelConfig, i: int, weights: WeightSource) -> MLP:
    p = f"blk.{i}."
    hidden, ffn = config.hidden_size, config.intermediate_size
    return MLP(
        gate=weights.linear(p + "ffn_gate.weight", (ffn, hidden)),
        up=weights.linear(p + "ffn_up.weight", (ffn, hidden)),
        down=weights.linear(p + "ffn_down.weight", (hidden, ffn)),
    )


def _sparse_moe(config: ModelConfig, i: int, weights: WeightSource) -> SparseMoE:
    p = f"blk.{i}."
    hidden, ffn, n = config.hidden_size, config.moe_intermediate_size, config.num_experts
    return SparseMoE(
        router=weights.linear(p + "ffn_gate_inp.weight", (n, hidden)),
        gate=weights.experts(p + "ffn_gate_exps.weight", (n, ffn, hidden)),
        up=weights.experts(p + "ffn_up_exps.weight", (n, ffn, hidden)),
        down=weights.experts(p + "ffn_down_exps.weight", (n, hidden, ffn)),
        top_k=config.num_experts_per_tok,
        norm_topk_prob=config.norm_topk_prob,
    )


_FEED_FORWARD = {MlpKind.DENSE: _mlp, MlpKind.SPARSE_MOE: _sparse_moe}


def build_layer(config: ModelConfig, i: int, weights: WeightSource) -> DecoderLayer:
    """Layer i of the model `config` describes, weights from `weights`."""
    p, hidden, eps = f"blk.{i}.", config.hidden_size, config.rms_norm_eps
    return DecoderLayer(
        attn_norm=RMSNorm(weights.tensor(p + "attn_norm.weight", (hidden,)), eps),
        attention=_attention(config, i, weights),
        ffn_norm=RMSNorm(weights.tensor(p + "ffn_norm.weight", (hidden,)), eps),
        mlp=_FEED_FORWARD[config.mlp_kind](config, i, weights),
    )


class Decoder(nn.Module):
    """tokens [B, T] -> float32 logits [B, T, vocab], continuing at position `cache.length`.

    The compute dtype is fixed at load time (`dtype`); the device is wherever the weights are.
    """

    def __init__(self, config: ModelConfig, weights: WeightSource) -> None:
        super().__init__()
        self.config = config
        self.dtype = weights.dtype
        vocab_shape = (config.vocab_size, config.hidden_size)
        self.embedding = weights.embedding("token_embd.weight", vocab_shape)
        self.layers = nn.ModuleList(build_layer(config, i, weights) for i in range(config.num_layers))
        self.norm = RMSNorm(weights.tensor("output_norm.weight", (config.hidden_size,)), config.rms_norm_eps)
        output_name = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
        self.output = weights.linear(output_name, vocab_shape)
        self.rotary = RotaryEmbedding(config, device=weights.device)

    @property
    def device(self) -> torch.device:
        return self.rotary.inv_freq.device

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """Logits for every position, or with `last_only` just the last ([B, 1, vocab]): enough for
        generation, and a long prompt's full-vocabulary logits would be large."""
        tokens = tokens.to(self.device)
        length = tokens.shape[1]
        positions = torch.arange(cache.length, cache.length + length, device=self.device)
        cos, sin = self.rotary(positions, self.dtype)
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, cache)
        cache.advance(length)
        if last_only:
            x = x[:, -1:]
        return self.output(self.norm(x)).float()

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        """An empty cache for `batch` sequences of up to `max_len` positions (default: the model's context)."""
        c = self.config
        return KVCache(
            num_layers=c.num_layers,
            batch=batch,
            num_kv_heads=c.num_kv_heads,
            max_len=c.context_length if max_len is None else max_len,
            head_dim=c.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
