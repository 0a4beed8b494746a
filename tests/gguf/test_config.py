"""GGUF metadata -> ModelConfig, on files written by the fixture writer (llama.cpp's key names) and
on the real SmolLM2 file."""

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from bubo.gguf.config import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError, config_from_gguf
from bubo.gguf.model_config import (
    MlpKind,
    ModelConfig,
    RopeScaling,
    RopeScalingType,
    RopeStyle,
    ValueHeadOrder,
)
from bubo.gguf.reader import GGUFError, GGUFFile
from tests.fixtures.gguf_writer import write_gguf

_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 280,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}


def _llama(**kwargs: Any) -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(**{**_SIZES, **kwargs}))


def _config(tmp_path: Path, model: PreTrainedModel, **overrides: Any) -> ModelConfig:
    path = write_gguf(model, tmp_path / "model.gguf", metadata_overrides=overrides)
    return config_from_gguf(GGUFFile(path))


def test_smollm2(smollm2_path: Path) -> None:
    config = config_from_gguf(GGUFFile(smollm2_path))
    assert config == ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,  # no attention.key_length in this file: 576 / 9
        intermediate_size=1536,
        rms_norm_eps=config.rms_norm_eps,
        context_length=8192,
        rope_theta=100000.0,
        rope_dim=64,
        rope_style=RopeStyle.INTERLEAVED,
        tie_word_embeddings=True,
    )
    assert math.isclose(config.rms_norm_eps, 1e-5, rel_tol=1e-6)  # stored as float32


def test_llama(tmp_path: Path) -> None:
    config = _config(tmp_path, _llama(tie_word_embeddings=False))
    assert (config.architecture, config.vocab_size, config.hidden_size, config.num_layers) == (
        "llama",
        280,
        64,
        2,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size) == (
        4,
        2,
        16,
        96,
    )
    assert (config.context_length, config.rope_theta, config.rope_dim) == (512, 10000.0, 16)
    assert (
        config.rope_style == RopeStyle.INTERLEAVED
    )  # the converter permuted q/k for llama.cpp's "norm" rope
    assert not config.tie_word_embeddings and not config.attention_bias and not config.qk_norm
    assert config.rope_scaling is None and config.rope_freq_factors is None


def test_qwen2_biases_and_vocab_from_token_list(tmp_path: Path) -> None:
    config = _config(tmp_path, Qwen2ForCausalLM(Qwen2Config(**_SIZES, tie_word_embeddings=True)))
    assert config.architecture == "qwen2"
    assert config.attention_bias and config.tie_word_embeddings and not config.qk_norm
    assert config.rope_style == RopeStyle.NEOX
    assert config.vocab_size == 280  # qwen files have no {arch}.vocab_size; the token list decides


def test_qwen3_qk_norm_and_key_length(tmp_path: Path) -> None:
    config = _config(tmp_path, Qwen3ForCausalLM(Qwen3Config(**_SIZES, head_dim=32)))
    assert config.architecture == "qwen3"
    assert config.qk_norm and not config.attention_bias
    assert (config.head_dim, config.rope_dim) == (32, 32)
    assert config.rope_style == RopeStyle.NEOX


def _qwen3moe() -> PreTrainedModel:
    config = Qwen3MoeConfig(
        **_SIZES, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24
    )
    return Qwen3MoeForCausalLM(config)


def test_qwen3moe_experts(tmp_path: Path) -> None:
    config = _config(tmp_path, _qwen3moe())
    assert config.architecture == "qwen3moe"
    assert config.mlp_kind == MlpKind.SPARSE_MOE
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 24)
    # The file has no expert_weights_norm (the HF config's default is False): llama.cpp renormalises.
    assert config.norm_topk_prob
    assert config.qk_norm and config.rope_style == RopeStyle.NEOX and config.head_dim == 32


def test_qwen3moe_explicit_expert_weights_norm_is_accepted(tmp_path: Path) -> None:
    assert _config(tmp_path, _qwen3moe(), **{"qwen3moe.expert_weights_norm": True}).norm_topk_prob


