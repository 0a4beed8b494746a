"""Gated full attention (Qwen3-Next, Qwen3.5) and interleaved mRoPE against transformers.

The references are Qwen3NextAttention and Qwen3_5Attention (float32, eager attention, explicit
causal mask) built from tiny configs with every parameter random, q/k norm weights included.
Their weights go through the converter's transforms (tests/fixtures/qwen_attention_weights.py)
into Bubo's Attention with `output_gate`. Measured max |Δ|: below 1e-6 everywhere.
"""

from collections.abc import Callable
from itertools import pairwise

import pytest
import torch
from torch import nn
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5Attention,
    Qwen3_5TextRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

from bubo.gguf.model_config import ModelConfig, RopeStyle
from bubo.model.attention import Attention
from bubo.model.layers import RMSNorm, RotaryEmbedding, apply_rotary, mrope_axes
from bubo.model.state import KVCache
from tests.fixtures.gguf_writer import randomize_
from tests.fixtures.qwen_attention_weights import gated_attention_tensors

TOLERANCE = 1e-4
SEQ_LEN = 20
BATCH = 2

_SIZES = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 64,
}


def _rope(partial: float, sections: list[int] | None = None) -> dict[str, object]:
    rope: dict[str, object] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": partial,
    }
    if sections is not None:
        rope |= {"mrope_section": sections, "mrope_interleaved": True}
    return rope


# name -> transformers config; a Qwen3.5 config's mrope_section sums to its rotated pairs (rope_dim / 2).
CONFIGS: dict[str, Callable[[], Qwen3NextConfig | Qwen3_5TextConfig]] = {
    "qwen3next-partial-0.25": lambda: Qwen3NextConfig(**_SIZES, rope_parameters=_rope(0.25)),
    "qwen35-partial-0.25": lambda: Qwen3_5TextConfig(**_SIZES, rope_parameters=_rope(0.25, [1, 1, 0])),
    "qwen35-partial-0.5": lambda: Qwen3_5TextConfig(**_SIZES, rope_parameters=_rope(0.5, [2, 1, 1])),
}


class _Reference:
    """One transformers attention layer with its rotary embedding, run on the whole sequence."""

    def __init__(self, name: str) -> None:
        self.config = CONFIGS[name]()
        self.config._attn_implementation = "eager"
        self.qwen35 = isinstance(self.config, Qwen3_5TextConfig)
        if self.qwen35:
            self.attention: nn.Module = Qwen3_5Attention(self.config, layer_idx=0)
            self.rotary: nn.Module = Qwen3_5TextRotaryEmbedding(self.config)
        else:
            self.attention = Qwen3NextAttention(self.config, layer_idx=0)
            self.rotary = Qwen3NextRotaryEmbedding(self.config)
        randomize_(self.attention, seed=0)
        self.attention.eval()

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden]; positions [T] or, Qwen3.5 only, [3, T] rows (t, h, w)."""
        position_ids = positions[..., None, :].expand(*positions.shape[:-1], x.shape[0], positions.shape[-1])
        cos, sin = self.rotary(x, position_ids)
        length = x.shape[1]
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            out, _ = self.attention(x, (cos, sin), mask)
        return out

    def bubo_config(self) -> ModelConfig:
        c = self.config
        return ModelConfig(
            architecture="qwen35" if self.qwen35 else "qwen3next",
            vocab_size=1,
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
        )

    def bubo(self) -> tuple[Attention, RotaryEmbedding]:
        """Bubo's attention from the converted (GGUF-layout) weights, and its rotary embedding."""
        config = self.bubo_config()
        tensors = gated_attention_tensors(self.attention)

        def linear(name: str) -> nn.Linear:
            weight = tensors[name]
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            return layer

        attention = Attention(
            config,
            layer_index=0,
            q_proj=linear("attn_q.weight"),
            k_proj=linear("attn_k.weight"),
            v_proj=linear("attn_v.weight"),
            o_proj=linear("attn_output.weight"),
            q_norm=RMSNorm(tensors["attn_q_norm.weight"], config.rms_norm_eps),
            k_norm=RMSNorm(tensors["attn_k_norm.weight"], config.rms_norm_eps),
            output_gate=True,
        )
        sections = self.config.rope_parameters.get("mrope_section") if self.qwen35 else None
        return attention, RotaryEmbedding(config, mrope_sections=sections)


def _new_cache(config: ModelConfig) -> KVCache:
    return KVCache(1, BATCH, config.num_kv_heads, SEQ_LEN, config.head_dim, torch.float32, "cpu")


