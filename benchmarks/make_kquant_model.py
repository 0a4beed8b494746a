"""A K-quant benchmark file whose matrices are all whole 256-weight super-blocks: random weights at the
widths of a ~0.4B llama (hidden 1024, MLP 3072, 24 layers, 16 query heads over 8 KV heads of 64, tied
embeddings), the default model's tokenizer, written as F16 and quantized by llama.cpp to Q4_K_M.

The default model's Q4_K_M (SmolLM2-135M, hidden 576) is mostly Q5_0 because 576 is not a multiple of
256; this file has the Q4_K / Q6_K mix a real Q4_K_M of a larger model has (Q4_K almost everywhere, Q6_K
for the embedding and half the layers' attn_v / ffn_down). Random weights: for speed and memory
figures only, its text is noise.

`--moe` writes a qwen3moe file instead, at Qwen3-30B-A3B's widths (hidden 2048, 32 query heads over 4
KV heads of 128, 8 of its experts of width 768 routed per token, an untied output head) with fewer
layers and experts (`--layers`, default 6; `--experts`, default 32): a decoded token does the work of
that many of Qwen3-30B-A3B's 48 layers, while the file stays small enough to make and hold here.
`--hybrid qwen35moe` writes bench_hybrid.py's random qwen35moe (Gated DeltaNet + gated attention,
shared-expert MoE; hidden 512, 64 experts of 256), `--hybrid qwen3next` a qwen3next of the same widths.
`--recipe` picks another of llama.cpp's mixes than Q4_K_M (IQ4_XS, Q3_K_M, ...).

    python benchmarks/make_kquant_model.py /tmp/r1024-q4km.gguf      # needs llama-cpp-python (README)
    python benchmarks/make_kquant_model.py --moe /tmp/moe-q4km.gguf
    python benchmarks/make_kquant_model.py --hybrid qwen35moe /tmp/qwen35moe-q4km.gguf
    python benchmarks/make_kquant_model.py --recipe IQ4_XS /tmp/r1024-iq4xs.gguf
    python benchmarks/run.py --model /tmp/r1024-q4km.gguf --engines bubo,llama.cpp
"""

import argparse
import ctypes
import tempfile
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from bubo.default_model import default_model_path

HIDDEN, MLP, LAYERS, HEADS, KV_HEADS = 1024, 3072, 24, 16, 8
# llama.cpp's recipes (llama-quantize's names) that need no importance matrix.
RECIPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "Q4_0", "Q8_0")
# Qwen3-30B-A3B's widths (its config.json), for --moe.
MOE_HIDDEN, MOE_HEADS, MOE_KV_HEADS, MOE_HEAD_DIM, MOE_EXPERT_WIDTH, MOE_USED = 2048, 32, 4, 128, 768, 8


