"""Hybrid MoE models (qwen35moe, qwen4exp) through Bubo and transformers, and the decode ceiling of the real one.

Writes two tiny-but-not-trivial random GGUFs with the test fixture writers: a qwen35moe (Gated
DeltaNet + gated attention, shared-expert MoE; projections Q8_0, experts Q4_0) and a qwen4exp of the
same size (adding QSA, hyper-connections and PLE; all F32, as its fixture writer doesn't quantize).
Then it measures prefill and decode speed and peak RSS per engine in fresh processes through
bench_generate.py's workers; transformers 5.24 can't read qwen4exp GGUF (its loader raises "not
supported yet"), which the table reports as skipped. Last it estimates, from the real
Qwen3.8-Flash-Next shapes (shared/spec/qwen4exp.md section 1), the weight bytes one decoded
token reads and the decode rate that bandwidth alone allows.

    python benchmarks/bench_hybrid.py
    python benchmarks/bench_hybrid.py --threads 8 --repeats 3 --bandwidth-gbs 4800,25
"""

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_generate import _print_table, interleaved_runs, run_engine  # noqa: E402

ENGINES = ("bubo", "transformers")
# A ~140 MB file: big enough that the matmuls, not Python overhead, dominate a step.
TINY_QWEN35MOE = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3
    + ["full_attention"]
    + ["linear_attention"] * 3
    + ["full_attention"],
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 64,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
}
# The same scale over spec section 7.1's tiny qwen4exp (every feature live; ~1 GB in F32). The QSA
# budget (128) is below the 512-token prompt, so the indexer selects rather than attending densely.
TINY_QWEN4EXP = {
    **TINY_QWEN35MOE,
    "hc_count": 4,
    "hc_lowrank": 64,
    "indexer_n_heads": 4,
    "indexer_head_dim": 64,
    "indexer_budget": 128,
    "indexer_compress_ratio": 4,
    "ple_embed_dim": 512,  # P = H, as llama.cpp requires
}

# Qwen3.8-Flash-Next, qwen4exp.md section 1 (real dimensions) and section 3 (tensor shapes).
H, LAYERS, ATTENTION_EVERY = 2560, 48, 4
VOCAB = 248320
EXPERTS_ACTIVE, EXPERTS, EXPERT_FFN, SHARED_FFN = 10, 512, 640, 640
GDN_HK, GDN_HV, GDN_DK, GDN_DV = 16, 48, 128, 128
ATTN_HEADS, KV_HEADS, HEAD_DIM = 24, 2, 256
INDEXER_HEADS, INDEXER_DIM = 4, 128
HC_STREAMS, HC_RANK = 4, 320
PLE_HEADS, PLE_HEAD_DIM = 16, 160
# UD-Q4_K_XL mixes Q4_K with wider types for sensitive tensors; ~4.5 bits/weight on average.
BITS_PER_WEIGHT = 4.5


def decode_weight_params() -> dict[str, int]:
    """Weights one decoded token reads, per part: only what that token's computation touches."""
    attention_layers = LAYERS // ATTENTION_EVERY
    gdn_layers = LAYERS - attention_layers
    gdn_mix = 2 * GDN_HK * GDN_DK + GDN_HV * GDN_DV
    gdn = H * gdn_mix + H * GDN_HV * GDN_DV + 2 * H * GDN_HV + GDN_HV * GDN_DV * H
    # q_proj yields query and output gate: 2 × heads × head_dim rows.
    attention = H * 2 * ATTN_HEADS * HEAD_DIM + 2 * H * KV_HEADS * HEAD_DIM + ATTN_HEADS * HEAD_DIM * H
    indexer = H * (INDEXER_HEADS + 1) * INDEXER_DIM
    swiglu = 3 * H
    # Two hyper-connection modules per layer (around the mixer and the MoE), each down + up + inject.
    hyper_connection = 2 * (2 * HC_RANK * HC_STREAMS * H + HC_STREAMS * HC_STREAMS * H)
    return {
        "GDN projections (36 layers)": gdn_layers * gdn,
        "attention + indexer projections (12 layers)": attention_layers * (attention + indexer),
        "routers (512 experts)": LAYERS * EXPERTS * H,
        "10 routed + 1 shared expert": LAYERS
        * (EXPERTS_ACTIVE * swiglu * EXPERT_FFN + swiglu * SHARED_FFN + H),
        "hyper-connections": LAYERS * hyper_connection + 2 * HC_RANK * HC_STREAMS * H,
        "PLE rows + key/value projections (1 layer)": PLE_HEADS * PLE_HEAD_DIM + HC_STREAMS * H * H + H * H,
        "embedding row": H,
        "output head": VOCAB * H,
    }


