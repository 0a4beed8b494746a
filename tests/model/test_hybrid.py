"""The hybrid Qwen models end to end: qwen35, qwen35moe and qwen3next against transformers.

Tiny random models (float32, eager attention, 4 layers alternating Gated DeltaNet and gated full
attention, every parameter random: A_log, dt_bias, conv, every norm, router and shared-expert gate
included) are written to GGUF by the fixture writer, the converter's transforms applied (tiled value
heads for the qwen35 family, grouped and a fused ssm_ba for qwen3next, +1 on the zero-centred norms),
and loaded by Bubo: a 64-token prefill, then 32 single-token decode steps through the hybrid cache,
each compared with transformers' full-sequence logits at the same positions. Then the same with
Q8_0 projections (the reference holds their dequantized values), and greedy generation through
`generate()` (also reusing its cache for a longer prompt), and a 1-D shared-expert gate (bitwise
the same logits). Measured max |Δlogit|: prefill 3e-5 to 6e-5, cached decode 3e-5 to 1.1e-4
(qwen3next the largest), Q8_0 alike; tolerance 1e-3.
"""

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import (
    PreTrainedModel,
)

from bubo.engine.generate import GenerationResult, generate
from bubo.engine.loaded_model import load_model
from bubo.engine.sampler import SamplingParams
from bubo.gguf.config import config_from_gguf
from bubo.gguf.model_config import MlpKind, ValueHeadOrder
from bubo.gguf.reader import GGUFFile
from bubo.model.attention import Attention
from bubo.model.decoder import Decoder
from bubo.model.decoder_layer import DeltaNetMixer
from bubo.model.loader import load_decoder
from bubo.model.moe import SparseMoE
from bubo.model.quantized_linear import QuantizedLinear
from tests.fixtures.compare import prefill_and_decode_deltas
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.fixtures.hybrid_models import HYBRID_SIZES, tiny_hybrid

TOLERANCE = 1e-3  # fp32 Bubo vs fp32 transformers (TESTING.md)
HALF_CACHE_TOLERANCE = 3e-2  # the same over a float16 KV cache; measured max 7.0e-3
PREFILL, DECODE, BATCH = 64, 32, 2
ARCHS = ["qwen35", "qwen35moe", "qwen3next"]
LAYER_TYPES = ["linear_attention", "full_attention"] * 2

# 32 = one Q8_0 block, so the qwen35 value-head reorder of ssm_out's columns moves whole blocks
_SIZES = {"linear_value_head_dim": 32, "max_position_embeddings": PREFILL + DECODE}
VOCAB, HIDDEN = HYBRID_SIZES["vocab_size"], HYBRID_SIZES["hidden_size"]

_PROJECTIONS_Q8 = {
    pattern: Q.Q8_0
    for pattern in (
        "blk.*.attn_q.weight",
        "blk.*.attn_k.weight",
        "blk.*.attn_v.weight",
        "blk.*.attn_output.weight",
        "blk.*.attn_qkv.weight",
        "blk.*.attn_gate.weight",
        "blk.*.ssm_beta.weight",
        "blk.*.ssm_alpha.weight",
        "blk.*.ssm_ba.weight",
        "blk.*.ssm_out.weight",
        "blk.*.ffn_*.weight",
        "output.weight",
    )
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(arch: str) -> PreTrainedModel:
    model = tiny_hybrid(arch, LAYER_TYPES, **_SIZES)
    randomize_(model)
    return model


def _tokens(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, length), generator=torch.Generator().manual_seed(seed))


def _load(path: Path) -> Decoder:
    f = GGUFFile(path)
    return load_decoder(f, config_from_gguf(f))


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_plan_and_parts(arch: str, tmp_path: Path) -> None:
    model = _load(write_gguf(_reference(arch), tmp_path / "model.gguf"))
    c = model.config
    assert c.architecture == arch and c.recurrent_layers == (True, False, True, False)
    assert c.deltanet is not None
    assert c.deltanet.value_head_order == (
        ValueHeadOrder.GROUPED if arch == "qwen3next" else ValueHeadOrder.TILED
    )
    assert c.mrope_sections == (None if arch == "qwen3next" else (2, 1, 1))
    assert c.mlp_kind == (MlpKind.DENSE if arch == "qwen35" else MlpKind.SPARSE_MOE_SHARED)
    mixers = [layer.attention for layer in model.layers]
    assert [type(m) for m in mixers] == [DeltaNetMixer, Attention] * 2
    # each kind of layer counts its own cache slots
    assert [m.state_index for m in mixers[0::2]] == [0, 1]
    assert [m.layer_index for m in mixers[1::2]] == [0, 1]
    assert all(m.output_gate for m in mixers[1::2])
    if arch != "qwen35":
        assert all(
            isinstance(layer.mlp, SparseMoE) and layer.mlp.shared_expert is not None for layer in model.layers
        )
    cache = model.new_cache(max_len=8)
    assert cache.num_layers == 2 and len(cache.recurrent) == 2 and not cache.can_rewind


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(arch: str, tmp_path: Path) -> None:
    reference = _reference(arch)
    model = _load(write_gguf(reference, tmp_path / "model.gguf"))
    d_prefill, d_decode = prefill_and_decode_deltas(reference, model, _tokens(PREFILL + DECODE), PREFILL)
    print(f"{arch}: max|Δlogit| prefill {d_prefill:.2e}, cached decode {d_decode:.2e}")
    assert d_prefill <= TOLERANCE and d_decode <= TOLERANCE


