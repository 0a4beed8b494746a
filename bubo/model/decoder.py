"""The decoder-only model shared by llama, qwen2, qwen3, qwen3moe and the hybrid Qwen models
(qwen3next, qwen35, qwen35moe).

The model is assembled from the config: `build_layer` picks each layer's parts (the token mixer:
attention with or without biases and q/k norms, or in a hybrid model per layer either a Gated
DeltaNet or gated full attention; by `config.mlp_kind`, a dense MLP or a sparse mixture of experts,
with or without a shared expert) and asks a `WeightSource` for their weights by GGUF tensor name.
The source decides how a weight is held (plain parameter or quantized blocks), so the modules here
are the same for every file. A new architecture adds a config mapping and, where its layers really
differ, a new part chosen in `build_layer` — not a new model class.
"""

from typing import Protocol

import torch
from torch import nn

from bubo.engine.kv_cache import KVCache
from bubo.gguf.config import MlpKind, ModelConfig
from bubo.model.attention import Attention
from bubo.model.deltanet import GatedDeltaNet
from bubo.model.layers import MLP, RMSNorm, RotaryEmbedding
from bubo.model.moe import Experts, SparseMoE

__all__ = ["Decoder", "DecoderLayer", "DeltaNetMixer", "WeightSource", "build_layer"]

# qwen3next keeps Hugging Face's fused beta/alpha projection (ssm_ba); the qwen35 family has two.
_FUSED_BETA_ALPHA = frozenset({"qwen3next"})


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


