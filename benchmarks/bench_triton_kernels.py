"""Time the Triton quantized kernels against the torch path they replace, on a CUDA GPU.

    python benchmarks/bench_triton_kernels.py                       # Qwen3-8B / Qwen3-30B-A3B shapes, bf16
    python benchmarks/bench_triton_kernels.py --types Q4_K,Q6_K --rows 1,8,512
    python benchmarks/bench_triton_kernels.py --quick               # tiny shapes: a smoke run of the script
    python benchmarks/bench_triton_kernels.py --bandwidth-gbs 3350  # "% of bandwidth" against an H100's

Both columns run Bubo's own modules, switched with the `triton` runtime option: QuantizedLinear (Triton GEMV up to
4 rows, GEMM beyond; or dequantize + F.linear) per type, matrix shape and row count, with the weight
bandwidth the kernels reach (the file's bytes read once per call) and its share of the GPU's
(--bandwidth-gbs, default an H200's 4800 GB/s); SparseMoE (fused kernel, or the
per-expert loop) with a random router. Weights are random bytes (values don't change the time);
times are triton.testing.do_bench medians in µs (short runs: 5 ms warm-up, 25 ms measured). Without CUDA (--quick on a CPU) both columns run
the torch path: the kernels only run on CUDA.
"""

import argparse
import functools
import time
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from bubo.model.moe import QuantizedExpertMatrices, SparseMoE
from bubo.model.quantized_linear import QuantizedLinear
from bubo.options import current_options, use_options

# (out_features, in_features): Qwen3-8B's q/o, gate/up and down projections.
LINEAR_SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]
# Qwen3-30B-A3B's experts: 128 of them, top 8, hidden 2048, expert width 768.
MOE_SHAPE = (128, 8, 2048, 768)
QUICK_LINEAR_SHAPES = [(64, 256)]
QUICK_MOE_SHAPE = (4, 2, 256, 256)


def _blocks(qtype: GGMLQuantizationType, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Random ggml blocks [*shape[:-1], row_bytes] for rows of shape[-1] weights."""
    weights, size = GGML_QUANT_SIZES[qtype]
    generator = torch.Generator(device=device).manual_seed(0)
    row_bytes = shape[-1] // weights * size
    return torch.randint(
        0, 256, (*shape[:-1], row_bytes), dtype=torch.uint8, device=device, generator=generator
    )


def _microseconds(fn: Callable[[], object], device: torch.device, triton_on: bool) -> float:
    use_options(current_options().changed(triton=triton_on))
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def _bench_linear(
    types: list[GGMLQuantizationType], shapes, rows: list[int], dtype, device, peak_gbs: float
) -> None:
    print("| type | N x K | rows | triton µs | torch µs | speed-up | weight GB/s (triton) | % of bandwidth |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for qtype in types:
        for n, k in shapes:
            layer = QuantizedLinear(_blocks(qtype, (n, k), device), qtype, k)
            for m in rows:
                run = functools.partial(layer, torch.randn(m, k, dtype=dtype, device=device))
                fused, plain = _microseconds(run, device, True), _microseconds(run, device, False)
                bandwidth = layer.raw.numel() / fused / 1e3
                print(
                    f"| {qtype.name} | {n} x {k} | {m} | {fused:.1f} | {plain:.1f} | {plain / fused:.2f}x "
                    f"| {bandwidth:.0f} | {100 * bandwidth / peak_gbs:.1f} |"
                )


def _bench_moe(types: list[GGMLQuantizationType], shape, tokens: list[int], dtype, device) -> None:
    experts, top_k, hidden, width = shape
    print(
        f"\n| type | {experts} experts, top {top_k}, {hidden} -> {width} | tokens | fused µs | loop µs | speed-up |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for qtype in types:
        moe = SparseMoE(
            nn.Linear(hidden, experts, bias=False, dtype=dtype, device=device),
            QuantizedExpertMatrices(_blocks(qtype, (experts, width, hidden), device), qtype, hidden),
            QuantizedExpertMatrices(_blocks(qtype, (experts, width, hidden), device), qtype, hidden),
            QuantizedExpertMatrices(_blocks(qtype, (experts, hidden, width), device), qtype, width),
            top_k,
            norm_topk_prob=True,
        )
        for t in tokens:
            run = functools.partial(moe, torch.randn(t, hidden, dtype=dtype, device=device))
            fused, plain = _microseconds(run, device, True), _microseconds(run, device, False)
            print(f"| {qtype.name} | | {t} | {fused:.1f} | {plain:.1f} | {plain / fused:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q5_K,Q6_K,IQ4_XS")
    parser.add_argument("--rows", default="1,4,16,512", help="activation rows for the linear products")
    parser.add_argument("--moe-tokens", default="1,16,512")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="the GPU's memory bandwidth")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run of the script")
    args = parser.parse_args()
    types = [GGMLQuantizationType[name] for name in args.types.split(",")]
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        linear_shapes, moe_shape, rows, tokens = QUICK_LINEAR_SHAPES, QUICK_MOE_SHAPE, [1, 5], [1, 5]
    elif device.type != "cuda":
        raise SystemExit("needs a CUDA GPU (--quick runs a smoke test of the script on the CPU)")
    else:
        linear_shapes, moe_shape = LINEAR_SHAPES, MOE_SHAPE
        rows = [int(r) for r in args.rows.split(",")]
        tokens = [int(t) for t in args.moe_tokens.split(",")]
    print(
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU: torch path only'}, {args.dtype}\n"
    )
    with torch.inference_mode():
        _bench_linear(types, linear_shapes, rows, dtype, device, args.bandwidth_gbs)
        _bench_moe(types, moe_shape, tokens, dtype, device)


if __name__ == "__main__":
    main()
