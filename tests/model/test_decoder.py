"""Bubo's decoder against transformers on tiny random models written to GGUF by the fixture writer.

transformers (float32, eager attention) is the reference. Every weight is random, norms included.
Each model is checked on a full-sequence prefill and on prefill -> a chunk at an offset ->
token-by-token decode through the KV cache; both must match within 1e-3 (measured: at most 2.3e-6).
"""

import copy
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from bubo.gguf.config import config_from_gguf
from bubo.gguf.model_config import RopeStyle
from bubo.gguf.reader import GGUFError, GGUFFile
from bubo.model import loader
from bubo.model.decoder import Decoder
from bubo.model.layers import apply_rotary
from bubo.model.loader import load_decoder
from bubo.model.quantized_linear import QuantizedEmbedding, QuantizedLinear
from tests.fixtures.gguf_writer import randomize_, write_gguf

TOLERANCE = 1e-3  # fp32 Bubo vs fp32 transformers (TESTING.md); measured max is 2.3e-6
HALF_CACHE_TOLERANCE = 3e-2  # the same with float16 keys and bfloat16 values cached; measured max 1.2e-2
SEQ_LEN = 14
BATCH = 2

_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "rms_norm_eps": 1e-6,
}
# Small original contexts put the test's positions (< 20) where the scalings change the frequencies.
_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}

# name -> (model class, config); every feature the decoder supports appears at least once.
CASES: dict[str, Callable[[], PreTrainedModel]] = {
    "llama-tied": lambda: LlamaForCausalLM(LlamaConfig(**_SIZES, tie_word_embeddings=True)),
    "llama-untied-llama3-rope": lambda: LlamaForCausalLM(
        LlamaConfig(**_SIZES, tie_word_embeddings=False, rope_parameters=_LLAMA3)
    ),
    "llama-linear-rope": lambda: LlamaForCausalLM(
        LlamaConfig(**_SIZES, rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0})
    ),
    "qwen2-bias": lambda: Qwen2ForCausalLM(Qwen2Config(**_SIZES, tie_word_embeddings=False)),
    "qwen2-yarn-rope": lambda: Qwen2ForCausalLM(
        Qwen2Config(**_SIZES, tie_word_embeddings=True, rope_parameters=_YARN, max_position_embeddings=128)
    ),
    # head_dim 32 != hidden / heads, as in real Qwen3 models
    "qwen3-qk-norm": lambda: Qwen3ForCausalLM(Qwen3Config(**_SIZES, head_dim=32, tie_word_embeddings=True)),
}

# Quantized variants: block types on the matrices (the tied embedding included), F16/BF16 floats.
_MATRICES_Q = {
    "token_embd.weight": Q.Q8_0,
    "output.weight": Q.Q8_0,
    "blk.*.attn_q.weight": Q.Q4_0,
    "blk.*.attn_k.weight": Q.Q8_0,
    "blk.*.attn_v.weight": Q.BF16,
    "blk.*.attn_output.weight": Q.Q4_0,
    "blk.*.ffn_gate.weight": Q.Q4_0,
    "blk.*.ffn_up.weight": Q.Q8_0,
    "blk.*.ffn_down.weight": Q.F16,
}
QUANT_CASES = ["llama-tied", "qwen2-bias", "qwen3-qk-norm"]


def _reference(name: str, seed: int = 0) -> PreTrainedModel:
    model = CASES[name]()
    model.config._attn_implementation = "eager"
    randomize_(model, seed=seed)
    return model.eval()


