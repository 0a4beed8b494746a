"""From a decoded picture to the flattened patches the tower reads, as transformers' Qwen2-VL image
processor (the one Qwen3-VL and Qwen3.5 use) makes them: RGB, resized so each side is a whole number of
merge blocks within the pixel budget, scaled to [0, 1] and normalised, cut into patches listed merge block
by merge block, each patch repeated over the temporal patch axis (a still image is a one-frame video)."""

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from bubo.vision.config import VisionConfig

__all__ = ["ImagePatches", "ImageSizeError", "grid_for_size", "patchify", "smart_resize", "to_rgb"]

# transformers' smart_resize refuses images more elongated than this.
MAX_ASPECT_RATIO = 200


class ImageSizeError(ValueError):
    """The image's shape can't be turned into patches (empty, or too elongated)."""


@dataclass(frozen=True)
class ImagePatches:
    pixels: torch.Tensor  # [t*h*w, 3 * temporal_patch * patch * patch] float32, normalized, merge-block order
    grid: tuple[int, int, int]  # (t, h, w) in patches, before the spatial merge


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: each a multiple of `factor` (patch x merge), the area
    within [min_pixels, max_pixels], the aspect ratio kept as nearly as those allow. Follows transformers'
    qwen2_vl smart_resize step for step (Python's round-half-even included), so the grids agree."""
    if height < 1 or width < 1:
        raise ImageSizeError(f"image of {width}x{height} pixels is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageSizeError(
            f"image of {width}x{height} pixels is too elongated: the aspect ratio must be at most "
            f"{MAX_ASPECT_RATIO}:1"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_for_size(config: VisionConfig, width: int, height: int) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of a still image of this size, without touching its pixels."""
    factor = config.patch_size * config.spatial_merge_size
    resized_h, resized_w = smart_resize(height, width, factor, config.min_pixels, config.max_pixels)
    return 1, resized_h // config.patch_size, resized_w // config.patch_size


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (transformers' convert_to_rgb), so a transparent
    background reads as white rather than as whatever colour its hidden pixels hold."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def patchify(image: Image.Image, config: VisionConfig) -> ImagePatches:
    """`image` as the tower's input: see the module docstring."""
    rgb = to_rgb(image)
    _, grid_h, grid_w = grid_for_size(config, rgb.width, rgb.height)
    p, m, tp = config.patch_size, config.spatial_merge_size, config.temporal_patch_size
    # PIL's bicubic, as the processor's PIL backend resizes (a no-op copy when the size already fits).
    resized = rgb.resize((grid_w * p, grid_h * p), resample=Image.Resampling.BICUBIC)
    # rescale in float64 then float32, as transformers' rescale; then (x - mean) / std in float32
    scaled = (np.asarray(resized, dtype=np.uint8).astype(np.float64) * (1 / 255)).astype(np.float32)
    normalized = (scaled - np.asarray(config.image_mean, np.float32)) / np.asarray(
        config.image_std, np.float32
    )
    channels_first = torch.from_numpy(np.ascontiguousarray(normalized.transpose(2, 0, 1)))
    c = channels_first.shape[0]
    # [C, H, W] -> [block row, block col, row in block, col in block, C, patch row, patch col]: the patches
    # of one merge block are consecutive, which is what lets the merger concatenate neighbours by a reshape.
    blocks = channels_first.reshape(c, grid_h // m, m, p, grid_w // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    # A still image fills every slot of the temporal patch with the same frame.
    frames = blocks.unsqueeze(5).expand(*blocks.shape[:5], tp, p, p)
    pixels = frames.reshape(grid_h * grid_w, c * tp * p * p).contiguous()
    return ImagePatches(pixels=pixels, grid=(1, grid_h, grid_w))
