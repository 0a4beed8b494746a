"""Load a Qwen3.5-family vision tower from a projector GGUF or from a Hugging Face checkpoint.

A projector GGUF is what llama.cpp's converter writes with `--mmproj` for Qwen3-VL / Qwen3.5
(Qwen3VLVisionModel): general.architecture "clip", projector type "qwen3vl_merger", the tower's sizes
under clip.vision.*, and tensors named v.* (the tower) and mm.* (the merger's two projections). The
converter splits the patch embedding's Conv3d over its temporal axis into two Conv2d kernels
(v.patch_embd.weight for frame 0, v.patch_embd.weight.1 for frame 1), keeps the fused qkv projection, and
names the merger's LayerNorm v.post_ln and its fc1 / fc2 mm.0 / mm.2.

A Hugging Face checkpoint is a directory (or one .safetensors file in it) with config.json's
vision_config, preprocessor_config.json when present, and the model.visual.* tensors.

Both are untrusted input: every size is checked before anything is built from it, and every problem is
a VisionLoadError that names the file and what is wrong with it.
"""

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from bubo.gguf.model_config import ModelConfig
from bubo.gguf.reader import GGUFError, GGUFFile
from bubo.vision.config import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, VisionConfig
from bubo.vision.tower import VisionTower

__all__ = ["VisionLoadError", "check_tower_fits", "load_vision_tower"]

PROJECTOR_TYPE = "qwen3vl_merger"  # gguf.VisionProjectorType.QWEN3VL
# The released Qwen3.5 preprocessor_config.json's normalisation, for a checkpoint that lacks the file.
_DEFAULT_MEAN_STD = (0.5, 0.5, 0.5)
_HF_PREFIXES = ("model.visual.", "visual.")
_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:blk|blocks)\.(\d+)\.")
_PATCH = "patch_embed.weight"  # the one parameter whose file layout differs from the tower's
# The tower's parameter names (bubo.vision.tower) -> the converter's (suffix .weight / .bias kept).
_GGUF_PARTS = {
    "patch_embed": "v.patch_embd",
    "pos_embed": "v.position_embd",
    "merger.norm": "v.post_ln",
    "merger.fc1": "mm.0",
    "merger.fc2": "mm.2",
}
_GGUF_BLOCK_PARTS = {
    "norm1": "ln1",
    "attn.qkv": "attn_qkv",
    "attn.out": "attn_out",
    "norm2": "ln2",
    "mlp_up": "ffn_up",
    "mlp_down": "ffn_down",
}
# ... -> transformers' (Qwen3_5VisionModel), after the checkpoint's prefix
_HF_RENAMES = (
    ("attn.out.", "attn.proj."),
    ("mlp_up.", "mlp.linear_fc1."),
    ("mlp_down.", "mlp.linear_fc2."),
    ("merger.fc1.", "merger.linear_fc1."),
    ("merger.fc2.", "merger.linear_fc2."),
    ("patch_embed.bias", "patch_embed.proj.bias"),
)


class VisionLoadError(ValueError):
    """A vision tower file is not one Bubo can load; the message says what is wrong with it."""


def load_vision_tower(path: str | Path, *, dtype: torch.dtype, device: torch.device | str) -> VisionTower:
    """The tower in `path` (a projector GGUF, or a Hugging Face checkpoint directory / .safetensors file),
    in eval mode, its weights in `dtype` on `device`."""
    path = Path(path)
    if not path.exists():
        raise VisionLoadError(f"{path}: no such file or directory")
    layout: _Layout
    if path.is_file() and _is_gguf(path):
        config, files = _read_gguf(path)
        layout = _gguf_layout
    elif path.is_dir() or path.suffix == ".safetensors":
        config, files = _read_checkpoint(path)
        layout = _checkpoint_layout
    else:
        raise VisionLoadError(
            f"{path}: neither a GGUF projector file nor a Hugging Face safetensors checkpoint"
        )
    return _build(files, layout, config, dtype, device)


def check_tower_fits(tower: VisionTower, config: ModelConfig) -> None:
    """Raise VisionLoadError unless `tower`'s embeddings can go into the text model `config` describes."""
    if config.mrope_sections is None:
        raise VisionLoadError(
            f"the text model ({config.architecture}) has no multimodal (mRoPE) positions, so it can't take "
            "image embeddings; a vision tower needs a Qwen3.5-family model"
        )
    if tower.config.out_hidden_size != config.hidden_size:
        raise VisionLoadError(
            f"the vision tower makes embeddings of {tower.config.out_hidden_size} values but the text model's "
            f"hidden size is {config.hidden_size}: the projector belongs to another model"
        )


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as fh:
        return fh.read(4) == b"GGUF"


