"""GGUF metadata -> `ModelConfig`: the one place that knows llama.cpp's key names per architecture.

Keys are read as llama.cpp writes them (`{arch}.embedding_length`, `{arch}.attention.head_count`, …).
Facts the metadata does not state are read from which tensors the file holds, as llama.cpp does:
q/k/v biases, per-head q/k norms, a separate output matrix (else the embedding is reused) and
llama3's `rope_freqs` frequency factors.

Mixture-of-experts files (qwen3moe) add `{arch}.expert_count`, `{arch}.expert_used_count` and
`{arch}.expert_feed_forward_length`, as llama.cpp's converter (Qwen2MoeModel, which Qwen3MoeModel
inherits) writes them.

The hybrid Qwen models (qwen3next, qwen35, qwen35moe) mix Gated DeltaNet layers with gated full
attention. Their files add the `{arch}.ssm.*` sizes of the DeltaNet, say which layers are recurrent
(`{arch}.attention.recurrent_layers`, else every `{arch}.full_attention_interval`-th layer is
attention, as llama.cpp reads them), qwen35's `{arch}.rope.dimension_sections` (interleaved mRoPE),
and for the MoE ones `{arch}.expert_shared_feed_forward_length` (the sigmoid-gated shared expert).

qwen4exp (Qwen3.8-Flash-Next) is a qwen35moe-shaped hybrid whose attention layers are QSA indexed
attention (`{arch}.attention.indexer.*`, `{arch}.attention.compress_ratios`), whose residual is
several hyper-connected streams (`{arch}.hyper_connection.*`) and which adds a hashed n-gram
embedding on one layer (`{arch}.ple.*`). Its Gated DeltaNet gates with a sigmoid, not silu.
"""

import math
import warnings
from typing import Any

import torch

from bubo.gguf.model_config import (
    DeltaNetSizes,
    IndexerSizes,
    MlpKind,
    ModelConfig,
    PLESizes,
    RopeScaling,
    RopeScalingType,
    RopeStyle,
    ValueHeadOrder,
)
from bubo.gguf.reader import GGUFError, GGUFFile

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedArchitectureError",
    "check_block_count",
    "config_from_gguf",
]

SUPPORTED_ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "qwen3next",
    "qwen35",
    "qwen35moe",
    "qwen4exp",
)


class UnsupportedArchitectureError(GGUFError):
    """The file's `general.architecture` is not one Bubo can run."""


# Per architecture, what the metadata can't say. Adding an architecture starts here.
_ROPE_STYLE = {
    "llama": RopeStyle.INTERLEAVED,
    "qwen2": RopeStyle.NEOX,
    "qwen3": RopeStyle.NEOX,
    "qwen3moe": RopeStyle.NEOX,
    "qwen3next": RopeStyle.NEOX,
    "qwen35": RopeStyle.NEOX,
    "qwen35moe": RopeStyle.NEOX,
    "qwen4exp": RopeStyle.NEOX,
}
# Every layer of a qwen3moe file is sparse, as llama.cpp builds it. Hugging Face's
# `decoder_sparse_step` / `mlp_only_layers` (dense layers among the sparse ones) have no GGUF key;
# a file with such layers would lack their expert tensors, and loading names the missing one.
# qwen3next's Hugging Face `decoder_sparse_step` / `mlp_only_layers` likewise have no key: llama.cpp
# builds every qwen3next layer as MoE with the shared expert.
_MLP_KIND = {
    "qwen3moe": MlpKind.SPARSE_MOE,
    "qwen3next": MlpKind.SPARSE_MOE_SHARED,
    "qwen35moe": MlpKind.SPARSE_MOE_SHARED,
    "qwen4exp": MlpKind.SPARSE_MOE_SHARED,
}
# The converter keeps Hugging Face's grouped value heads for qwen3next and tiles them for the
# qwen35 family (_LinearAttentionVReorderBase).
_HYBRID_VALUE_HEAD_ORDER = {
    "qwen3next": ValueHeadOrder.GROUPED,
    "qwen35": ValueHeadOrder.TILED,
    "qwen35moe": ValueHeadOrder.TILED,
    "qwen4exp": ValueHeadOrder.TILED,
}
# llama.cpp's default when a hybrid file has neither recurrent_layers nor full_attention_interval.
_DEFAULT_FULL_ATTENTION_INTERVAL = 4

