"""Decode tokens per second of one sequence, the eager decoder's step beside the compiled one
(bubo/engine/compiled_decode.py), in one process, interleaved so that drift on a shared machine hits
both alike. Prints each round and the median of each path, and the CPU time per token (less sensitive
to other processes than wall time).

    python benchmarks/bench_decode_step.py                    # default model, 2 threads
    python benchmarks/bench_decode_step.py --model FILE --threads 1 --steps 64 --rounds 5

On a device where no compiled step applies (CUDA: the captured step is bench_cuda_graphs.py's) only the
eager step is measured.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

Step = Callable[[torch.Tensor], torch.Tensor]


def _measure(step: Step, steps: int, device: torch.device) -> tuple[float, float]:
    """(tokens per second, CPU milliseconds per token) over `steps` greedy steps fed their own tokens."""
    token = torch.zeros((), dtype=torch.long, device=device)
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        token = step(token).argmax()
    int(token.item())  # wait for the device
    wall = time.perf_counter() - started
    return steps / wall, (time.process_time() - cpu) / steps * 1000


def run_rounds(paths: dict[str, Step], steps: int, rounds: int, device: torch.device) -> None:
    """Warm every path up, then time `rounds` interleaved rounds of `steps` steps of each; print each
    round and each path's median (bench_cuda_graphs.py runs its paths through this too)."""
    results: dict[str, list[float]] = {name: [] for name in paths}
    for step in paths.values():
        _measure(step, 2, device)
    for round_ in range(rounds):
        for name, step in paths.items():
            rate, cpu_ms = _measure(step, steps, device)
            results[name].append(rate)
            print(f"round {round_ + 1} {name:>8}: {rate:6.1f} tok/s, {cpu_ms:6.1f} CPU ms/token")
    for name, rates in results.items():
        print(f"{name:>8}: median {statistics.median(rates):.1f} tok/s ({min(rates):.1f}-{max(rates):.1f})")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from bubo.engine.compiled_decode import prepare_decode_step
    from bubo.engine.loaded_model import load_model

    if args.model is None:
        from bubo.default_model import default_model_path

        args.model = default_model_path()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    loaded = load_model(args.model, device=args.device)
    print(f"load (compiled step included): {time.perf_counter() - started:.1f} s")
    model = loaded.model
    compiled = prepare_decode_step(model)
    max_len = args.prompt_tokens + (args.rounds + 1) * args.steps + 1
    prompt = torch.arange(args.prompt_tokens, device=model.device)[None] % model.config.vocab_size

    paths: dict[str, Step] = {}
    with torch.inference_mode():
        eager_cache = model.new_cache(max_len=max_len)
        model(prompt, eager_cache, last_only=True)
        paths["eager"] = lambda token: model(token.view(1, 1), eager_cache)[0, -1]
        if compiled is not None:
            compiled_cache = model.new_cache(max_len=max_len)
            model(prompt, compiled_cache, last_only=True)
            paths["compiled"] = lambda token: compiled(token, compiled_cache)
        else:
            print(f"no compiled step for this model on {model.device}: eager only")
        run_rounds(paths, args.steps, args.rounds, model.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
