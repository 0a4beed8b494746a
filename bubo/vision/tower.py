"""The Qwen3.5 vision tower (qwen4exp's too, spec 4.12) in plain torch: patches in, one embedding per
merged token out, ready to take the place of the image's <|image_pad|> tokens in the text model.

Top to bottom, following transformers' Qwen3_5VisionModel:
1. patch embedding: a Conv3d whose kernel equals its stride is one linear map of each flattened
   (channel, frame, row, column) patch;
2. plus a learned position embedding: a square grid resampled bilinearly (align_corners) to the image's
   patch grid;
3. `depth` pre-norm ViT blocks (LayerNorm, full attention within each frame with 2-D rotary positions,
   LayerNorm, GELU-tanh MLP);
4. the patch merger: LayerNorm, then each merge block's patches (consecutive, by the preprocessing's patch
   order) concatenated and projected through a GELU MLP to the text model's hidden size.
Qwen3.5 has no deepstack mergers (Qwen3-VL's) and no windowed attention (Qwen2.5-VL's).
"""

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from bubo.vision.config import VisionConfig
from bubo.vision.image_patches import ImagePatches, grid_for_size, patchify

__all__ = ["VisionTower"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's halves: the rope pairing of transformers' Qwen models."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    """Multi-head self-attention over the patches of each frame (non-causal), q and k rotated by the
    patches' 2-D positions (transformers' Qwen3_5VisionAttention: fused qkv with bias, rope in float32)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: int) -> torch.Tensor:
        n, hidden = x.shape
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)  # each [N, heads, head_dim]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)

        def per_frame(t: torch.Tensor) -> torch.Tensor:
            # Frames attend only to themselves (transformers' cu_seqlens: one segment of h*w per frame).
            return t.reshape(frames, n // frames, self.num_heads, -1).transpose(1, 2)

        attended = F.scaled_dot_product_attention(per_frame(q), per_frame(k), per_frame(v))
        return self.out(attended.transpose(1, 2).reshape(n, hidden))


class VisionBlock(nn.Module):
    """x + attention(LayerNorm(x)), then + MLP(LayerNorm(x)); the MLP is up, GELU (tanh approximation:
    the config's gelu_pytorch_tanh), down, with biases."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp_up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.mlp_down = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp_down(F.gelu(self.mlp_up(self.norm2(x)), approximate="tanh"))


class PatchMerger(nn.Module):
    """LayerNorm over each patch, then every merge block's merge² patches side by side -> fc1 -> GELU
    (exact, erf: transformers' nn.GELU()) -> fc2 to the text hidden size (Qwen3_5VisionPatchMerger without
    the post-shuffle norm)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(config.merged_size, config.merged_size)
        self.fc2 = nn.Linear(config.merged_size, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.norm(x).reshape(-1, self.fc1.in_features)
        return self.fc2(F.gelu(self.fc1(blocks)))


class VisionTower(nn.Module):
    """The tower of `config`; parameters are created empty and filled by bubo.vision.loader."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Linear(config.patch_values, config.hidden_size)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    @property
    def device(self) -> torch.device:
        return self.patch_embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    def preprocess(self, image: Image.Image) -> ImagePatches:
        """RGB, smart-resize, normalise, cut into patches (bubo.vision.image_patches)."""
        return patchify(image, self.config)

    def grid_for_size(self, width: int, height: int) -> tuple[int, int, int]:
        """The patch grid `preprocess` gives an image of this size, without touching pixels."""
        return grid_for_size(self.config, width, height)

    def token_count(self, grid: tuple[int, int, int]) -> int:
        """How many text-model tokens (embeddings) an image of this patch grid becomes."""
        t, h, w = grid
        return t * h * w // self.config.spatial_merge_size**2

    @torch.no_grad()
    def encode(self, patches: ImagePatches) -> torch.Tensor:
        """The image's embeddings [token_count, out_hidden_size] on the tower's device, in its dtype."""
        t, h, w = self._check(patches)
        x = self.patch_embed(patches.pixels.to(self.device, self.dtype))
        x = x + self._position_embeddings(t, h, w)
        cos, sin = self._rotary(t, h, w)
        for block in self.blocks:
            x = block(x, cos, sin, frames=t)
        return self.merger(x)

    def _check(self, patches: ImagePatches) -> tuple[int, int, int]:
        c, merge = self.config, self.config.spatial_merge_size
        grid = tuple(patches.grid)
        if len(grid) != 3 or min(grid) < 1 or grid[1] % merge or grid[2] % merge:
            raise ValueError(
                f"patch grid {patches.grid} must be 3 positive sizes, h and w multiples of {merge}"
            )
        t, h, w = grid
        expected = (t * h * w, c.patch_values)
        if tuple(patches.pixels.shape) != expected:
            raise ValueError(
                f"pixels of shape {tuple(patches.pixels.shape)} don't fit grid {grid}: expected {expected}"
            )
        return t, h, w

    def _in_merge_order(self, grid_values: torch.Tensor) -> torch.Tensor:
        """[h, w, ...] per-patch values -> [h*w, ...] in the preprocessing's patch order (merge block by
        merge block, row-major inside each block)."""
        h, w, *rest = grid_values.shape
        m = self.config.spatial_merge_size
        blocks = grid_values.reshape(h // m, m, w // m, m, *rest).transpose(1, 2)
        return blocks.reshape(h * w, *rest)

    def _position_embeddings(self, t: int, h: int, w: int) -> torch.Tensor:
        """The learned side x side position grid resampled to h x w, bilinear with align_corners (the
        corner patches take the corner embeddings exactly), in float32; the same for every frame
        (transformers' get_vision_interpolation_indices_and_weights: 4 taps of the same bilinear kernel)."""
        side = self.config.position_grid_side
        table = self.pos_embed.weight.float().T.reshape(1, -1, side, side)
        resampled = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)
        per_patch = self._in_merge_order(resampled[0].permute(1, 2, 0))
        return per_patch.repeat(t, 1).to(self.dtype)

    def _rotary(self, t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [t*h*w, 1, head_dim] float32 of each patch's (row, column): the first quarter of a
        head's angles turn with the row, the second with the column, and the second half repeats the
        first (rotate_half pairs dimension i with i + head_dim/2)."""
        rows = torch.arange(h, device=self.device)[:, None].expand(h, w)
        cols = torch.arange(w, device=self.device)[None, :].expand(h, w)
        positions = self._in_merge_order(torch.stack((rows, cols), dim=-1)).repeat(t, 1).float()
        # Axial rope: head_dim/4 frequencies theta^(-2i / (head_dim/2)), shared by the row and the column
        # (transformers' Qwen3_5VisionRotaryEmbedding.compute_axial_rope_parameters).
        half = self.config.head_dim // 2
        exponents = torch.arange(0, half, 2, dtype=torch.float32, device=self.device) / half
        inv_freq = 1.0 / self.config.rope_theta**exponents
        angles = torch.cat((positions[:, :1] * inv_freq, positions[:, 1:] * inv_freq), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return angles.cos(), angles.sin()
