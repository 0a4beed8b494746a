"""Decode speed of each model family, server against server: `bubo serve` beside llama.cpp's server.

Makes the files first (in --dir, kept for the next run): the default model as it is, and random hybrids
quantized by llama.cpp's own Q4_K_M recipe (Q4_K with Q6_K where the recipe puts it,
make_kquant_model.py --hybrid): a qwen35moe (Gated DeltaNet + gated attention, shared-expert MoE) and a
qwen3next of the same widths; and bench_hybrid.py's tiny qwen4exp (float32: its fixture writer doesn't
quantize, and llama.cpp doesn't run qwen4exp, so Bubo alone). Then for each file it starts both servers
on the same threads, streams the same completion from each in alternating rounds (a fresh prompt prefix
each time, end tokens pushed down), and prints the median decode speed,
its range and Bubo's ratio to llama.cpp. The decode speed is timed on whole answers (`decode_rate`).

    python benchmarks/bench_families.py                       # 2 threads, 3 rounds of 64 tokens
    python benchmarks/bench_families.py --families qwen35moe --rounds 5 --threads 1
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_busy import completion_request, end_token_ids, start_servers  # noqa: E402

from bubo.default_model import default_model_path  # noqa: E402


def _completion_seconds(base: str, tokens: int, prefix: str, end_ids: list[int]) -> float:
    """Seconds one completion of exactly `tokens` tokens takes (not streamed), its prompt fresh."""
    request = completion_request(base, tokens, prefix, end_ids, stream=False)
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    elapsed = time.perf_counter() - started
    # llama-cpp-python's server counts the answer's text tokenized again, a few more than it generated
    # for a random model's text; fewer would mean it stopped early.
    if answer["usage"]["completion_tokens"] < tokens:
        raise RuntimeError(f"{base} stopped after {answer['usage']['completion_tokens']} of {tokens} tokens")
    return elapsed


def decode_rate(base: str, tokens: int, prefix: str, end_ids: list[int]) -> float:
    """Decode tokens/s: the tokens after the first over the time a completion of `tokens` takes beyond one
    of a single token (prompts of the same length, both fresh). Timing whole answers rather than streamed
    chunks: a random model's tokens are often pieces of characters, which a server holds back until they
    form text, so chunks don't arrive one a token."""
    one = _completion_seconds(base, 1, f"{prefix} a", end_ids)
    many = _completion_seconds(base, tokens, f"{prefix} b", end_ids)
    return (tokens - 1) / (many - one)


def _quantized_hybrid(arch: str) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        from make_kquant_model import quantize, write_f32_hybrid

        with tempfile.TemporaryDirectory() as scratch:
            f32 = Path(scratch) / "f32.gguf"
            write_f32_hybrid(f32, arch)
            quantize(f32, path, "Q4_K_M")

    return make


def _qwen4exp(path: Path) -> None:
    from bench_hybrid import write_qwen4exp

    write_qwen4exp(path)


# family -> (file name, how to make it, whether llama.cpp runs it)
FAMILIES: dict[str, tuple[str, Callable[[Path], None] | None, bool]] = {
    "default": ("", None, True),
    "qwen35moe": ("qwen35moe-q4km.gguf", _quantized_hybrid("qwen35moe"), True),
    "qwen3next": ("qwen3next-q4km.gguf", _quantized_hybrid("qwen3next"), True),
    "qwen4exp": ("qwen4exp-f32.gguf", _qwen4exp, False),
}


def model_file(family: str, folder: Path) -> Path:
    name, make, _ = FAMILIES[family]
    if make is None:
        return default_model_path()
    path = folder / name
    if not path.exists():
        make(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--families", default=",".join(FAMILIES), help="comma-separated, of " + ", ".join(FAMILIES)
    )
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "bubo-families")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    try:
        import llama_cpp.server  # noqa: F401

        peer = True
    except ImportError:
        print("llama-cpp-python[server] is not installed: measuring Bubo alone", file=sys.stderr)
        peer = False
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in [f for f in args.families.split(",") if f]:
        path = model_file(family, args.dir)
        engines = ["bubo", "llama.cpp"] if peer and FAMILIES[family][2] else ["bubo"]
        end_ids = end_token_ids(path)
        servers = start_servers(path, args.threads, engines)
        rates: dict[str, list[float]] = {engine: [] for engine in engines}
        try:
            for round_ in range(args.rounds):
                for engine in engines if round_ % 2 == 0 else engines[::-1]:
                    base = servers[engine][1]
                    decode_rate(base, 8, f"warm {round_}", end_ids)
                    rates[engine].append(decode_rate(base, args.tokens, f"#{round_} {family}", end_ids))
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=30)
        rows.append((family, path.name, rates))
    print(
        f"{args.threads} threads, {args.tokens} tokens, {args.rounds} alternating rounds, server against server"
    )
    print("| family | file | Bubo decode tok/s | llama.cpp decode tok/s | ratio |")
    print("| --- | --- | ---: | ---: | ---: |")
    for family, name, rates in rows:
        cells = []
        for engine in ("bubo", "llama.cpp"):
            r = rates.get(engine)
            cells.append(f"{statistics.median(r):.1f} [{min(r):.1f}-{max(r):.1f}]" if r else "-")
        ratio = "-"
        if rates.get("llama.cpp") and statistics.median(rates["llama.cpp"]):
            ratio = f"{statistics.median(rates['bubo']) / statistics.median(rates['llama.cpp']):.2f}x"
        print(f"| {family} | {name} | {cells[0]} | {cells[1]} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
