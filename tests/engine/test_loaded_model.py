"""load_model's warning when a CPU model's repacked weights can't run their float32 kernels."""

import logging
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from bubo.engine.loaded_model import load_model
from bubo.model import quantized_linear
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.model.test_decoder import CASES


@pytest.fixture
def packed_model_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The tiny model's matrices are below the packing threshold; lowered, its Q4_0 ones are repacked.
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    monkeypatch.setenv("BUBO_COMPILE_DECODE", "0")  # no compile: the warning is about the dtype alone
    reference = CASES["qwen2-bias"]()
    randomize_(reference, seed=3)
    return write_gguf(reference, tmp_path / "q4.gguf", quantize={"blk.*.ffn_up.weight": Q.Q4_0})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_cpu_model_with_packed_weights_is_warned_about(
    packed_model_path: Path, dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="bubo.engine.loaded_model"):
        loaded = load_model(packed_model_path, dtype=dtype)
    assert loaded.model.layers[0].mlp.up.packed is not None
    assert any(
        "float32 only" in r.getMessage() and "--dtype float32" in r.getMessage() for r in caplog.records
    )


def test_float32_is_not_warned_about(packed_model_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="bubo.engine.loaded_model"):
        load_model(packed_model_path)
    assert not [r for r in caplog.records if r.name == "bubo.engine.loaded_model"]


def test_a_narrower_cache_compiles_its_attention_at_load(tiny_llama_path: Path) -> None:
    """A float16 cache on a model the compiled step doesn't cover (float weights): the eager step's
    single-query kernel for it is compiled by the load, not by the first request."""
    from bubo.kernels import decode_attention

    loaded = load_model(tiny_llama_path, cache_dtypes=(torch.float16, torch.float16))
    config, pool = loaded.config, loaded.model.new_cache(max_len=4).pool
    assert pool.keys[0].dtype == pool.values[0].dtype == torch.float16
    wanted = ((1, config.num_kv_heads, -1, config.head_dim), 1, torch.float16)
    # A kernel's key: the options in force, then each argument's layout (q, keys, values).
    assert any(key[2] == key[3] == wanted for key in decode_attention._kernel._compiled)
