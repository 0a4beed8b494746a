"""qwen4exp PLE (hashed n-gram embedding) against transformers' Qwen4ExpTextPLELayer.

The spec's unit-test config (section 7.1: hidden 64, 4 streams, n = 3, 2 heads per order, primes
31/37/41/43, a 256-row table) builds the PLE layer; every parameter gets random values (the
table, the norm weights, which transformers initialises to 0 so that a lost +1 goes unnoticed,
and the conv, initialised to 0 so that a missing conv goes unnoticed), the tensors are converted
as llama.cpp's converter does (spec 3.4: norms + 1, conv squeezed, hash constants from the
buffers), and Bubo's layer runs token sequences with EOS inside (at the start, twice in a row, one
or two tokens apart) from an empty state: in one call, in pieces (some shorter than the n − 1
tokens of history) and token by token. Transformers runs the whole sequence without a cache; the
layer is causal, so its position t is what every split must give at t. The table is given as a
float tensor, and as raw F16 and Q8_0 blocks (transformers then holds the blocks' dequantized
values). Measured max |Δ| (float32, outputs up to ~10): 7e-7 in one call, 2.6e-6 in pieces,
5.3e-6 token by token (tolerance 1e-4); zeroing the conv, ignoring EOS or dropping the +1 moves
the output by 3 to 10.
"""

import itertools

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn
from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import (
    Qwen4ExpTextNGramEmbedding,
    Qwen4ExpTextPLELayer,
    _build_layer_multipliers,
    _find_nth_prime_after,
)

from bubo.model.ngram_embedding import NGramEmbedding, NGramHash, PLELayer, derive_ngram_hash, ngram_rows
from tests.fixtures.qwen4exp_gguf import TINY_QWEN4EXP_CONFIG

TOLERANCE = 1e-4
HIDDEN, STREAMS, EOS, VOCAB = 64, 4, 1792, 2048
BATCH, LENGTH = 2, 40
PLE_LAYER = 1  # 0-based; HF ple_layer_ids [2] (1-based), as in 7.1


pytestmark = pytest.mark.usefixtures("one_thread")


def _config(ple_embed_dim: int = HIDDEN) -> Qwen4ExpTextConfig:
    return Qwen4ExpTextConfig(**{**TINY_QWEN4EXP_CONFIG, "ple_embed_dim": ple_embed_dim})


