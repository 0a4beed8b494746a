"""The tower's image embeddings against transformers' Qwen3_5VisionModel on a tiny random tower, loaded
from the projector GGUF the fixture writes as llama.cpp's converter would and from the safetensors
checkpoint; pixels from transformers' own image processor, so only the tower is compared. Measured max
|Δ| over the three image sizes: 3.3e-6 from either source. Tolerance 1e-4."""

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from bubo.vision.image_patches import ImagePatches
from bubo.vision.loader import load_vision_tower
from tests.fixtures.mmproj_writer import PREPROCESSOR

TOLERANCE = 1e-4  # fp32 image embeddings (issue 9)
MEAN, STD = tuple(PREPROCESSOR["image_mean"]), tuple(PREPROCESSOR["image_std"])

pytestmark = pytest.mark.usefixtures("one_thread")


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _reference(
    model: Qwen3_5ForConditionalGeneration, pixels: torch.Tensor, grid: torch.Tensor
) -> torch.Tensor:
    with torch.no_grad():
        return model.model.get_image_features(pixels, grid).pooler_output[0]


@pytest.mark.parametrize("source", ["mmproj", "checkpoint"])
@pytest.mark.parametrize("size", [(256, 256), (300, 200), (180, 420)])
def test_embeddings_match_transformers(
    vl_model: Qwen3_5ForConditionalGeneration, vl_files: dict[str, Path], source: str, size: tuple[int, int]
) -> None:
    tower = load_vision_tower(vl_files[source], dtype=torch.float32, device="cpu")
    image = _image(*size)
    processed = Qwen2VLImageProcessorPil(**PREPROCESSOR)(images=[image], return_tensors="pt")
    expected = _reference(vl_model, processed["pixel_values"], processed["image_grid_thw"])

    patches = tower.preprocess(image)
    assert list(patches.grid) == processed["image_grid_thw"][0].tolist()
    embeddings = tower.encode(patches)
    assert embeddings.shape == (tower.token_count(patches.grid), vl_model.config.text_config.hidden_size)
    assert embeddings.dtype == torch.float32
    assert (embeddings - expected).abs().max().item() <= TOLERANCE


def test_several_frames_attend_within_their_frame(
    vl_model: Qwen3_5ForConditionalGeneration, vl_files: dict[str, Path]
) -> None:
    """A grid of 2 temporal patches (video-like): position grid repeated, attention per frame."""
    tower = load_vision_tower(vl_files["mmproj"], dtype=torch.float32, device="cpu")
    grid = (2, 4, 6)
    pixels = torch.randn(48, tower.config.patch_values, generator=torch.Generator().manual_seed(1))
    expected = _reference(vl_model, pixels, torch.tensor([grid]))
    embeddings = tower.encode(ImagePatches(pixels=pixels, grid=grid))
    assert (embeddings - expected).abs().max().item() <= TOLERANCE


def test_config_read_from_both_sources(vl_files: dict[str, Path]) -> None:
    from_gguf = load_vision_tower(vl_files["mmproj"], dtype=torch.float32, device="cpu").config
    from_checkpoint = load_vision_tower(vl_files["checkpoint"], dtype=torch.float32, device="cpu").config
    # the GGUF holds mean and std as float32 (the same float32 values normalise the pixels)
    assert replace(from_gguf, image_mean=MEAN, image_std=STD) == replace(
        from_checkpoint, image_mean=MEAN, image_std=STD
    )
    assert from_checkpoint.image_mean == MEAN and from_checkpoint.image_std == STD
    assert from_gguf.image_mean == pytest.approx(MEAN) and from_gguf.image_std == pytest.approx(STD)
    assert (from_gguf.min_pixels, from_gguf.max_pixels) == (65536, 16777216)
    assert (from_gguf.depth, from_gguf.hidden_size, from_gguf.num_position_embeddings) == (2, 32, 16)


def test_bfloat16_tower_returns_bfloat16(vl_files: dict[str, Path]) -> None:
    tower = load_vision_tower(vl_files["mmproj"], dtype=torch.bfloat16, device="cpu")
    reference = load_vision_tower(vl_files["mmproj"], dtype=torch.float32, device="cpu")
    patches = tower.preprocess(_image(256, 256))
    embeddings = tower.encode(patches)
    assert embeddings.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: a few percent of the embeddings' scale after two blocks
    scale = reference.encode(patches).abs().max()
    assert (embeddings.float() - reference.encode(patches)).abs().max() <= 0.05 * scale


def test_encode_refuses_patches_that_do_not_fit_the_grid(vl_files: dict[str, Path]) -> None:
    tower = load_vision_tower(vl_files["mmproj"], dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="don't fit grid"):
        tower.encode(ImagePatches(pixels=torch.zeros(10, tower.config.patch_values), grid=(1, 4, 4)))
    with pytest.raises(ValueError, match="multiples of 2"):
        tower.encode(ImagePatches(pixels=torch.zeros(15, tower.config.patch_values), grid=(1, 3, 5)))


def test_sharded_checkpoint_and_bare_visual_prefix(vl_files: dict[str, Path], tmp_path: Path) -> None:
    """Released checkpoints come in shards; older conversions name the tower visual.* (no model.)."""
    weights = load_file(vl_files["checkpoint"] / "model.safetensors")
    visual = sorted(name for name in weights if name.startswith("model.visual."))
    shutil.copy(vl_files["checkpoint"] / "config.json", tmp_path / "config.json")
    shutil.copy(vl_files["checkpoint"] / "preprocessor_config.json", tmp_path / "preprocessor_config.json")
    for i, names in enumerate((visual[::2], visual[1::2])):
        bare = {name.removeprefix("model."): weights[name] for name in names}
        save_file(bare, tmp_path / f"model-0000{i + 1}-of-00002.safetensors")
    sharded = load_vision_tower(tmp_path, dtype=torch.float32, device="cpu")
    whole = load_vision_tower(vl_files["checkpoint"], dtype=torch.float32, device="cpu")
    for (name, ours), (_, theirs) in zip(
        sharded.state_dict().items(), whole.state_dict().items(), strict=True
    ):
        assert torch.equal(ours, theirs), name
