"""Bubo against transformers' own GGUF loader: both read the same tiny random file, logits compared.

test_hybrid checks Bubo against the in-memory transformers model the file was written from; this is
the second, independent check that Bubo reads a file the way the ecosystem reads it
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`, transformers 5.24). What that loader
can and can't read, found in transformers/modeling_gguf_pytorch_utils.py and integrations/ggml.py:

- qwen35 / qwen35moe go through transformers' newer GGUF path (transformers/integrations/gguf/):
  `gguf_config_mapping.GGUF_CONFIG_ARCHS` rebuilds the whole config from the metadata (layer plan,
  `ssm.*` sizes, partial rotary, mRoPE sections, expert and shared-expert widths) and
  `gguf_conversion_mapping` undoes the converter's weight transforms (tiled value heads, ssm_a,
  conv, the +1 on zero-centred norms, the expert stacks). Both are compared below. qwen3next has
  no entry there and none in the older path's map either, so it is not compared here.
- qwen3moe, on the older path (modeling_gguf_pytorch_utils + integrations/ggml.py): its config map has no `expert_feed_forward_length`, so `moe_intermediate_size` keeps
  Qwen3MoeConfig's default 768 and a file with any other expert width fails to load (size
  mismatch on mlp.experts.*); it also has no `attention.key_length` for qwen3 (dense), whose
  head_dim then keeps Qwen3Config's default 128. Real Qwen3 checkpoints use exactly those
  defaults, which is why the loader works for them; the tiny models here use them too, and the
  narrower files are pinned as refused.
- llama and qwen2 are read completely (llama's q/k rows are un-permuted by LlamaTensorProcessor).

Every comparison is fp32, eager attention, tolerance 1e-3 on the logits of a 24-token prompt.
Measured max |Δlogit|: qwen35 7.0e-6, qwen35moe 7.6e-6, the others 1.4e-6 to 2.1e-6.
"""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
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
)

from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model.loader import load_decoder
from tests.fixtures.gguf_writer import randomize_, write_gguf

TOLERANCE = 1e-3  # fp32 Bubo vs fp32 transformers (TESTING.md)
VOCAB, TOKENS = 300, 24
_SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "tie_word_embeddings": False,
}
# The expert width and head size transformers' GGUF loader assumes (it reads neither from the file).
_HF_DEFAULT_MOE_WIDTH, _HF_DEFAULT_QWEN3_HEAD_DIM = 768, 128


def _llama() -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(**_SMALL, intermediate_size=96))


def _qwen2() -> PreTrainedModel:
    return Qwen2ForCausalLM(Qwen2Config(**_SMALL, intermediate_size=96))


def _qwen3(head_dim: int = _HF_DEFAULT_QWEN3_HEAD_DIM) -> PreTrainedModel:
    return Qwen3ForCausalLM(Qwen3Config(**_SMALL, intermediate_size=96, head_dim=head_dim))


def _qwen3moe(expert_width: int = _HF_DEFAULT_MOE_WIDTH) -> PreTrainedModel:
    config = Qwen3MoeConfig(
        **_SMALL,
        intermediate_size=96,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=expert_width,
        norm_topk_prob=True,  # what llama.cpp's qwen3moe always does
    )
    return Qwen3MoeForCausalLM(config)


_HYBRID = {
    **_SMALL,
    "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
}


def _qwen35() -> PreTrainedModel:
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_HYBRID, intermediate_size=96))


def _qwen35moe() -> PreTrainedModel:
    config = Qwen3_5MoeTextConfig(
        **_HYBRID,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    )
    return Qwen3_5MoeForCausalLM(config)


def _write(build: Callable[[], PreTrainedModel], path: Path) -> Path:
    model = build()
    randomize_(model)
    return write_gguf(model, path)


def _transformers_gguf(path: Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.mark.parametrize(
    "build",
    [_qwen35, _qwen35moe, _llama, _qwen2, _qwen3, _qwen3moe],
    ids=["qwen35", "qwen35moe", "llama", "qwen2", "qwen3", "qwen3moe"],
)
def test_bubo_reads_the_file_as_transformers_gguf_loader_does(
    build: Callable[[], PreTrainedModel], tmp_path: Path
) -> None:
    path = _write(build, tmp_path / "model.gguf")
    reference = _transformers_gguf(path)
    with GGUFFile(path) as f:
        model = load_decoder(f, config_from_gguf(f))
        tokens = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = reference(tokens).logits
            actual = model(tokens, model.new_cache(max_len=TOKENS))
    delta = (actual - expected).abs().max().item()
    print(f"{path.name}: max|Δlogit| {delta:.2e}")
    assert delta <= TOLERANCE


@pytest.mark.parametrize(
    "build", [lambda: _qwen3moe(expert_width=32), lambda: _qwen3(head_dim=16)], ids=["qwen3moe", "qwen3"]
)
def test_transformers_ignores_the_expert_width_and_head_size(
    build: Callable[[], PreTrainedModel], tmp_path: Path
) -> None:
    path = _write(build, tmp_path / "model.gguf")
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        _transformers_gguf(path)