# YaRN knobs whose llama.cpp semantics (attention-factor overrides and corrections) Bubo doesn't
# reproduce yet; a file that sets one is refused rather than run with a silently different rope.
_UNSUPPORTED_YARN_KEYS = (
    "rope.scaling.attn_factor",
    "rope.scaling.yarn_attn_factor",
    "rope.scaling.yarn_ext_factor",
    "rope.scaling.yarn_log_multiplier",
)


class _Metadata:
    """Typed access to one architecture's `{arch}.*` keys, with errors that name the key."""

    def __init__(self, f: GGUFFile, arch: str) -> None:
        self._f = f
        self._arch = arch

    def key(self, suffix: str) -> str:
        return f"{self._arch}.{suffix}"

    def error(self, problem: str) -> GGUFError:
        return GGUFError(f"{self._f.path}: {problem}")

    def has(self, suffix: str) -> bool:
        return self._f.get(self.key(suffix)) is not None

    def get_int(self, suffix: str, default: int | None = None) -> int:
        value = self._value(suffix, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"metadata key '{self.key(suffix)}' should be an integer, got {value!r}")
        return value

    def get_float(self, suffix: str, default: float | None = None) -> float:
        value = self._value(suffix, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(f"metadata key '{self.key(suffix)}' should be a number, got {value!r}")
        return float(value)

    def get_bool(self, suffix: str, default: bool | None = None) -> bool:
        value = self._value(suffix, default)
        if not isinstance(value, bool):
            raise self.error(f"metadata key '{self.key(suffix)}' should be a boolean, got {value!r}")
        return value

    def get_str(self, suffix: str, default: str | None = None) -> str:
        value = self._value(suffix, default)
        if not isinstance(value, str):
            raise self.error(f"metadata key '{self.key(suffix)}' should be a string, got {value!r}")
        return value

    def _value(self, suffix: str, default: Any) -> Any:
        value = self._f.get(self.key(suffix))
        if value is not None:
            return value
        if default is None:
            raise self.error(f"missing required metadata key '{self.key(suffix)}'")
        return default


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """Read the model hyper-parameters of `f`; raise GGUFError naming any missing or invalid key."""
    arch = f.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{f.path}: architecture '{arch}' is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    meta = _Metadata(f, arch)

    hidden_size = meta.get_int("embedding_length")
    num_heads = meta.get_int("attention.head_count")
    _require_positive(meta, hidden_size=hidden_size, num_heads=num_heads)
    if meta.has("attention.key_length"):
        head_dim = meta.get_int("attention.key_length")
    elif hidden_size % num_heads == 0:
        head_dim = hidden_size // num_heads
    else:
        raise meta.error(
            f"'{meta.key('attention.key_length')}' is absent and "
            f"{meta.key('embedding_length')} = {hidden_size} is not a multiple of "
            f"{meta.key('attention.head_count')} = {num_heads}"
        )
    num_kv_heads = meta.get_int("attention.head_count_kv", default=num_heads)
    rope_dim = meta.get_int("rope.dimension_count", default=head_dim)
    num_layers, mtp_layers = _layer_counts(f, meta, arch)
    mlp_kind = _MLP_KIND.get(arch, MlpKind.DENSE)
    hybrid = _hybrid_fields(f, meta, num_layers, mtp_layers)
    # Which tensors a layer has says whether attention has biases and q/k norms; in a hybrid file
    # layer 0 is usually a DeltaNet layer, so ask the first attention layer.
    recurrent = hybrid.get("recurrent_layers", ())
    attention_layer = next((i for i in range(num_layers) if not (recurrent and recurrent[i])), 0)
    p = f"blk.{attention_layer}."

    config = ModelConfig(
        architecture=arch,
        vocab_size=_vocab_size(f, meta),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        # The MoE-only hybrids (qwen35moe) have no dense width and their converter writes none.
        intermediate_size=meta.get_int(
            "feed_forward_length", default=0 if mlp_kind == MlpKind.SPARSE_MOE_SHARED else None
        ),
        rms_norm_eps=meta.get_float("attention.layer_norm_rms_epsilon"),
        context_length=meta.get_int("context_length"),
        rope_theta=meta.get_float("rope.freq_base", default=10000.0),
        rope_dim=rope_dim,
        rope_style=_ROPE_STYLE[arch],
        rope_scaling=_rope_scaling(meta),
        rope_freq_factors=_rope_freq_factors(f, meta, rope_dim),
        attention_bias=p + "attn_q.bias" in f.tensors,
        qk_norm=p + "attn_q_norm.weight" in f.tensors,
        tie_word_embeddings="output.weight" not in f.tensors,
        mtp_layers=mtp_layers,
        **_moe_fields(meta, mlp_kind),
        **hybrid,
        **(_qwen4exp_fields(f, meta, recurrent, mtp_layers) if arch == "qwen4exp" else {}),
    )
    _validate(meta, config)
    return config


# The architectures whose files may carry MTP blocks as `nextn` layers (qwen4exp's: bubo/model/
# hyper_connected_mtp.py).
_MTP_ARCHITECTURES = ("qwen3next", "qwen35", "qwen35moe", "qwen4exp")


def check_block_count(f: GGUFFile) -> None:
    """Raise GGUFError when the file's `block_count` is more than its tensors hold (blk.0 to blk.N-1): a
    broken file, on which anything that walks its layers would take as long as the count says."""
    meta = _Metadata(f, f.architecture)
    if not meta.has("block_count"):
        return
    blocks = meta.get_int("block_count")
    stored = 1 + max((_block_index(name) for name in f.tensors), default=-1)
    if blocks > stored:
        raise meta.error(
            f"'{meta.key('block_count')}' is {blocks} but the file's tensors hold {stored} blocks"
        )


def _block_index(tensor_name: str) -> int:
    """N of a `blk.N.` tensor; -1 for the others."""
    prefix, _, rest = tensor_name.partition(".")
    index = rest.partition(".")[0]
    return int(index) if prefix == "blk" and index.isdigit() else -1


def _layer_counts(f: GGUFFile, meta: _Metadata, arch: str) -> tuple[int, int]:
    """(decoder layers, MTP layers). llama.cpp counts `nextn_predict_layers` MTP blocks into
    `block_count` and stores them last (as for GLM-4.5); a file whose MTP block sits just past
    `block_count` is read too. Which one holds is told by where the `nextn.eh_proj` tensors are."""
    blocks = meta.get_int("block_count")
    check_block_count(f)
    nextn = meta.get_int("nextn_predict_layers", default=0)
    if nextn < 0:
        raise meta.error(f"'{meta.key('nextn_predict_layers')}' must be >= 0, got {nextn}")
    if nextn == 0 or arch not in _MTP_ARCHITECTURES:
        return blocks, 0
    for first in (blocks - nextn, blocks):
        if all(f"blk.{first + j}.nextn.eh_proj.weight" in f.tensors for j in range(nextn)):
            if nextn != 1:
                raise meta.error(f"'{meta.key('nextn_predict_layers')}' = {nextn}: Bubo runs one MTP block")
            return first, nextn
    raise meta.error(
        f"'{meta.key('nextn_predict_layers')}' = {nextn} but the file has no blk.N.nextn.eh_proj tensors"
    )


def _hybrid_fields(f: GGUFFile, meta: _Metadata, num_layers: int, mtp_layers: int) -> dict[str, Any]:
    order = _HYBRID_VALUE_HEAD_ORDER.get(f.architecture)
    if order is None:
        return {}
    if meta.has("attention.recurrent_layers"):
        recurrent = f.get(meta.key("attention.recurrent_layers"))
        # llama.cpp sizes per-layer arrays by block_count, which counts an MTP block kept inside it.
        lengths = {num_layers, num_layers + mtp_layers}
        if not (
            isinstance(recurrent, list)
            and len(recurrent) in lengths
            and all(isinstance(x, bool) for x in recurrent)
        ):
            raise meta.error(
                f"'{meta.key('attention.recurrent_layers')}' should be {num_layers} booleans "
                f"(one per layer), got {recurrent!r}"
            )
        recurrent = recurrent[:num_layers]
    else:
        interval = meta.get_int("full_attention_interval", default=_DEFAULT_FULL_ATTENTION_INTERVAL)
        if interval <= 0:
            raise meta.error(f"'{meta.key('full_attention_interval')}' must be positive, got {interval}")
        recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]

    num_v_heads = meta.get_int("ssm.time_step_rank")
    inner_size = meta.get_int("ssm.inner_size")
    sizes = {
        "ssm.conv_kernel": meta.get_int("ssm.conv_kernel"),
        "ssm.group_count": meta.get_int("ssm.group_count"),
        "ssm.time_step_rank": num_v_heads,
        "ssm.state_size": meta.get_int("ssm.state_size"),
        "ssm.inner_size": inner_size,
    }
    for suffix, value in sizes.items():
        if value <= 0:
            raise meta.error(f"'{meta.key(suffix)}' must be positive, got {value}")
    if inner_size % num_v_heads:
        raise meta.error(
            f"'{meta.key('ssm.inner_size')}' = {inner_size} is not a multiple of "
            f"'{meta.key('ssm.time_step_rank')}' = {num_v_heads}"
        )
    if num_v_heads % sizes["ssm.group_count"]:
        raise meta.error(
            f"'{meta.key('ssm.time_step_rank')}' = {num_v_heads} is not a multiple of "
            f"'{meta.key('ssm.group_count')}' = {sizes['ssm.group_count']}"
        )
    fields: dict[str, Any] = {
        "recurrent_layers": tuple(recurrent),
        "deltanet": DeltaNetSizes(
            conv_kernel=sizes["ssm.conv_kernel"],
            num_k_heads=sizes["ssm.group_count"],
            num_v_heads=num_v_heads,
            head_k_dim=sizes["ssm.state_size"],
            head_v_dim=inner_size // num_v_heads,
            value_head_order=order,
            gate_activation="sigmoid" if f.architecture == "qwen4exp" else "silu",
        ),
    }
    if f.architecture in ("qwen35", "qwen35moe", "qwen4exp"):
        fields["mrope_sections"] = _mrope_sections(f, meta)
    if _MLP_KIND.get(f.architecture) == MlpKind.SPARSE_MOE_SHARED:
        fields["shared_expert_intermediate_size"] = meta.get_int("expert_shared_feed_forward_length")
    return fields


