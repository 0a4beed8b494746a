"""Decode speed next to busy neighbours, server against server.

Starts each engine's server once on the same GGUF file and thread count: `bubo serve` (its thread
governor on, as by default), `bubo serve --no-adaptive-threads` (always every thread, the old
behaviour) and, where llama-cpp-python[server] is installed, llama.cpp's server. Then, for 0, 1 and 2
neighbours (processes that spin on a core each), it streams the same completion from each server in
alternating rounds, with a fresh prompt prefix each time (no prompt cache helps) and the end tokens
pushed down (every run decodes the same count), and prints the median decode speed, its range, and each
engine's share of its own speed with no neighbour.

    python benchmarks/bench_busy.py                      # default model, 2 threads, 0/1/2 neighbours
    python benchmarks/bench_busy.py --model FILE --rounds 5 --tokens 96 --neighbours 0,1
"""

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from servers import free_port, wait_ready  # noqa: E402

from bubo.default_model import default_model_path  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details."


def _spin() -> None:
    while True:
        pass


@contextmanager
def neighbours(count: int) -> Iterator[None]:
    """`count` processes that keep a core busy each, for the duration of the block."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(count)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join()


def start_servers(model: Path, threads: int, engines: list[str]) -> dict[str, tuple[subprocess.Popen, str]]:
    """Each engine's server process and base URL, ready."""
    servers = {}
    for engine in engines:
        port = free_port()
        if engine.startswith("bubo"):
            command = [sys.executable, "-m", "bubo", "serve", "--model", str(model), "--port", str(port)]
            command += ["--threads", str(threads)]
            if engine == "bubo-fixed":
                command.append("--no-adaptive-threads")
            ready = f"http://127.0.0.1:{port}/ready"
        else:
            # llama-cpp-python's server with its model calls on one thread (see that script for why).
            server = str(Path(__file__).with_name("llama_cpp_server.py"))
            command = [sys.executable, server, "--model", str(model), "--port", str(port)]
            command += ["--n_threads", str(threads), "--n_ctx", "2048"]
            ready = f"http://127.0.0.1:{port}/v1/models"
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(ready, proc)
        servers[engine] = (proc, f"http://127.0.0.1:{port}")
    return servers


def completion_request(
    base: str, tokens: int, prefix: str, end_ids: list[int], stream: bool
) -> urllib.request.Request:
    """A greedy /v1/completions request for exactly `tokens` tokens (the end tokens pushed down), its
    prompt made fresh by `prefix` (no prompt cache helps)."""
    body = {
        "model": "bubo",
        "prompt": f"{prefix} {PROMPT}",
        "max_tokens": tokens,
        "temperature": 0,
        "stream": stream,
        "logit_bias": {str(i): -100 for i in end_ids},
    }
    return urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )


def decode_rate(base: str, tokens: int, prefix: str, end_ids: list[int]) -> float:
    """Decode tokens/s of one streamed completion: tokens after the first over the time they took."""
    request = completion_request(base, tokens, prefix, end_ids, stream=True)
    stamps = []
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    if len(stamps) < 2:
        return 0.0
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def end_token_ids(model: Path) -> list[int]:
    from bubo.gguf.reader import GGUFFile
    from bubo.model.tokenizer import Tokenizer

    with GGUFFile(model) as file:
        return sorted(Tokenizer.from_gguf(file.metadata).stop_ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--neighbours", default="0,1,2", help="neighbour counts to measure (comma-separated)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--engines", default="bubo,bubo-fixed,llama.cpp")
    args = parser.parse_args(argv)
    model = args.model or default_model_path()
    engines = [e for e in args.engines.split(",") if e]
    if "llama.cpp" in engines:
        try:
            import llama_cpp.server  # noqa: F401
        except ImportError:
            print("llama-cpp-python[server] is not installed: measuring Bubo alone", file=sys.stderr)
            engines.remove("llama.cpp")
    end_ids = end_token_ids(model)
    servers = start_servers(model, args.threads, engines)
    results: dict[tuple[str, int], list[float]] = {}
    try:
        for count in [int(n) for n in args.neighbours.split(",")]:
            with neighbours(count):
                time.sleep(1)
                for round_ in range(args.rounds):
                    order = engines if round_ % 2 == 0 else engines[::-1]
                    for engine in order:
                        # A few tokens first: the governor (and the OS) settle on the new load.
                        decode_rate(servers[engine][1], 8, f"warm {round_} {count}", end_ids)
                        rate = decode_rate(servers[engine][1], args.tokens, f"#{round_}-{count}", end_ids)
                        results.setdefault((engine, count), []).append(rate)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    print(f"{model.name}, {args.threads} threads, {args.tokens} tokens, {args.rounds} alternating rounds")
    print("| engine | neighbours | decode tok/s median [min-max] | share of its idle median |")
    print("| --- | ---: | ---: | ---: |")
    for (engine, count), rates in results.items():
        idle = results.get((engine, 0))
        share = (
            statistics.median(rates) / statistics.median(idle) if idle and statistics.median(idle) else None
        )
        print(
            f"| {engine} | {count} | {statistics.median(rates):.1f} [{min(rates):.1f}-{max(rates):.1f}] | "
            + (f"{share:.0%} |" if share is not None else "- |")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
