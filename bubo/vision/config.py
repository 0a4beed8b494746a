"""The hyper-parameters of a Qwen3.5-family vision tower (also qwen4exp's: spec 4.12, the same tower)."""

import math
from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_PIXELS", "DEFAULT_MIN_PIXELS", "VisionConfig"]

# The released Qwen3-VL / Qwen3.5 preprocessor_config.json: size.shortest_edge and size.longest_edge,
# which the Qwen2-VL image processor reads as the least and most pixels an image is resized to. llama.cpp's
# projector files carry no such keys (clip.vision.image_min_pixels / image_max_pixels are read when present).
DEFAULT_MIN_PIXELS = 65536  # 256 x 256
DEFAULT_MAX_PIXELS = 16777216  # 4096 x 4096


@dataclass(frozen=True)
class VisionConfig:
    """What the tower and its image preprocessing need; one field per transformers' Qwen3_5VisionConfig
    field (or preprocessor_config.json entry) that changes the numbers."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    depth: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int  # the text model's hidden size: what each merged token becomes
    num_position_embeddings: int  # rows of the learned square position grid
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    rope_theta: float = 10000.0  # transformers' default for the vision tower's axial rope
    layer_norm_eps: float = 1e-6  # transformers hard-codes it for every LayerNorm of the tower
    in_channels: int = 3

    def __post_init__(self) -> None:
        problems = []
        if self.hidden_size % self.num_heads:
            problems.append(f"hidden size {self.hidden_size} is not a multiple of {self.num_heads} heads")
        elif self.head_dim % 4:
            # the 2-D rope gives a quarter of each head to the row and a quarter to the column frequencies
            problems.append(f"head size {self.head_dim} is not a multiple of 4 (2-D rotary positions)")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            problems.append(f"{self.num_position_embeddings} position embeddings do not form a square grid")
        if not 0 < self.min_pixels <= self.max_pixels:
            problems.append(f"pixel budget {self.min_pixels}..{self.max_pixels} is empty")
        sizes = (self.depth, self.patch_size, self.temporal_patch_size, self.spatial_merge_size)
        if min(sizes) < 1:
            problems.append(f"depth, patch, temporal patch and merge sizes must be positive, got {sizes}")
        if len(self.image_mean) != self.in_channels or len(self.image_std) != self.in_channels:
            problems.append(f"image mean/std need {self.in_channels} values each")
        elif min(self.image_std) <= 0:
            problems.append(f"image std {self.image_std} must be positive")
        if problems:
            raise ValueError("invalid vision config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def merged_size(self) -> int:
        """Width of a merge block's concatenated patches: what the merger's first projection reads."""
        return self.hidden_size * self.spatial_merge_size**2

    @property
    def patch_values(self) -> int:
        """Values in one flattened patch: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2
