"""One tiny random Qwen3.5 vision-language model per session, written as a projector GGUF, a Hugging Face
checkpoint and (its text model) a qwen35 GGUF."""

from pathlib import Path

import pytest
from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

from tests.fixtures.gguf_writer import write_gguf
from tests.fixtures.mmproj_writer import (
    text_model_of,
    tiny_vision_language_model,
    write_checkpoint,
    write_mmproj,
)


@pytest.fixture(scope="session")
def vl_model() -> Qwen3_5ForConditionalGeneration:
    return tiny_vision_language_model(seed=3)


@pytest.fixture(scope="session")
def vl_files(
    vl_model: Qwen3_5ForConditionalGeneration, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vl")
    text = text_model_of(vl_model, Qwen3_5ForCausalLM)
    return {
        "mmproj": write_mmproj(vl_model, folder / "mmproj.gguf"),
        "checkpoint": write_checkpoint(vl_model, folder / "checkpoint"),
        "text": write_gguf(text, folder / "text.gguf"),
    }
