"""Tensor parallelism on the CPU: tiny models of every architecture split over two gloo ranks
(bubo/model/tensor_parallel.py), rank 0 leading the steps and rank 1 following
(bubo/engine/tensor_parallel_steps.py), against the same file run whole in one process.

One spawn of two ranks runs every model in turn (starting the ranks costs more than the models): a
prefill, greedy decode steps, then the cache cut back (a few positions, a recurrent-state snapshot, or
zero) and the same positions again. Greedy tokens must be identical and float32 logits within 1e-4 (the
split only reorders float32 sums: each rank sums its heads, columns or experts, then the all-reduce adds
the two parts); each rank holds about half the weight bytes. Quantized matrices (Q4_0 / Q8_0) are split
as blocks: llama's attention output and down projections, Qwen3-MoE's experts, Qwen3.5's DeltaNet.
"""

from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen4ExpForCausalLM,
    Qwen4ExpTextConfig,
)

from bubo.engine.runner import runner_for
from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model.loader import load_decoder
from bubo.model.quantized_linear import QuantizedLinear, packing_deferred
from bubo.model.tensor_parallel import SHARDED_REASON, TensorParallel, shard_decoder
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.fixtures.hybrid_models import tiny_hybrid
from tests.fixtures.qwen4exp_gguf import TINY_QWEN4EXP_CONFIG, write_qwen4exp_gguf
from tests.model.tensor_parallel_ranks import load, run_split, scenario

TOLERANCE = 1e-4
# Each rank's share of the whole model's weight bytes: half, give or take the replicated norms, the
# router and (qwen4exp) the hyper-connections, indexer and n-gram table.
SHARE = (0.45, 0.62)

_DENSE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "rms_norm_eps": 1e-6,
}
_LLAMA_Q = {
    "token_embd.weight": Q.Q8_0,  # tied: the head is the same blocks, split by vocabulary rows
    "blk.*.attn_q.weight": Q.Q4_0,
    "blk.*.attn_output.weight": Q.Q4_0,  # 2 heads x 16 = one Q4_0 block of columns a rank
    "blk.*.ffn_down.weight": Q.Q8_0,
    "blk.*.ffn_gate.weight": Q.Q8_0,
}
_HYBRID_LAYERS = ["linear_attention", "full_attention"]
_DELTANET_Q8 = {
    pattern: Q.Q8_0
    for pattern in (
        "blk.*.attn_qkv.weight",
        "blk.*.attn_gate.weight",
        "blk.*.ssm_out.weight",
        "blk.*.attn_output.weight",
    )
}


def _random(model: PreTrainedModel) -> PreTrainedModel:
    model.config._attn_implementation = "eager"
    randomize_(model)
    return model.eval()


def _write(name: str, directory: Path) -> Path:
    path = directory / f"{name}.gguf"
    if name == "llama":
        model = _random(LlamaForCausalLM(LlamaConfig(**_DENSE, tie_word_embeddings=True)))
        return write_gguf(model, path, quantize=_LLAMA_Q)
    if name == "qwen2":
        return write_gguf(_random(Qwen2ForCausalLM(Qwen2Config(**_DENSE, tie_word_embeddings=False))), path)
    if name == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**_DENSE, head_dim=32, tie_word_embeddings=False))
        return write_gguf(_random(model), path)
    if name == "qwen3moe":
        config = Qwen3MoeConfig(
            **{**_DENSE, "intermediate_size": 96},
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            head_dim=32,
        )
        return write_gguf(
            _random(Qwen3MoeForCausalLM(config)), path, quantize={"blk.*.ffn_*_exps.weight": Q.Q8_0}
        )
    if name == "qwen3next":  # grouped value heads, the fused ssm_in and ssm_ba, a shared expert
        return write_gguf(_random(tiny_hybrid("qwen3next", _HYBRID_LAYERS)), path, fused_qkvz=True)
    if name == "qwen35":  # tiled value heads of 32 (one Q8_0 block of ssm_out's columns each)
        model = tiny_hybrid("qwen35", _HYBRID_LAYERS, linear_value_head_dim=32)
        return write_gguf(_random(model), path, quantize=_DELTANET_Q8)
    if name == "qwen35moe":
        return write_gguf(_random(tiny_hybrid("qwen35moe", _HYBRID_LAYERS)), path)
    assert name == "qwen4exp"
    return write_qwen4exp_gguf(_random(Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**TINY_QWEN4EXP_CONFIG))), path)


