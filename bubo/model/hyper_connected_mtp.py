"""qwen4exp's MTP block (Qwen3.8-Flash-Next): a one-layer draft model over the residual streams,
proposing the token after the next one.

The forward the released serving code computes (vLLM 0.34 `models/qwen4_exp/*/mtp.py`,
Qwen4ExpMultiTokenPredictor; SGLang 0.5.23 `srt/models/qwen4_exp_mtp.py`, its
`_fuse_residual_linear_shared`), with X the main model's wide residual at position t (its hc streams
after the last layer, before the output mixer: shared/spec/qwen4exp.md 4.2) and e the embedding of
token t+1:

    Xn   = rms(X over all hc·H values) ⊙ pre_fc_norm_hidden       ONE norm across the streams
    E    = fc_embedding(rms(e) ⊙ pre_fc_norm_embedding)            [H]
    S[s] = fc_hidden(Xn[s]) + E                                   per stream s, fc_hidden shared
    S    = the block: a trunk layer over the streams (hyper-connected QSA attention, then the MoE;
           qwen4exp's HyperConnectedLayer), no PLE, its own KV cache and indexer, position t
    logits = head(mixer(S))                                       the block's own stream mixer
                                                                  (`mtp.hyper_connection_mixer`),
                                                                  the trunk's head
    S is what a chained draft continues from (vLLM's "scheme A": the next step's X).

The norms are zero-centred in the checkpoint and +1-folded in a GGUF, like every other qwen4exp norm;
the mixer is the trunk mixer's formula (StreamMixer: per-stream norm, no inject).

GGUF (llama.cpp PRs #27836 / #28243, conversion/qwen4exp.py): the block is blk.{n_layer}, counted
into `block_count` with `nextn_predict_layers` = 1 (or stored just past it); `nextn.eh_proj` [H, 2H]
holds fc_embedding and fc_hidden side by side, embedding columns first, so per stream
eh_proj([E' ; Xn[s]]) = fc_embedding(E') + fc_hidden(Xn[s]), computed here in that form, which also
works for a quantized eh_proj; `nextn.enorm` [H], `nextn.hnorm` [hc·H]; the mixer is
`nextn.hc_head_{norm,down,up}` (unsloth's files: `output_hc_{norm,down,up}` inside the block); the
layer's hyper-connection, attention, indexer and MoE tensors under blk.{n_layer}.*; optionally
`nextn.shared_head_head`, a head of the block's own.

Where llama.cpp's graph (src/models/qwen4exp.cpp, graph_mtp) differs, this follows vLLM and SGLang,
the model's official serving recipes:
- llama.cpp normalises X stream by stream (a grouped RMS, as the hyper-connection mixers do); vLLM
  and SGLang take one RMS over all hc·H values (a GemmaRMSNorm of width hc·H). Full width here.
- llama.cpp's draft layer attends densely (its converter writes compress ratio 0 for the block);
  vLLM's is a QSA layer like the trunk's attention layers (ratio and budget from the config), and so
  is this one, selecting blocks over the MTP layer's own keys. (vLLM reuses the first chained step's
  selection on later chained steps; here every step selects anew, as transformers' indexer would.)
"""

import torch
from torch import nn

from bubo.model.hyper_connections import StreamMixer, grouped_rms_norm
from bubo.model.state import KVCache

__all__ = ["HyperConnectedMTP"]


class HyperConnectedMTP(nn.Module):
    """hidden [B, T, hc·H] (the main model's wide residual, or this block's own output when chained)
    and next-token embeddings [B, T, H] -> (head input [B, T, H], wide output [B, T, hc·H]).

    enorm [H] and hnorm [hc·H] are the +1-folded gammas; eh_proj is any module applying x Wᵀ for
    W [H, 2H] = [fc_embedding | fc_hidden]; `layer` a HyperConnectedLayer without PLE whose attention
    keeps its keys (and indexer state) in slot 0 of the MTP's own cache; `mixer` the block's StreamMixer;
    `head`, when given, the block's own output head (else the trunk's serves).
    """

    def __init__(
        self,
        enorm: torch.Tensor,
        hnorm: torch.Tensor,
        eh_proj: nn.Module,
        layer: nn.Module,
        mixer: StreamMixer,
        *,
        norm_eps: float,
        head: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.hc_count = mixer.hc_count
        self.enorm = nn.Parameter(enorm, requires_grad=False)
        self.hnorm = nn.Parameter(hnorm, requires_grad=False)
        self.eh_proj = eh_proj
        self.layer = layer
        self.mixer = mixer
        self.head = head
        self.norm_eps = norm_eps

    def forward(
        self,
        hidden: torch.Tensor,
        next_embeddings: torch.Tensor,
        next_tokens: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embedded = grouped_rms_norm(next_embeddings, self.enorm, 1, self.norm_eps)
        # One RMS over all the streams (vLLM, SGLang), not one per stream (llama.cpp): see above.
        streams = grouped_rms_norm(hidden, self.hnorm, 1, self.norm_eps).unflatten(-1, (self.hc_count, -1))
        paired = torch.cat([embedded.unsqueeze(-2).expand_as(streams), streams], dim=-1)  # [B, T, hc, 2H]
        # Three dimensions in, as every projection kind takes them: the streams ride along the rows.
        x = self.eh_proj(paired.flatten(1, 2)).reshape(hidden.shape)
        x = self.layer(x, cos, sin, cache, next_tokens)
        cache.advance(x.shape[1])
        return self.mixer(x), x
