"""Whether a request's speed follows the configured context (--ctx-size) rather than the tokens it holds.

Starts two `bubo serve` processes on the same model, one per context size, and sends each the same
cached request (the prompt sent once before, so the prompt cache holds it) in turns, A, B, A, B, so
that load on a shared machine falls on both alike. Prints each server's median wall time per request,
time to first token and decode milliseconds per token, with their spread.

    python benchmarks/bench_context_size.py                       # default model, 2048 vs 8192
    python benchmarks/bench_context_size.py --ctx 2048 8192 --rounds 10 --n-predict 16
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from servers import wait_ready

PROMPT = (
    "I believe the meaning of life is to find your gift. The purpose of life is to give it away, they say."
)


def start(ctx: int, port: int, model: str | None, threads: int | None) -> subprocess.Popen:
    command = [sys.executable, "-m", "bubo", "serve", "--ctx-size", str(ctx), "--port", str(port)]
    if model:
        command += ["--model", model]
    if threads:
        command += ["--threads", str(threads)]
    return subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy()
    )


def one(url: str, n_predict: int) -> tuple[float, float, float, int]:
    body = {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0}
    started = time.perf_counter()
    reply = httpx.post(url + "/completion", json=body, timeout=600).json()
    wall = time.perf_counter() - started
    timings = reply["timings"]
    per_token = timings["predicted_ms"] / max(timings["predicted_n"] - 1, 1)
    return wall, timings["prompt_ms"], per_token, reply["tokens_evaluated"]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--n-predict", type=int, default=16)
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--port", type=int, default=18600)
    args = parser.parse_args()
    servers = {ctx: start(ctx, args.port + i, args.model, args.threads) for i, ctx in enumerate(args.ctx)}
    urls = {ctx: f"http://127.0.0.1:{args.port + i}" for i, ctx in enumerate(args.ctx)}
    try:
        for ctx, url in urls.items():
            wait_ready(url + "/ready", servers[ctx])
            one(url, args.n_predict)  # the prompt into the cache, and the compiled step warmed up
        results: dict[int, list[tuple[float, float, float, int]]] = {ctx: [] for ctx in args.ctx}
        for _ in range(args.rounds):
            for ctx, url in urls.items():
                results[ctx].append(one(url, args.n_predict))
        print(
            f"cached /completion of {results[args.ctx[0]][0][3]} prompt tokens, n_predict {args.n_predict}, "
            f"{args.rounds} rounds interleaved; median (min-max)"
        )
        print("| --ctx-size | wall s | prompt ms | decode ms/token |")
        print("| --- | --- | --- | --- |")
        for ctx, rows in results.items():
            walls, prompts, tokens = ([r[i] for r in rows] for i in range(3))
            print(f"| {ctx} | {spread(walls)} | {spread(prompts)} | {spread(tokens)} |")
    finally:
        for process in servers.values():
            process.terminate()
        for process in servers.values():
            process.wait(30)


if __name__ == "__main__":
    main()