def _int_array(
    f: GGUFFile, meta: _Metadata, suffix: str, length: int | None = None, extra: int = 0
) -> tuple[int, ...]:
    """The array `suffix`: `length` non-negative integers (any number if None), or `length + extra`
    of which the first `length` are returned (a per-layer array sized by a block_count that counts
    `extra` MTP blocks)."""
    key = meta.key(suffix)
    value = f.get(key)
    if value is None:
        raise meta.error(f"missing required metadata key '{key}'")
    if not (
        isinstance(value, list)
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
        and (length is None or len(value) in (length, length + extra))
    ):
        count = "" if length is None else f"{length} "
        raise meta.error(f"'{key}' should be {count}non-negative integers, got {value!r}")
    return tuple(value if length is None else value[:length])


def _qwen4exp_fields(
    f: GGUFFile, meta: _Metadata, recurrent: tuple[bool, ...], mtp_layers: int
) -> dict[str, Any]:
    num_layers = len(recurrent)
    hc_count = meta.get_int("hyper_connection.count")
    if hc_count < 2:
        raise meta.error(f"'{meta.key('hyper_connection.count')}' must be at least 2, got {hc_count}")
    # The converter writes ratio 0 for an MTP block (llama.cpp's draft attends densely); the block
    # follows vLLM and reads the trunk's ratio instead (bubo/model/hyper_connected_mtp.py).
    ratios = _int_array(f, meta, "attention.compress_ratios", num_layers, mtp_layers)
    indexer = IndexerSizes(
        num_heads=meta.get_int("attention.indexer.head_count"),
        head_dim=meta.get_int("attention.indexer.key_length"),
        budget=meta.get_int("attention.indexer.top_k"),
        compress_ratios=tuple(0 if rec else r for rec, r in zip(recurrent, ratios, strict=True)),
    )
    dense = [i for i, r in enumerate(indexer.compress_ratios) if not recurrent[i] and r == 0]
    if dense:
        # Spec 2.3: a converter run under transformers >= 5.23 sees the QSA layers spelled
        # `indexed_attention` and writes ratio 0 for all of them. llama.cpp then runs those layers
        # as plain causal gated attention, and so does Bubo (the indexer tensors stay unused): that
        # matches llama.cpp, but not the original model once a query sees more than the budget.
        warnings.warn(
            f"{f.path}: '{meta.key('attention.compress_ratios')}' is 0 on attention layers {dense}, "
            "which turns their QSA sparse attention dense (a known converter slip, usually every ratio 0); "
            "running them as plain gated attention as llama.cpp does, so logits beyond the indexer budget "
            "differ from the original model",
            stacklevel=3,
        )
    return {
        "hc_count": hc_count,
        "hc_low_rank": meta.get_int("hyper_connection.low_rank"),
        "indexer": indexer,
        "ple": _ple_sizes(f, meta, recurrent) if meta.has("ple.layers") else None,
    }


