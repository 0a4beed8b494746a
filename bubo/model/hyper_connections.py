"""Hyper-connections of qwen4exp (Qwen3.8-Flash-Next): several residual streams in place of one.

The residual is hc streams of `hidden` values each, held as one [.., hc·hidden] vector, stream-major
(stream s = elements s·hidden .. (s+1)·hidden − 1; spec section 4.2). The embedding is copied into
every stream; before each block (token mixer, then MoE) a low-rank mixer reads all streams into the
block's single input, and the block's output is written back into every stream with a learnt
per-stream weight; after the last layer the same mixer without the write-back reduces the streams
to the vector the output head reads. There is no other norm in the model: these mixers carry them.

Formula (spec section 4.3; transformers' Qwen4ExpTextGatedResidual), with the GGUF tensors
(torch-shaped, spec sections 3.1 and 3.2):

    Xn = grouped_rmsnorm(X, hc_*_norm)                each stream normalised on its own
    G  = sigmoid(hc_*_up · silu(hc_*_down · Xn / hc))  [hc, hidden] gate
    m  = mean over s of G[s] ⊙ Xn[s]                   the block input
    w  = 2 · sigmoid(hc_*_inject · Xn / hc)            [hc] write-back weights, centred on 1
    X' = X + w[s] · block(m) for each stream s         the residual is X itself, not Xn

The norm gammas in the GGUF already hold 1 + w (the converter's +1 folding, spec section 3.6), so
they multiply as stored; transformers multiplies by (1 + w).
"""

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HyperConnection", "StreamMixer", "expand_streams", "grouped_rms_norm"]


def grouped_rms_norm(x: torch.Tensor, gamma: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """RMSNorm of each of the `groups` equal slices of x's last dimension, times the full-width gamma.

    The "grouped RMSNorm" of spec section 4.1 (transformers' Qwen4ExpTextRMSNorm with group_size):
    normalised and multiplied in float32, cast back to x's dtype at the end, as transformers does
    (not the llama order of casting before the gamma). `gamma` is the +1-folded GGUF gamma.
    """
    x32 = x.float().unflatten(-1, (groups, -1))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32.flatten(-2) * gamma.float()).to(x.dtype)


def expand_streams(x: torch.Tensor, hc_count: int) -> torch.Tensor:
    """[.., hidden] -> [.., hc·hidden]: the token embedding copied into every stream (spec 4.2 step 2)."""
    return x.repeat(*([1] * (x.dim() - 1)), hc_count)


class StreamMixer(nn.Module):
    """Streams [.., hc·hidden] -> one vector [.., hidden]: the gated low-rank mean of the normed streams.

    Alone, it is the final stream reduction before the output head (GGUF `output_hc_norm`,
    `output_hc_down`, `output_hc_up`; transformers' `hyper_connection_mixer`, built without the
    inject weight). Tensors, torch-shaped (spec sections 3.1, 3.2):
        norm  [hc·hidden]       +1-folded gamma (spec 3.6)
        down  [R, hc·hidden]    any module applying x Wᵀ (nn.Linear, QuantizedLinear)
        up    [hc·hidden, R]    likewise
    `hc_count`: GGUF `hyper_connection.count`; `norm_eps`: `attention.layer_norm_rms_epsilon`.
    """

    def __init__(
        self, norm: torch.Tensor, down: nn.Module, up: nn.Module, *, hc_count: int, norm_eps: float
    ) -> None:
        super().__init__()
        if hc_count < 2 or norm.shape[0] % hc_count:
            raise ValueError(f"norm of {norm.shape[0]} values can't hold {hc_count} streams (need hc > 1)")
        self.hc_count = hc_count
        self.hidden_size = norm.shape[0] // hc_count
        self.norm_eps = norm_eps
        self.norm = nn.Parameter(norm, requires_grad=False)
        self.down, self.up = down, up

    def normalise(self, streams: torch.Tensor) -> torch.Tensor:
        """Xn: every stream RMS-normalised on its own, times the gamma."""
        if streams.shape[-1] != self.hc_count * self.hidden_size:
            raise ValueError(
                f"expected {self.hc_count} streams of {self.hidden_size}, got {streams.shape[-1]} features"
            )
        return grouped_rms_norm(streams, self.norm, self.hc_count, self.norm_eps)

    def mix(self, normed: torch.Tensor) -> torch.Tensor:
        """m = mean over streams of G[s] ⊙ Xn[s], from the normalised streams Xn."""
        # The 1/hc before the silu (and before the inject sigmoid) is transformers' scaling of the
        # hc-fold sum the down projection takes over the streams.
        gate = torch.sigmoid(self.up(F.silu(self.down(normed) / self.hc_count)))
        shape = (self.hc_count, self.hidden_size)
        return (gate.unflatten(-1, shape) * normed.unflatten(-1, shape)).mean(dim=-2)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return self.mix(self.normalise(streams))

    def extra_repr(self) -> str:
        return f"streams={self.hc_count}, hidden={self.hidden_size}, eps={self.norm_eps}"


class HyperConnection(nn.Module):
    """The mixer around one block: `forward` gives the block input and the write-back weights,
    `combine` adds the block output into every stream.

    Tensors, torch-shaped, of layer N's attention side (`blk.N.hc_attn_*`) or MoE side
    (`blk.N.hc_ffn_*`), spec section 3.2:
        norm    [hc·hidden]      +1-folded gamma (spec 3.6)
        down    [R, hc·hidden]   modules applying x Wᵀ
        up      [hc·hidden, R]
        inject  [hc, hc·hidden]
    """

    def __init__(
        self,
        norm: torch.Tensor,
        down: nn.Module,
        up: nn.Module,
        inject: nn.Module,
        *,
        hc_count: int,
        norm_eps: float,
    ) -> None:
        super().__init__()
        self.mixer = StreamMixer(norm, down, up, hc_count=hc_count, norm_eps=norm_eps)
        self.inject = inject

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [.., hc·hidden] -> (block input [.., hidden], write-back weights [.., hc])."""
        normed = self.mixer.normalise(streams)
        weights = 2 * torch.sigmoid(self.inject(normed) / self.mixer.hc_count)
        return self.mixer.mix(normed), weights

    @staticmethod
    def combine(streams: torch.Tensor, weights: torch.Tensor, block_output: torch.Tensor) -> torch.Tensor:
        """X'[s] = X[s] + w[s] · y: the block output y [.., hidden] written into each stream."""
        return streams + (weights.unsqueeze(-1) * block_output.unsqueeze(-2)).flatten(-2)
