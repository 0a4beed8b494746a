"""How long a model takes to load, and where the time goes: Bubo's `load_model` (repacking the quantized
matrices, tracing the compiled kernels with make_fx, taking them from inductor's cache or compiling
them) beside llama.cpp's `Llama(...)` on the same file. Each load runs in a fresh process, interleaved
with the other engine's; the best of each figure is reported (a shared machine only makes a run slower).
The first Bubo load after a code change or a new model also compiles its kernels: run twice to see a
warm inductor cache.

    python benchmarks/bench_load.py                          # default model, 2 threads, 3 runs each
    python benchmarks/bench_load.py --model FILE --repeats 2
"""

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_generate import interleaved_runs, spawn_worker


def _bubo() -> dict:
    started = time.perf_counter()
    from bubo.engine.loaded_model import load_model
    from bubo.kernels import compiled
    from bubo.model import moe, quantized_linear

    imported = time.perf_counter() - started
    spent = {"repack_s": 0.0, "trace_s": 0.0, "compile_s": 0.0}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[name] += time.perf_counter() - start

        return run

    # Module globals, looked up at each call: wrapped here, every call the load makes is timed (dense
    # matrices and expert stacks are packed through pack_for_cpu).
    quantized_linear.pack_for_cpu = moe.pack_for_cpu = timed("repack_s", quantized_linear.pack_for_cpu)
    compiled._trace = timed("trace_s", compiled._trace)
    compiled._inductor_compile = timed("compile_s", compiled._inductor_compile)
    start = time.perf_counter()
    load_model(ARGS.model)
    return {"import_s": imported, "load_s": time.perf_counter() - start, **spent}


def _llama_cpp() -> dict:
    started = time.perf_counter()
    import llama_cpp

    imported = time.perf_counter() - started
    start = time.perf_counter()
    llama_cpp.Llama(str(ARGS.model), n_threads=ARGS.threads, verbose=False)
    return {"import_s": imported, "load_s": time.perf_counter() - start}


WORKERS = {"bubo": _bubo, "llama.cpp": _llama_cpp}
COLUMNS = ("import_s", "load_s", "repack_s", "trace_s", "compile_s")


def main() -> int:
    if ARGS.worker:
        print(json.dumps(WORKERS[ARGS.worker]()))
        return 0
    argv = ["--model", str(ARGS.model), "--threads", str(ARGS.threads)]
    results, skipped = interleaved_runs(
        list(WORKERS),
        ARGS.repeats,
        lambda engine: spawn_worker(__file__, ["--worker", engine, *argv], ARGS.threads),
    )
    print(
        f"model: {ARGS.model}\nthreads: {ARGS.threads}, best of {ARGS.repeats} fresh processes per engine\n"
    )
    print(f"{'engine':<12}" + "".join(f"{c:>12}" for c in COLUMNS))
    for engine, runs in results.items():
        if engine in skipped:
            print(f"{engine:<12}skipped: {skipped[engine]}")
            continue
        cells = [min(r[c] for r in runs) if c in runs[0] else None for c in COLUMNS]
        print(f"{engine:<12}" + "".join(f"{'-':>12}" if v is None else f"{v:>12.2f}" for v in cells))
    return 0


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from bubo.default_model import default_model_path

        args.model = default_model_path()
    return args


if __name__ == "__main__":
    ARGS = _parse()
    raise SystemExit(main())
