"""Files that are not a Qwen3.5 vision tower get a VisionLoadError that says what is wrong."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForConditionalGeneration

from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.vision.loader import VisionLoadError, check_tower_fits, load_vision_tower
from tests.fixtures.mmproj_writer import write_mmproj


def _load(path: Path) -> None:
    load_vision_tower(path, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"general.architecture": "qwen35"}, "not 'clip'"),
        ({"clip.has_vision_encoder": False}, "no vision tower"),
        ({"clip.projector_type": "qwen2.5vl_merger"}, "projector type 'qwen2.5vl_merger'"),
        ({"clip.projector_type": None}, "projector type None"),
        ({"clip.vision.block_count": None}, "missing required metadata key 'clip.vision.block_count'"),
        ({"clip.vision.spatial_merge_size": "2"}, "must be a positive integer"),
        ({"clip.vision.image_mean": [0.5, 0.5]}, "must be 3 finite numbers"),
        ({"clip.vision.attention.head_count": 5}, "not a multiple of 5 heads"),
        ({"clip.vision.is_deepstack_layers": [True, False]}, "deepstack"),
        (
            {"clip.vision.feed_forward_length": 40},
            r"tensor v\.blk\.0\.ffn_up\.weight has shape \[48, 32\], expected \[40, 32\]",
        ),
        (
            {"clip.vision.projection_dim": 48},
            r"tensor mm\.2\.weight has shape \[64, 128\], expected \[48, 128\]",
        ),
        ({"clip.vision.block_count": 3}, "3 blocks, but the file holds tensors of 2"),
        ({"clip.vision.block_count": 10**9}, "1000000000 blocks, but the file holds tensors of 2"),
        (
            {"clip.vision.block_count": 1},
            r"doesn't have: v\.blk\.1\.attn_out\.bias, v\.blk\.1\.attn_out\.weight, .* and 6 more",
        ),
        ({"clip.vision.embedding_length": 16}, "v.position_embd.weight has shape"),
    ],
)
def test_bad_metadata(
    vl_model: Qwen3_5ForConditionalGeneration, tmp_path: Path, overrides: dict[str, object], message: str
) -> None:
    path = write_mmproj(vl_model, tmp_path / "bad.gguf", metadata_overrides=overrides)
    with pytest.raises(VisionLoadError, match=message):
        _load(path)


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        (("v.blk.1.ffn_up.weight",), r"missing tensors v\.blk\.1\.ffn_up\.weight$"),
        (("mm.2.bias",), r"missing tensors mm\.2\.bias$"),
        (("v.patch_embd.weight.1",), r"missing tensors v\.patch_embd\.weight\.1$"),
        (("v.position_embd.weight",), r"missing tensor v\.position_embd\.weight"),
    ],
)
def test_missing_tensors(
    vl_model: Qwen3_5ForConditionalGeneration, tmp_path: Path, drop: tuple[str, ...], message: str
) -> None:
    path = write_mmproj(vl_model, tmp_path / "bad.gguf", drop=drop)
    with pytest.raises(VisionLoadError, match=message):
        _load(path)


def test_tensors_of_another_tower_are_refused(
    vl_model: Qwen3_5ForConditionalGeneration, tmp_path: Path
) -> None:
    """Qwen3-VL's deepstack mergers in a file that doesn't flag them."""
    path = write_mmproj(
        vl_model, tmp_path / "bad.gguf", extra_tensors={"v.deepstack.0.fc1.weight": torch.zeros(4, 4)}
    )
    with pytest.raises(VisionLoadError, match=r"doesn't have: v\.deepstack\.0\.fc1\.weight"):
        _load(path)


def test_unsupported_tensor_type_is_named(vl_model: Qwen3_5ForConditionalGeneration, tmp_path: Path) -> None:
    path = write_mmproj(vl_model, tmp_path / "bad.gguf", quantize={"mm.0.weight": GGMLQuantizationType.F64})
    with pytest.raises(VisionLoadError, match=r"mm\.0\.weight.*F64"):
        _load(path)


def test_quantized_tensors_load(vl_model: Qwen3_5ForConditionalGeneration, tmp_path: Path) -> None:
    """Q8_0 / F16 projections dequantize as bubo.gguf does for the text model."""
    quantize = {"mm.0.weight": GGMLQuantizationType.Q8_0, "v.blk.0.ffn_up.weight": GGMLQuantizationType.F16}
    tower = load_vision_tower(
        write_mmproj(vl_model, tmp_path / "q.gguf", quantize=quantize), dtype=torch.float32, device="cpu"
    )
    exact = vl_model.model.visual.merger.linear_fc1.weight
    assert not torch.equal(tower.merger.fc1.weight, exact)
    assert (tower.merger.fc1.weight - exact).abs().max() <= exact.abs().max() / 127


def test_truncated_and_foreign_files(vl_model: Qwen3_5ForConditionalGeneration, tmp_path: Path) -> None:
    whole = write_mmproj(vl_model, tmp_path / "whole.gguf").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(VisionLoadError, match="truncated"):
        _load(truncated)
    foreign = tmp_path / "image.png"
    foreign.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    with pytest.raises(VisionLoadError, match="neither a GGUF projector file nor"):
        _load(foreign)
    with pytest.raises(VisionLoadError, match="no such file"):
        _load(tmp_path / "absent.gguf")


def test_text_model_gguf_is_not_a_projector(vl_files: dict[str, Path]) -> None:
    with pytest.raises(VisionLoadError, match=r"general\.architecture is 'qwen35', not 'clip'"):
        _load(vl_files["text"])


def _checkpoint_copy(vl_files: dict[str, Path], tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoint"
    shutil.copytree(vl_files["checkpoint"], folder)
    return folder


def test_checkpoint_errors(vl_files: dict[str, Path], tmp_path: Path) -> None:
    folder = _checkpoint_copy(vl_files, tmp_path)
    config = json.loads((folder / "config.json").read_text())

    (folder / "config.json").write_text(json.dumps({**config, "vision_config": None}))
    with pytest.raises(VisionLoadError, match="no vision_config"):
        _load(folder)
    (folder / "config.json").write_text(
        json.dumps({**config, "vision_config": {**config["vision_config"], "depth": -1}})
    )
    with pytest.raises(VisionLoadError, match="depth must be a positive integer"):
        _load(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(VisionLoadError, match="can't read JSON"):
        _load(folder)
    (folder / "config.json").unlink()
    with pytest.raises(VisionLoadError, match=r"no config\.json"):
        _load(folder)


def test_checkpoint_tensor_errors(vl_files: dict[str, Path], tmp_path: Path) -> None:
    folder = _checkpoint_copy(vl_files, tmp_path)
    weights = load_file(folder / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if k != "model.visual.blocks.1.attn.qkv.bias"},
        folder / "model.safetensors",
    )
    with pytest.raises(VisionLoadError, match=r"missing tensors model\.visual\.blocks\.1\.attn\.qkv\.bias$"):
        _load(folder)
    kernel = weights["model.visual.patch_embed.proj.weight"]
    save_file(
        {**weights, "model.visual.patch_embed.proj.weight": kernel[:, :, :1].contiguous()},
        folder / "model.safetensors",
    )
    with pytest.raises(VisionLoadError, match=r"patch_embed\.proj\.weight has shape"):
        _load(folder / "model.safetensors")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    with pytest.raises(VisionLoadError, match="not a readable safetensors file"):
        _load(folder)


def test_preprocessor_that_disagrees_with_the_tower(vl_files: dict[str, Path], tmp_path: Path) -> None:
    folder = _checkpoint_copy(vl_files, tmp_path)
    preprocessor = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**preprocessor, "patch_size": 14}))
    with pytest.raises(VisionLoadError, match="patch_size 14 differs"):
        _load(folder)


def test_tower_fits_only_its_text_model(vl_files: dict[str, Path], tiny_llama_path: Path) -> None:
    tower = load_vision_tower(vl_files["mmproj"], dtype=torch.float32, device="cpu")
    text = config_from_gguf(GGUFFile(vl_files["text"]))
    check_tower_fits(tower, text)
    with pytest.raises(VisionLoadError, match="hidden size is 96"):
        check_tower_fits(tower, text.__class__(**{**text.__dict__, "hidden_size": 96}))
    with pytest.raises(VisionLoadError, match="no multimodal"):
        check_tower_fits(tower, config_from_gguf(GGUFFile(tiny_llama_path)))