def test_dense_architectures_have_no_experts(tmp_path: Path) -> None:
    config = _config(tmp_path, Qwen3ForCausalLM(Qwen3Config(**_SIZES)))
    assert config.mlp_kind == MlpKind.DENSE
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (0, 0, 0)
    assert not config.norm_topk_prob


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"qwen3moe.expert_count": None}, r"missing required metadata key 'qwen3moe\.expert_count'"),
        (
            {"qwen3moe.expert_used_count": None},
            r"missing required metadata key 'qwen3moe\.expert_used_count'",
        ),
        (
            {"qwen3moe.expert_feed_forward_length": None},
            r"missing required metadata key 'qwen3moe\.expert_feed_forward_length'",
        ),
        ({"qwen3moe.expert_count": 0}, r"'qwen3moe\.expert_count' must be positive, got 0"),
        ({"qwen3moe.expert_used_count": 0}, r"'qwen3moe\.expert_used_count' must be positive, got 0"),
        (
            {"qwen3moe.expert_feed_forward_length": 0},
            r"'qwen3moe\.expert_feed_forward_length' must be positive, got 0",
        ),
        (
            {"qwen3moe.expert_used_count": 9},
            r"'qwen3moe\.expert_used_count' = 9 exceeds 'qwen3moe\.expert_count' = 8",
        ),
        ({"qwen3moe.expert_count": "many"}, r"'qwen3moe\.expert_count' should be an integer"),
        (
            {"qwen3moe.expert_weights_norm": False},
            r"'qwen3moe\.expert_weights_norm' = false is not supported",
        ),
        ({"qwen3moe.expert_weights_norm": 1}, r"'qwen3moe\.expert_weights_norm' should be a boolean"),
    ],
)
def test_invalid_expert_values_are_named(overrides: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=message):
        _config(tmp_path, _qwen3moe(), **overrides)


_HYBRID_SIZES = {
    **_SIZES,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "linear_conv_kernel_dim": 4,
}
# Qwen3.5-MoE has no dense MLP width: without it the converter writes no feed_forward_length.
_QWEN35MOE_SIZES = {k: v for k, v in _HYBRID_SIZES.items() if k != "intermediate_size"}
_HYBRID_MOE = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 40,
}
# rope_dim = 32 * 0.25 = 8: 4 rotated pairs
_MROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [2, 1, 1],
}


def _qwen35() -> PreTrainedModel:
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_HYBRID_SIZES, rope_parameters=_MROPE))


def test_qwen35_hybrid_layers(tmp_path: Path) -> None:
    config = _config(tmp_path, _qwen35())
    assert config.architecture == "qwen35" and config.is_hybrid
    # the converter writes full_attention_interval = 4: every 4th layer is attention
    assert config.recurrent_layers == (True, True, True, False)
    assert config.deltanet is not None
    d = config.deltanet
    assert (d.conv_kernel, d.num_k_heads, d.num_v_heads, d.head_k_dim, d.head_v_dim) == (4, 2, 4, 16, 24)
    assert d.value_head_order == ValueHeadOrder.TILED
    assert config.mrope_sections == (2, 1, 1) and config.rope_dim == 8
    assert config.mlp_kind == MlpKind.DENSE and config.intermediate_size == 96
    # q/k norms are read from the first attention layer (layer 3), not layer 0
    assert config.qk_norm and not config.attention_bias


def test_explicit_recurrent_layers_win_over_the_interval(tmp_path: Path) -> None:
    config = _config(tmp_path, _qwen35(), **{"qwen35.attention.recurrent_layers": [True, False, True, False]})
    assert config.recurrent_layers == (True, False, True, False)


def test_full_attention_interval_defaults_to_4(tmp_path: Path) -> None:
    config = _config(tmp_path, _qwen35(), **{"qwen35.full_attention_interval": None})
    assert config.recurrent_layers == (True, True, True, False)


