"""QSA indexed sparse attention (qwen4exp) against transformers' Qwen4ExpTextAttention.

The reference is built from the spec's unit-test config (section 7.1: 4 heads of 16, 2 KV heads,
rotary 0.5 with mRoPE sections [2, 1, 1], indexer 2 heads of 16, budget 8 tokens = 2 blocks of 4), in
float32 with eager attention and an explicit causal mask, every parameter random (the (1 + w) norms
included, which random init would leave at w = 0). Its weights go through the converter's transforms
(`_gguf_tensors`) into Bubo's IndexedAttention. Measured max |Δ|: below 1e-6 everywhere.
"""

from itertools import pairwise

import pytest
import torch
from torch import nn
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import (
    Qwen4ExpTextAttention,
    Qwen4ExpTextRotaryEmbedding,
)

from bubo.gguf.model_config import ModelConfig, RopeStyle
from bubo.model.indexed_attention import IndexedAttention, QSAIndexer
from bubo.model.layers import RMSNorm, RotaryEmbedding
from bubo.model.state import IndexerState, KVCache
from tests.fixtures.gguf_writer import randomize_
from tests.fixtures.qwen4exp_gguf import TINY_QWEN4EXP_CONFIG

TOLERANCE = 1e-4
BATCH = 2
MAX_LEN = 72
LAYER = 3  # a QSA layer of the 7.1 config


def _gguf_tensors(attention: Qwen4ExpTextAttention) -> dict[str, torch.Tensor]:
    """GGUF tensor name (without `blk.N.`) -> tensor in torch order, as llama.cpp's converter writes a
    QSA layer (spec section 3.5): index_qk_proj split into the query rows and the key head, and +1 on
    every norm (section 3.6)."""
    params = {name: p.detach().clone() for name, p in attention.named_parameters()}
    query_rows = attention.indexer.index_n_heads * attention.indexer.index_head_dim
    tensors = {
        "attn_q.weight": params.pop("q_proj.weight"),
        "attn_k.weight": params.pop("k_proj.weight"),
        "attn_v.weight": params.pop("v_proj.weight"),
        "attn_output.weight": params.pop("o_proj.weight"),
        "attn_q_norm.weight": params.pop("q_norm.weight") + 1,
        "attn_k_norm.weight": params.pop("k_norm.weight") + 1,
        "indexer.q_norm.weight": params.pop("indexer.q_layernorm.weight") + 1,
        "indexer.k_norm.weight": params.pop("indexer.k_layernorm.weight") + 1,
    }
    qk = params.pop("indexer.index_qk_proj.weight")
    tensors["indexer.q_proj.weight"], tensors["indexer.k_proj.weight"] = qk[:query_rows], qk[query_rows:]
    assert not params, f"unconverted parameters {sorted(params)}"
    return tensors


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


