"""Prefill and decode speed, time to first token and peak memory: Bubo beside llama.cpp and transformers.

Every engine runs the same GGUF file, the same prompt token ids and the same thread count, greedy, each
run in a fresh process (so peak RSS is that engine's alone), interleaved A, B, C, A, B, C so that drift
on a shared machine hits every engine alike. Prints the median of each figure and its spread (min–max).

    python benchmarks/bench_generate.py                      # default model, 2 threads, all engines
    python benchmarks/bench_generate.py --model FILE --engines bubo,llama.cpp --repeats 5
    python benchmarks/bench_generate.py --model FILE --engines bubo,bubo-float-matvecs,llama.cpp

llama.cpp is measured through llama-cpp-python (a benchmark-only extra: see benchmarks/README.md);
an engine whose package is missing is reported as skipped.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# transformers twice: in --dtype (float32 by default), and in bfloat16, its fastest prefill on a CPU with
# bfloat16 dot products (dense GEMMs on the dequantized weights; 828 against 386 tok/s on a 512-token prompt
# on an AVX512-BF16 machine), the figure the README holds Bubo's prefill to.
ENGINES = ("bubo", "llama.cpp", "transformers", "transformers-bf16")
# Chosen by name only: Bubo with --no-int8-matvec (float activations in the quantized matvecs).
OTHER_ENGINES = ("bubo-float-matvecs",)
ALL_ENGINES = ENGINES + OTHER_ENGINES
PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books at a "
    "scale no scribe could match. Within fifty years, presses were running in more than two hundred cities. "
)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What one comparison run takes (shared with benchmarks/run.py): file, threads, sizes, engines."""
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument(
        "--dtype", default="float32", help="compute dtype for bubo and transformers (transformers-bf16: bf16)"
    )
    # bubo.cli.CACHE_TYPES's names, spelled out: importing bubo here would load torch into every worker,
    # llama.cpp's included, and inflate its measured peak memory.
    parser.add_argument(
        "--cache-type",
        choices=("bf16", "f16", "f32"),
        default="f16",
        help="bubo's KV cache type (default f16: `bubo serve`'s default, and llama.cpp's)",
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_arguments(parser)
    parser.add_argument("--worker", choices=ALL_ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.model is None:
        from bubo.default_model import default_model_path

        args.model = default_model_path()
    if args.worker:
        print(json.dumps(_run_worker(args)))
        return 0

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ALL_ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; choose from {list(ALL_ENGINES)}")
    results, skipped = interleaved_runs(engines, args.repeats, lambda engine: run_engine(engine, args))
    _print_table(args, results, skipped)
    return 0


def interleaved_runs(
    engines: Sequence[str], repeats: int, run: Callable[[str], dict]
) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """`run(engine)` for each engine in turn, `repeats` rounds (A, B, A, B: drift on a shared machine hits
    every engine alike): each engine's outcomes, and why an engine was skipped (its first outcome with a
    "skipped" key; it isn't run again)."""
    results: dict[str, list[dict]] = {e: [] for e in engines}
    skipped: dict[str, str] = {}
    for _ in range(repeats):
        for engine in engines:
            if engine in skipped:
                continue
            outcome = run(engine)
            if "skipped" in outcome:
                skipped[engine] = outcome["skipped"]
            else:
                results[engine].append(outcome)
    return results, skipped


def spawn_worker(script: str, argv: list[str], threads: int) -> dict:
    """`python script argv...` in a fresh process with `threads` OpenMP threads: the JSON object its last
    line of output holds, or {"skipped": why} when it fails (its last line of stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(
        [sys.executable, script, *argv], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return {"skipped": f"worker failed: {lines[-1] if lines else proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_engine(engine: str, args: argparse.Namespace) -> dict:
    argv = ["--worker", engine, "--model", str(args.model), "--threads", str(args.threads)]
    argv += ["--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]
    argv += ["--dtype", args.dtype, "--cache-type", args.cache_type]
    return spawn_worker(__file__, argv, args.threads)


def _print_table(args: argparse.Namespace, results: dict[str, list[dict]], skipped: dict[str, str]) -> None:
    print(f"model: {args.model}")
    print(
        f"threads: {args.threads}  prompt: {args.prompt_tokens} tokens  generated: {args.gen_tokens} tokens  "
        f"dtype: {args.dtype}  bubo KV cache: {args.cache_type}  runs per engine: {args.repeats} (interleaved); median [min–max]\n"
    )
    cols = [
        ("prefill tok/s", "prefill_tps", "{:.1f}"),
        ("decode tok/s", "decode_tps", "{:.1f}"),
        ("TTFT s", "ttft_s", "{:.3f}"),
        ("peak RSS MB", "peak_rss_mb", "{:.0f}"),
    ]
    print(f"{'engine':<18}" + "".join(f"{name:>26}" for name, _, _ in cols))
    for engine, runs in results.items():
        if engine in skipped:
            print(f"{engine:<18}  skipped: {skipped[engine]}")
            continue
        cells = []
        for _, key, fmt in cols:
            values = [r[key] for r in runs]
            lo, mid, hi = min(values), statistics.median(values), max(values)
            cells.append(f"{fmt.format(mid)} [{fmt.format(lo)}–{fmt.format(hi)}]")
        print(f"{engine:<18}" + "".join(f"{c:>26}" for c in cells))
    _print_ratios(results, skipped)


def _print_ratios(results: dict[str, list[dict]], skipped: dict[str, str]) -> None:
    """Bubo's median prefill and decode speed over each other engine's."""
    if "bubo" not in results or "bubo" in skipped:
        return
    for engine, runs in results.items():
        if engine == "bubo" or engine in skipped:
            continue
        ratios = [
            f"{label} {statistics.median(r[key] for r in results['bubo']) / statistics.median(r[key] for r in runs):.2f}x"
            for label, key in (("prefill", "prefill_tps"), ("decode", "decode_tps"))
        ]
        print(f"bubo / {engine}: " + ", ".join(ratios))


def _prompt_ids(tokenize, n: int) -> list[int]:
    text = PROMPT_TEXT
    ids = tokenize(text)
    while len(ids) < n:
        text += PROMPT_TEXT
        ids = tokenize(text)
    return ids[:n]


def _peak_rss_mb() -> float:
    # VmHWM, not getrusage's ru_maxrss: ru_maxrss survives fork + exec, so a worker spawned by a parent
    # that holds a big model would report the parent's peak instead of its own.
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # no procfs: the best there is


def _run_worker(args: argparse.Namespace) -> dict:
    try:
        run = {
            "bubo": _bubo,
            "bubo-float-matvecs": lambda args: _bubo(args, int8_matvec=False),
            "llama.cpp": _llama_cpp,
            "transformers": lambda args: _transformers(args, args.dtype),
            "transformers-bf16": lambda args: _transformers(args, "bfloat16"),
        }[args.worker]
        prefill_s, decode_s = run(args)
    except ImportError as error:
        return {"skipped": f"{error.name or error} not installed"}
    return {
        "prefill_tps": args.prompt_tokens / prefill_s,
        "decode_tps": (args.gen_tokens - 1) / decode_s,
        "ttft_s": prefill_s,
        "peak_rss_mb": _peak_rss_mb(),
    }


def _bubo(args: argparse.Namespace, int8_matvec: bool = True) -> tuple[float, float]:
    from dataclasses import replace

    import torch

    from bubo.process_memory import configure_cpu_process

    configure_cpu_process()  # as `bubo serve` / `bubo generate` do on the CPU, before the model code loads
    from bubo.cli import CACHE_TYPES
    from bubo.engine.generate import GenerationResult, generate
    from bubo.engine.loaded_model import load_model
    from bubo.engine.sampler import SamplingParams
    from bubo.options import current_options, use_options

    use_options(replace(current_options(), int8_matvec=int8_matvec and current_options().int8_matvec))
    torch.set_num_threads(args.threads)
    cache = CACHE_TYPES[args.cache_type]
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype), cache_dtypes=(cache, cache))
    ids = _prompt_ids(lambda t: loaded.tokenizer.encode(t), args.prompt_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    result = None
    for event in generate(loaded.model, loaded.tokenizer, ids, params):
        if isinstance(event, GenerationResult):
            result = event
    assert result is not None and result.completion_tokens == args.gen_tokens
    # The first token comes out of prefill; decode time covers the remaining gen_tokens - 1 steps.
    return result.timings.prefill_seconds, result.timings.decode_seconds


def _llama_cpp(args: argparse.Namespace) -> tuple[float, float]:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        str(args.model),
        n_ctx=args.prompt_tokens + args.gen_tokens + 8,
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    ids = _prompt_ids(lambda t: llm.tokenize(t.encode(), add_bos=True), args.prompt_tokens)
    n_vocab = llm.n_vocab()

    def greedy() -> int:
        # Without logits_all, llama-cpp-python keeps no logits of its own: read the last row from the context.
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))))

    start = time.perf_counter()
    llm.eval(ids)
    token = greedy()
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.gen_tokens - 1):
        llm.eval([token])
        token = greedy()
    return prefill_s, time.perf_counter() - start


def _transformers(args: argparse.Namespace, dtype: str) -> tuple[float, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    path = Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
    )
    model.eval()
    ids = _prompt_ids(lambda t: tokenizer(t)["input_ids"], args.prompt_tokens)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True)
        token = out.logits[0, -1].argmax()
        prefill_s = time.perf_counter() - start
        past = out.past_key_values
        start = time.perf_counter()
        for _ in range(args.gen_tokens - 1):
            out = model(token.view(1, 1), past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[0, -1].argmax()
        decode_s = time.perf_counter() - start
    return prefill_s, decode_s


if __name__ == "__main__":
    raise SystemExit(main())