def _ple_sizes(f: GGUFFile, meta: _Metadata, recurrent: tuple[bool, ...]) -> PLESizes:
    layers = _int_array(f, meta, "ple.layers")
    # llama.cpp accepts exactly one PLE layer; the real model has one.
    if len(layers) != 1 or layers[0] >= len(recurrent) or not recurrent[layers[0]]:
        raise meta.error(
            f"'{meta.key('ple.layers')}' = {list(layers)} should name exactly one linear-attention layer"
        )
    ngram_size = meta.get_int("ple.ngram_size")
    heads_per_ngram = meta.get_int("ple.heads_per_ngram")
    num_heads = (ngram_size - 1) * heads_per_ngram
    return PLESizes(
        layer=layers[0],
        table_dim=meta.get_int("embedding_length_per_layer_input"),
        conv_kernel=meta.get_int("ple.conv_kernel"),
        ngram_size=ngram_size,
        heads_per_ngram=heads_per_ngram,
        eos_token_id=meta.get_int("ple.eos_token_id"),
        layer_multipliers=_int_array(f, meta, "ple.layer_multipliers", ngram_size),
        head_offsets=_int_array(f, meta, "ple.head_offsets", num_heads),
        head_vocab_sizes=_int_array(f, meta, "ple.head_vocab_sizes", num_heads),
    )


