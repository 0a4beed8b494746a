"""The decoder-only model shared by llama, qwen2, qwen3, qwen3moe and the hybrid Qwen models
(qwen3next, qwen35, qwen35moe, qwen4exp): the token embedding, the layers `build_layer` assembles from
the config (bubo/model/decoder_layer.py), the final norm and the output head, and the forward that runs
them on a cache. A cache runs each layer and the step's inputs (`run_layer`, `run_inputs`): its own
modules eagerly, or in a compiled step their compiled traces.

qwen4exp's residual is several streams (bubo.model.hyper_connections): the embedding is copied into the
streams and a StreamMixer takes the place of the final norm.
"""

import torch
from torch import nn

from bubo.gguf.model_config import ModelConfig
from bubo.model.attention import Attention
from bubo.model.block_pool import DEFAULT_BLOCK_SIZE, BlockPool
from bubo.model.decoder_layer import (
    DecoderLayer,
    DeltaNetMixer,
    HyperConnectedLayer,
    IndexedAttentionMixer,
    WeightSource,
    build_layer,
    build_mtp,
)
from bubo.model.hyper_connections import StreamMixer, expand_streams
from bubo.model.layers import RMSNorm, RotaryEmbedding
from bubo.model.moe import QuantizedExpertMatrices, SparseMoE
from bubo.model.multimodal_inputs import MultimodalInputs
from bubo.model.quantized_linear import QuantizedLinear
from bubo.model.state import CacheBatch, KVCache

__all__ = ["Decoder"]


