"""`--mtp-weights`: the MTP block read from a Hugging Face checkpoint's `mtp.*` tensors.

The checkpoint is written by the test from the reference block (tests/fixtures/mtp_models.py) under
the names transformers' own modules give the layer; the same weights written as GGUF `nextn` tensors
are the comparison: both loads must draft the same logits.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model.decoder import Decoder
from bubo.model.loader import load_decoder
from bubo.model.mtp_weights import MTPWeightsError, load_mtp_weights
from tests.fixtures.gguf_writer import write_gguf
from tests.fixtures.mtp_models import ReferenceMTP, mtp_model

pytestmark = pytest.mark.usefixtures("one_thread")

MAIN = ["linear_attention", "full_attention"] * 2


def _load(path: Path) -> Decoder:
    f = GGUFFile(path)
    return load_decoder(f, config_from_gguf(f))


def _models(arch: str, tmp_path: Path) -> tuple[ReferenceMTP, Decoder, Decoder]:
    """The reference block, the model with the block from its GGUF, and the model from a GGUF without
    it (as llama.cpp's default converter writes it)."""
    reference, path = mtp_model(arch, MAIN, tmp_path / "with_mtp.gguf")
    plain = write_gguf(reference.main, tmp_path / "without_mtp.gguf")
    return reference, _load(path), _load(plain)


@pytest.mark.parametrize(
    ("arch", "per_expert"),
    [("qwen35", False), ("qwen35moe", False), ("qwen35moe", True), ("qwen3next", False), ("qwen3next", True)],
)
def test_checkpoint_mtp_drafts_like_the_gguf_mtp(arch: str, per_expert: bool, tmp_path: Path) -> None:
    reference, with_mtp, without = _models(arch, tmp_path)
    tensors = reference.checkpoint_tensors()
    if per_expert:  # how the released checkpoints store experts, before transformers fuses them
        prefix = "mtp.layers.0.mlp.experts."
        gate, up = tensors.pop(prefix + "gate_up_proj").chunk(2, dim=1)
        down = tensors.pop(prefix + "down_proj")
        for e in range(gate.shape[0]):
            for kind, stack in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                tensors[f"{prefix}{e}.{kind}.weight"] = stack[e].contiguous()
    # a shard holds other tensors too: only mtp.* are read
    tensors["model.norm.weight"] = torch.ones(4)
    save_file(tensors, tmp_path / "shard.safetensors")
    assert without.mtp is None
    load_mtp_weights(without, tmp_path / "shard.safetensors")

    tokens = torch.randint(0, 300, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        hidden = without.hidden(tokens[:, :-1], without.new_cache(max_len=32))
        loaded = without.draft_logits(hidden, tokens[:, 1:], without.new_mtp_cache(max_len=32))
        stored = with_mtp.draft_logits(hidden, tokens[:, 1:], with_mtp.new_mtp_cache(max_len=32))
        expected = reference(hidden, tokens[:, 1:])
    assert (loaded - stored).abs().max() <= 1e-5
    assert (loaded - expected).abs().max() <= 1e-3


def _refusal(tmp_path: Path, tensors: dict[str, torch.Tensor], model: Decoder) -> str:
    save_file(tensors, tmp_path / "bad.safetensors")
    with pytest.raises(MTPWeightsError) as error:
        load_mtp_weights(model, tmp_path / "bad.safetensors")
    message = str(error.value)
    assert "\n" not in message and model.mtp is None
    return message


def test_bad_files_are_refused_with_one_line(tmp_path: Path) -> None:
    reference, with_mtp, without = _models("qwen35", tmp_path)
    good = reference.checkpoint_tensors()

    assert "holds no mtp.*" in _refusal(tmp_path, {"lm_head.weight": torch.zeros(2, 2)}, without)
    missing = {k: v for k, v in good.items() if k != "mtp.fc.weight"}
    assert "no mtp.fc.weight" in _refusal(tmp_path, missing, without)
    wrong_shape = {**good, "mtp.fc.weight": torch.zeros(64, 64)}
    assert "mtp.fc.weight has shape (64, 64)" in _refusal(tmp_path, wrong_shape, without)
    extra = {**good, "mtp.layers.0.self_attn.q_proj.bias": torch.zeros(128)}
    assert "q_proj.bias" in _refusal(tmp_path, extra, without)
    second_layer = {**good, "mtp.layers.1.input_layernorm.weight": torch.zeros(64)}
    assert "more than one MTP layer" in _refusal(tmp_path, second_layer, without)

    save_file(good, tmp_path / "good.safetensors")
    with pytest.raises(MTPWeightsError, match="already holds an MTP block"):
        load_mtp_weights(with_mtp, tmp_path / "good.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    for unreadable in ("junk.safetensors", "absent.safetensors"):
        with pytest.raises(MTPWeightsError, match="can't read"):
            load_mtp_weights(without, tmp_path / unreadable)