def _mrope_sections(f: GGUFFile, meta: _Metadata) -> tuple[int, int, int]:
    key = meta.key("rope.dimension_sections")
    sections = f.get(key)
    if sections is None:
        raise meta.error(f"missing required metadata key '{key}'")
    # llama.cpp's four slots: t, h, w and a fourth the text rope never uses (0 as converted).
    if not (
        isinstance(sections, list)
        and len(sections) == 4
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in sections)
    ):
        raise meta.error(f"'{key}' should be 4 non-negative integers, got {sections!r}")
    return sections[0], sections[1], sections[2]


def _moe_fields(meta: _Metadata, kind: MlpKind) -> dict[str, Any]:
    if kind == MlpKind.DENSE:
        return {}
    # llama.cpp's qwen3moe graph always renormalises the top-k weights (the `true` after
    # LLM_FFN_SILU in src/models/qwen3moe.cpp) and its converter writes no
    # `expert_weights_norm`, though Hugging Face's Qwen3MoeConfig defaults norm_topk_prob to
    # False; transformers' GGUF loader sets it to True for the same reason. A file that says
    # otherwise would run differently here than in llama.cpp, so it is refused, not obeyed.
    if not meta.get_bool("expert_weights_norm", default=True):
        raise meta.error(
            f"'{meta.key('expert_weights_norm')}' = false is not supported: "
            "llama.cpp always renormalises this architecture's top-k expert weights"
        )
    return {
        "mlp_kind": kind,
        "num_experts": meta.get_int("expert_count"),
        "num_experts_per_tok": meta.get_int("expert_used_count"),
        "moe_intermediate_size": meta.get_int("expert_feed_forward_length"),
        "norm_topk_prob": True,
    }


def _vocab_size(f: GGUFFile, meta: _Metadata) -> int:
    # llama's converter writes {arch}.vocab_size; qwen's doesn't, and the token list is the vocabulary.
    if meta.has("vocab_size"):
        return meta.get_int("vocab_size")
    tokens = f.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise meta.error(
            f"missing required metadata key '{meta.key('vocab_size')}' (or 'tokenizer.ggml.tokens')"
        )
    return len(tokens)


def _rope_scaling(meta: _Metadata) -> RopeScaling | None:
    for suffix in _UNSUPPORTED_YARN_KEYS:
        if meta.has(suffix):
            raise meta.error(f"metadata key '{meta.key(suffix)}' is not supported")
    # llama.cpp's default scaling type is linear: a factor without a type still scales.
    kind = meta.get_str("rope.scaling.type", default="linear" if meta.has("rope.scaling.factor") else "none")
    if kind == "none":
        return None
    if kind not in set(RopeScalingType):
        raise meta.error(
            f"rope scaling type '{kind}' ({meta.key('rope.scaling.type')}) is not supported "
            f"(supported: none, {', '.join(RopeScalingType)})"
        )
    factor = meta.get_float("rope.scaling.factor")
    if factor == 1.0 and kind == RopeScalingType.LINEAR:
        return None
    if kind == RopeScalingType.LINEAR:
        return RopeScaling(type=RopeScalingType.LINEAR, factor=factor)
    return RopeScaling(
        type=RopeScalingType.YARN,
        factor=factor,
        original_context_length=meta.get_int("rope.scaling.original_context_length"),
        yarn_beta_fast=meta.get_float("rope.scaling.yarn_beta_fast", default=32.0),
        yarn_beta_slow=meta.get_float("rope.scaling.yarn_beta_slow", default=1.0),
    )