def _hidden(seed: int = 1) -> torch.Tensor:
    return torch.randn(BATCH, SEQ_LEN, _SIZES["hidden_size"], generator=torch.Generator().manual_seed(seed))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_matches_transformers(name: str) -> None:
    reference = _Reference(name)
    attention, rotary = reference.bubo()
    x, positions = _hidden(), torch.arange(SEQ_LEN)
    cos, sin = rotary(positions, torch.float32)
    with torch.no_grad():
        out = attention(x, cos, sin, _new_cache(reference.bubo_config()))
    diff = _max_diff(out, reference(x, positions))
    print(f"{name}: prefill max|Δ| {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decode_matches_full_sequence(name: str) -> None:
    """Prefill, then a 3-token chunk at an offset (explicit mask), then one token at a time."""
    reference = _Reference(name)
    attention, rotary = reference.bubo()
    x = _hidden()
    expected = reference(x, torch.arange(SEQ_LEN))
    cache = _new_cache(reference.bubo_config())
    pieces = []
    bounds = [0, 12, 15, *range(16, SEQ_LEN + 1)]
    with torch.no_grad():
        for start, end in pairwise(bounds):
            cos, sin = rotary(torch.arange(start, end), torch.float32)
            pieces.append(attention(x[:, start:end], cos, sin, cache))
            cache.advance(end - start)
    diff = _max_diff(torch.cat(pieces, dim=1), expected)
    print(f"{name}: prefill -> chunk -> decode max|Δ| {diff:.2e}")
    assert diff <= TOLERANCE


def _image_like_positions(seed: int = 2) -> torch.Tensor:
    """[3, SEQ_LEN] rows (t, h, w) that differ from each other, as an image's patches have."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (3, SEQ_LEN), generator=generator)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.startswith("qwen35")])
def test_mrope_with_distinct_rows_matches_transformers(name: str) -> None:
    """Distinct t/h/w positions: Bubo's cos/sin and rotation against Qwen3_5TextRotaryEmbedding +
    apply_rotary_pos_emb, and the whole attention layer on such positions."""
    reference = _Reference(name)
    attention, rotary = reference.bubo()
    positions = _image_like_positions()
    q = torch.randn(BATCH, 4, SEQ_LEN, 16, generator=torch.Generator().manual_seed(3))
    k = torch.randn(BATCH, 2, SEQ_LEN, 16, generator=torch.Generator().manual_seed(4))
    ref_cos, ref_sin = reference.rotary(q, positions[:, None, :].expand(3, BATCH, SEQ_LEN))
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    cos, sin = rotary(positions, torch.float32)
    assert _max_diff(apply_rotary(q, cos, sin, RopeStyle.NEOX), ref_q) <= TOLERANCE
    assert _max_diff(apply_rotary(k, cos, sin, RopeStyle.NEOX), ref_k) <= TOLERANCE

    x = _hidden()
    with torch.no_grad():
        out = attention(x, cos, sin, _new_cache(reference.bubo_config()))
    diff = _max_diff(out, reference(x, positions))
    print(f"{name}: mRoPE prefill max|Δ| {diff:.2e}")
    assert diff <= TOLERANCE


def test_mrope_with_equal_rows_is_plain_rope() -> None:
    """Text has t = h = w, so it may pass one position row; the result is bit-identical."""
    config = _Reference("qwen35-partial-0.5").bubo_config()
    rotary = RotaryEmbedding(config, mrope_sections=[2, 1, 1])
    positions = torch.arange(7, 7 + SEQ_LEN)
    for plain, multi in zip(
        rotary(positions, torch.float32), rotary(positions.expand(3, -1), torch.float32), strict=True
    ):
        assert torch.equal(plain, multi)


def test_mrope_axes_interleave_rows() -> None:
    # Qwen3.5's default [11, 11, 10] over 32 pairs: a plain t h w cycle.
    assert mrope_axes(32, [11, 11, 10]).tolist() == [0, 1, 2] * 10 + [0, 1]
    # An exhausted h row hands its turns to t.
    assert mrope_axes(6, [4, 1, 1]).tolist() == [0, 1, 2, 0, 0, 0]


@pytest.mark.parametrize("sections", [[11, 11, 9], [11, 11], [12, 11, 10, 0], [-1, 23, 10]])
def test_mrope_sections_must_cover_the_rotated_pairs(sections: list[int]) -> None:
    with pytest.raises(ValueError, match="mRoPE sections"):
        mrope_axes(32, sections)


def test_positions_must_match_the_rope_kind() -> None:
    config = _Reference("qwen35-partial-0.5").bubo_config()
    with pytest.raises(ValueError, match="expected"):
        RotaryEmbedding(config)(torch.zeros(3, 4, dtype=torch.int64), torch.float32)
    with pytest.raises(ValueError, match="expected"):
        RotaryEmbedding(config, mrope_sections=[2, 1, 1])(torch.zeros(2, 4, dtype=torch.int64), torch.float32)


def test_ungated_attention_ignores_the_gate_path() -> None:
    """Without `output_gate`, q_proj is [heads * head_dim, hidden] as before (qwen3)."""
    reference = _Reference("qwen3next-partial-0.25")
    gated, rotary = reference.bubo()
    plain = Attention(
        reference.bubo_config(),
        layer_index=0,
        q_proj=nn.Linear(64, 64, bias=False),
        k_proj=gated.k_proj,
        v_proj=gated.v_proj,
        o_proj=gated.o_proj,
        q_norm=gated.q_norm,
        k_norm=gated.k_norm,
    )
    cos, sin = rotary(torch.arange(SEQ_LEN), torch.float32)
    with torch.no_grad():
        out = plain(_hidden(), cos, sin, _new_cache(reference.bubo_config()))
    assert out.shape == (BATCH, SEQ_LEN, 64)
