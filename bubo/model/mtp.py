"""The multi-token prediction (MTP) block of Qwen3-Next and Qwen3.5: a one-layer draft model on top of
the main model, proposing the token after the next one. (qwen4exp's, over residual streams:
bubo/model/hyper_connected_mtp.py.)

At position t it combines the main model's final hidden state h_t (after the output norm) with the
embedding of token t+1, and predicts token t+2 (DeepSeek-V3's MTP, as Qwen3-Next adopted it; vLLM's
qwen3_next_mtp.py is the reference forward, transformers ignores the `mtp.*` weights):

    x = eh_proj( [ enorm(embed(token_{t+1})) ; hnorm(h_t) ] )      the embedding half first
    x = decoder layer (gated full attention + the model's MLP kind), its own KV cache, position t
    logits = output( shared_head_norm(x) )                           embedding and head shared

GGUF names (llama.cpp's `nextn` convention): blk.{n}.nextn.eh_proj [hidden, 2·hidden], nextn.enorm,
nextn.hnorm, nextn.shared_head_norm, and the layer's own attention/FFN tensors at blk.{n}.*, where n
is the number of main layers. The norms are zero-centred in the checkpoint; the converter folds the +1
in like every other RMSNorm of these models. The MTP layer's attention is dense (llama.cpp, vLLM).
"""

import torch
from torch import nn

from bubo.model.layers import RMSNorm
from bubo.model.state import KVCache

__all__ = ["MultiTokenPredictor"]


class MultiTokenPredictor(nn.Module):
    """hidden [B, T, H] and next-token embeddings [B, T, H] -> normed draft hidden states [B, T, H]
    (twice: the head reads them and a chained draft continues from them).

    The decoder owns the shared embedding, rotary table and output head and calls this in between
    (Decoder.draft_hidden); `layer` keeps its keys and values in slot 0 of its own one-layer cache.
    For more than one draft per step the output is fed back as the next row's `hidden` (as vLLM chains
    its MTP proposer; bubo/engine/speculative.py).
    """

    def __init__(
        self,
        enorm: RMSNorm,
        hnorm: RMSNorm,
        eh_proj: nn.Module,
        layer: nn.Module,
        shared_head_norm: RMSNorm,
    ) -> None:
        super().__init__()
        self.enorm, self.hnorm, self.eh_proj = enorm, hnorm, eh_proj
        self.layer = layer
        self.shared_head_norm = shared_head_norm

    def forward(
        self,
        hidden: torch.Tensor,
        next_embeddings: torch.Tensor,
        next_tokens: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(head input, what a chained draft continues from): here the same normed states."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeddings), self.hnorm(hidden)], dim=-1))
        x = self.layer(x, cos, sin, cache, next_tokens)
        cache.advance(x.shape[1])
        x = self.shared_head_norm(x)
        return x, x
