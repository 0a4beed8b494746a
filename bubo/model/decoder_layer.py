"""One decoder layer, assembled from the config: `build_layer` picks its parts (the token mixer: attention
with or without biases and q/k norms, or in a hybrid model per layer either a Gated DeltaNet or gated full
attention; by `config.mlp_kind`, a dense MLP or a sparse mixture of experts, with or without a shared
expert) and asks a `WeightSource` for their weights by GGUF tensor name; `build_mtp` does the same for the
multi-token-prediction block. The source decides how a weight is held (plain parameter or quantized
blocks), so the modules here are the same for every file. A new architecture adds a config mapping and,
where its layers really differ, a new part chosen in `build_layer` — not a new model class.

qwen4exp is such a part: its residual is several streams (bubo.model.hyper_connections), so its layers are
`HyperConnectedLayer`s; its attention layers are QSA indexed attention and one layer adds the PLE n-gram
embedding, which reads the token ids every layer is handed. The model around the layers is
bubo/model/decoder.py.
"""

from typing import Any, Protocol

import torch
from gguf import GGMLQuantizationType
from torch import nn

from bubo.gguf.model_config import MlpKind, ModelConfig
from bubo.model.attention import Attention
from bubo.model.deltanet import GatedDeltaNet
from bubo.model.hyper_connected_mtp import HyperConnectedMTP
from bubo.model.hyper_connections import HyperConnection, StreamMixer
from bubo.model.indexed_attention import IndexedAttention, QSAIndexer
from bubo.model.layers import MLP, RMSNorm
from bubo.model.moe import Experts, SparseMoE
from bubo.model.mtp import MultiTokenPredictor
from bubo.model.ngram_embedding import NGramEmbedding, NGramHash, PLELayer
from bubo.model.quantized_linear import group_rows
from bubo.model.state import CacheBatch, DeltaNetState, KVCache
from bubo.model.step_ops import in_compiled_step

__all__ = [
    "DecoderLayer",
    "DeltaNetMixer",
    "HyperConnectedLayer",
    "IndexedAttentionMixer",
    "WeightSource",
    "build_layer",
    "build_mtp",
]

# qwen3next keeps Hugging Face's fused beta/alpha projection (ssm_ba); the qwen35 family has two.
_FUSED_BETA_ALPHA = frozenset({"qwen3next"})


class WeightSource(Protocol):
    """Hands out weights by GGUF tensor name, checked against the expected torch-order shape."""

    dtype: torch.dtype  # compute dtype
    device: torch.device

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A plain tensor in the compute dtype (norm weights)."""
        ...

    def has(self, name: str) -> bool:
        """Whether the file holds tensor `name` (for tensors that come in more than one layout)."""
        ...

    def linear(self, name: str, shape: tuple[int, int], bias: str | None = None) -> nn.Module:
        """A module computing x W^T (+ b) for the [out, in] weight `name` and optional bias tensor `bias`;
        a [1, in] weight may be stored 1-D."""
        ...

    def embedding(self, name: str, shape: tuple[int, int]) -> nn.Module:
        """A module mapping token ids [...] to rows [..., dim] of the [vocab, dim] matrix `name`."""
        ...

    def experts(self, name: str, shape: tuple[int, int, int]) -> Experts:
        """The [num_experts, out, in] stack of expert matrices `name`, applied one expert at a time."""
        ...

    def table(self, name: str, dim: int) -> tuple[torch.Tensor, GGMLQuantizationType | None]:
        """The lookup table `name` (any number of rows of `dim` values) as stored, never converted whole
        (qwen4exp's PLE table is 51.2 B entries): a float tensor, or its raw uint8 blocks and their type."""
        ...


class DeltaNetMixer(nn.Module):
    """A Gated DeltaNet in a layer's attention slot: same call as Attention, continuing from (and
    advancing) recurrent state `state_index` of the cache."""

    def __init__(self, deltanet: GatedDeltaNet, state_index: int) -> None:
        super().__init__()
        self.deltanet = deltanet
        self.state_index = state_index

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | CacheBatch
    ) -> torch.Tensor:
        if isinstance(cache, CacheBatch):
            return self._forward_rows(x, cache)
        state = cache.recurrent[self.state_index]
        start, length = cache.length, x.shape[1]
        # Copies of this layer's state wanted inside this pass (the prompt cache's turn ends, the
        # positions speculative decoding may roll back to), keyed by position.
        positions = sorted(p for p in cache.snapshot_at if start < p < start + length)
        if not positions:
            return self.deltanet(x, state)
        out, kept = self.deltanet.forward_keeping(x, state, [p - start for p in positions])
        for position, copy in zip(positions, kept, strict=True):
            cache.taken.setdefault(position, {})[self.state_index] = copy
        return out

    def _forward_rows(self, x: torch.Tensor, batch: CacheBatch) -> torch.Tensor:
        """Row i continues the state of batch.caches[i]: the rows' states are stacked into one batch
        state for the step and copied back after."""
        rows = [c.recurrent[self.state_index] for c in batch.caches]
        state = DeltaNetState(
            torch.cat([r.conv_state for r in rows]), torch.cat([r.recurrent_state for r in rows])
        )
        out = self.deltanet(x, state)
        for i, row in enumerate(rows):
            row.conv_state.copy_(state.conv_state[i : i + 1])
            row.recurrent_state.copy_(state.recurrent_state[i : i + 1])
        return out