def print_decode_estimate(bandwidths_gbs: list[float]) -> None:
    params = decode_weight_params()
    total = sum(params.values())
    nbytes = total * BITS_PER_WEIGHT / 8
    print(
        f"\nQwen3.8-Flash-Next decode: weights read per token at {BITS_PER_WEIGHT} bits/weight (UD-Q4_K_XL average)"
    )
    for part, n in params.items():
        print(f"  {part:<44} {n / 1e6:>8.1f} M weights  {n * BITS_PER_WEIGHT / 8 / 1e6:>8.1f} MB")
    print(f"  {'total':<44} {total / 1e6:>8.1f} M weights  {nbytes / 1e6:>8.1f} MB")
    # Per-sequence state is read and written every step too; it depends on context, not on the weights.
    state = (LAYERS - LAYERS // ATTENTION_EVERY) * GDN_HV * GDN_DK * GDN_DV * 4
    print(
        f"  not counted: GDN recurrent states ({state / 1e6:.0f} MB fp32, read + written), KV cache, activations"
    )
    for gbs in bandwidths_gbs:
        print(f"  bandwidth-bound ceiling at {gbs:>6.0f} GB/s: {gbs * 1e9 / nbytes:>8.1f} tok/s")


def write_qwen35moe(path: Path) -> Path:
    import torch
    from gguf import GGMLQuantizationType as Q
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from tests.fixtures.gguf_writer import randomize_, write_gguf

    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TINY_QWEN35MOE))
    randomize_(model, std=0.05)
    q8 = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate", "ssm_out", "ffn_*_shexp")
    quantize = {"blk.*.ffn_*_exps.weight": Q.Q4_0, "output.weight": Q.Q8_0}
    quantize |= {f"blk.*.{name}.weight": Q.Q8_0 for name in q8}
    return write_gguf(model, path, quantize=quantize)


def write_qwen4exp(path: Path) -> Path:
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    from tests.fixtures.gguf_writer import randomize_
    from tests.fixtures.qwen4exp_gguf import TINY_QWEN4EXP_CONFIG, write_qwen4exp_gguf

    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**{**TINY_QWEN4EXP_CONFIG, **TINY_QWEN4EXP}))
    randomize_(model, std=0.05)
    return write_qwen4exp_gguf(model, path)


# name -> (writer, how its tensors are stored)
MODELS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "qwen35moe": (write_qwen35moe, "projections Q8_0, experts Q4_0"),
    "qwen4exp": (write_qwen4exp, "all F32: the qwen4exp fixture writer doesn't quantize"),
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cache-type", choices=("bf16", "f16", "f32"), default="f16", help="bubo's KV cache")
    parser.add_argument(
        "--bandwidth-gbs",
        default="4800,25",
        help="memory bandwidths, GB/s (default: H200 4800, this machine 25)",
    )
    args = parser.parse_args()

    for name, (write, storage) in MODELS.items():
        # One file at a time: the qwen4exp one is ~1 GB.
        with tempfile.TemporaryDirectory() as tmp:
            args.model = write(Path(tmp) / f"tiny-{name}.gguf")
            results, skipped = interleaved_runs(
                ENGINES, args.repeats, lambda engine: run_engine(engine, args)
            )
            print(f"\ntiny {name}: {args.model.stat().st_size / 1e6:.1f} MB ({storage})")
            _print_table(args, results, skipped)
    print_decode_estimate([float(x) for x in args.bandwidth_gbs.split(",")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