class DeltaNetMixer(nn.Module):
    """A Gated DeltaNet in a layer's attention slot: same call as Attention, continuing from (and
    advancing) recurrent state `state_index` of the cache."""

    def __init__(self, deltanet: GatedDeltaNet, state_index: int) -> None:
        super().__init__()
        self.deltanet = deltanet
        self.state_index = state_index

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return self.deltanet(x, cache.recurrent[self.state_index])


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + mlp(norm(x)).

    `attention` is the token mixer: an Attention, or a DeltaNetMixer in a hybrid model's recurrent layers.
    """

    def __init__(
        self, attn_norm: RMSNorm, attention: Attention | DeltaNetMixer, ffn_norm: RMSNorm, mlp: nn.Module
    ) -> None:
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
    # A hybrid model's attention is gated: attn_q holds per head the query and its output gate.
    gated = config.is_hybrid

    def bias(name: str) -> str | None:
        return p + name + ".bias" if config.attention_bias else None

    q_norm = k_norm = None
    if config.qk_norm:
        q_norm = RMSNorm(weights.tensor(p + "attn_q_norm.weight", (head_dim,)), config.rms_norm_eps)
        k_norm = RMSNorm(weights.tensor(p + "attn_k_norm.weight", (head_dim,)), config.rms_norm_eps)
    return Attention(
        config,
        # its KV slot: hybrid caches hold keys and values for the attention layers only
        layer_index=i - sum(config.recurrent_layers[:i]),
        q_proj=weights.linear(p + "attn_q.weight", ((1 + gated) * q_out, hidden), bias=bias("attn_q")),
        k_proj=weights.linear(p + "attn_k.weight", (kv_out, hidden), bias=bias("attn_k")),
        v_proj=weights.linear(p + "attn_v.weight", (kv_out, hidden), bias=bias("attn_v")),
        o_proj=weights.linear(p + "attn_output.weight", (hidden, q_out)),
        q_norm=q_norm,
        k_norm=k_norm,
        output_gate=gated,
    )


def _deltanet(config: ModelConfig, i: int, weights: WeightSource) -> DeltaNetMixer:
    p, hidden, d = f"blk.{i}.", config.hidden_size, config.deltanet
    assert d is not None  # config_from_gguf sets it for every hybrid architecture
    hv, v_out = d.num_v_heads, d.num_v_heads * d.head_v_dim
    channels = 2 * d.num_k_heads * d.head_k_dim + v_out
    if config.architecture in _FUSED_BETA_ALPHA:
        beta_alpha = {"ssm_ba": weights.linear(p + "ssm_ba.weight", (2 * hv, hidden))}
    else:
        beta_alpha = {
            "ssm_beta": weights.linear(p + "ssm_beta.weight", (hv, hidden)),
            "ssm_alpha": weights.linear(p + "ssm_alpha.weight", (hv, hidden)),
        }
    deltanet = GatedDeltaNet(
        attn_qkv=weights.linear(p + "attn_qkv.weight", (channels, hidden)),
        attn_gate=weights.linear(p + "attn_gate.weight", (v_out, hidden)),
        ssm_conv1d=weights.tensor(p + "ssm_conv1d.weight", (channels, d.conv_kernel)),
        ssm_a=weights.tensor(p + "ssm_a", (hv,)),
        ssm_dt=weights.tensor(p + "ssm_dt.bias", (hv,)),
        ssm_norm=weights.tensor(p + "ssm_norm.weight", (d.head_v_dim,)),
        ssm_out=weights.linear(p + "ssm_out.weight", (hidden, v_out)),
        num_k_heads=d.num_k_heads,
        num_v_heads=hv,
        head_k_dim=d.head_k_dim,
        head_v_dim=d.head_v_dim,
        value_head_order=d.value_head_order.value,
        norm_eps=config.rms_norm_eps,
        **beta_alpha,
    )
    return DeltaNetMixer(deltanet, state_index=sum(config.recurrent_layers[:i]))


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
    shared: dict[str, nn.Module] = {}
    if config.mlp_kind == MlpKind.SPARSE_MOE_SHARED:
        width = config.shared_expert_intermediate_size
        shared["shared_expert"] = MLP(
            gate=weights.linear(p + "ffn_gate_shexp.weight", (width, hidden)),
            up=weights.linear(p + "ffn_up_shexp.weight", (width, hidden)),
            down=weights.linear(p + "ffn_down_shexp.weight", (hidden, width)),
        )
        shared["shared_expert_gate"] = weights.linear(p + "ffn_gate_inp_shexp.weight", (1, hidden))
    return SparseMoE(
        router=weights.linear(p + "ffn_gate_inp.weight", (n, hidden)),
        gate=weights.experts(p + "ffn_gate_exps.weight", (n, ffn, hidden)),
        up=weights.experts(p + "ffn_up_exps.weight", (n, ffn, hidden)),
        down=weights.experts(p + "ffn_down_exps.weight", (n, hidden, ffn)),
        top_k=config.num_experts_per_tok,
        norm_topk_prob=config.norm_topk_prob,
        **shared,
    )


_FEED_FORWARD = {MlpKind.DENSE: _mlp, MlpKind.SPARSE_MOE: _sparse_moe, MlpKind.SPARSE_MOE_SHARED: _sparse_moe}


def build_layer(config: ModelConfig, i: int, weights: WeightSource) -> DecoderLayer:
    """Layer i of the model `config` describes, weights from `weights`."""
    p, hidden, eps = f"blk.{i}.", config.hidden_size, config.rms_norm_eps
    recurrent = config.is_hybrid and config.recurrent_layers[i]
    # llama.cpp names the hybrids' pre-MLP norm after Hugging Face's post_attention_layernorm.
    ffn_norm = "post_attention_norm.weight" if config.is_hybrid else "ffn_norm.weight"
    return DecoderLayer(
        attn_norm=RMSNorm(weights.tensor(p + "attn_norm.weight", (hidden,)), eps),
        attention=_deltanet(config, i, weights) if recurrent else _attention(config, i, weights),
        ffn_norm=RMSNorm(weights.tensor(p + ffn_norm, (hidden,)), eps),
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
        self.rotary = RotaryEmbedding(config, device=weights.device, mrope_sections=config.mrope_sections)

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
        recurrent = [
            layer.attention.deltanet.new_state(batch, self.dtype, self.device)
            for layer in self.layers
            if isinstance(layer.attention, DeltaNetMixer)
        ]
        return KVCache(
            num_layers=c.num_layers - len(recurrent),
            batch=batch,
            num_kv_heads=c.num_kv_heads,
            max_len=c.context_length if max_len is None else max_len,
            head_dim=c.head_dim,
            dtype=self.dtype,
            device=self.device,
            recurrent=recurrent,
        )