class IndexedAttentionMixer(nn.Module):
    """QSA indexed attention in a layer's attention slot: same call as Attention, with the indexer
    state `state_index` of the cache."""

    def __init__(self, attention: IndexedAttention, state_index: int) -> None:
        super().__init__()
        self.attention = attention
        self.state_index = state_index

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if in_compiled_step():
            # The indexer's state and selection change shape from step to step: a compiled step's state
            # runs this mixer eagerly, as one opaque op of its graph (bubo/model/step_ops.py).
            return cache.opaque_mixer(x, cos, sin)
        return self.attention(x, cos, sin, cache, cache.indexers[self.state_index])


TokenMixer = Attention | DeltaNetMixer | IndexedAttentionMixer


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + mlp(norm(x)).

    `attention` is the token mixer: an Attention, or a DeltaNetMixer in a hybrid model's recurrent layers.
    Every layer kind takes the token ids; this one has no use for them.
    """

    def __init__(self, attn_norm: RMSNorm, attention: TokenMixer, ffn_norm: RMSNorm, mlp: nn.Module) -> None:
        super().__init__()
        self.attn_norm = attn_norm
        self.attention = attention
        self.ffn_norm = ffn_norm
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | CacheBatch,
        tokens: torch.Tensor,
        last_only: bool = False,
    ) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden], or with `last_only` [B, 1, hidden]: the last position's
        output, which plain attention computes from that position's query alone (the keys and values of
        every position still reach the cache), and the MLP from that row alone."""
        if last_only and isinstance(self.attention, Attention) and isinstance(cache, KVCache):
            x = x[:, -1:] + self.attention(self.attn_norm(x), cos, sin, cache, last_only=True)
            return x + self.mlp(self.ffn_norm(x))
        x = x + self.attention(self.attn_norm(x), cos, sin, cache)
        x = x + self.mlp(self.ffn_norm(x))
        return x[:, -1:] if last_only else x


class HyperConnectedLayer(nn.Module):
    """qwen4exp's layer over the residual streams x [B, T, hc·hidden] (spec 4.2): on the PLE layer
    first x + PLE(x, tokens); then the token mixer and the MoE, each reading the streams through its
    HyperConnection and writing its output back into every stream. No other norm: the
    hyper-connections carry them."""

    def __init__(
        self,
        attn_hc: HyperConnection,
        attention: TokenMixer,
        ffn_hc: HyperConnection,
        mlp: nn.Module,
        ple: PLELayer | None = None,
    ) -> None:
        super().__init__()
        self.attn_hc = attn_hc
        self.attention = attention
        self.ffn_hc = ffn_hc
        self.mlp = mlp
        self.ple = ple

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, tokens: torch.Tensor
    ) -> torch.Tensor:
        if self.ple is not None:
            assert cache.ple is not None  # Decoder.new_cache makes one when a layer has PLE
            x = x + self.ple(x, tokens, cache.ple)
        block_input, inject = self.attn_hc(x)
        x = self.attn_hc.combine(x, inject, self.attention(block_input, cos, sin, cache))
        block_input, inject = self.ffn_hc(x)
        return self.ffn_hc.combine(x, inject, self.mlp(block_input))