class Decoder(nn.Module):
    """tokens [B, T] -> float32 logits [B, T, vocab], continuing at position `cache.length`.

    The compute dtype is fixed at load time (`dtype`); the device is wherever the weights are. With
    an MTP block (`mtp`), `draft_logits` proposes the token after the next from `hidden` states. The
    caches it makes store keys and values in `cache_dtypes` (keys, values): the compute dtype unless set
    narrower (float16 halves the KV cache's memory and what a decode step's attention reads, as
    llama.cpp's default f16 cache does); attention widens them to the compute dtype as it reads them.
    """

    def __init__(self, config: ModelConfig, weights: WeightSource) -> None:
        super().__init__()
        self.config = config
        self.dtype = weights.dtype
        self.cache_dtypes = (self.dtype, self.dtype)
        vocab_shape = (config.vocab_size, config.hidden_size)
        self.embedding = weights.embedding("token_embd.weight", vocab_shape)
        self.layers = nn.ModuleList(build_layer(config, i, weights) for i in range(config.num_layers))
        self.norm = self._final_norm(config, weights)
        output_name = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
        self.output = weights.linear(output_name, vocab_shape)
        self.rotary = RotaryEmbedding(config, device=weights.device, mrope_sections=config.mrope_sections)
        self.mtp = build_mtp(config, weights) if config.mtp_layers else None
        for module in self.modules():
            if isinstance(module, QuantizedLinear | QuantizedExpertMatrices | SparseMoE):
                module.warm_up(self.dtype)
            elif isinstance(module, Attention):
                # A last_only prefill (Attention.project's queries_from) runs k and v without q.
                for projection in (module.k_proj, module.v_proj):
                    if isinstance(projection, QuantizedLinear):
                        projection.warm_up(self.dtype, alone=True)

    @staticmethod
    def _final_norm(config: ModelConfig, weights: WeightSource) -> nn.Module:
        if not config.hc_count:
            return RMSNorm(weights.tensor("output_norm.weight", (config.hidden_size,)), config.rms_norm_eps)
        # With several residual streams the output head reads the streams' gated mix (spec 4.3).
        streams, rank = config.hc_count * config.hidden_size, config.hc_low_rank
        return StreamMixer(
            weights.tensor("output_hc_norm.weight", (streams,)),
            weights.linear("output_hc_down.weight", (rank, streams)),
            weights.linear("output_hc_up.weight", (streams, rank)),
            hc_count=config.hc_count,
            norm_eps=config.rms_norm_eps,
        )

    @property
    def device(self) -> torch.device:
        return self.rotary.inv_freq.device

    @property
    def supports_cache_batch(self) -> bool:
        """Whether `forward` takes a CacheBatch (several sequences' decode steps at once): every layer
        kind but qwen4exp's (its indexer and n-gram states are per call) can."""
        return not (self.config.hc_count or self.config.indexer or self.config.ple)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | CacheBatch,
        last_only: bool = False,
        multimodal: MultimodalInputs | None = None,
    ) -> torch.Tensor:
        """Logits for every position, or with `last_only` just the last ([B, 1, vocab]): enough for
        generation, and a long prompt's full-vocabulary logits would be large."""
        return self.head(self.residual(tokens, cache, last_only, multimodal))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the residual after the last layer (`residual`): the output norm, then the
        output head."""
        return self.output(self.norm(x)).float()

    def hidden(
        self,
        tokens: torch.Tensor,
        cache: KVCache | CacheBatch,
        last_only: bool = False,
        multimodal: MultimodalInputs | None = None,
    ) -> torch.Tensor:
        """The final hidden states [B, T or 1, hidden], after the output norm: what the head reads.
        With a CacheBatch row i continues caches[i].

        Positions are `cache.length + cache.rope_delta` onwards (rope_delta: how far the text after an
        image runs off its token index, see bubo.vision.positions), or with `multimodal` (one sequence)
        its mRoPE positions, and its image embeddings take the place of the tokens' at its rows. The
        tokens there stay the image placeholder id, which is what qwen4exp's PLE hashes (spec 4.12)."""
        return self.norm(self.residual(tokens, cache, last_only, multimodal))

    def hidden_and_mtp_input(
        self, tokens: torch.Tensor, cache: KVCache, multimodal: MultimodalInputs | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden` for every position, and what the MTP block continues from at those positions: the
        same normed states, or for qwen4exp the residual streams [B, T, hc·hidden] before the output
        mixer (bubo/model/hyper_connected_mtp.py)."""
        x = self.residual(tokens, cache, False, multimodal)
        normed = self.norm(x)
        return normed, (x if self.config.hc_count else normed)

    def residual(
        self,
        tokens: torch.Tensor,
        cache: KVCache | CacheBatch,
        last_only: bool = False,
        multimodal: MultimodalInputs | None = None,
    ) -> torch.Tensor:
        """The residual after the last layer, before the output norm (`hidden` and `head` take it from
        there); the arguments as `forward`'s."""
        tokens = tokens.to(self.device)
        length = tokens.shape[1]
        positions = cache.positions(length).to(self.device)
        if isinstance(cache, CacheBatch) and not self.supports_cache_batch:
            raise ValueError(f"{self.config.architecture} can't run several caches as one batch")
        if multimodal is not None:
            if positions.dim() > 1:
                raise ValueError("image inputs run one sequence at a time, not in a cache batch")
            cos, sin = self._multimodal_rotary(tokens, multimodal)
            # transformers' masked_scatter of the image features into the placeholder embeddings
            rows = multimodal.rows.to(self.device)
            x = self.embedding(tokens)
            x = x.index_copy(1, rows, multimodal.embeds.to(self.device, x.dtype)[None])
        else:
            # The cache runs `inputs` as it runs the layers (a compiled step: one compiled graph).
            x, cos, sin = cache.run_inputs(self, tokens, positions)
        if self.config.hc_count:
            x = expand_streams(x, self.config.hc_count)
        # The cache runs each layer: its own forward, or in a compiled step the compiled trace of that
        # forward (bubo/engine/compiled_decode.py).
        # (Unpacked, not sliced: a slice of a ModuleList is a new ModuleList, built at every step.)
        *layers, last = self.layers
        for layer in layers:
            x = cache.run_layer(layer, x, cos, sin, tokens)
        if last_only and isinstance(last, DecoderLayer):
            # Only the last position leaves the model: the last layer computes little more than that.
            x = last(x, cos, sin, cache, tokens, last_only=True)
        else:
            x = cache.run_layer(last, x, cos, sin, tokens)
            if last_only:
                x = x[:, -1:]
        cache.advance(length)
        return x

    def inputs(
        self, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first layer's input (the tokens' embeddings [B, T, hidden]) and the rotary cos, sin of
        `positions`: [T, rope_dim / 2], or with positions [B, T] (rows of a batch, each continuing its own
        sequence at its own position) [B, T, rope_dim / 2]."""
        if positions.dim() == 1:
            cos, sin = self.rotary(positions, self.dtype)
        else:
            cos, sin = (t.view(*positions.shape, -1) for t in self.rotary(positions.flatten(), self.dtype))
        return self.embedding(tokens), cos, sin

    def _multimodal_rotary(
        self, tokens: torch.Tensor, multimodal: MultimodalInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary.mrope_axes is None:
            raise ValueError(f"{self.config.architecture} has no multimodal rope: it can't take image inputs")
        if tokens.shape[0] != 1:
            raise ValueError(f"image inputs run one sequence at a time, got a batch of {tokens.shape[0]}")
        multimodal.check(tokens.shape[1], self.config.hidden_size)
        return self.rotary(multimodal.positions.to(self.device), self.dtype)

    def draft_logits(
        self, hidden: torch.Tensor, next_tokens: torch.Tensor, mtp_cache: KVCache
    ) -> torch.Tensor:
        """The MTP block's logits [B, T, vocab] for the tokens after `next_tokens` (`draft_hidden`)."""
        return self.draft_head(self.draft_hidden(hidden, next_tokens, mtp_cache)[0])

    def draft_head(self, head_input: torch.Tensor) -> torch.Tensor:
        """Float32 logits from the MTP block's head input (`draft_hidden`): its own head if it has one,
        else the model's."""
        head = getattr(self.mtp, "head", None)
        return (self.output if head is None else head)(head_input).float()

    def draft_hidden(
        self, hidden: torch.Tensor, next_tokens: torch.Tensor, mtp_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP block's head input [B, T, H] and what a chained draft feeds back as the next row's
        `hidden` (the same normed states; for qwen4exp the block's residual streams). Row t pairs the
        main model's hidden[:, t] (`hidden_and_mtp_input`'s second part, at position
        mtp_cache.length + t) with next_tokens[:, t], the token that followed it."""
        if self.mtp is None:
            raise ValueError("this model has no MTP block")
        next_tokens = next_tokens.to(self.device)
        length = next_tokens.shape[1]
        positions = torch.arange(mtp_cache.length, mtp_cache.length + length, device=self.device)
        cos, sin = self.rotary(positions, self.dtype)
        return self.mtp(hidden, self.embedding(next_tokens), next_tokens, cos, sin, mtp_cache)

    def new_mtp_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        """The MTP layer's own cache: one attention layer's keys and values (and its QSA indexer state)."""
        c = self.config
        max_len = c.context_length if max_len is None else max_len
        mixer = getattr(getattr(self.mtp, "layer", None), "attention", None)
        indexers = []
        if isinstance(mixer, IndexedAttentionMixer):
            indexers.append(
                mixer.attention.indexer.new_state(batch, max_len, c.rope_dim // 2, self.dtype, self.device)
            )
        return KVCache(
            num_layers=1,
            batch=batch,
            num_kv_heads=c.num_kv_heads,
            max_len=max_len,
            head_dim=c.head_dim,
            dtype=self.cache_dtypes[0],
            device=self.device,
            indexers=indexers,
            value_dtype=self.cache_dtypes[1],
        )

    def new_block_pool(self, positions: int, block_size: int = DEFAULT_BLOCK_SIZE) -> BlockPool:
        """A pool of KV blocks for `positions` positions in all (rounded up to whole blocks), to share
        between the caches of several slots."""
        c = self.config
        blocks = -(-positions // block_size)
        attention_layers = c.num_layers - sum(c.recurrent_layers)
        keys, values = self.cache_dtypes
        return BlockPool(
            attention_layers, c.num_kv_heads, c.head_dim, blocks, block_size, keys, self.device, values
        )

    def new_cache(self, batch: int = 1, max_len: int | None = None, pool: BlockPool | None = None) -> KVCache:
        """An empty cache for `batch` sequences of up to `max_len` positions (default: the model's context),
        its KV in `pool`'s blocks (default: a pool of its own)."""
        c = self.config
        max_len = c.context_length if max_len is None else max_len
        mixers = [layer.attention for layer in self.layers]
        recurrent = [
            m.deltanet.new_state(batch, self.dtype, self.device)
            for m in mixers
            if isinstance(m, DeltaNetMixer)
        ]
        indexers = [
            m.attention.indexer.new_state(batch, max_len, c.rope_dim // 2, self.dtype, self.device)
            for m in mixers
            if isinstance(m, IndexedAttentionMixer)
        ]
        ple = next(
            (layer.ple for layer in self.layers if isinstance(layer, HyperConnectedLayer) and layer.ple), None
        )
        return KVCache(
            num_layers=c.num_layers - len(recurrent),
            batch=batch,
            num_kv_heads=c.num_kv_heads,
            max_len=max_len,
            head_dim=c.head_dim,
            dtype=self.cache_dtypes[0],
            device=self.device,
            recurrent=recurrent,
            indexers=indexers,
            ple=None if ple is None else ple.new_state(batch, self.dtype, self.device),
            pool=pool,
            value_dtype=self.cache_dtypes[1],
        )
