"""Building blocks shared by every architecture: RMSNorm, rotary position embedding (plain or
multimodal), SwiGLU MLP."""

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bubo.gguf.model_config import ModelConfig, RopeScalingType, RopeStyle
from bubo.model.quantized_linear import project_rows

__all__ = [
    "MLP",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "mrope_axes",
    "rms_norm",
    "rope_frequencies",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension, normalised in float32 whatever the compute dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, normalised in float32 whatever the compute dtype."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, gate: nn.Module, up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.gate = gate
        self.up = up
        self.down = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project_rows(x, self.gate, self.up)
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return self.down(F.silu(gate) * up)
        # In place: gate and up are this call's own outputs, and a prompt's are megabytes each
        # ([tokens, intermediate] floats), so two fewer such temporaries lower prefill's peak memory.
        return self.down(F.silu(gate, inplace=True).mul_(up))


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Per rotated pair i, its angular speed (radians per position), and the cos/sin magnitude.

    Base speeds are theta^(-2i/d). llama3 divides them by the file's per-pair factors; linear
    scaling divides them all by the factor; YaRN divides only the slow pairs (those making
    fewer than beta_slow rotations over the original context), keeps the fast ones (more than
    beta_fast rotations), ramps linearly in between, and scales cos/sin by 1 + 0.1 ln(factor).
    """
    d = config.rope_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    if scaling.type == RopeScalingType.LINEAR:
        return inv_freq / scaling.factor, 1.0

    assert scaling.original_context_length is not None

    def pair_index(rotations: float) -> float:
        # The (fractional) pair index whose frequency makes `rotations` turns over the original context.
        return (
            d
            * math.log(scaling.original_context_length / (rotations * 2 * math.pi))
            / (2 * math.log(config.rope_theta))
        )

    low = max(math.floor(pair_index(scaling.yarn_beta_fast)), 0)
    high = min(math.ceil(pair_index(scaling.yarn_beta_slow)), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the speed), 0: interpolate (divide by the factor)
    inv_freq = inv_freq / scaling.factor * (1 - keep) + inv_freq * keep
    magnitude = 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0
    return inv_freq, magnitude


def mrope_axes(num_pairs: int, sections: Sequence[int]) -> torch.Tensor:
    """For each rotated pair, which position row drives it in interleaved mRoPE: 0 (t), 1 (h) or 2 (w).

    `sections` = [t, h, w] pair counts (Qwen3.5's `mrope_section`, the first three of llama.cpp's
    `rope.dimension_sections`). Interleaved means the rows take turns pair by pair, t h w t h w …,
    each row dropping out once its count is used up, so every row spans slow and fast frequencies
    alike (the blockwise mRoPE of Qwen2-VL gave h and w only the slow ones). A pair left over by h
    or w goes to t, as transformers does.
    """
    if len(sections) != 3 or sum(sections) != num_pairs or min(sections) < 0:
        raise ValueError(
            f"mRoPE sections {list(sections)} must be 3 counts summing to the {num_pairs} rotated pairs"
        )
    pair = torch.arange(num_pairs)
    axes = torch.zeros(num_pairs, dtype=torch.int64)
    for axis in (1, 2):
        axes[(pair % 3 == axis) & (pair < 3 * sections[axis])] = axis
    return axes


class RotaryEmbedding(nn.Module):
    """cos/sin of position x frequency for every rotated pair, from the config's rope settings.

    With `mrope_sections` it also takes the three position rows (t, h, w) of multimodal rope; text
    has equal rows, where that reduces to plain rope, so text may keep passing one row.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str | None = None,
        mrope_sections: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        inv_freq, self.magnitude = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        axes = None if mrope_sections is None else mrope_axes(inv_freq.shape[0], mrope_sections).to(device)
        self.register_buffer("mrope_axes", axes, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T], or [3, T] rows (t, h, w) with mRoPE -> (cos, sin), each [T, rope_dim / 2]
        in `dtype` (angles computed in float32)."""
        if positions.dim() == 1:
            angles = positions.float()[:, None] * self.inv_freq[None, :]
        elif self.mrope_axes is not None and positions.shape[0] == 3:
            # pair i turns with the position of row mrope_axes[i]
            angles = positions.float()[self.mrope_axes].T * self.inv_freq[None, :]
        else:
            raise ValueError(
                f"positions of shape {tuple(positions.shape)}: expected [T], or [3, T] with mRoPE"
            )
        return (angles.cos() * self.magnitude).to(dtype), (angles.sin() * self.magnitude).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle) -> torch.Tensor:
    """Rotate the first rope_dim dimensions of x [B, H, T, head_dim] pairwise; cos/sin are [T, rope_dim / 2],
    or [B, T, rope_dim / 2] when the rows of the batch are at different positions."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    rope_dim = 2 * cos.shape[-1]
    rotated, passed = x[..., :rope_dim], x[..., rope_dim:]
    if style == RopeStyle.NEOX:
        x1, x2 = rotated[..., : rope_dim // 2], rotated[..., rope_dim // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, passed), dim=-1) if passed.shape[-1] else out
