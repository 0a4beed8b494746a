"""The int8 matvecs (bubo/kernels/int8_matvec.py) beside the float ones on the same packed weights: one
activation row, random blocks of each type, shapes of the hybrid test models and of a 2048-wide model,
medians of 5 runs of N calls, microseconds a call. The weights stay in cache between calls, so this is the
kernels' compute; inside a decode step they stream from memory. `--rows` adds the int8 kernels on several
rows at once (a batched step's, a verify pass's), against that many one-row calls. `--from-memory` adds
the int8 kernels streaming their weights from memory, as in a decode step: 32 different matrices in
turn (more than a 32 MB L3 holds), against a float32 sum over as many bytes, in GB/s.

    python benchmarks/bench_int8_matvec.py                  # one thread, then two
    python benchmarks/bench_int8_matvec.py --threads 1 --calls 5000
    python benchmarks/bench_int8_matvec.py --rows 2,4,8
    python benchmarks/bench_int8_matvec.py --threads 1 --from-memory

Needs AVX512-VNNI or AVX2 (and a C++ compiler for the first build).
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
from gguf import GGMLQuantizationType as Q

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bubo.kernels.int8_matvec import int8_matvec_enabled  # noqa: E402
from bubo.kernels.q4_matvec import pack_q4  # noqa: E402
from bubo.kernels.q8_matvec import pack_q8  # noqa: E402
from bubo.kernels.repack import Packed, repack  # noqa: E402
from bubo.options import current_options, use_options  # noqa: E402
from tests.kernels.k_blocks import random_blocks  # noqa: E402

SHAPES = [
    (Q.Q4_K, 512, 512),
    (Q.Q4_K, 2048, 2048),
    (Q.Q6_K, 1024, 512),
    (Q.Q6_K, 4096, 512),
    (Q.Q6_K, 2048, 2048),
    (Q.Q4_1, 1536, 576),
    (Q.Q8_0, 4096, 576),
]


def _median_us(call: Callable[[], object], calls: int) -> float:
    for _ in range(calls // 10):
        call()
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(runs)


def _packed(qtype: Q, rows: int, columns: int, seed: int = 0) -> Packed:
    if qtype == Q.Q4_1:  # gguf's numpy code quantizes Q4_1 (random bytes would give non-finite scales)
        weight = np.random.default_rng(seed).standard_normal((rows, columns), dtype=np.float32)
        return pack_q4(torch.from_numpy(gguf.quants.quantize(weight, qtype)), qtype)
    blocks = torch.from_numpy(random_blocks(qtype, rows, columns, seed=seed))
    return pack_q8(blocks) if qtype == Q.Q8_0 else repack(blocks, qtype)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rows", default="", help="row counts for the int8 kernels, comma-separated")
    parser.add_argument("--from-memory", action="store_true", help="also stream 32 matrices a type")
    args = parser.parse_args()
    if not int8_matvec_enabled():
        print(
            "the int8 matvecs don't run here (neither AVX512-VNNI nor AVX2, or no compiler)", file=sys.stderr
        )
        return 1
    print("| type | rows x columns | threads | float µs | int8 µs | float / int8 |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for qtype, rows, columns in SHAPES:
        x = torch.randn(columns)
        times = {}
        for int8 in (False, True):
            # Packed under the options in force: Q6_K's layout differs between the two.
            use_options(current_options().changed(int8_matvec=int8))
            packed = _packed(qtype, rows, columns)
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                times[int8, threads] = _median_us(lambda packed=packed, x=x: packed.matvec(x), args.calls)
        for threads in (int(t) for t in args.threads.split(",")):
            slow, fast = times[False, threads], times[True, threads]
            print(
                f"| {qtype.name} | {rows} x {columns} | {threads} | {slow:.1f} | {fast:.1f} | {slow / fast:.2f}x |"
            )
    if args.rows:
        _several_rows(args, [int(r) for r in args.rows.split(",")])
    if args.from_memory:
        _from_memory(args)
    return 0


STREAMED = [(Q.Q4_K, 4096, 512), (Q.Q6_K, 4096, 512), (Q.Q4_1, 4096, 576), (Q.Q8_0, 4096, 576)]


def _from_memory(args: argparse.Namespace) -> None:
    """Each type's int8 matvec over 32 different matrices in turn, against a float32 sum of as many bytes
    (what one core's loads reach from memory): medians of 7 passes."""
    print()
    print("| type | rows x columns | threads | matrices | MB | int8 GB/s | float sum GB/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    use_options(current_options().changed(int8_matvec=True))
    for qtype, rows, columns in STREAMED:
        matrices = [_packed(qtype, rows, columns, seed) for seed in range(32)]
        size = sum(t.nbytes for m in matrices for t in vars(m).values() if isinstance(t, torch.Tensor))
        x, flat = torch.randn(columns), torch.ones(size // 4)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            int8, float_sum = [], []
            for _ in range(8):  # the first pass warms up
                started = time.perf_counter()
                for m in matrices:
                    m.matvec(x)
                int8.append(time.perf_counter() - started)
                started = time.perf_counter()
                flat.sum()
                float_sum.append(time.perf_counter() - started)
            print(
                f"| {qtype.name} | {rows} x {columns} | {threads} | {len(matrices)} | {size / 1e6:.0f} | "
                f"{size / statistics.median(int8[1:]) / 1e9:.2f} | {size / statistics.median(float_sum[1:]) / 1e9:.2f} |"
            )


def _several_rows(args: argparse.Namespace, counts: list[int]) -> None:
    """The int8 kernels on `counts` rows in one call against one row a call, on the same weights."""
    print()
    print("| type | rows x columns | threads | activation rows | one call µs | a call a row µs | ratio |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    use_options(current_options().changed(int8_matvec=True))
    for qtype, rows, columns in SHAPES:
        packed = _packed(qtype, rows, columns)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            row = torch.randn(1, columns)
            one = _median_us(lambda packed=packed, row=row: packed.matvec(row), args.calls)
            for count in counts:
                x = torch.randn(count, columns)
                together = _median_us(lambda packed=packed, x=x: packed.matvec(x), args.calls)
                print(
                    f"| {qtype.name} | {rows} x {columns} | {threads} | {count} | {together:.1f} | "
                    f"{count * one:.1f} | {count * one / together:.2f}x |"
                )


if __name__ == "__main__":
    raise SystemExit(main())