def test_a_float16_cache_tracks_transformers(tmp_path: Path) -> None:
    """Gated attention over float16 keys and values (`bubo serve`'s default cache), one sequence: its
    decode steps take the CPU's single-query kernel; the logits stay within float16's rounding."""
    reference = _reference("qwen35")
    model = _load(write_gguf(reference, tmp_path / "model.gguf"))
    model.cache_dtypes = (torch.float16, torch.float16)
    tokens = _tokens(PREFILL + DECODE)[:1]
    d_prefill, d_decode = prefill_and_decode_deltas(reference, model, tokens, PREFILL)
    print(f"qwen35, float16 cache: max|Δlogit| prefill {d_prefill:.2e}, cached decode {d_decode:.2e}")
    assert d_prefill <= HALF_CACHE_TOLERANCE and d_decode <= HALF_CACHE_TOLERANCE


def test_qwen3next_with_a_fused_ssm_in_matches_transformers(tmp_path: Path) -> None:
    """Files from llama.cpp's first Qwen3Next converter keep in_proj_qkvz whole as `ssm_in`."""
    reference = _reference("qwen3next")
    path = write_gguf(reference, tmp_path / "fused.gguf", fused_qkvz=True)
    assert (
        "blk.0.ssm_in.weight" in GGUFFile(path).tensors
        and "blk.0.attn_qkv.weight" not in GGUFFile(path).tensors
    )
    model = _load(path)
    assert model.layers[0].attention.deltanet.ssm_in is not None
    d_prefill, d_decode = prefill_and_decode_deltas(reference, model, _tokens(PREFILL + DECODE), PREFILL)
    assert d_prefill <= TOLERANCE and d_decode <= TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_projections_match_transformers(arch: str, tmp_path: Path) -> None:
    reference = _reference(arch)
    model = _load(write_gguf(reference, tmp_path / "q8.gguf", quantize=_PROJECTIONS_Q8))
    deltanet = model.layers[0].attention.deltanet
    assert isinstance(deltanet.attn_qkv, QuantizedLinear) and isinstance(deltanet.ssm_out, QuantizedLinear)
    assert isinstance(model.layers[1].attention.q_proj, QuantizedLinear)
    d_prefill, d_decode = prefill_and_decode_deltas(reference, model, _tokens(PREFILL + DECODE), PREFILL)
    print(f"{arch} Q8_0: max|Δlogit| prefill {d_prefill:.2e}, cached decode {d_decode:.2e}")
    assert d_prefill <= TOLERANCE and d_decode <= TOLERANCE


@pytest.mark.parametrize("quantize", [None, _PROJECTIONS_Q8], ids=["f32", "q8_0"])
def test_vector_shared_expert_gate(quantize: dict[str, Q] | None, tmp_path: Path) -> None:
    """llama-quantize leaves ffn_gate_inp_shexp 1-D [H] (qwen4exp.md section 5): same logits as [1, H]."""
    reference = _reference("qwen35moe")
    gate = "blk.*.ffn_gate_inp_shexp.weight"
    matrix = write_gguf(reference, tmp_path / "matrix.gguf", quantize=quantize)
    vector = write_gguf(reference, tmp_path / "vector.gguf", quantize=quantize, vectors=(gate,))
    assert GGUFFile(vector).tensors["blk.0.ffn_gate_inp_shexp.weight"].shape == (HIDDEN,)
    logits = []
    for path in (matrix, vector):
        model = _load(path)
        with torch.no_grad():
            logits.append(model(_tokens(PREFILL), model.new_cache(batch=BATCH, max_len=PREFILL)))
    assert torch.equal(logits[0], logits[1])


def test_recurrent_cache_resets_but_does_not_rewind(tmp_path: Path) -> None:
    model = _load(write_gguf(_reference("qwen35"), tmp_path / "model.gguf"))
    tokens = _tokens(8)[:1]
    cache = model.new_cache(max_len=16)
    with torch.no_grad():
        first = model(tokens, cache)
        with pytest.raises(ValueError, match="can't be rewound"):
            cache.truncate(4)
        cache.truncate(8)  # keeping everything is fine
        assert cache.length == 8
        cache.truncate(0)
        assert all(not s.recurrent_state.any() and not s.conv_state.any() for s in cache.recurrent)
        again = model(tokens, cache)
    assert torch.equal(first, again)


def _greedy_reference(reference: PreTrainedModel, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_generate_is_greedy_transformers(arch: str, tmp_path: Path) -> None:
    reference = _reference(arch)
    loaded = load_model(write_gguf(reference, tmp_path / "model.gguf"))
    try:
        prompt = _tokens(20)[0].tolist()
        params = SamplingParams(temperature=0.0, max_tokens=12)
        result = list(generate(loaded.model, loaded.tokenizer, prompt, params))[-1]
        assert isinstance(result, GenerationResult)
        expected = _greedy_reference(reference, prompt, 12)
        stop = next((i for i, t in enumerate(expected) if t in loaded.tokenizer.stop_ids), len(expected) - 1)
        assert result.token_ids == expected[: stop + 1]

        # A cache reused for a longer prompt continues its recurrent state instead of recomputing it.
        cache = loaded.model.new_cache(max_len=64)
        list(generate(loaded.model, loaded.tokenizer, prompt, params, cache=cache))
        longer = prompt + result.token_ids[:-1] + [5, 6]
        reused = list(generate(loaded.model, loaded.tokenizer, longer, params, cache=cache))[-1]
        fresh = list(generate(loaded.model, loaded.tokenizer, longer, params))[-1]
        assert isinstance(reused, GenerationResult) and isinstance(fresh, GenerationResult)
        assert reused.cached_tokens == len(prompt) + len(result.token_ids) - 1
        assert reused.token_ids == fresh.token_ids
    finally:
        loaded.file.close()