def _attention_parts(config: ModelConfig, i: int, weights: WeightSource) -> dict[str, Any]:
    """The projections and norms of attention layer i, as Attention's keyword arguments."""
    p = f"blk.{i}."
    hidden, head_dim = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * head_dim, config.num_kv_heads * head_dim
    gated = config.is_hybrid

    def bias(name: str) -> str | None:
        return p + name + ".bias" if config.attention_bias else None

    q_norm = k_norm = None
    if config.qk_norm:
        q_norm = RMSNorm(weights.tensor(p + "attn_q_norm.weight", (head_dim,)), config.rms_norm_eps)
        k_norm = RMSNorm(weights.tensor(p + "attn_k_norm.weight", (head_dim,)), config.rms_norm_eps)
    q_proj = weights.linear(p + "attn_q.weight", ((1 + gated) * q_out, hidden), bias=bias("attn_q"))
    k_proj = weights.linear(p + "attn_k.weight", (kv_out, hidden), bias=bias("attn_k"))
    v_proj = weights.linear(p + "attn_v.weight", (kv_out, hidden), bias=bias("attn_v"))
    group_rows(q_proj, k_proj, v_proj)
    return {
        # its KV slot: hybrid caches hold keys and values for the attention layers only
        "layer_index": i - sum(config.recurrent_layers[:i]),
        "q_proj": q_proj,
        "k_proj": k_proj,
        "v_proj": v_proj,
        "o_proj": weights.linear(p + "attn_output.weight", (hidden, q_out)),
        "q_norm": q_norm,
        "k_norm": k_norm,
    }


def _attention(config: ModelConfig, i: int, weights: WeightSource) -> Attention:
    # A hybrid model's attention is gated: attn_q holds per head the query and its output gate.
    return Attention(config, **_attention_parts(config, i, weights), output_gate=config.is_hybrid)


def _indexed_attention(
    config: ModelConfig, i: int, weights: WeightSource, mtp: bool = False
) -> IndexedAttentionMixer:
    """QSA layer i; with `mtp` the MTP block's (layer i = num_layers), with the trunk's compress ratio
    and slot 0 of the MTP's own cache."""
    p, hidden, idx = f"blk.{i}.", config.hidden_size, config.indexer
    assert idx is not None  # config_from_gguf sets it for qwen4exp
    ratio = max(idx.compress_ratios) if mtp else idx.compress_ratios[i]
    indexer = QSAIndexer(
        q_proj=weights.linear(p + "indexer.q_proj.weight", (idx.num_heads * idx.head_dim, hidden)),
        k_proj=weights.linear(p + "indexer.k_proj.weight", (idx.head_dim, hidden)),
        q_norm=RMSNorm(weights.tensor(p + "indexer.q_norm.weight", (idx.head_dim,)), config.rms_norm_eps),
        k_norm=RMSNorm(weights.tensor(p + "indexer.k_norm.weight", (idx.head_dim,)), config.rms_norm_eps),
        num_heads=idx.num_heads,
        compress_ratio=ratio,
        budget=idx.budget,
        rope_style=config.rope_style,
    )
    parts = _attention_parts(config, i, weights)
    if mtp:
        parts["layer_index"] = 0
    # its indexer slot: one per QSA layer
    state_index = 0 if mtp else sum(1 for j in range(i) if idx.compress_ratios[j])
    return IndexedAttentionMixer(IndexedAttention(config, **parts, indexer=indexer), state_index)


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
    if weights.has(p + "ssm_in.weight"):
        # qwen3next files from llama.cpp's first converter keep the fused in_proj_qkvz as ssm_in.
        fused = d.num_k_heads * 2 * d.head_k_dim + 2 * v_out
        projections = {
            "attn_qkv": None,
            "attn_gate": None,
            "ssm_in": weights.linear(p + "ssm_in.weight", (fused, hidden)),
        }
    else:
        projections = {
            "attn_qkv": weights.linear(p + "attn_qkv.weight", (channels, hidden)),
            "attn_gate": weights.linear(p + "attn_gate.weight", (v_out, hidden)),
        }
    deltanet = GatedDeltaNet(
        **projections,
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
        gate_activation=d.gate_activation,
        **beta_alpha,
    )
    return DeltaNetMixer(deltanet, state_index=sum(config.recurrent_layers[:i]))


def _mlp(config: ModelConfig, i: int, weights: WeightSource) -> MLP:
    p = f"blk.{i}."
    hidden, ffn = config.hidden_size, config.intermediate_size
    gate = weights.linear(p + "ffn_gate.weight", (ffn, hidden))
    up = weights.linear(p + "ffn_up.weight", (ffn, hidden))
    group_rows(gate, up)
    return MLP(gate=gate, up=up, down=weights.linear(p + "ffn_down.weight", (hidden, ffn)))


