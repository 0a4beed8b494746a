"""One command for the speed comparison: Bubo beside llama.cpp and transformers on the same GGUF file.

Prints prefill tokens/s, decode tokens/s, time to first token and peak RSS for each engine (each run
in its own process, interleaved, several runs: the best of each figure is reported, since a shared
machine only ever makes a run slower), next to this machine's bandwidth limit for decode (the bytes of
weights read per token over the memory bandwidth a torch copy reaches). Writes the figures as JSON and
a bar chart (PNG, matplotlib from the `bench` extra).

    python benchmarks/run.py                        # default model, 2 threads, 512-token prompt
    python benchmarks/run.py --quick                # a short prompt, few tokens, one run: a smoke test
    python benchmarks/run.py --model FILE --engines bubo,llama.cpp --out benchmarks/results
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import bench_generate

METRICS = (  # (key, label, better)
    ("prefill_tps", "prefill tok/s", max),
    ("decode_tps", "decode tok/s", max),
    ("ttft_s", "TTFT s", min),
    ("peak_rss_mb", "peak RSS MB", min),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    bench_generate.add_run_arguments(parser)
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="folder for JSON and PNG"
    )
    parser.add_argument("--quick", action="store_true", help="16-token prompt, 8 tokens, one run")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.gen_tokens, args.repeats = 16, 8, 1
    if args.model is None:
        from bubo.default_model import default_model_path

        args.model = default_model_path()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(bench_generate.ALL_ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; choose from {list(bench_generate.ALL_ENGINES)}")

    runs, skipped = bench_generate.interleaved_runs(
        engines, args.repeats, lambda engine: bench_generate.run_engine(engine, args)
    )

    weights = weight_bytes(args.model)
    bandwidth = memory_bandwidth(torch_threads=args.threads, megabytes=64 if args.quick else 512)
    report = {
        "machine": machine(),
        "model": str(args.model),
        "settings": {
            k: getattr(args, k)
            for k in ("threads", "prompt_tokens", "gen_tokens", "repeats", "dtype", "cache_type")
        },
        "weight_bytes": weights,
        "memory_bandwidth_gb_s": bandwidth / 1e9,
        "decode_limit_tps": bandwidth / weights,
        "engines": {
            engine: {"skipped": skipped[engine]}
            if engine in skipped
            else {key: better(r[key] for r in runs[engine]) for key, _, better in METRICS}
            | {"runs": runs[engine]}
            for engine in engines
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    draw_chart(report, args.out / "bench.png")
    print_table(report)
    print(f"\nwrote {args.out / 'bench.json'} and {args.out / 'bench.png'}")
    return 0


def weight_bytes(model: Path) -> int:
    """Bytes of weights one decoded token reads: every tensor of the file once, except that a mixture of
    experts' stacks count only the routed share (expert_used_count of expert_count), and the embedding
    table nothing when a separate output head is there (a token reads one row of it)."""
    from bubo.gguf.reader import GGUFFile

    f = GGUFFile(model)
    try:
        arch = f.metadata.get("general.architecture")
        experts = f.metadata.get(f"{arch}.expert_count") or 0
        routed = (f.metadata.get(f"{arch}.expert_used_count") or 0) / experts if experts else 1.0
        total = 0.0
        for name, t in f.tensors.items():
            if name == "token_embd.weight" and "output.weight" in f.tensors:
                continue
            total += t.raw.numel() * (routed if "_exps." in name else 1.0)
        return int(total)
    finally:
        f.close()


def memory_bandwidth(torch_threads: int, megabytes: int) -> float:
    """Bytes per second a torch copy between two buffers far larger than the caches reaches (best of 5;
    a copy reads and writes each byte, so it moves twice the buffer)."""
    import torch

    torch.set_num_threads(torch_threads)
    src = torch.ones(megabytes << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    from bubo.model.quantized_linear import native_bf16

    return {
        "cpu": cpu,
        "bf16_dot_products": native_bf16(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def print_table(report: dict) -> None:
    s = report["settings"]
    print(f"model: {report['model']}")
    bf16 = "with" if report["machine"]["bf16_dot_products"] else "without"
    print(
        f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, {bf16} bfloat16 dot "
        f"products; threads: {s['threads']}"
    )
    print(
        f"prompt: {s['prompt_tokens']} tokens, generated: {s['gen_tokens']}, dtype: {s['dtype']}, "
        f"bubo KV cache: {s['cache_type']}, best of {s['repeats']} interleaved runs per engine\n"
    )
    print(f"{'engine':<18}" + "".join(f"{label:>16}" for _, label, _ in METRICS))
    for engine, figures in report["engines"].items():
        if "skipped" in figures:
            print(f"{engine:<18}  skipped: {figures['skipped']}")
        else:
            print(f"{engine:<18}" + "".join(f"{figures[key]:>16.3g}" for key, _, _ in METRICS))
    print(
        f"\nbandwidth limit: {report['weight_bytes'] / 1e6:.0f} MB of weights per token at "
        f"{report['memory_bandwidth_gb_s']:.1f} GB/s -> at most {report['decode_limit_tps']:.0f} decode tok/s"
    )


def draw_chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = {e: f for e, f in report["engines"].items() if "skipped" not in f}
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.6))
    for ax, (key, label, _) in zip(axes, METRICS, strict=True):
        ax.bar(list(measured), [f[key] for f in measured.values()], color="tab:blue")
        if key == "decode_tps":
            ax.axhline(report["decode_limit_tps"], color="tab:red", linestyle="--", label="bandwidth limit")
            ax.legend(fontsize=8)
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(
        f"{Path(report['model']).name} on {report['machine']['cpu']}, threads: {report['settings']['threads']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