def test_qwen35moe_and_qwen3next_shared_expert(tmp_path: Path) -> None:
    moe = _config(
        tmp_path,
        Qwen3_5MoeForCausalLM(
            Qwen3_5MoeTextConfig(**_QWEN35MOE_SIZES, **_HYBRID_MOE, rope_parameters=_MROPE)
        ),
    )
    assert moe.architecture == "qwen35moe" and moe.mlp_kind == MlpKind.SPARSE_MOE_SHARED
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 24)
    assert moe.shared_expert_intermediate_size == 40 and moe.norm_topk_prob
    assert moe.intermediate_size == 0  # optional for this architecture
    next_rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    nxt = _config(
        tmp_path,
        Qwen3NextForCausalLM(Qwen3NextConfig(**_HYBRID_SIZES, **_HYBRID_MOE, rope_parameters=next_rope)),
    )
    assert nxt.architecture == "qwen3next" and nxt.mlp_kind == MlpKind.SPARSE_MOE_SHARED
    assert nxt.deltanet is not None and nxt.deltanet.value_head_order == ValueHeadOrder.GROUPED
    assert nxt.mrope_sections is None and nxt.shared_expert_intermediate_size == 40


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"qwen35.ssm.conv_kernel": None}, r"missing required metadata key 'qwen35\.ssm\.conv_kernel'"),
        ({"qwen35.ssm.group_count": None}, r"missing required metadata key 'qwen35\.ssm\.group_count'"),
        ({"qwen35.ssm.inner_size": None}, r"missing required metadata key 'qwen35\.ssm\.inner_size'"),
        ({"qwen35.ssm.state_size": 0}, r"'qwen35\.ssm\.state_size' must be positive, got 0"),
        ({"qwen35.ssm.inner_size": 90}, r"'qwen35\.ssm\.inner_size' = 90 is not a multiple of"),
        ({"qwen35.ssm.group_count": 3}, r"'qwen35\.ssm\.time_step_rank' = 4 is not a multiple of"),
        ({"qwen35.full_attention_interval": 0}, r"'qwen35\.full_attention_interval' must be positive"),
        (
            {"qwen35.attention.recurrent_layers": [True, False]},
            r"'qwen35\.attention\.recurrent_layers' should be 4 booleans",
        ),
        (
            {"qwen35.rope.dimension_sections": None},
            r"missing required metadata key 'qwen35\.rope\.dimension_sections'",
        ),
        ({"qwen35.rope.dimension_sections": [2, 1, 1]}, r"'qwen35\.rope\.dimension_sections' should be 4"),
        ({"qwen35.rope.dimension_sections": [2, 2, 1, 0]}, r"must sum to the 4 rotated pairs"),
    ],
)
def test_invalid_hybrid_values_are_named(overrides: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=message):
        _config(tmp_path, _qwen35(), **overrides)


def test_qwen35moe_needs_the_shared_expert_width(tmp_path: Path) -> None:
    model = Qwen3_5MoeForCausalLM(
        Qwen3_5MoeTextConfig(**_QWEN35MOE_SIZES, **_HYBRID_MOE, rope_parameters=_MROPE)
    )
    with pytest.raises(
        GGUFError, match=r"missing required metadata key 'qwen35moe\.expert_shared_feed_forward_length'"
    ):
        _config(tmp_path, model, **{"qwen35moe.expert_shared_feed_forward_length": None})


