"""Preprocessing against transformers' Qwen2-VL image processor (PIL backend), the one Qwen3.5 uses:
the same pixels (bit for bit) and grids for several sizes, aspect ratios and image modes."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from bubo.vision.config import VisionConfig
from bubo.vision.image_patches import ImageSizeError, grid_for_size, patchify

# A small pixel budget (4 to 40 merge blocks of 32 x 32) takes both of smart_resize's branches with
# small images; the released budget is checked on a few sizes too.
SMALL_BUDGET = (32 * 32 * 4, 32 * 32 * 40)
RELEASED_BUDGET = (65536, 16777216)
MEAN, STD = (0.48, 0.5, 0.52), (0.27, 0.26, 0.28)


def _config(budget: tuple[int, int]) -> VisionConfig:
    return VisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        depth=1,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=64,
        num_position_embeddings=16,
        image_mean=MEAN,
        image_std=STD,
        min_pixels=budget[0],
        max_pixels=budget[1],
    )


def _processor(budget: tuple[int, int]) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=list(MEAN),
        image_std=list(STD),
        size={"shortest_edge": budget[0], "longest_edge": budget[1]},
    )


def _image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode]
    data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode)


def _assert_same(image: Image.Image, budget: tuple[int, int]) -> None:
    reference = _processor(budget)(images=[image], return_tensors="pt")
    ours = patchify(image, _config(budget))
    assert list(ours.grid) == reference["image_grid_thw"][0].tolist()
    assert ours.pixels.dtype == torch.float32
    assert torch.equal(ours.pixels, reference["pixel_values"])


@pytest.mark.parametrize(
    "size",
    [
        (64, 64),
        (100, 50),
        (50, 100),
        (37, 250),
        (300, 200),
        (640, 480),
        (1000, 30),
        (7, 9),
        (1, 1),
        (401, 401),
    ],
)
def test_pixels_and_grid_match_transformers(size: tuple[int, int]) -> None:
    _assert_same(_image(*size), SMALL_BUDGET)


@pytest.mark.parametrize("size", [(300, 200), (200, 520)])
def test_released_pixel_budget(size: tuple[int, int]) -> None:
    _assert_same(_image(*size), RELEASED_BUDGET)


@pytest.mark.parametrize("mode", ["RGBA", "L", "LA"])
def test_image_modes_convert_as_transformers(mode: str) -> None:
    """Transparency is composited onto white, grey is spread over the three channels."""
    _assert_same(_image(120, 90, mode), SMALL_BUDGET)


def test_palette_with_transparency() -> None:
    image = _image(80, 60).convert("P")
    image.info["transparency"] = 0
    _assert_same(image, SMALL_BUDGET)


@pytest.mark.parametrize("size", [(33, 2000), (640, 480), (5000, 4000), (1, 1), (999, 333)])
def test_grid_for_size_without_pixels(size: tuple[int, int]) -> None:
    width, height = size
    config = _config(RELEASED_BUDGET)
    processor = _processor(RELEASED_BUDGET)
    patches = processor.get_number_of_image_patches(height, width)
    t, h, w = grid_for_size(config, width, height)
    assert (t, h * w) == (1, patches)
    assert h % 2 == 0 and w % 2 == 0


def test_patch_order_is_merge_block_by_merge_block() -> None:
    """An image whose pixels encode their own patch coordinates: the listed patches go block by block."""
    config = _config((64 * 64, 64 * 64))  # a 64 x 64 image stays as it is: 4 x 4 patches
    rows = np.repeat(np.arange(4, dtype=np.uint8)[:, None], 4, axis=1)
    cols = rows.T
    coords = np.stack([rows * 60, cols * 60, np.zeros_like(rows)], axis=-1)
    image = Image.fromarray(np.kron(coords, np.ones((16, 16, 1), dtype=np.uint8)), "RGB")
    patches = patchify(image, config)
    first_values = patches.pixels[:, 0] * config.image_std[0] + config.image_mean[0]
    patch_rows = torch.round(first_values * 255 / 60).int().tolist()
    assert patches.grid == (1, 4, 4)
    assert patch_rows == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]


@pytest.mark.parametrize("size", [(201 * 10, 10), (0, 5)])
def test_unusable_shapes_are_refused(size: tuple[int, int]) -> None:
    with pytest.raises(ImageSizeError):
        grid_for_size(_config(SMALL_BUDGET), *size)
