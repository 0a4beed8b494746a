"""What loading leaves resident: float tensors copied or mapped by size, no vocabulary lists twice."""

from pathlib import Path

import pytest
import torch

from bubo.engine.loaded_model import load_model
from bubo.gguf.reader import GGUFFile
from bubo.model import loader
from bubo.model.tokenizer import Tokenizer


def _in_map(t: torch.Tensor, f: GGUFFile) -> bool:
    base = next(iter(f.tensors.values())).raw.untyped_storage()
    return t.untyped_storage().data_ptr() == base.data_ptr()


def test_small_float_tensors_are_copied_out_of_the_map(tiny_llama_path: Path) -> None:
    loaded = load_model(tiny_llama_path)
    norms = [layer.attn_norm.weight for layer in loaded.model.layers] + [loaded.model.norm.weight]
    assert not any(_in_map(w, loaded.file) for w in norms)
    with GGUFFile(tiny_llama_path) as f:
        stored = f.tensors["blk.0.attn_norm.weight"].dequantize()
    assert torch.equal(loaded.model.layers[0].attn_norm.weight, stored)


def test_large_float_tensors_stay_in_the_map(tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "MIN_MAPPED_FLOAT_BYTES", 0)
    loaded = load_model(tiny_llama_path)
    assert _in_map(loaded.model.layers[0].attn_norm.weight, loaded.file)


def test_the_vocabulary_lives_only_in_the_tokenizer(tiny_llama_path: Path) -> None:
    loaded = load_model(tiny_llama_path)
    assert not any(
        key.startswith(("tokenizer.ggml.tokens", "tokenizer.ggml.merges")) for key in loaded.file.metadata
    )
    assert (
        "tokenizer.ggml.model" in loaded.file.metadata and "tokenizer.chat_template" in loaded.file.metadata
    )
    with GGUFFile(tiny_llama_path) as f:
        reference = Tokenizer.from_gguf(f.metadata)
    text = "Hello, world! <|im_start|>user"
    assert loaded.tokenizer.encode(text) == reference.encode(text)