def test_llama3_rope_freqs(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = _config(tmp_path, _llama(rope_parameters=rope))
    assert config.rope_scaling is None
    factors = config.rope_freq_factors
    assert factors is not None and len(factors) == 8
    # fast pairs unscaled, slow pairs divided by the full factor, a smooth band in between
    assert factors[0] == 1.0 and factors[-1] == 8.0
    assert any(1.0 < x < 8.0 for x in factors)


def test_linear_and_yarn_scaling(tmp_path: Path) -> None:
    linear = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    config = _config(tmp_path, _llama(rope_parameters=linear))
    assert config.rope_scaling == RopeScaling(type=RopeScalingType.LINEAR, factor=2.0)

    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    config = _config(tmp_path, Qwen2ForCausalLM(Qwen2Config(**_SIZES, rope_parameters=yarn)))
    assert config.rope_scaling == RopeScaling(
        type=RopeScalingType.YARN, factor=4.0, original_context_length=128
    )


def test_factor_without_type_is_linear(tmp_path: Path) -> None:
    """llama.cpp's default scaling type is linear."""
    config = _config(tmp_path, _llama(), **{"llama.rope.scaling.factor": 4.0})
    assert config.rope_scaling == RopeScaling(type=RopeScalingType.LINEAR, factor=4.0)


def test_head_dim_defaults_to_hidden_over_heads(tmp_path: Path) -> None:
    config = _config(
        tmp_path, _llama(), **{"llama.attention.key_length": None, "llama.attention.value_length": None}
    )
    assert config.head_dim == 16


def test_config_is_frozen(tmp_path: Path) -> None:
    config = _config(tmp_path, _llama())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_layers = 3  # type: ignore[misc]


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedArchitectureError) as info:
        _config(tmp_path, _llama(), **{"general.architecture": "mamba"})
    assert isinstance(info.value, GGUFError)
    assert "'mamba'" in str(info.value)
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize(
    "key",
    [
        "llama.embedding_length",
        "llama.block_count",
        "llama.attention.head_count",
        "llama.attention.layer_norm_rms_epsilon",
        "llama.context_length",
        "llama.feed_forward_length",
    ],
)
def test_missing_required_key_is_named(key: str, tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=f"missing required metadata key '{key}'"):
        _config(tmp_path, _llama(), **{key: None})


def test_missing_vocabulary(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=r"'llama\.vocab_size' \(or 'tokenizer\.ggml\.tokens'\)"):
        _config(tmp_path, _llama(), **{"llama.vocab_size": None, "tokenizer.ggml.tokens": None})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"llama.block_count": 0}, r"'llama\.block_count' must be positive, got 0"),
        ({"llama.attention.head_count": -4}, r"'llama\.attention\.head_count' must be positive, got -4"),
        ({"llama.attention.layer_norm_rms_epsilon": 0.0}, r"layer_norm_rms_epsilon' must be positive"),
        ({"llama.attention.head_count_kv": 3}, r"head_count' = 4 is not a multiple of .*head_count_kv' = 3"),
        (
            {"llama.attention.head_count": 6, "llama.attention.key_length": None},
            r"key_length' is absent and llama\.embedding_length = 64 is not a multiple",
        ),
        ({"llama.attention.value_length": 8}, r"value_length' = 8 differs from the key length 16"),
        ({"llama.rope.dimension_count": 15}, r"dimension_count' = 15 must be even"),
        (
            {"llama.rope.dimension_count": 32},
            r"dimension_count' = 32 must be even and at most the head size 16",
        ),
        ({"llama.embedding_length": "wide"}, r"'llama\.embedding_length' should be an integer, got 'wide'"),
        ({"llama.rope.freq_base": "x"}, r"'llama\.rope\.freq_base' should be a number"),
        ({"llama.rope.scaling.type": "longrope"}, r"rope scaling type 'longrope' .* not supported"),
        (
            {"llama.rope.scaling.type": "yarn"},
            r"missing required metadata key 'llama\.rope\.scaling\.factor'",
        ),
        (
            {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
            r"missing required metadata key 'llama\.rope\.scaling\.original_context_length'",
        ),
        (
            {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": -2.0},
            r"scaling\.factor' must be",
        ),
        (
            {"llama.rope.scaling.yarn_attn_factor": 1.2},
            r"'llama\.rope\.scaling\.yarn_attn_factor' is not supported",
        ),
    ],
)
def test_invalid_values_are_named(overrides: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=message) as info:
        _config(tmp_path, _llama(), **overrides)
    assert str(tmp_path) in str(info.value)  # the message names the file