def _sparse_moe(config: ModelConfig, i: int, weights: WeightSource) -> SparseMoE:
    p = f"blk.{i}."
    hidden, ffn, n = config.hidden_size, config.moe_intermediate_size, config.num_experts
    shared: dict[str, nn.Module] = {}
    if config.mlp_kind == MlpKind.SPARSE_MOE_SHARED:
        width = config.shared_expert_intermediate_size
        gate = weights.linear(p + "ffn_gate_shexp.weight", (width, hidden))
        up = weights.linear(p + "ffn_up_shexp.weight", (width, hidden))
        group_rows(gate, up)  # one matvec for both, as a dense MLP's
        shared["shared_expert"] = MLP(
            gate=gate, up=up, down=weights.linear(p + "ffn_down_shexp.weight", (hidden, width))
        )
        # Files through llama-quantize hold this [1, H] gate 1-D; GGUFWeights.linear accepts both.
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


def _hyper_connection(config: ModelConfig, name: str, weights: WeightSource) -> HyperConnection:
    """The mixer `name` (e.g. `blk.3.hc_attn`) around one block."""
    streams, rank = config.hc_count * config.hidden_size, config.hc_low_rank
    return HyperConnection(
        weights.tensor(name + "_norm.weight", (streams,)),
        weights.linear(name + "_down.weight", (rank, streams)),
        weights.linear(name + "_up.weight", (streams, rank)),
        weights.linear(name + "_inject.weight", (config.hc_count, streams)),
        hc_count=config.hc_count,
        norm_eps=config.rms_norm_eps,
    )


def _ple(config: ModelConfig, i: int, weights: WeightSource) -> PLELayer:
    p, hidden, ple = f"blk.{i}.", config.hidden_size, config.ple
    assert ple is not None  # only the PLE layer asks
    streams, num_heads = config.hc_count * hidden, len(ple.head_offsets)
    # transformers' ple_embed_dim is not in the file; llama.cpp requires it to equal hidden.
    width = num_heads * ple.table_dim
    ngram_hash = NGramHash.from_values(ple.layer_multipliers, ple.head_offsets, ple.head_vocab_sizes)
    table, table_type = weights.table("per_layer_token_embd.weight", ple.table_dim)
    return PLELayer(
        NGramEmbedding(table, ngram_hash, ple.eos_token_id, table_type=table_type, dtype=weights.dtype),
        weights.linear(p + "ple_key.weight", (streams, width)),
        weights.linear(p + "ple_value.weight", (hidden, width)),
        weights.tensor(p + "ple_norm_key.weight", (streams,)),
        weights.tensor(p + "ple_norm_query.weight", (streams,)),
        weights.tensor(p + "ple_norm_conv.weight", (streams,)),
        weights.tensor(p + "ple_conv1d.weight", (streams, ple.conv_kernel)),
        hc_count=config.hc_count,
        norm_eps=config.rms_norm_eps,
    )


def _token_mixer(config: ModelConfig, i: int, weights: WeightSource) -> TokenMixer:
    if config.is_hybrid and config.recurrent_layers[i]:
        return _deltanet(config, i, weights)
    # A qwen4exp attention layer with compress ratio 0 runs dense, as llama.cpp does (config.py warns).
    if config.indexer is not None and config.indexer.compress_ratios[i]:
        return _indexed_attention(config, i, weights)
    return _attention(config, i, weights)


def build_layer(config: ModelConfig, i: int, weights: WeightSource) -> DecoderLayer | HyperConnectedLayer:
    """Layer i of the model `config` describes, weights from `weights`."""
    p, hidden, eps = f"blk.{i}.", config.hidden_size, config.rms_norm_eps
    if config.hc_count:
        return HyperConnectedLayer(
            attn_hc=_hyper_connection(config, p + "hc_attn", weights),
            attention=_token_mixer(config, i, weights),
            ffn_hc=_hyper_connection(config, p + "hc_ffn", weights),
            mlp=_FEED_FORWARD[config.mlp_kind](config, i, weights),
            ple=_ple(config, i, weights) if config.ple is not None and config.ple.layer == i else None,
        )
    # llama.cpp names the hybrids' pre-MLP norm after Hugging Face's post_attention_layernorm.
    ffn_norm = "post_attention_norm.weight" if config.is_hybrid else "ffn_norm.weight"
    return DecoderLayer(
        attn_norm=RMSNorm(weights.tensor(p + "attn_norm.weight", (hidden,)), eps),
        attention=_token_mixer(config, i, weights),
        ffn_norm=RMSNorm(weights.tensor(p + ffn_norm, (hidden,)), eps),
        mlp=_FEED_FORWARD[config.mlp_kind](config, i, weights),
    )