class _Case:
    """The transformers layer and Bubo's, built from the same random weights."""

    def __init__(self) -> None:
        self.hf_config = Qwen4ExpTextConfig(**TINY_QWEN4EXP_CONFIG)
        self.hf_config._attn_implementation = "eager"
        self.reference = Qwen4ExpTextAttention(self.hf_config, layer_idx=LAYER)
        randomize_(self.reference, seed=0)
        self.reference.eval()
        self.rotary_reference = Qwen4ExpTextRotaryEmbedding(self.hf_config)

        c = self.hf_config
        self.config = ModelConfig(
            architecture="qwen4exp",
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_layers=1,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            intermediate_size=1,
            rms_norm_eps=c.rms_norm_eps,
            context_length=c.max_position_embeddings,
            rope_theta=c.rope_parameters["rope_theta"],
            rope_dim=int(c.head_dim * c.rope_parameters["partial_rotary_factor"]),
            rope_style=RopeStyle.NEOX,
            qk_norm=True,
            mrope_sections=tuple(c.rope_parameters["mrope_section"]),
        )
        t, eps = _gguf_tensors(self.reference), c.rms_norm_eps
        indexer = QSAIndexer(
            q_proj=_linear(t["indexer.q_proj.weight"]),
            k_proj=_linear(t["indexer.k_proj.weight"]),
            q_norm=RMSNorm(t["indexer.q_norm.weight"], eps),
            k_norm=RMSNorm(t["indexer.k_norm.weight"], eps),
            num_heads=c.indexer_n_heads,
            compress_ratio=c.indexer_compress_ratio,
            budget=c.indexer_budget,
            rope_style=RopeStyle.NEOX,
        )
        self.attention = IndexedAttention(
            self.config,
            layer_index=0,
            q_proj=_linear(t["attn_q.weight"]),
            k_proj=_linear(t["attn_k.weight"]),
            v_proj=_linear(t["attn_v.weight"]),
            o_proj=_linear(t["attn_output.weight"]),
            q_norm=RMSNorm(t["attn_q_norm.weight"], eps),
            k_norm=RMSNorm(t["attn_k_norm.weight"], eps),
            indexer=indexer,
        )
        self.rotary = RotaryEmbedding(self.config, mrope_sections=self.config.mrope_sections)

    def new_state(self) -> tuple[KVCache, IndexerState]:
        c = self.config
        cache = KVCache(1, BATCH, c.num_kv_heads, MAX_LEN, c.head_dim, torch.float32, "cpu")
        return cache, self.attention.indexer.new_state(BATCH, MAX_LEN, c.rope_dim // 2, torch.float32)

    def reference_inputs(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Rotary cos/sin of positions 0..T-1 and the float causal mask, as Qwen4ExpTextModel passes them."""
        length = x.shape[1]
        cos_sin = self.rotary_reference(x, torch.arange(length).expand(BATCH, length))
        mask = torch.full((length, length), float("-inf")).triu(1).expand(BATCH, 1, length, length)
        return cos_sin, mask

    def reference_output(self, x: torch.Tensor) -> torch.Tensor:
        cos_sin, mask = self.reference_inputs(x)
        with torch.no_grad():
            return self.reference(x, cos_sin, mask)[0]

    def reference_selection(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' indexer mask [B, T, T]: the tokens each query may attend to."""
        cos_sin, mask = self.reference_inputs(x)
        with torch.no_grad():
            return self.reference.indexer(x, cos_sin, mask, None)[:, 0]


def _hidden(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(
        BATCH, length, TINY_QWEN4EXP_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(seed)
    )


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def case() -> _Case:
    return _Case()


@pytest.mark.parametrize("length", [64, 70])
def test_selection_matches_transformers(case: _Case, length: int) -> None:
    """The same tokens selected for every query, and the selection really drops some."""
    x = _hidden(length)
    _, state = case.new_state()
    cos, sin = case.rotary(torch.arange(length), torch.float32)
    with torch.no_grad():
        selected = case.attention.indexer(x, cos, sin, state)
    expected = case.reference_selection(x)
    assert torch.equal(selected, expected)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    assert not selected[:, ~causal].any()
    dropped = (causal & ~selected).sum().item()
    print(f"T={length}: {dropped} of {BATCH * int(causal.sum())} causal (query, key) pairs dropped")
    assert dropped > 0
    # budget 8 = 2 blocks of 4 plus the tail: from position 11 on, every query keeps 8 + (p + 1) % 4 tokens
    kept = selected.sum(-1)
    tail = (torch.arange(length) + 1) % 4
    assert torch.equal(kept[:, 11:], (8 + tail[11:]).expand(BATCH, -1))


def _zero_score_case() -> _Case:
    """A case whose indexer query projection is zeroed (here and in transformers): every block scores 0."""
    case = _Case()
    query_rows = TINY_QWEN4EXP_CONFIG["indexer_n_heads"] * TINY_QWEN4EXP_CONFIG["indexer_head_dim"]
    with torch.no_grad():
        case.reference.indexer.index_qk_proj.weight[:query_rows] = 0
        case.attention.indexer.q_proj.weight.zero_()
    return case


def test_zero_score_ties_break_as_transformers() -> None:
    """With the indexer's query projection zeroed every block scores 0 (relu), so which blocks are
    kept is decided by torch.topk's tie order over each query's visible blocks, as in transformers."""
    case = _zero_score_case()
    x = _hidden(70)
    _, state = case.new_state()
    cos, sin = case.rotary(torch.arange(70), torch.float32)
    with torch.no_grad():
        selected = case.attention.indexer(x, cos, sin, state)
    assert torch.equal(selected, case.reference_selection(x))


def test_zero_score_ties_break_as_transformers_one_token_at_a_time() -> None:
    """The decode path skips the tie check (its one query sees every block, so the batched topk is
    already the per-query one): every decode step still keeps the blocks transformers keeps."""
    case = _zero_score_case()
    x = _hidden(70)
    expected = case.reference_selection(x)
    _, state = case.new_state()
    cos, sin = case.rotary(torch.arange(70), torch.float32)
    with torch.no_grad():
        case.attention.indexer(x[:, :40], cos[:40], sin[:40], state)
        for p in range(40, 70):
            selected = case.attention.indexer(x[:, p : p + 1], cos[p : p + 1], sin[p : p + 1], state)
            assert torch.equal(selected[:, 0], expected[:, p, : p + 1]), f"position {p}"


@pytest.mark.parametrize("length", [64, 70])
def test_prefill_matches_transformers(case: _Case, length: int) -> None:
    x = _hidden(length)
    cache, state = case.new_state()
    cos, sin = case.rotary(torch.arange(length), torch.float32)
    with torch.no_grad():
        out = case.attention(x, cos, sin, cache, state)
    diff = _max_diff(out, case.reference_output(x))
    print(f"T={length}: prefill max|Δ| {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize(
    "bounds",
    [
        [0, 40, *range(41, 71)],  # prefill 40 (complete blocks only), then one token at a time
        [0, 37, 42, *range(43, 71)],  # ragged prefill, a 5-token chunk across a block edge, then decode
    ],
    ids=["prefill40-decode", "prefill37-chunk-decode"],
)
def test_cached_decode_matches_full_sequence(case: _Case, bounds: list[int]) -> None:
    """Prefill, then continue from the KV cache and the indexer state; transformers sees the whole
    70-token sequence at once."""
    x = _hidden(70, seed=2)
    expected = case.reference_output(x)
    cache, state = case.new_state()
    pieces = []
    with torch.no_grad():
        for start, end in pairwise(bounds):
            cos, sin = case.rotary(torch.arange(start, end), torch.float32)
            pieces.append(case.attention(x[:, start:end], cos, sin, cache, state))
            cache.advance(end - start)
    assert state.length == 70 and state.num_blocks == 17 and state.tail_len == 2
    diff = _max_diff(torch.cat(pieces, dim=1), expected)
    print(f"{bounds[1]}-token prefill -> decode to 70: max|Δ| {diff:.2e}")
    assert diff <= TOLERANCE


def test_state_must_follow_the_cache(case: _Case) -> None:
    cache, state = case.new_state()
    cache.advance(1)
    cos, sin = case.rotary(torch.arange(1, 2), torch.float32)
    with pytest.raises(ValueError, match="indexer state"):
        case.attention(_hidden(1), cos, sin, cache, state)