ARCHS = ["llama", "qwen2", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe", "qwen4exp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, dict, int]]:
    """Per architecture: the split run's rank 0 results, the whole model's, and rank 1's weight bytes."""
    directory = tmp_path_factory.mktemp("tensor-parallel")
    paths = [_write(name, directory) for name in ARCHS]
    run_split(paths, directory)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, path in zip(ARCHS, paths, strict=True):
            whole = scenario(load(path))
            split = torch.load(directory / f"{name}.rank0.pt")
            other = torch.load(directory / f"{name}.rank1.pt")["weight_bytes"]
            out[name] = (split, whole, other)
        return out
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", ARCHS)
def test_split_model_matches_the_whole(arch: str, runs: dict[str, tuple[dict, dict, int]]) -> None:
    split, whole, rank1_bytes = runs[arch]
    assert split["greedy"] == whole["greedy"]
    deltas = {
        key: (split[key] - whole[key]).abs().max().item()
        for key in ("prefill", "decode", "again", "from_zero")
    }
    shares = [b / whole["weight_bytes"] for b in (split["weight_bytes"], rank1_bytes)]
    print(f"{arch}: max|Δlogit| {deltas}; weight bytes a rank / whole {shares[0]:.3f}, {shares[1]:.3f}")
    assert max(deltas.values()) <= TOLERANCE
    assert all(SHARE[0] <= s <= SHARE[1] for s in shares)


def test_a_split_that_would_cut_a_head_or_a_block_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="2 KV heads can't be split evenly over 3 ranks"):
        shard_decoder(load(_write("llama", tmp_path)), TensorParallel(0, 3))
    # Four ranks would give each one head of 16 columns of the Q4_0 attention output: half a block.
    model = _random(LlamaForCausalLM(LlamaConfig(**{**_DENSE, "num_key_value_heads": 4})))
    path = write_gguf(model, tmp_path / "mha.gguf", quantize={"blk.*.attn_output.weight": Q.Q4_0})
    with pytest.raises(ValueError, match="cut its blocks"):
        shard_decoder(load(path), TensorParallel(0, 4))


def test_the_runner_runs_a_split_model_eagerly_and_says_why(tmp_path: Path) -> None:
    model = shard_decoder(load(_write("qwen2", tmp_path)), TensorParallel(0, 2))
    plan = runner_for(model).plan
    assert plan.decode.path == "eager" and plan.decode.reason == SHARDED_REASON
    assert runner_for(model).decode_step(model.new_cache(max_len=4)) is None


def test_a_rank_keeps_views_of_the_file_and_packs_only_its_shard(tmp_path: Path) -> None:
    """Row and column slices of quantized blocks are views of the memory map (columns strided), never
    copies; a model loaded inside packing_deferred packs nothing until the shard's matrices are made."""
    f = GGUFFile(_write("llama", tmp_path))
    model = shard_decoder(load_decoder(f, config_from_gguf(f)), TensorParallel(1, 2))
    o_proj = model.layers[0].attention.o_proj.inner
    file_blocks = f.tensors["blk.0.attn_output.weight"].raw
    assert o_proj.raw.untyped_storage().data_ptr() == file_blocks.untyped_storage().data_ptr()
    assert not o_proj.raw.is_contiguous() and o_proj.in_features == 32
    q_proj = model.layers[0].attention.q_proj
    assert q_proj.raw.data_ptr() == f.tensors["blk.0.attn_q.weight"].raw[32:].data_ptr()  # heads 2, 3

    blocks = torch.from_numpy(gguf.quants.quantize(torch.randn(256, 512).numpy(), Q.Q8_0))
    with packing_deferred():
        assert QuantizedLinear(blocks, Q.Q8_0, 512).packed is None
    assert QuantizedLinear(blocks, Q.Q8_0, 512).packed is not None