def build_mtp(config: ModelConfig, weights: WeightSource) -> MultiTokenPredictor | HyperConnectedMTP:
    """The MTP block stored after the main layers (bubo/model/mtp.py; qwen4exp's:
    bubo/model/hyper_connected_mtp.py). Its layer is a full-attention layer of the model's kind whose
    keys and values go to slot 0 of the MTP's own cache."""
    if config.hc_count:
        return _hyper_connected_mtp(config, weights)
    n, hidden, eps = config.num_layers, config.hidden_size, config.rms_norm_eps
    p = f"blk.{n}."
    attention = Attention(
        config, **{**_attention_parts(config, n, weights), "layer_index": 0}, output_gate=config.is_hybrid
    )
    ffn_norm = "post_attention_norm.weight" if config.is_hybrid else "ffn_norm.weight"
    layer = DecoderLayer(
        attn_norm=RMSNorm(weights.tensor(p + "attn_norm.weight", (hidden,)), eps),
        attention=attention,
        ffn_norm=RMSNorm(weights.tensor(p + ffn_norm, (hidden,)), eps),
        mlp=_FEED_FORWARD[config.mlp_kind](config, n, weights),
    )
    return MultiTokenPredictor(
        enorm=RMSNorm(weights.tensor(p + "nextn.enorm.weight", (hidden,)), eps),
        hnorm=RMSNorm(weights.tensor(p + "nextn.hnorm.weight", (hidden,)), eps),
        eh_proj=weights.linear(p + "nextn.eh_proj.weight", (hidden, 2 * hidden)),
        layer=layer,
        shared_head_norm=RMSNorm(weights.tensor(p + "nextn.shared_head_norm.weight", (hidden,)), eps),
    )


# The MTP block's own stream mixer: llama.cpp's name, and the one unsloth's files use.
_MTP_MIXER_NAMES = ("nextn.hc_head", "output_hc")


def _hyper_connected_mtp(config: ModelConfig, weights: WeightSource) -> HyperConnectedMTP:
    n, hidden, eps = config.num_layers, config.hidden_size, config.rms_norm_eps
    p, streams, rank = f"blk.{n}.", config.hc_count * hidden, config.hc_low_rank
    # Neither there: the first name is asked for, and the source says it is missing.
    mixer = next(
        (p + name for name in _MTP_MIXER_NAMES if weights.has(f"{p}{name}_norm.weight")),
        p + _MTP_MIXER_NAMES[0],
    )
    assert config.indexer is not None  # config_from_gguf sets it for qwen4exp
    # Like vLLM's draft layer, QSA wherever the trunk's attention layers are (ratio 0 throughout: a
    # file that runs them dense, as llama.cpp does; spec 2.3).
    if any(config.indexer.compress_ratios):
        attention: TokenMixer = _indexed_attention(config, n, weights, mtp=True)
    else:
        attention = Attention(
            config, **{**_attention_parts(config, n, weights), "layer_index": 0}, output_gate=True
        )
    layer = HyperConnectedLayer(
        attn_hc=_hyper_connection(config, p + "hc_attn", weights),
        attention=attention,
        ffn_hc=_hyper_connection(config, p + "hc_ffn", weights),
        mlp=_FEED_FORWARD[config.mlp_kind](config, n, weights),
    )
    head_name = p + "nextn.shared_head_head.weight"
    own_head = weights.has(head_name)
    return HyperConnectedMTP(
        enorm=weights.tensor(p + "nextn.enorm.weight", (hidden,)),
        hnorm=weights.tensor(p + "nextn.hnorm.weight", (streams,)),
        eh_proj=weights.linear(p + "nextn.eh_proj.weight", (hidden, 2 * hidden)),
        layer=layer,
        mixer=StreamMixer(
            weights.tensor(mixer + "_norm.weight", (streams,)),
            weights.linear(mixer + "_down.weight", (rank, streams)),
            weights.linear(mixer + "_up.weight", (streams, rank)),
            hc_count=config.hc_count,
            norm_eps=eps,
        ),
        norm_eps=eps,
        head=weights.linear(head_name, (config.vocab_size, hidden)) if own_head else None,
    )
