"""qwen4exp (Qwen3.8-Flash-Next) end to end from GGUF against transformers' Qwen4ExpForCausalLM.

The reference is the spec's unit-test config (section 7.1: 8 layers, GDN with 2 value heads per key
head, QSA every 4th layer with a budget of 2 blocks of 4 so selection drops blocks from position 11,
4 hyper-connected streams, PLE on layer 1 (0-based), 3-of-8 experts with a gated shared expert),
float32, eager attention, every parameter random: the (1 + w) norms, A_log, dt_bias, the gated norm,
the indexer, the hyper-connections and the PLE table and conv, which transformers' init leaves inert
(spec 7.1). It is written to GGUF with llama.cpp's names and transforms (tests/fixtures/qwen4exp_gguf.py)
and loaded by Bubo: a 64-token prefill, then 32 single-token decode steps through the cache, each
compared with transformers' full-sequence logits at the same positions. Sequences hold EOS tokens so
the PLE's n-gram context is cut mid-sequence. Measured max |Δlogit|: prefill 2.4e-5, cached decode
4.3e-5 (the all-zero-ratio file against a dense reference: 2.3e-5, 2.5e-5); tolerance 1e-3. ~10 s.
"""

import re
from pathlib import Path

import pytest
import torch
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

from bubo import cli
from bubo.engine.generate import GenerationResult, generate
from bubo.engine.loaded_model import load_model
from bubo.engine.sampler import SamplingParams
from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFError, GGUFFile
from bubo.model.attention import Attention
from bubo.model.decoder import Decoder
from bubo.model.decoder_layer import DeltaNetMixer, HyperConnectedLayer, IndexedAttentionMixer
from bubo.model.hyper_connections import StreamMixer
from bubo.model.loader import load_decoder
from bubo.model.state import KVCache
from tests.fixtures.compare import prefill_and_decode_deltas
from tests.fixtures.gguf_writer import randomize_
from tests.fixtures.qwen4exp_gguf import TINY_QWEN4EXP_CONFIG, write_qwen4exp_gguf

TOLERANCE = 1e-3  # fp32 Bubo vs fp32 transformers (TESTING.md)
PREFILL, DECODE, BATCH = 64, 32, 2
EOS = 1792
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
QSA_LAYERS = [3, 7]


pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(**overrides: object) -> Qwen4ExpForCausalLM:
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**{**TINY_QWEN4EXP_CONFIG, **overrides}))
    model.config._attn_implementation = "eager"
    randomize_(model)  # every parameter; the 1-D norm gammas (incl. the (1 + w) ones) around 1
    return model.eval()


@pytest.fixture(scope="module")
def reference() -> Qwen4ExpForCausalLM:
    return _reference()


