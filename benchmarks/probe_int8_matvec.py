"""A design probe, not used by the runtime: how fast Bubo's packed Q4_K words multiply with integer dot
products (AVX512-VNNI `vpdpbusd`), beside the compiled matvec the runtime runs on the same words.

Inductor emits float code only: an AND, a conversion and an FMA per 16 weights. llama.cpp multiplies
int8 activations with the codes' bytes instead. The packed layout suits that as it is: a word holds 8
consecutive 4-bit codes of one row and a vector's 16 lanes are 16 rows, so `w & 0x0F0F0F0F` and
`(w >> 4) & 0x0F0F0F0F` are, as bytes, the codes of inputs k, k+2, k+4, k+6 and k+1, k+3, k+5, k+7, one
`vpdpbusd` each against a broadcast dword of int8 activations. The probe's kernel does that per
sub-block of 32 weights and scales each sub-block's sum by a float per lane; it leaves out what a real
kernel adds once per super-block or per matvec (unpacking the 6-bit scales and mins, the min term,
quantizing the activations), and its int8 activations are random, not the matvec's own. It checks its
integer sums against torch before timing.

    python benchmarks/probe_int8_matvec.py                 # a few shapes, one thread
    python benchmarks/probe_int8_matvec.py --shapes 2048x512 --threads 1

Needs AVX512-VNNI and a C++ compiler (torch.utils.cpp_extension builds the kernel on first use).
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_SOURCE = r"""
#include <immintrin.h>
#include <torch/extension.h>

// words int32 [tiles, super-blocks, 32, 16]: Q4_K's packed codes, 8 sub-blocks of 4 words a lane.
// activations int32 [in / 4]: int8 activations, each code word's 8 inputs as two dwords (even, odd).
// scales float [tiles, super-blocks, 8, 16]: a float per sub-block and lane.
torch::Tensor q4k_int8_matvec(torch::Tensor words, torch::Tensor activations, torch::Tensor scales) {
  const int64_t tiles = words.size(0), runs = words.size(1) * 8;
  auto out = torch::empty({tiles * 16}, torch::kFloat32);
  const int32_t* w = words.data_ptr<int32_t>();
  const int32_t* x = activations.data_ptr<int32_t>();
  const float* s = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const __m512i low = _mm512_set1_epi32(0x0F0F0F0F);
  for (int64_t t = 0; t < tiles; ++t) {
    const int32_t* wt = w + t * runs * 4 * 16;
    const float* st = s + t * runs * 16;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t r = 0; r < runs; ++r) {
      __m512i sum = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k) {
        const __m512i v = _mm512_loadu_si512(wt + (r * 4 + k) * 16);
        const int32_t* xs = x + (r * 4 + k) * 2;
        sum = _mm512_dpbusd_epi32(sum, _mm512_and_si512(v, low), _mm512_set1_epi32(xs[0]));
        sum = _mm512_dpbusd_epi32(sum, _mm512_and_si512(_mm512_srli_epi32(v, 4), low), _mm512_set1_epi32(xs[1]));
      }
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_loadu_ps(st + r * 16), acc);
    }
    _mm512_storeu_ps(o + t * 16, acc);
  }
  return out;
}
"""


def _expected(
    words: torch.Tensor, activations: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's result computed by torch in float64 (the codes' bytes times the activations' bytes,
    scaled per sub-block), and the sum of its terms' magnitudes (what float32 accumulation rounds against)."""
    tiles, supers, _, lanes = words.shape
    shifts = torch.arange(0, 32, 8, dtype=torch.int32)[:, None]
    # [tiles, runs, 4 words, 1, lanes] -> bytes [.., 4 words, 4 bytes, lanes] of the low and high nibbles
    w = words.view(tiles, supers * 8, 4, 1, lanes)
    low, high = (w >> shifts) & 0x0F, (w >> (shifts + 4)) & 0x0F
    x = activations.view(torch.int8).view(supers * 8, 4, 2, 4).to(torch.float64)
    dots = (low.double() * x[None, :, :, 0, :, None]).sum((2, 3))
    dots += (high.double() * x[None, :, :, 1, :, None]).sum((2, 3))
    terms = dots * scales.view(tiles, supers * 8, lanes).double()
    return terms.sum(1).view(-1), terms.abs().sum(1).view(-1)


def _probe(
    kernel: Callable[..., torch.Tensor], out_features: int, in_features: int, rounds: int, g: torch.Generator
) -> dict[str, list[float]]:
    """Seconds a call of each matvec on one random Q4_K matrix, `rounds` alternated rounds."""
    import gguf

    from bubo.model.quantized_linear import pack_for_cpu
    from tests.kernels.k_blocks import random_blocks

    q4_k = gguf.GGMLQuantizationType.Q4_K
    packed = pack_for_cpu(torch.from_numpy(random_blocks(q4_k, out_features, in_features, 0)), q4_k)
    words = packed.words.contiguous()
    x = torch.randn(in_features, generator=g)
    activations = torch.randint(-127, 128, (in_features,), dtype=torch.int8, generator=g).view(torch.int32)
    scales = torch.randn(words.shape[0], words.shape[1], 8, 16, generator=g)
    expected, magnitude = _expected(words, activations, scales)
    error = (kernel(words, activations, scales).double() - expected).abs()
    if not bool((error <= 1e-6 * magnitude).all()):
        raise AssertionError(f"the int8 kernel is off by up to {error.max().item():.3g}")
    runs = {
        "compiled float matvec": lambda: packed.matvec(x),
        "int8 dot products": lambda: kernel(words, activations, scales),
    }
    calls = max(5, int(2e8 // (out_features * in_features)))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():  # alternated, each warmed up first
            run()
            started = time.perf_counter()
            for _ in range(calls):
                run()
            times[name].append((time.perf_counter() - started) / calls)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="2048x512,3072x1024,16384x4096", help="OUTxIN, comma-separated")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch's threads (the probe's kernel runs on one)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if "avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        print("this CPU has no AVX512-VNNI: nothing to probe")
        return 1

    from torch.utils.cpp_extension import load_inline

    torch.set_num_threads(args.threads)
    kernel = load_inline(
        "bubo_probe_int8_matvec",
        cpp_sources=_SOURCE,
        functions=["q4k_int8_matvec"],
        extra_cflags=["-O3", "-march=native"],
    ).q4k_int8_matvec
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        out_features, in_features = (int(n) for n in shape.split("x"))
        for name, values in _probe(kernel, out_features, in_features, args.rounds, g).items():
            median = statistics.median(values)
            print(
                f"{shape:>12} {name:<22} {median * 1e6:9.1f} us  [{min(values) * 1e6:.1f}-{max(values) * 1e6:.1f}]"
                f"  {out_features * in_features / median / 1e9:6.1f} G weights/s"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