# -- building -------------------------------------------------------------------------------------------


class _FileTensors:
    """The tensors of one file (or checkpoint) under their own names: shapes known up front, data read
    only once every name and shape has been checked."""

    def __init__(
        self, path: Path, shapes: dict[str, tuple[int, ...]], read: Callable[[str], torch.Tensor]
    ) -> None:
        self.path = path
        self.shapes = shapes
        self._read = read
        self.missing: list[str] = []
        self._taken: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        """A reader of tensor `name` as float32, after checking it has `shape` (a missing name is noted)."""
        if name not in self.shapes:
            self.missing.append(name)
        elif self.shapes[name] != shape:
            raise VisionLoadError(
                f"{self.path}: tensor {name} has shape {list(self.shapes[name])}, expected {list(shape)}"
            )
        self._taken.add(name)
        return lambda: self._read(name)

    def check_complete(self) -> None:
        if self.missing:
            raise VisionLoadError(f"{self.path}: missing tensors {_names(self.missing)}")
        unexpected = sorted(self.shapes.keys() - self._taken)
        if unexpected:
            raise VisionLoadError(
                f"{self.path}: tensors a Qwen3.5 vision tower doesn't have: {_names(unexpected)}"
            )

    def block_count(self) -> int:
        return len({m[1] for name in self.shapes if (m := _BLOCK_INDEX.search(name))})


# For one kind of file: the tower's parameter shapes -> a reader per parameter, taken from the file.
_Layout = Callable[
    [_FileTensors, dict[str, tuple[int, ...]], VisionConfig], dict[str, Callable[[], torch.Tensor]]
]


def _build(
    files: _FileTensors, layout: _Layout, config: VisionConfig, dtype: torch.dtype, device: torch.device | str
) -> VisionTower:
    # Checked before building: a block count from the file could ask for a billion empty blocks.
    if config.depth > files.block_count():
        raise VisionLoadError(
            f"{files.path}: {config.depth} blocks, but the file holds tensors of {files.block_count()}"
        )
    with torch.device("meta"):
        tower = VisionTower(config)
    expected = {name: tuple(p.shape) for name, p in tower.state_dict().items()}
    readers = layout(files, expected, config)
    files.check_complete()
    tower.load_state_dict({name: read().to(device, dtype) for name, read in readers.items()}, assign=True)
    return tower.eval()


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:6])
    return shown + (f" and {len(names) - 6} more" if len(names) > 6 else "")


# -- projector GGUF -------------------------------------------------------------------------------------


class _Keys:
    """Typed reads of a projector's clip.* metadata, with errors that name the key and the file."""

    def __init__(self, f: GGUFFile) -> None:
        self.f = f

    def error(self, problem: str) -> VisionLoadError:
        return VisionLoadError(f"{self.f.path}: {problem}")

    def get(self, key: str) -> Any:
        value = self.f.get(key)
        if value is None:
            raise self.error(f"missing required metadata key '{key}'")
        return value

    def positive_int(self, key: str) -> int:
        value = self.get(key)
        if type(value) is not int or value < 1:
            raise self.error(f"'{key}' must be a positive integer, got {value!r}")
        return value

    def optional_positive_int(self, key: str, default: int) -> int:
        return default if self.f.get(key) is None else self.positive_int(key)

    def floats(self, key: str, count: int) -> tuple[float, ...]:
        value = self.get(key)
        if not (
            isinstance(value, list)
            and len(value) == count
            and all(
                isinstance(x, float | int) and not isinstance(x, bool) and math.isfinite(x) for x in value
            )
        ):
            raise self.error(f"'{key}' must be {count} finite numbers, got {value!r}")
        return tuple(float(x) for x in value)