@pytest.fixture(scope="module")
def gguf_path(reference: Qwen4ExpForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen4exp_gguf(reference, tmp_path_factory.mktemp("qwen4exp") / "model.gguf")


def _load(path: Path) -> Decoder:
    f = GGUFFile(path)
    return load_decoder(f, config_from_gguf(f))


def _tokens(seed: int = 1) -> torch.Tensor:
    """[BATCH, PREFILL + DECODE] random ids with EOS at chosen places."""
    shape = (BATCH, PREFILL + DECODE)
    tokens = torch.randint(
        0, TINY_QWEN4EXP_CONFIG["vocab_size"], shape, generator=torch.Generator().manual_seed(seed)
    )
    tokens[0, [5, 6, 40]] = EOS  # two in a row, and one that cuts a context mid-sequence
    tokens[1, [0, PREFILL + 3]] = EOS  # at the start, and in the decode part
    return tokens


def test_config_and_layer_plan(gguf_path: Path) -> None:
    model = _load(gguf_path)
    c = model.config
    assert c.architecture == "qwen4exp" and c.hc_count == 4 and c.hc_low_rank == 16
    assert c.recurrent_layers == tuple(kind == "linear_attention" for kind in LAYER_TYPES)
    assert c.deltanet is not None and c.deltanet.gate_activation == "sigmoid"
    assert c.indexer is not None and c.indexer.budget == 8
    assert c.indexer.compress_ratios == tuple(4 if i in QSA_LAYERS else 0 for i in range(8))
    assert c.ple is not None and c.ple.layer == 1 and c.ple.table_dim == 16 and c.ple.eos_token_id == EOS
    assert c.mrope_sections == (2, 1, 1) and c.rope_dim == 8
    assert all(isinstance(layer, HyperConnectedLayer) for layer in model.layers)
    assert [type(layer.attention) for layer in model.layers] == [
        IndexedAttentionMixer if i in QSA_LAYERS else DeltaNetMixer for i in range(8)
    ]
    assert [i for i, layer in enumerate(model.layers) if layer.ple is not None] == [1]
    assert isinstance(model.norm, StreamMixer)

    cache = model.new_cache(batch=BATCH, max_len=16)
    assert cache.num_layers == 2 and len(cache.recurrent) == 6 and len(cache.indexers) == 2
    assert cache.ple is not None and not cache.can_rewind


def test_ple_table_stays_memory_mapped(gguf_path: Path) -> None:
    f = GGUFFile(gguf_path)
    model = load_decoder(f, config_from_gguf(f))
    table = model.layers[1].ple.embedding.table
    stored = f.tensors["per_layer_token_embd.weight"].raw
    # a view of the file's bytes, not a copy
    assert table.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr()
    assert table.shape == (256, 16)


def test_matches_transformers(reference: Qwen4ExpForCausalLM, gguf_path: Path) -> None:
    d_prefill, d_decode = prefill_and_decode_deltas(reference, _load(gguf_path), _tokens(), PREFILL)
    print(f"qwen4exp: max|Δlogit| prefill {d_prefill:.2e}, cached decode {d_decode:.2e}")
    assert d_prefill <= TOLERANCE and d_decode <= TOLERANCE


def test_a_float16_cache_is_the_float32_one_with_its_keys_and_values_rounded(
    gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QSA layers over float16 keys and values (`bubo serve`'s default cache) compute exactly what the
    float32 cache computes when every key and value written is first rounded to float16. (Against
    transformers this tiny model moves by up to 0.6 a logit: its block selection flips on keys rounded
    to 11 bits, as it would on any perturbation of that size.)"""
    model = _load(gguf_path)
    tokens = _tokens()[:, :PREFILL]
    with torch.no_grad():
        model.cache_dtypes = (torch.float16, torch.float16)
        narrow = model(tokens, model.new_cache(batch=BATCH, max_len=PREFILL))
        model.cache_dtypes = (torch.float32, torch.float32)
        write = KVCache.write

        def rounded(cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            write(cache, layer, k.half().float(), v.half().float())

        monkeypatch.setattr(KVCache, "write", rounded)
        emulated = model(tokens, model.new_cache(batch=BATCH, max_len=PREFILL))
    assert torch.equal(narrow, emulated)


def test_reset_cache_repeats_the_prompt(gguf_path: Path) -> None:
    model = _load(gguf_path)
    tokens = _tokens()[:, :20]
    cache: KVCache = model.new_cache(batch=BATCH, max_len=24)
    with torch.no_grad():
        first = model(tokens, cache)
        with pytest.raises(ValueError, match="can't be rewound"):
            cache.truncate(8)
        cache.truncate(0)
        assert all(s.length == 0 for s in cache.indexers)
        again = model(tokens, cache)
    assert torch.equal(first, again)


def test_all_zero_compress_ratios_warn_and_run_dense(tmp_path: Path) -> None:
    """Spec 2.3: a converter under transformers >= 5.23 writes every ratio 0; llama.cpp then runs the
    QSA layers as dense gated attention, and so must Bubo, which matches transformers with a budget
    that covers the whole sequence."""
    sparse = _reference()
    path = write_qwen4exp_gguf(
        sparse, tmp_path / "dense.gguf", metadata_overrides={"qwen4exp.attention.compress_ratios": [0] * 8}
    )
    f = GGUFFile(path)
    with pytest.warns(UserWarning, match=r"compress_ratios' is 0 on attention layers \[3, 7\]"):
        config = config_from_gguf(f)
    model = load_decoder(f, config)
    assert [type(model.layers[i].attention) for i in QSA_LAYERS] == [Attention, Attention]
    assert all(model.layers[i].attention.output_gate for i in QSA_LAYERS)

    dense = _reference(indexer_budget=PREFILL + DECODE)  # a budget >= T selects every block
    dense.load_state_dict(sparse.state_dict())
    with torch.no_grad():  # the selection matters: the sparse model's logits are not these
        assert (dense(_tokens()).logits - sparse(_tokens()).logits).abs().max() > 100 * TOLERANCE
    d_prefill, d_decode = prefill_and_decode_deltas(dense, model, _tokens(), PREFILL)
    print(f"qwen4exp dense file: max|Δlogit| prefill {d_prefill:.2e}, cached decode {d_decode:.2e}")
    assert d_prefill <= TOLERANCE and d_decode <= TOLERANCE


@pytest.mark.parametrize(
    "key",
    [
        "hyper_connection.count",
        "attention.indexer.top_k",
        "attention.compress_ratios",
        "ple.layer_multipliers",
    ],
)
def test_missing_key_is_named(reference: Qwen4ExpForCausalLM, key: str, tmp_path: Path) -> None:
    path = write_qwen4exp_gguf(reference, tmp_path / "bad.gguf", metadata_overrides={f"qwen4exp.{key}": None})
    with pytest.raises(GGUFError, match=f"missing required metadata key 'qwen4exp.{key}'"):
        config_from_gguf(GGUFFile(path))


def test_ple_on_an_attention_layer_is_refused(reference: Qwen4ExpForCausalLM, tmp_path: Path) -> None:
    path = write_qwen4exp_gguf(
        reference, tmp_path / "bad.gguf", metadata_overrides={"qwen4exp.ple.layers": [3]}
    )
    with pytest.raises(GGUFError, match="exactly one linear-attention layer"):
        config_from_gguf(GGUFFile(path))


def test_inspect_shows_the_layer_plan(gguf_path: Path, tmp_path: Path, reference, capsys) -> None:
    assert cli.main(["inspect", str(gguf_path)]) == 0
    out = capsys.readouterr().out
    assert "8 layers, 4 hyper-connected residual streams, mlp: sparse MoE, 8 experts, top-3" in out
    # ple_layer_ids [2] is 1-based: the n-gram embedding sits on 0-based layer 1.
    assert re.search(r"\n  0\s+linear attention \(Gated DeltaNet\)\s", out)
    assert re.search(r"\n  1\s+linear attention \(Gated DeltaNet\) \+ n-gram embedding\s", out)
    assert re.search(r"\n  4-6\s+linear attention \(Gated DeltaNet\)\s", out)
    assert re.search(r"\n  3\s+indexed sparse attention \(QSA, 4 tokens/block, budget 8\)\s", out)

    dense = write_qwen4exp_gguf(
        reference, tmp_path / "dense.gguf", metadata_overrides={"qwen4exp.attention.compress_ratios": [0] * 8}
    )
    with pytest.warns(UserWarning, match="compress_ratios"):
        assert cli.main(["inspect", str(dense)]) == 0
    assert re.search(r"\n  3\s+gated full attention \(QSA off: compress ratio 0\)\s", capsys.readouterr().out)


def test_generate_is_greedy_transformers(reference: Qwen4ExpForCausalLM, gguf_path: Path) -> None:
    loaded = load_model(gguf_path)
    try:
        prompt = _tokens()[0, :24].tolist()
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        result = list(generate(loaded.model, loaded.tokenizer, prompt, params))[-1]
        assert isinstance(result, GenerationResult)
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(len(result.token_ids)):
                logits = reference(torch.tensor([tokens])).logits[0, -1]
                for banned in loaded.tokenizer.stop_ids:  # ignore_eos bans them, as llama-server does
                    logits[banned] = float("-inf")
                tokens.append(int(logits.argmax()))
        assert result.token_ids == tokens[len(prompt) :]
        assert len(result.token_ids) == 10
    finally:
        loaded.file.close()
