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

from bubo.gguf.config import ModelConfig
from bubo.gguf.reader import GGUFError, GGUFFile
from bubo.vision.config import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, VisionConfig
from bubo.vision.tower import VisionTower

__all__ = ["VisionLoadError", "check_tower_fits", "load_vision_tower"]

PROJECTOR_TYPE = "qwen3vl_merger"  # gguf.VisionProjectorType.QWEN3VL
# The released Qwen3.5 preprocessor_config.json's normalisation, for a checkpoint that lacks the file.
_DEFAULT_MEAN_STD = (0.5, 0.5, 0.5)
_HF_PREFIXES = ("model.visual.", "visual.")
_GGUF_BLOCK_TENSOR = re.compile(r"v\.blk\.(?P<index>\d+)\.(?P<part>\w+)\.(?P<kind>weight|bias)")


class VisionLoadError(ValueError):
    """A vision tower file is not one Bubo can load; the message says what is wrong with it."""


def load_vision_tower(path: str | Path, *, dtype: torch.dtype, device: torch.device | str) -> VisionTower:
    """The tower in `path` (a projector GGUF, or a Hugging Face checkpoint directory / .safetensors file),
    in eval mode, its weights in `dtype` on `device`."""
    path = Path(path)
    if not path.exists():
        raise VisionLoadError(f"{path}: no such file or directory")
    if path.is_file() and _is_gguf(path):
        config, tensors = _read_gguf(path)
    elif path.is_dir() or path.suffix == ".safetensors":
        config, tensors = _read_checkpoint(path)
    else:
        raise VisionLoadError(
            f"{path}: neither a GGUF projector file nor a Hugging Face safetensors checkpoint"
        )
    return _build(path, config, tensors, dtype, device)


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

# A tensor as the loader found it: its shape, and how to read it as float32 once the shape is checked.
_Tensors = dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]]


def _build(
    path: Path, config: VisionConfig, tensors: _Tensors, dtype: torch.dtype, device: torch.device | str
) -> VisionTower:
    # Checked before building: a block count from the file could ask for a billion empty blocks.
    blocks = {name.split(".")[1] for name in tensors if name.startswith("blocks.")}
    if config.depth > len(blocks):
        raise VisionLoadError(f"{path}: {config.depth} blocks, but the file holds tensors of {len(blocks)}")
    with torch.device("meta"):
        tower = VisionTower(config)
    expected = {name: tuple(p.shape) for name, p in tower.state_dict().items()}
    missing = sorted(expected.keys() - tensors.keys())
    if missing:
        raise VisionLoadError(f"{path}: missing tensors {_names(missing)}")
    unexpected = sorted(tensors.keys() - expected.keys())
    if unexpected:
        raise VisionLoadError(f"{path}: tensors a Qwen3.5 vision tower doesn't have: {_names(unexpected)}")
    for name, shape in expected.items():
        if tensors[name][0] != shape:
            raise VisionLoadError(
                f"{path}: tensor {name} has shape {list(tensors[name][0])}, expected {list(shape)}"
            )
    state = {name: read().to(device=device, dtype=dtype) for name, (_, read) in tensors.items()}
    tower.load_state_dict(state, assign=True)
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


def _read_gguf(path: Path) -> tuple[VisionConfig, _Tensors]:
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
    return config, _gguf_tensors(f, config)