def _read_gguf(path: Path) -> tuple[VisionConfig, _FileTensors]:
    try:
        f = GGUFFile(path)
    except GGUFError as e:
        raise VisionLoadError(str(e)) from None
    keys = _Keys(f)
    arch = f.get("general.architecture")
    if arch != "clip":
        raise keys.error(
            f"general.architecture is {arch!r}, not 'clip': this is not a vision projector file "
            "(llama.cpp's converter writes one with --mmproj)"
        )
    if f.get("clip.has_vision_encoder") is not True:
        raise keys.error("clip.has_vision_encoder is not true: the projector has no vision tower")
    projector = f.get("clip.vision.projector_type", f.get("clip.projector_type"))
    if projector != PROJECTOR_TYPE:
        raise keys.error(
            f"projector type {projector!r}: Bubo runs the Qwen3.5 / Qwen3-VL tower ('{PROJECTOR_TYPE}') only"
        )
    deepstack = f.get("clip.vision.is_deepstack_layers") or []
    if not isinstance(deepstack, list) or any(deepstack):
        raise keys.error("the tower has deepstack layers (Qwen3-VL's); the Qwen3.5 family's has none")
    if "v.position_embd.weight" not in f.tensors:
        raise keys.error("missing tensor v.position_embd.weight")
    hidden = keys.positive_int("clip.vision.embedding_length")
    positions = f.tensors["v.position_embd.weight"].shape
    if len(positions) != 2 or positions[1] != hidden:
        raise keys.error(f"tensor v.position_embd.weight has shape {list(positions)}, expected [n, {hidden}]")
    try:
        config = VisionConfig(
            hidden_size=hidden,
            intermediate_size=keys.positive_int("clip.vision.feed_forward_length"),
            num_heads=keys.positive_int("clip.vision.attention.head_count"),
            depth=keys.positive_int("clip.vision.block_count"),
            patch_size=keys.positive_int("clip.vision.patch_size"),
            # the converter accepts only a temporal patch of 2, the two halves of the split Conv3d
            temporal_patch_size=2,
            spatial_merge_size=keys.positive_int("clip.vision.spatial_merge_size"),
            out_hidden_size=keys.positive_int("clip.vision.projection_dim"),
            num_position_embeddings=positions[0],
            image_mean=keys.floats("clip.vision.image_mean", 3),  # type: ignore[arg-type]
            image_std=keys.floats("clip.vision.image_std", 3),  # type: ignore[arg-type]
            min_pixels=keys.optional_positive_int("clip.vision.image_min_pixels", DEFAULT_MIN_PIXELS),
            max_pixels=keys.optional_positive_int("clip.vision.image_max_pixels", DEFAULT_MAX_PIXELS),
            # Not clip.vision.attention.layer_norm_epsilon: the converter writes the text model's RMSNorm
            # epsilon there, while transformers' tower uses 1e-6 (VisionConfig's default) whatever it is.
        )
    except ValueError as e:
        raise keys.error(str(e)) from None

    def read(name: str) -> torch.Tensor:
        try:
            return f.tensors[name].dequantize(torch.float32)
        except GGUFError as e:
            raise VisionLoadError(str(e)) from None

    return config, _FileTensors(path, {name: t.shape for name, t in f.tensors.items()}, read)


def _gguf_name(name: str) -> str:
    """The converter's name for the tower parameter `name`."""
    stem, kind = name.rsplit(".", 1)
    if stem.startswith("blocks."):
        _, index, part = stem.split(".", 2)
        return f"v.blk.{index}.{_GGUF_BLOCK_PARTS[part]}.{kind}"
    return f"{_GGUF_PARTS[stem]}.{kind}"


def _gguf_layout(
    files: _FileTensors, expected: dict[str, tuple[int, ...]], config: VisionConfig
) -> dict[str, Callable[[], torch.Tensor]]:
    readers = {
        name: files.take(_gguf_name(name), shape) for name, shape in expected.items() if name != _PATCH
    }
    # The Conv3d kernel [out, channel, frame, row, col] from the converter's two per-frame Conv2d kernels,
    # flattened in the (channel, frame, row, col) order of the preprocessing's patches.
    kernel = (config.hidden_size, config.in_channels, config.patch_size, config.patch_size)
    frames = [files.take(name, kernel) for name in ("v.patch_embd.weight", "v.patch_embd.weight.1")]
    readers[_PATCH] = lambda: torch.stack([read() for read in frames], dim=2).reshape(expected[_PATCH])
    return readers


# -- Hugging Face checkpoint ----------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VisionLoadError(f"{path}: can't read JSON ({e})") from None
    if not isinstance(value, dict):
        raise VisionLoadError(f"{path}: expected a JSON object")
    return value


def _read_checkpoint(path: Path) -> tuple[VisionConfig, _FileTensors]:
    folder = path if path.is_dir() else path.parent
    if not (folder / "config.json").is_file():
        raise VisionLoadError(f"{folder}: no config.json (a Hugging Face checkpoint has one)")
    vision = _read_json(folder / "config.json").get("vision_config")
    if not isinstance(vision, dict):
        raise VisionLoadError(
            f"{folder / 'config.json'}: no vision_config: the checkpoint has no vision tower"
        )
    preprocessor: dict[str, Any] = {}
    if (folder / "preprocessor_config.json").is_file():
        preprocessor = _read_json(folder / "preprocessor_config.json")
    config = _checkpoint_config(folder, vision, preprocessor)
    files = [path] if path.is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise VisionLoadError(f"{folder}: no .safetensors files")
    return config, _checkpoint_tensors(folder, files)