def _copy_tokenizer(source: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for field in source.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            if field.types[-1] == gguf.GGUFValueType.STRING:
                writer.add_array(field.name, [bytes(field.parts[i]).decode() for i in field.data])
            else:
                writer.add_array(field.name, [field.parts[i].tolist()[0] for i in field.data])
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(field.name, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(field.name, field.parts[field.data[0]].tolist()[0], kind)


Matrix = Callable[..., None]


def _random_f16_tensors(writer: gguf.GGUFWriter, seed: int) -> tuple[Matrix, int]:
    """After a writer's architecture keys: the F16 file type and the default model's tokenizer and chat
    template; returns `matrix(name, *shape)`, which adds a random tensor (F16 unless `dtype` says), and
    the vocabulary size."""
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    source = gguf.GGUFReader(default_model_path())
    _copy_tokenizer(source, writer)
    rng = np.random.default_rng(seed)

    def matrix(name: str, *shape: int, dtype: type = np.float16) -> None:
        weights = rng.standard_normal(shape, dtype=np.float32) * 0.02
        writer.add_tensor(name, weights.astype(dtype))

    return matrix, len(source.fields["tokenizer.ggml.tokens"].data)


def _ones(writer: gguf.GGUFWriter, name: str, width: int) -> None:
    writer.add_tensor(name, np.ones(width, np.float32))


def _write(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_f16_model(path: Path, seed: int = 0) -> None:
    """The random F16 llama described above, with the default model's tokenizer and chat template."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(8192)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(MLP)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    matrix, vocab = _random_f16_tensors(writer, seed)
    matrix("token_embd.weight", vocab, HIDDEN)
    _ones(writer, "output_norm.weight", HIDDEN)
    kv_width = HIDDEN * KV_HEADS // HEADS
    for i in range(LAYERS):
        p = f"blk.{i}."
        _ones(writer, p + "attn_norm.weight", HIDDEN)
        _ones(writer, p + "ffn_norm.weight", HIDDEN)
        matrix(p + "attn_q.weight", HIDDEN, HIDDEN)
        matrix(p + "attn_k.weight", kv_width, HIDDEN)
        matrix(p + "attn_v.weight", kv_width, HIDDEN)
        matrix(p + "attn_output.weight", HIDDEN, HIDDEN)
        matrix(p + "ffn_gate.weight", MLP, HIDDEN)
        matrix(p + "ffn_up.weight", MLP, HIDDEN)
        matrix(p + "ffn_down.weight", HIDDEN, MLP)
    _write(writer)


def write_f16_moe_model(path: Path, layers: int, experts: int, seed: int = 0) -> None:
    """The random F16 qwen3moe described above, with the default model's tokenizer and chat template."""
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_context_length(8192)
    writer.add_embedding_length(MOE_HIDDEN)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(6144)
    writer.add_head_count(MOE_HEADS)
    writer.add_head_count_kv(MOE_KV_HEADS)
    writer.add_key_length(MOE_HEAD_DIM)
    writer.add_value_length(MOE_HEAD_DIM)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(MOE_USED)
    writer.add_expert_feed_forward_length(MOE_EXPERT_WIDTH)
    matrix, vocab = _random_f16_tensors(writer, seed)
    matrix("token_embd.weight", vocab, MOE_HIDDEN)
    matrix("output.weight", vocab, MOE_HIDDEN)
    _ones(writer, "output_norm.weight", MOE_HIDDEN)
    q_width, kv_width = MOE_HEADS * MOE_HEAD_DIM, MOE_KV_HEADS * MOE_HEAD_DIM
    for i in range(layers):
        p = f"blk.{i}."
        _ones(writer, p + "attn_norm.weight", MOE_HIDDEN)
        _ones(writer, p + "ffn_norm.weight", MOE_HIDDEN)
        _ones(writer, p + "attn_q_norm.weight", MOE_HEAD_DIM)
        _ones(writer, p + "attn_k_norm.weight", MOE_HEAD_DIM)
        matrix(p + "attn_q.weight", q_width, MOE_HIDDEN)
        matrix(p + "attn_k.weight", kv_width, MOE_HIDDEN)
        matrix(p + "attn_v.weight", kv_width, MOE_HIDDEN)
        matrix(p + "attn_output.weight", MOE_HIDDEN, q_width)
        # The router stays float32, as llama.cpp's quantizer leaves ffn_gate_inp.
        matrix(p + "ffn_gate_inp.weight", experts, MOE_HIDDEN, dtype=np.float32)
        matrix(p + "ffn_gate_exps.weight", experts, MOE_EXPERT_WIDTH, MOE_HIDDEN)
        matrix(p + "ffn_up_exps.weight", experts, MOE_EXPERT_WIDTH, MOE_HIDDEN)
        matrix(p + "ffn_down_exps.weight", experts, MOE_HIDDEN, MOE_EXPERT_WIDTH)
    _write(writer)


def write_f32_hybrid(path: Path, arch: str) -> None:
    """bench_hybrid.py's random qwen35moe (Gated DeltaNet + gated attention, shared-expert MoE), or a
    qwen3next of the same widths, in float32 by the test fixture writer: what llama.cpp then quantizes."""
    import torch
    from bench_hybrid import TINY_QWEN35MOE
    from transformers import (
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    from tests.fixtures.gguf_writer import randomize_, write_gguf

    torch.manual_seed(0)
    if arch == "qwen35moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TINY_QWEN35MOE))
    else:
        rope = {k: v for k, v in TINY_QWEN35MOE["rope_parameters"].items() if not k.startswith("mrope")}
        config = {**TINY_QWEN35MOE, "rope_parameters": rope}
        model = Qwen3NextForCausalLM(
            Qwen3NextConfig(
                **config,
                intermediate_size=1024,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        )
    randomize_(model, std=0.05)
    write_gguf(model, path)


def quantize(source: Path, target: Path, recipe: str) -> None:
    """One of llama.cpp's own recipes (`Q4_K_M`, `IQ4_XS`, ...: llama_model_quantize), as `llama-quantize`
    applies it."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{recipe}")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)):
        raise RuntimeError(f"llama.cpp could not quantize {source}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("output", type=Path, help="the quantized file to write")
    parser.add_argument(
        "--recipe", default="Q4_K_M", choices=RECIPES, help="llama.cpp's quantization recipe (default Q4_K_M)"
    )
    parser.add_argument("--moe", action="store_true", help="a qwen3moe file at Qwen3-30B-A3B's widths")
    parser.add_argument(
        "--hybrid",
        choices=("qwen35moe", "qwen3next"),
        help="a hybrid file instead: bench_hybrid.py's random qwen35moe, or a qwen3next of its widths",
    )
    parser.add_argument("--layers", type=int, default=6, help="--moe: layers (default 6)")
    parser.add_argument("--experts", type=int, default=32, help="--moe: experts a layer (default 32)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        f16 = Path(scratch) / "f16.gguf"
        if args.hybrid:
            write_f32_hybrid(f16, args.hybrid)
        elif args.moe:
            write_f16_moe_model(f16, args.layers, args.experts)
        else:
            write_f16_model(f16)
        quantize(f16, args.output, args.recipe)
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