def _gguf_tensors(f: GGUFFile, config: VisionConfig) -> _Tensors:
    """The file's tensors under the tower's parameter names; the split patch kernel is put back together
    (and checked) here, the rest is checked by name and shape in _build."""

    def read(name: str) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            try:
                return f.tensors[name].dequantize(torch.float32)
            except GGUFError as e:
                raise VisionLoadError(str(e)) from None

        return load

    renames = {
        "v.patch_embd.bias": "patch_embed.bias",
        "v.position_embd.weight": "pos_embed.weight",
        "v.post_ln.weight": "merger.norm.weight",
        "v.post_ln.bias": "merger.norm.bias",
    }
    for suffix in ("weight", "bias"):
        renames[f"mm.0.{suffix}"] = f"merger.fc1.{suffix}"
        renames[f"mm.2.{suffix}"] = f"merger.fc2.{suffix}"
    block_parts = {
        "ln1": "norm1",
        "attn_qkv": "attn.qkv",
        "attn_out": "attn.out",
        "ln2": "norm2",
        "ffn_up": "mlp_up",
        "ffn_down": "mlp_down",
    }
    tensors: _Tensors = {}
    kernels = ("v.patch_embd.weight", "v.patch_embd.weight.1")
    for name, tensor in f.tensors.items():
        if name in kernels:
            continue
        new = renames.get(name)
        block = _GGUF_BLOCK_TENSOR.fullmatch(name)
        if block is not None and block["part"] in block_parts:
            new = f"blocks.{block['index']}.{block_parts[block['part']]}.{block['kind']}"
        tensors[new or name] = (tensor.shape, read(name))
    kernel_shape = (config.hidden_size, config.in_channels, config.patch_size, config.patch_size)
    for name in kernels:
        if name not in f.tensors:
            raise VisionLoadError(
                f"{f.path}: missing tensor {name} (the patch embedding of frame {name[-1]})"
            )
        if f.tensors[name].shape != kernel_shape:
            raise VisionLoadError(
                f"{f.path}: tensor {name} has shape {list(f.tensors[name].shape)}, expected {list(kernel_shape)}"
            )

    def patch_embedding() -> torch.Tensor:
        # Conv3d kernel [out, channels, frame, row, col] from the two per-frame Conv2d kernels, flattened
        # in the (channel, frame, row, col) order of the preprocessing's patches.
        frames = torch.stack([read(name)() for name in kernels], dim=2)
        return frames.reshape(config.hidden_size, config.patch_values)

    tensors["patch_embed.weight"] = ((config.hidden_size, config.patch_values), patch_embedding)
    return tensors


# -- Hugging Face checkpoint ----------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VisionLoadError(f"{path}: can't read JSON ({e})") from None
    if not isinstance(value, dict):
        raise VisionLoadError(f"{path}: expected a JSON object")
    return value


def _read_checkpoint(path: Path) -> tuple[VisionConfig, _Tensors]:
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
    return config, _checkpoint_tensors(files, config)


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


def _checkpoint_tensors(files: list[Path], config: VisionConfig) -> _Tensors:
    """The model.visual.* tensors of `files` under the tower's parameter names (the Conv3d patch kernel
    flattened to the linear map it is)."""
    renames = {
        "patch_embed.proj.bias": "patch_embed.bias",
        "merger.linear_fc1.weight": "merger.fc1.weight",
        "merger.linear_fc1.bias": "merger.fc1.bias",
        "merger.linear_fc2.weight": "merger.fc2.weight",
        "merger.linear_fc2.bias": "merger.fc2.bias",
    }
    block_parts = {"attn.proj": "attn.out", "mlp.linear_fc1": "mlp_up", "mlp.linear_fc2": "mlp_down"}
    kernel = (
        config.hidden_size,
        config.in_channels,
        config.temporal_patch_size,
        config.patch_size,
        config.patch_size,
    )
    tensors: _Tensors = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                names = list(handle.keys())
                shapes = {n: tuple(handle.get_slice(n).get_shape()) for n in names}
        except (SafetensorError, OSError) as e:
            raise VisionLoadError(f"{file}: not a readable safetensors file ({e})") from None
        for full in names:
            prefix = next((p for p in _HF_PREFIXES if full.startswith(p)), None)
            if prefix is None:
                continue
            name = full.removeprefix(prefix)
            read = _safetensors_reader(file, full)
            shape = shapes[full]
            if name == "patch_embed.proj.weight":
                if shape != kernel:
                    raise VisionLoadError(
                        f"{file}: tensor {full} has shape {list(shape)}, expected {list(kernel)}"
                    )
                name, shape, read = (
                    "patch_embed.weight",
                    (config.hidden_size, config.patch_values),
                    _flat(read),
                )
            elif name.startswith("blocks."):
                for old, new in block_parts.items():
                    name = name.replace(f".{old}.", f".{new}.")
            tensors[renames.get(name, name)] = (shape, read)
    return tensors


def _safetensors_reader(file: Path, name: str) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        with safe_open(file, framework="pt") as handle:
            return handle.get_tensor(name).float()

    return read


def _flat(read: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    # A Conv3d with kernel == stride over a [channel, frame, row, col] patch is its kernel, flattened in
    # that order, as one linear map.
    return lambda: read().flatten(1)