def _rope_freq_factors(f: GGUFFile, meta: _Metadata, rope_dim: int) -> tuple[float, ...] | None:
    tensor = f.tensors.get("rope_freqs.weight")
    if tensor is None:
        return None
    if tensor.shape != (rope_dim // 2,):
        raise meta.error(
            f"tensor 'rope_freqs.weight' has shape {tensor.shape}, expected ({rope_dim // 2},) "
            f"(half of {meta.key('rope.dimension_count')} = {rope_dim})"
        )
    return tuple(tensor.dequantize(torch.float32).tolist())


# ModelConfig field -> the metadata key (after "{arch}.") it comes from, for error messages.
_KEY_OF_FIELD = {
    "vocab_size": "vocab_size",
    "hidden_size": "embedding_length",
    "num_layers": "block_count",
    "num_heads": "attention.head_count",
    "num_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "intermediate_size": "feed_forward_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "context_length": "context_length",
    "rope_theta": "rope.freq_base",
    "rope_dim": "rope.dimension_count",
}
_KEY_OF_MOE_FIELD = {
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
}
_KEY_OF_ANY_FIELD = {
    **_KEY_OF_FIELD,
    **_KEY_OF_MOE_FIELD,
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
}


def _require_positive(meta: _Metadata, **values: int | float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value > 0):
            key = _KEY_OF_ANY_FIELD[name]
            raise meta.error(f"'{meta.key(key)}' must be positive, got {value}")


def _validate(meta: _Metadata, c: ModelConfig) -> None:
    # A shared-expert MoE file may lack the dense width (intermediate_size 0): nothing uses it.
    dense_width_optional = c.mlp_kind == MlpKind.SPARSE_MOE_SHARED and c.intermediate_size == 0
    required = [name for name in _KEY_OF_FIELD if not (name == "intermediate_size" and dense_width_optional)]
    _require_positive(meta, **{name: getattr(c, name) for name in required})
    if c.mlp_kind != MlpKind.DENSE:
        _require_positive(meta, **{name: getattr(c, name) for name in _KEY_OF_MOE_FIELD})
        if c.num_experts_per_tok > c.num_experts:
            raise meta.error(
                f"'{meta.key('expert_used_count')}' = {c.num_experts_per_tok} exceeds "
                f"'{meta.key('expert_count')}' = {c.num_experts}"
            )
    if c.mlp_kind == MlpKind.SPARSE_MOE_SHARED:
        _require_positive(meta, shared_expert_intermediate_size=c.shared_expert_intermediate_size)
    if c.mrope_sections is not None and sum(c.mrope_sections) != c.rope_dim // 2:
        raise meta.error(
            f"'{meta.key('rope.dimension_sections')}' = {list(c.mrope_sections)} must sum to the "
            f"{c.rope_dim // 2} rotated pairs ('{meta.key('rope.dimension_count')}' = {c.rope_dim} / 2)"
        )
    if c.num_heads % c.num_kv_heads:
        raise meta.error(
            f"'{meta.key('attention.head_count')}' = {c.num_heads} is not a multiple of "
            f"'{meta.key('attention.head_count_kv')}' = {c.num_kv_heads}"
        )
    value_length = meta.get_int("attention.value_length", default=c.head_dim)
    if value_length != c.head_dim:
        raise meta.error(
            f"'{meta.key('attention.value_length')}' = {value_length} differs from the key length {c.head_dim}; "
            "separate value head sizes are not supported"
        )
    if c.rope_dim % 2 or c.rope_dim > c.head_dim:
        raise meta.error(
            f"'{meta.key('rope.dimension_count')}' = {c.rope_dim} must be even and at most the head size {c.head_dim}"
        )
    scaling = c.rope_scaling
    if scaling is not None:
        if not (math.isfinite(scaling.factor) and scaling.factor > 0):
            raise meta.error(f"'{meta.key('rope.scaling.factor')}' must be positive, got {scaling.factor}")
        if scaling.original_context_length is not None and scaling.original_context_length <= 0:
            raise meta.error(
                f"'{meta.key('rope.scaling.original_context_length')}' must be positive, "
                f"got {scaling.original_context_length}"
            )
    if c.rope_freq_factors is not None and not all(x > 0 for x in c.rope_freq_factors):
        raise meta.error("tensor 'rope_freqs.weight' holds non-positive frequency factors")