def _random_ple(ple_embed_dim: int, seed: int) -> Qwen4ExpTextPLELayer:
    module = Qwen4ExpTextPLELayer(_config(ple_embed_dim), layer_idx=PLE_LAYER, ple_layer_index=0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            scale = 1.0 if "ngram_embedding" in name else 0.3
            param.copy_(scale * torch.randn(param.shape, generator=generator))
    return module.eval()


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return layer


def _table(
    reference: Qwen4ExpTextPLELayer, table_type: GGMLQuantizationType
) -> tuple[torch.Tensor, GGMLQuantizationType | None]:
    """per_layer_token_embd as Bubo gets it: a float tensor for F32, else the raw blocks. For a
    quantized type the reference's table takes the blocks' values, so both see the same weights."""
    weights = reference.ple_embedding.ngram_embedding.weight
    if table_type == GGMLQuantizationType.F32:
        return weights.detach().clone(), None
    raw = gguf.quants.quantize(weights.detach().numpy(), table_type)
    with torch.no_grad():
        weights.copy_(torch.from_numpy(gguf.quants.dequantize(raw, table_type).astype(np.float32)))
    return torch.from_numpy(raw.view(np.uint8)), table_type


def _bubo_ple(reference: Qwen4ExpTextPLELayer, table_type: GGMLQuantizationType) -> PLELayer:
    """Bubo's layer from the reference's tensors in the GGUF layout (spec 3.1, 3.4)."""
    embedding = reference.ple_embedding
    ngram_hash = NGramHash.from_values(
        embedding.layer_multipliers.tolist(),  # ple.layer_multipliers
        embedding.ngram_heads_offsets.tolist(),  # ple.head_offsets
        embedding.ngram_heads_vocab_sizes.tolist(),  # ple.head_vocab_sizes
    )
    table, kind = _table(reference, table_type)
    return PLELayer(
        NGramEmbedding(table, ngram_hash, EOS, table_type=kind),
        _linear(reference.key_proj.weight.detach()),
        _linear(reference.value_proj.weight.detach()),
        reference.norm_key.weight.detach() + 1,  # the converter's +1 (spec 3.4, 3.6)
        reference.norm_query.weight.detach() + 1,
        reference.norm_conv.weight.detach() + 1,
        reference.conv1d.weight.detach().squeeze(1),  # [hc·H, 1, Kp] -> [hc·H, Kp]
        hc_count=STREAMS,
        norm_eps=1e-6,
    )


def _tokens(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    ids[ids == EOS] = 0
    ids[0, [0, 9, 10, 20, 22, 39]] = EOS  # at the start, twice in a row, two apart, at the end
    ids[1, [5, 6, 7, 30]] = EOS
    return ids


@pytest.mark.parametrize(
    ("table_type", "ple_embed_dim"),
    [
        (GGMLQuantizationType.F32, HIDDEN),
        (GGMLQuantizationType.F16, HIDDEN),
        # 32-value Q8_0 blocks need a row width d_p = P / Nh of 32: P = 128 (transformers allows P != H)
        (GGMLQuantizationType.Q8_0, 2 * HIDDEN),
    ],
    ids=["f32", "f16", "q8_0"],
)
def test_ple_layer_matches_transformers(table_type: GGMLQuantizationType, ple_embed_dim: int) -> None:
    reference = _random_ple(ple_embed_dim, seed=1)
    ours = _bubo_ple(reference, table_type)
    ids = _tokens(seed=2)
    streams = torch.randn(BATCH, LENGTH, STREAMS * HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(streams, ids, cache=None)

        whole = ours(streams, ids, ours.new_state(BATCH))
        assert (whole - expected).abs().max() <= TOLERANCE

        state = ours.new_state(BATCH)
        bounds = [0, 1, 2, 7, 8, 25, LENGTH]  # pieces of 1 and 2 tokens: shorter than the history
        pieces = [ours(streams[:, a:b], ids[:, a:b], state) for a, b in itertools.pairwise(bounds)]
        assert (torch.cat(pieces, dim=1) - expected).abs().max() <= TOLERANCE

        state = ours.new_state(BATCH)
        steps = [ours(streams[:, t : t + 1], ids[:, t : t + 1], state) for t in range(LENGTH)]
        assert (torch.cat(steps, dim=1) - expected).abs().max() <= TOLERANCE
        assert torch.equal(state.tokens, ids[:, -2:])


def test_row_ids_follow_the_eos_rule() -> None:
    """Spec 4.4 "Context ids", spelled out for n = 3: c₁ = EOS right after an EOS, c₂ = EOS within
    two tokens after one, and the token's own EOS doesn't cut its context."""
    ngram_hash, _ = derive_ngram_hash(VOCAB, 3, 2, 31, 1234, 128)
    m = ngram_hash.layer_multipliers.tolist()
    sizes, offsets = ngram_hash.head_vocab_sizes.tolist(), ngram_hash.head_offsets.tolist()
    ids = [5, EOS, 7, 8, 9, EOS]
    rows = ngram_rows(torch.tensor([ids]), torch.full((1, 2), EOS), ngram_hash, EOS)[0].tolist()
    for t, token in enumerate(ids):
        c1 = ids[t - 1] if t >= 1 else EOS
        c2 = ids[t - 2] if t >= 2 and c1 != EOS else EOS
        bigram, trigram = (token * m[0]) ^ (c1 * m[1]), (token * m[0]) ^ (c1 * m[1]) ^ (c2 * m[2])
        expected = [bigram % sizes[h] + offsets[h] for h in (0, 1)] + [
            trigram % sizes[h] + offsets[h] for h in (2, 3)
        ]
        assert rows[t] == expected, t


@pytest.mark.parametrize("ple_layer_index", [0, 1, 2])
def test_derived_constants_match_transformers(ple_layer_index: int) -> None:
    config = _config()
    reference = Qwen4ExpTextNGramEmbedding(
        config, HIDDEN, layer_idx=PLE_LAYER, ple_layer_index=ple_layer_index
    )
    ngram_hash, rows = derive_ngram_hash(VOCAB, 3, 2, 31, 1234, 128, ple_layer_index=ple_layer_index)
    # the module's buffers hold the values _init_weights writes; built outside from_pretrained they're recomputed here
    assert torch.equal(
        ngram_hash.layer_multipliers, _build_layer_multipliers(VOCAB, 3, ple_layer_index, 1234)
    )
    assert ngram_hash.head_vocab_sizes.tolist() == reference.head_vocab_sizes
    assert ngram_hash.head_offsets.tolist() == reference.head_offsets
    assert rows == reference.ngram_embedding.num_embeddings
    for h, size in enumerate(ngram_hash.head_vocab_sizes.tolist()):
        assert size == _find_nth_prime_after(30, ple_layer_index * 4 + h + 1)
    if ple_layer_index == 0:
        assert ngram_hash.head_vocab_sizes.tolist() == [31, 37, 41, 43] and rows == 256


def test_real_model_constants_and_rows() -> None:
    """The real model's constants and the spec's test vector (section 4.4, checked there with transformers)."""
    ngram_hash, rows = derive_ngram_hash(248320, 3, 8, 20_000_000, 1234, 128)
    assert ngram_hash.layer_multipliers.tolist() == [23703573157769, 20109073645365, 8052911324071]
    assert ngram_hash.head_vocab_sizes.tolist()[:3] == [20000003, 20000023, 20000033]
    assert ngram_hash.head_vocab_sizes.tolist()[-1] == 20000171
    assert rows == 320_001_536
    ids = torch.tensor([[9707, 11, 1879, 248044, 3555]])
    picked = ngram_rows(ids, torch.full((1, 2), 248044), ngram_hash, 248044)[0][:, [0, 8, 15]]
    assert picked.tolist() == [
        [16410909, 169641436, 300984276],
        [18158303, 175132467, 307699687],
        [6380558, 164226950, 312121804],
        [18827606, 163793416, 318943450],
        [12145267, 161432964, 318814986],
    ]


def test_rejects_inconsistent_inputs() -> None:
    ngram_hash, _ = derive_ngram_hash(VOCAB, 3, 2, 31, 1234, 128)
    with pytest.raises(ValueError, match="table_type"):
        NGramEmbedding(torch.zeros(256, 8, dtype=torch.uint8), ngram_hash, EOS)
    with pytest.raises(ValueError, match="reach row"):
        NGramEmbedding(torch.zeros(100, 16), ngram_hash, EOS)
    with pytest.raises(ValueError, match="orders"):
        NGramHash.from_values([1, 3, 5], [0, 31, 68], [31, 37, 41])