def _checkpoint_config(folder: Path, vision: dict[str, Any], preprocessor: dict[str, Any]) -> VisionConfig:
    def error(problem: str) -> VisionLoadError:
        return VisionLoadError(f"{folder}: {problem}")

    if vision.get("deepstack_visual_indexes"):
        raise error("vision_config has deepstack layers (Qwen3-VL's); the Qwen3.5 family's tower has none")
    if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise error(
            f"vision_config.hidden_act {vision['hidden_act']!r}: the Qwen3.5 tower uses gelu_pytorch_tanh"
        )
    rope = vision.get("rope_parameters") or {}
    size = preprocessor.get("size") or {}
    sizes = {
        "patch_size": "patch_size",
        "temporal_patch_size": "temporal_patch_size",
        "merge_size": "spatial_merge_size",
    }
    for key, field in sizes.items():
        if key in preprocessor and field in vision and preprocessor[key] != vision[field]:
            raise error(
                f"preprocessor_config.json {key} {preprocessor[key]} differs from vision_config {field}"
            )
    fields = {
        "hidden_size": vision.get("hidden_size"),
        "intermediate_size": vision.get("intermediate_size"),
        "num_heads": vision.get("num_heads"),
        "depth": vision.get("depth"),
        "patch_size": vision.get("patch_size"),
        "temporal_patch_size": vision.get("temporal_patch_size"),
        "spatial_merge_size": vision.get("spatial_merge_size"),
        "out_hidden_size": vision.get("out_hidden_size"),
        "num_position_embeddings": vision.get("num_position_embeddings"),
        "min_pixels": size.get("shortest_edge", preprocessor.get("min_pixels", DEFAULT_MIN_PIXELS)),
        "max_pixels": size.get("longest_edge", preprocessor.get("max_pixels", DEFAULT_MAX_PIXELS)),
    }
    for key, value in fields.items():
        if type(value) is not int or value < 1:
            raise error(f"vision config {key} must be a positive integer, got {value!r}")
    mean = preprocessor.get("image_mean", _DEFAULT_MEAN_STD)
    std = preprocessor.get("image_std", _DEFAULT_MEAN_STD)
    theta = rope.get("rope_theta", 10000.0)
    for key, value in (("image_mean", mean), ("image_std", std)):
        if not (
            isinstance(value, list | tuple)
            and len(value) == 3
            and all(type(x) in (int, float) for x in value)
        ):
            raise error(f"preprocessor {key} must be 3 numbers, got {value!r}")
    if type(theta) not in (int, float) or not theta > 0:
        raise error(f"vision rope_theta must be a positive number, got {theta!r}")
    try:
        return VisionConfig(
            **fields,
            image_mean=tuple(mean),
            image_std=tuple(std),
            rope_theta=float(theta),  # type: ignore[arg-type]
        )
    except ValueError as e:
        raise error(str(e)) from None


def _checkpoint_layout(
    files: _FileTensors, expected: dict[str, tuple[int, ...]], config: VisionConfig
) -> dict[str, Callable[[], torch.Tensor]]:
    prefix = next((p for p in _HF_PREFIXES if p + "pos_embed.weight" in files.shapes), _HF_PREFIXES[0])

    def hf_name(name: str) -> str:
        for ours, theirs in _HF_RENAMES:
            name = name.replace(ours, theirs)
        return prefix + name

    readers = {name: files.take(hf_name(name), shape) for name, shape in expected.items() if name != _PATCH}
    # A Conv3d whose kernel equals its stride is its kernel, flattened in (channel, frame, row, col) order,
    # applied to each flattened patch.
    kernel = (
        config.hidden_size,
        config.in_channels,
        config.temporal_patch_size,
        config.patch_size,
        config.patch_size,
    )
    conv = files.take(prefix + "patch_embed.proj.weight", kernel)
    readers[_PATCH] = lambda: conv().flatten(1)
    return readers


def _checkpoint_tensors(folder: Path, files: list[Path]) -> _FileTensors:
    """The tower's tensors (model.visual.* or visual.*) of the checkpoint's safetensors `files`."""
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                names = handle.keys()
                for name in names:
                    if name.startswith(_HF_PREFIXES):
                        shapes[name] = tuple(handle.get_slice(name).get_shape())
                        where[name] = file
        except (SafetensorError, OSError) as e:
            raise VisionLoadError(f"{file}: not a readable safetensors file ({e})") from None

    def read(name: str) -> torch.Tensor:
        with safe_open(where[name], framework="pt") as handle:
            return handle.get_tensor(name).float()

    return _FileTensors(folder, shapes, read)
