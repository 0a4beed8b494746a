"""What a model is, as Bubo runs it: `ModelConfig` and the sizes and kinds it holds (a hybrid's DeltaNet,
qwen4exp's indexer and n-gram embedding, the rope's style and scaling). bubo/gguf/config.py reads them
from a GGUF file's metadata."""

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

__all__ = [
    "DeltaNetSizes",
    "IndexerSizes",
    "MlpKind",
    "ModelConfig",
    "PLESizes",
    "RopeScaling",
    "RopeScalingType",
    "RopeStyle",
    "ValueHeadOrder",
]


class RopeStyle(StrEnum):
    """Which pairs of head dimensions a rotary embedding rotates together.

    INTERLEAVED rotates (0, 1), (2, 3), …: llama.cpp's "norm" rope. llama.cpp's converter permutes
    llama's q/k rows into this layout, so the file's weights need it.
    NEOX rotates (i, i + rope_dim/2): the layout Hugging Face checkpoints use, kept as-is by the
    converter for qwen2/qwen3.

    Bubo rotates the way the file's layout asks instead of un-permuting llama's q/k rows on load:
    the weights stay byte-for-byte the file's (quantized ones zero-copy from the memory map, which
    a row shuffle would have to copy), every tensor matches what llama.cpp computes with, and
    later architectures bring their own llama.cpp rope modes (e.g. qwen4exp's interleaved mRoPE)
    as further styles. Attention scores are unchanged either way: q and k get the same permutation
    within each head, and a dot product doesn't depend on the order of its terms.
    """

    INTERLEAVED = "interleaved"
    NEOX = "neox"


class MlpKind(StrEnum):
    """The feed-forward block of every layer: DENSE is one SwiGLU MLP, SPARSE_MOE routes each token
    to `num_experts_per_tok` of `num_experts` SwiGLU experts (Qwen3-MoE)."""

    DENSE = "dense"
    SPARSE_MOE = "sparse_moe"
    # SPARSE_MOE plus one always-on shared expert scaled by sigmoid(w·x) (Qwen3-Next, Qwen3.5-MoE).
    SPARSE_MOE_SHARED = "sparse_moe_shared"


class ValueHeadOrder(StrEnum):
    """How a hybrid file orders the Gated DeltaNet's value heads (bubo.model.deltanet explains)."""

    GROUPED = "grouped"
    TILED = "tiled"


@dataclass(frozen=True)
class DeltaNetSizes:
    """The Gated DeltaNet layers' sizes (`{arch}.ssm.*`)."""

    conv_kernel: int  # ssm.conv_kernel
    num_k_heads: int  # ssm.group_count
    num_v_heads: int  # ssm.time_step_rank
    head_k_dim: int  # ssm.state_size
    head_v_dim: int  # ssm.inner_size / ssm.time_step_rank
    value_head_order: ValueHeadOrder
    # Activation of the gated output norm: no key says it; llama.cpp hard-codes sigmoid for qwen4exp.
    gate_activation: Literal["silu", "sigmoid"] = "silu"


@dataclass(frozen=True)
class IndexerSizes:
    """qwen4exp's QSA indexer (`{arch}.attention.indexer.*`, `{arch}.attention.compress_ratios`)."""

    num_heads: int  # attention.indexer.head_count
    head_dim: int  # attention.indexer.key_length
    budget: int  # attention.indexer.top_k: tokens (not blocks) of complete blocks each query keeps
    # Per layer: tokens per block; 0 on recurrent layers, and on attention layers that run dense.
    compress_ratios: tuple[int, ...]


@dataclass(frozen=True)
class PLESizes:
    """qwen4exp's per-layer n-gram embedding (`{arch}.ple.*`), on one layer."""

    layer: int  # ple.layers[0], 0-based
    table_dim: int  # embedding_length_per_layer_input: row width of per_layer_token_embd
    conv_kernel: int  # ple.conv_kernel
    ngram_size: int  # ple.ngram_size
    heads_per_ngram: int  # ple.heads_per_ngram
    eos_token_id: int  # ple.eos_token_id: the token that cuts n-gram contexts
    layer_multipliers: tuple[int, ...]  # ple.layer_multipliers (uint64 in the file, all below 2⁶³)
    head_offsets: tuple[int, ...]  # ple.head_offsets
    head_vocab_sizes: tuple[int, ...]  # ple.head_vocab_sizes


class RopeScalingType(StrEnum):
    LINEAR = "linear"
    YARN = "yarn"


@dataclass(frozen=True)
class RopeScaling:
    """Context-extension scaling of the rotary frequencies (`{arch}.rope.scaling.*`)."""

    type: RopeScalingType
    factor: float
    # YaRN only: the context the model was pretrained with, and the ramp between extrapolated
    # (fast-rotating) and interpolated (slow) dimensions, in rotations over that context.
    original_context_length: int | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one model, as llama.cpp reads them from a GGUF file."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    context_length: int
    rope_theta: float
    rope_dim: int  # leading dimensions of each head that are rotated; the rest pass through
    rope_style: RopeStyle
    rope_scaling: RopeScaling | None = None
    # llama3: per-frequency divisors from the `rope_freqs.weight` tensor (rope_dim / 2 of them).
    rope_freq_factors: tuple[float, ...] | None = None
    attention_bias: bool = False  # q/k/v projections carry biases (qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head before rope (qwen3)
    tie_word_embeddings: bool = False  # no output.weight: logits use the token embedding matrix
    mlp_kind: MlpKind = MlpKind.DENSE
    # SPARSE_MOE only (0 / False otherwise):
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k: experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # rescale the top-k router probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # SPARSE_MOE_SHARED only
    # Hybrid models only: per layer, True where it is a Gated DeltaNet layer (the others are gated
    # full attention: q_proj also yields a sigmoid output gate); empty for plain transformers.
    recurrent_layers: tuple[bool, ...] = ()
    deltanet: DeltaNetSizes | None = None
    # Interleaved mRoPE [t, h, w] pair counts (qwen35); text positions reduce it to plain rope.
    mrope_sections: tuple[int, int, int] | None = None
    # Multi-token prediction (Qwen3-Next / Qwen3.5 `nextn` layers): how many MTP blocks follow the
    # num_layers decoder layers in the file (0: none, or the file dropped them).
    mtp_layers: int = 0
    # qwen4exp only: residual streams (0 = a plain single residual) and their mixers' rank.
    hc_count: int = 0
    hc_low_rank: int = 0
    indexer: IndexerSizes | None = None
    ple: PLESizes | None = None

    @property
    def is_hybrid(self) -> bool:
        return bool(self.recurrent_layers)