def _tokens(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def _load(path: Path, dtype: torch.dtype = torch.float32) -> tuple[GGUFFile, Decoder]:
    f = GGUFFile(path)
    return f, load_decoder(f, config_from_gguf(f), dtype=dtype)


@torch.no_grad()
def _prefill(model: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens, model.new_cache(batch=tokens.shape[0], max_len=32))


@torch.no_grad()
def _stepwise(model: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    """Prefill 5 tokens, then a 4-token chunk at offset 5 (the offset causal mask), then one at a time."""
    cache = model.new_cache(batch=tokens.shape[0], max_len=32)
    pieces = [model(tokens[:, :5], cache), model(tokens[:, 5:9], cache)]
    pieces += [model(tokens[:, i : i + 1], cache) for i in range(9, tokens.shape[1])]
    assert cache.length == tokens.shape[1]
    return torch.cat(pieces, dim=1)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _check_against_reference(reference: PreTrainedModel, model: Decoder, label: str) -> None:
    tokens = _tokens(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference(tokens).logits
    full, stepwise = _prefill(model, tokens), _stepwise(model, tokens)
    assert full.dtype == torch.float32 and full.shape == expected.shape
    d_full, d_step = _max_diff(full, expected), _max_diff(stepwise, expected)
    print(f"{label}: max|Δlogit| prefill {d_full:.2e}, cached decode {d_step:.2e}")
    assert d_full <= TOLERANCE
    assert d_step <= TOLERANCE


@pytest.mark.parametrize("name", CASES)
def test_matches_transformers(name: str, tmp_path: Path) -> None:
    reference = _reference(name)
    _, model = _load(write_gguf(reference, tmp_path / f"{name}.gguf"))
    _check_against_reference(reference, model, name)


@pytest.mark.parametrize("name", ["llama-tied", "qwen3-qk-norm"])
def test_half_precision_cache_tracks_transformers(name: str, tmp_path: Path) -> None:
    """Keys stored in float16 and values in bfloat16 (`--cache-type-k f16 --cache-type-v bf16`) under
    float32 compute: every read widens them, so the logits stay within the half types' rounding of
    transformers' float32 ones. One sequence: its decode steps take the CPU's single-query kernel, its
    second chunk SDPA over the widened cache under the offset causal mask."""
    reference = _reference(name)
    _, model = _load(write_gguf(reference, tmp_path / f"{name}.gguf"))
    model.cache_dtypes = (torch.float16, torch.bfloat16)
    pool = model.new_cache(max_len=8).pool
    assert (pool.keys[0].dtype, pool.values[0].dtype) == (torch.float16, torch.bfloat16)
    tokens = _tokens(reference.config.vocab_size)[:1]
    with torch.no_grad():
        expected = reference(tokens).logits
    d_full, d_step = (
        _max_diff(_prefill(model, tokens), expected),
        _max_diff(_stepwise(model, tokens), expected),
    )
    print(f"{name}: max|Δlogit| prefill {d_full:.2e}, cached decode {d_step:.2e}")
    assert d_full <= HALF_CACHE_TOLERANCE
    assert d_step <= HALF_CACHE_TOLERANCE


@pytest.mark.parametrize("name", CASES)
def test_last_only_prefill_matches_transformers_and_fills_the_cache(name: str, tmp_path: Path) -> None:
    """A last_only pass runs the last layer's query, attention and MLP on the last position alone: its
    logits, and the cache it leaves (read back by the following chunk and decode steps), match the
    reference's."""
    reference = _reference(name)
    _, model = _load(write_gguf(reference, tmp_path / f"{name}.gguf"))
    tokens = _tokens(reference.config.vocab_size)
    cache = model.new_cache(batch=BATCH, max_len=32)
    with torch.no_grad():
        expected = reference(tokens).logits
        first = model(tokens[:, :5], cache, last_only=True)  # from an empty cache
        second = model(tokens[:, 5:9], cache, last_only=True)  # after 5 cached positions
        steps = [model(tokens[:, i : i + 1], cache) for i in range(9, tokens.shape[1])]
    assert first.shape == second.shape == (BATCH, 1, reference.config.vocab_size)
    assert _max_diff(first, expected[:, 4:5]) <= TOLERANCE
    assert _max_diff(second, expected[:, 8:9]) <= TOLERANCE
    assert _max_diff(torch.cat(steps, dim=1), expected[:, 9:]) <= TOLERANCE


def test_float_weights_in_the_compute_dtype_stay_in_the_memory_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reference's weights are all small, which the loader copies (tests/model/test_loader_memory.py).
    monkeypatch.setattr(loader, "MIN_MAPPED_FLOAT_BYTES", 0)
    path = write_gguf(_reference("llama-untied-llama3-rope"), tmp_path / "f32.gguf")
    f, model = _load(path)
    assert model.norm.weight.data_ptr() == f.tensors["output_norm.weight"].raw.data_ptr()
    assert model.output.weight.data_ptr() == f.tensors["output.weight"].raw.data_ptr()
    _, converted = _load(path, dtype=torch.bfloat16)  # another dtype needs its own copy
    assert converted.norm.weight.data_ptr() != f.tensors["output_norm.weight"].raw.data_ptr()


@pytest.mark.parametrize("name", QUANT_CASES)
def test_quantized_weights_match_dequantized_reference(name: str, tmp_path: Path) -> None:
    reference = _reference(name)
    # The writer swaps the reference's weights for their dequantized values, so it stays exact.
    path = write_gguf(reference, tmp_path / f"{name}-q.gguf", quantize=_MATRICES_Q)
    f, model = _load(path)
    attention = model.layers[0].attention
    assert isinstance(attention.q_proj, QuantizedLinear)
    assert isinstance(attention.v_proj, torch.nn.Linear)  # BF16: a plain parameter in the compute dtype
    assert isinstance(model.embedding, QuantizedEmbedding)
    # Zero-copy: the quantized weight is the memory map's bytes, not a copy.
    assert attention.q_proj.raw.data_ptr() == f.tensors["blk.0.attn_q.weight"].raw.data_ptr()
    if model.config.tie_word_embeddings:
        assert isinstance(model.output, QuantizedLinear)
        assert model.output.raw.data_ptr() == model.embedding.raw.data_ptr()
    _check_against_reference(reference, model, f"{name} quantized")


def test_fixture_file_reads_the_same_in_transformers(tmp_path: Path) -> None:
    """The fixture writes what the ecosystem expects: transformers' own GGUF loader (which undoes
    llama's q/k permutation itself) rebuilds the same model from the file. Only where its GGUF
    config mapping can: it ignores llama3's rope_freqs, the rope scaling keys and qwen3's
    attention.key_length (it assumes head_dim 128)."""
    for name in ("llama-tied", "qwen2-bias"):
        reference = _reference(name)
        write_gguf(reference, tmp_path / f"{name}.gguf")
        reloaded = AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=f"{name}.gguf", dtype=torch.float32
        )
        tokens = _tokens(reference.config.vocab_size)
        with torch.no_grad():
            assert _max_diff(reloaded(tokens).logits, reference(tokens).logits) <= 1e-5, name


# Half precision rounds every activation to 8 (bf16) or 11 (fp16) mantissa bits. The yardstick is
# transformers itself run in that dtype: its logits move from its fp32 ones by 0.04-0.07 (bf16) and
# 0.006-0.008 (fp16) on these models (|logit| up to ~3.5); Bubo's by 0.05-0.065 and ~0.0055, a
# ratio of at most 1.5. Bubo may be at most twice as far off as transformers is.
HALF_PRECISION_SLACK = 2.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["llama-tied", "qwen3-qk-norm"])
def test_half_precision_stays_close(name: str, dtype: torch.dtype, tmp_path: Path) -> None:
    reference = _reference(name)
    path = write_gguf(reference, tmp_path / f"{name}.gguf", quantize={"blk.*.ffn_up.weight": Q.Q8_0})
    _, model = _load(path, dtype=dtype)
    tokens = _tokens(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference(tokens).logits
        yardstick = _max_diff(copy.deepcopy(reference).to(dtype)(tokens).logits.float(), expected)
    full, stepwise = _prefill(model, tokens), _stepwise(model, tokens)
    assert full.dtype == torch.float32
    d_full, d_step = _max_diff(full, expected), _max_diff(stepwise, expected)
    print(
        f"{name} {dtype}: max|Δlogit| prefill {d_full:.2e}, decode {d_step:.2e}; transformers {yardstick:.2e}"
    )
    assert d_full <= HALF_PRECISION_SLACK * yardstick
    assert d_step <= HALF_PRECISION_SLACK * yardstick


@pytest.mark.parametrize("style", list(RopeStyle))
def test_partial_rotary_passes_the_tail_through(style: RopeStyle) -> None:
    """rope_dim < head_dim (llama.cpp's n_rot): the first rope_dim dims rotate as a whole head would."""
    x = torch.randn(1, 2, 5, 24)
    angles = torch.arange(5.0)[:, None] * torch.rand(8)[None, :]
    out = apply_rotary(x, angles.cos(), angles.sin(), style)
    assert torch.equal(out[..., 16:], x[..., 16:])
    assert torch.equal(out[..., :16], apply_rotary(x[..., :16], angles.cos(), angles.sin(), style))
    assert not torch.allclose(out[..., :16], x[..., :16])


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield write_gguf(_reference("llama-tied"), tmp_path_factory.mktemp("llama") / "llama.gguf")


def test_llama_uses_interleaved_rope_and_qwen_neox(llama_file: Path, tmp_path: Path) -> None:
    assert config_from_gguf(GGUFFile(llama_file)).rope_style == RopeStyle.INTERLEAVED
    qwen = write_gguf(_reference("qwen2-bias"), tmp_path / "qwen2.gguf")
    assert config_from_gguf(GGUFFile(qwen)).rope_style == RopeStyle.NEOX


def test_truncated_cache_replays_the_same_logits(llama_file: Path) -> None:
    _, model = _load(llama_file)
    tokens = _tokens(300)
    cache = model.new_cache(batch=BATCH, max_len=SEQ_LEN)
    with torch.no_grad():
        first = model(tokens, cache)
        cache.truncate(6)
        again = model(tokens[:, 6:], cache)
    assert cache.length == SEQ_LEN
    assert _max_diff(again, first[:, 6:]) <= 1e-5
    cache.reset()
    assert cache.length == 0


def test_last_only_returns_the_last_position(llama_file: Path) -> None:
    _, model = _load(llama_file)
    tokens = _tokens(300)
    with torch.no_grad():
        full = model(tokens, model.new_cache(batch=BATCH, max_len=SEQ_LEN))
        last = model(tokens, model.new_cache(batch=BATCH, max_len=SEQ_LEN), last_only=True)
    assert last.shape == (BATCH, 1, 300)
    # The last layer runs its query, attention and MLP on one row there (other kernels, another order of
    # fp32 sums): a few ulps of logits near 2 apart, 1.2e-6 seen.
    assert _max_diff(last, full[:, -1:]) <= 1e-5


def test_cache_overflow_is_an_error(llama_file: Path) -> None:
    _, model = _load(llama_file)
    cache = model.new_cache(batch=BATCH, max_len=8)
    with torch.no_grad(), pytest.raises(ValueError, match="KV cache full"):
        model(_tokens(300), cache)
    assert cache.length == 0
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(3)


def test_default_cache_spans_the_context(llama_file: Path) -> None:
    _, model = _load(llama_file)
    cache = model.new_cache()
    assert cache.max_len == model.config.context_length
    pool = cache.pool
    assert pool.num_blocks * pool.block_size >= model.config.context_length
    assert pool.keys[0].shape == (2, pool.num_blocks * pool.block_size, 16)


def test_missing_tensor_is_named(llama_file: Path) -> None:
    f = GGUFFile(llama_file)
    config = dataclasses.replace(config_from_gguf(f), num_layers=3)
    with pytest.raises(GGUFError, match=r"missing tensor 'blk\.2\.attn_norm\.weight'"):
        load_decoder(f, config)


def test_wrong_shape_names_tensor_and_both_shapes(llama_file: Path) -> None:
    f = GGUFFile(llama_file)
    config = dataclasses.replace(config_from_gguf(f), intermediate_size=96)
    with pytest.raises(
        GGUFError, match=r"'blk\.0\.ffn_gate\.weight' has shape \(128, 64\), expected \(96, 64\)"
    ):
        load_decoder(f, config)


def test_unused_tensors_are_an_error(llama_file: Path) -> None:
    f = GGUFFile(llama_file)
    config = dataclasses.replace(config_from_gguf(f), num_layers=1)
    with pytest.raises(GGUFError, match=r"not used by the llama model: blk\.1\."):
        load_decoder(f, config)


def test_progress_bar_counts_tensors(llama_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = GGUFFile(llama_file)
    load_decoder(f, config_from_gguf(f), progress=True)
    err = capsys.readouterr().err
    assert "Loading weights" in err
    assert f"{len(f.tensors)}/{len(f.tensors)}" in err


def test_rejects_unsupported_dtype(llama_file: Path) -> None:
    f = GGUFFile(llama_file)
    with pytest.raises(ValueError, match="compute dtype"):
        load_decoder(f, config_from_gguf(f), dtype=torch.float64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runs_on_cuda(tmp_path: Path) -> None:
    reference = _reference("qwen3-qk-norm")
    path = write_gguf(reference, tmp_path / "q.gguf", quantize={"blk.*.ffn_[gud]*.weight": Q.Q4_0})
    f = GGUFFile(path)
    model = load_decoder(f, config_from_gguf(f), device="cuda")
    tokens = _tokens(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference(tokens).logits
        got = model(tokens.cuda(), model.new_cache(batch=BATCH, max_len=32)).cpu()
    assert _max_diff(got, expected) <= TOLERANCE
