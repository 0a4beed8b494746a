"""One decode matvec per quantized type on the CPU: the packed layout's compiled kernel beside the
dequantize-then-`F.linear` path it replaces, with the layout's bits a weight and the bandwidth it reaches,
and how long repacking a matrix from the file's blocks takes at load (median of the matrices).

Random blocks (every code and sub-scale, tests/kernels/k_blocks.py; Q4_0 / Q4_1 / Q8_0 quantized from
random weights by gguf), `--matrices` of them cycled so that, as in a decoded token, each one's weights
come from memory rather than the cache. Prints the median and best microseconds a matrix of `--rounds`.

    python benchmarks/bench_matvec.py                                 # 3072x1024, 2 threads, every type
    python benchmarks/bench_matvec.py --types Q4_K Q6_K --out 1024 --in 3072
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from run import memory_bandwidth

from bubo.gguf.quants import dequantize
from bubo.model.quantized_linear import PACKED_BITS, pack_for_cpu

# The repository's tests hold the random blocks' maker.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.kernels.k_blocks import FP16_FIELDS, random_blocks

Q = gguf.GGMLQuantizationType


def _blocks(qtype: Q, rows: int, columns: int, seed: int) -> torch.Tensor:
    if qtype in FP16_FIELDS:
        return torch.from_numpy(random_blocks(qtype, rows, columns, seed))
    weights = np.random.default_rng(seed).standard_normal((rows, columns), dtype=np.float32)
    return torch.from_numpy(gguf.quants.quantize(weights, qtype))


def _time(calls: list[Callable[[], torch.Tensor]], rounds: int) -> tuple[float, float]:
    """Median and best seconds a call over `rounds` passes through all of `calls`."""
    for call in calls[:2]:
        call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for call in calls:
            call()
        times.append((time.perf_counter() - start) / len(calls))
    return statistics.median(times), min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--types", nargs="+", default=[t.name for t in PACKED_BITS], help="ggml type names")
    parser.add_argument("--out", type=int, default=3072, help="output rows")
    parser.add_argument(
        "--in", dest="columns", type=int, default=1024, help="input width (a multiple of 256)"
    )
    parser.add_argument("--matrices", type=int, default=24, help="matrices cycled (a 24-layer model's)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    bandwidth = memory_bandwidth(torch_threads=args.threads, megabytes=256)
    x = torch.randn(args.columns)
    print(
        f"{args.out}x{args.columns}, {args.matrices} matrices cycled, {args.threads} threads, copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"{'type':8} {'bits':>6} {'packed µs (median/best)':>24} {'GB/s':>6} {'dequantize+linear µs':>21} "
        f"{'repack ms':>10}"
    )
    for name in args.types:
        qtype = Q[name]
        raws = [_blocks(qtype, args.out, args.columns, seed) for seed in range(args.matrices)]
        packed, repack_seconds = [], []
        for raw in raws:
            start = time.perf_counter()
            packed.append(pack_for_cpu(raw, qtype))
            repack_seconds.append(time.perf_counter() - start)
        if any(p is None for p in packed):
            print(f"{name:8} not packed here (type, size or memory)")
            continue
        with torch.inference_mode():
            fast = _time([lambda p=p: p.matvec(x) for p in packed], args.rounds)
            plain = _time(
                [lambda r=r, t=qtype: torch.nn.functional.linear(x, dequantize(r, t)) for r in raws[:4]],
                max(3, args.rounds // 10),
            )
        stored = sum(
            t.numel() * t.element_size() for t in vars(packed[0]).values() if isinstance(t, torch.Tensor)
        )
        bits = stored * 8 / (args.out * args.columns)
        print(
            f"{name:8} {bits:6.3f} {fast[0] * 1e6:13.0f} / {fast[1] * 1e6:<8.0f} {stored / fast[0] / 1e9:6.1f} "
            f"{plain[0] * 1e6:21.0f} {statistics.median(repack_seconds) * 1e3:10.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
