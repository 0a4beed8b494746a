"""Decode tokens per second of one sequence, the eager decoder's step beside the compiled one
(bubo/engine/compiled_decode.py), in one process, interleaved so that drift on a shared machine hits
both alike. Prints each round and the median of each path, and the CPU time per token (less sensitive
to other processes than wall time).

    python benchmarks/bench_decode_step.py                    # default model, 2 threads
    python benchmarks/bench_decode_step.py --model FILE --threads 1 --steps 64 --rounds 5
    python benchmarks/bench_decode_step.py --prompt-tokens 512 --breakdown

On a device where no compiled step applies (CUDA: the captured step is bench_cuda_graphs.py's) only the
eager step is measured. `--breakdown` then times the compiled step's parts where they run: the layers'
graphs, the attention kernel and the writes of each layer's new key and value into the cache, a mixture
of experts' routed experts (the last three run as opaque ops inside the graphs, and count as theirs),
the inputs' graph (token embeddings, rotary angles), the head's (final norm, output head), and the rest
(Python between the calls) as what the parts leave of the step.
"""

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bubo.model.moe import SparseMoE

if TYPE_CHECKING:
    from bubo.engine.compiled_decode import CompiledDecodeStep

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


@contextlib.contextmanager
def timed_parts(step: "CompiledDecodeStep") -> Iterator[dict[str, list[float]]]:
    """[seconds, calls] of each part of the compiled decode step `step` while the block runs, summed, each
    part's own time (an op that runs inside a layer's graph counts as the op's, not the graph's): the layer
    graphs, the attention kernel, the KV cache writes, a mixture of experts' routed experts (the opaque
    ops inside the graphs), the inputs' graph and the head's."""
    from bubo.engine import compiled_decode

    parts = ["inputs", "layer graphs", "attention", "KV cache writes", "output head"]
    if any(isinstance(layer.mlp, SparseMoE) for layer in step.layers):
        parts.append("routed experts")
    totals = {part: [0.0, 0] for part in parts}
    nested: list[float] = []  # per running part, the time of the parts it called

    def timer(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            started = time.perf_counter()
            nested.append(0.0)
            try:
                return fn(*args)
            finally:
                elapsed = time.perf_counter() - started
                inner = nested.pop()
                if nested:
                    nested[-1] += elapsed
                totals[part][0] += elapsed - inner
                totals[part][1] += 1

        return timed

    patches = [
        (type(step), "run_inputs", timer("inputs", type(step).run_inputs)),
        (type(step), "run_layer", timer("layer graphs", type(step).run_layer)),
        (type(step), "attention", timer("attention", type(step).attention)),
        (compiled_decode, "_store", timer("KV cache writes", compiled_decode._store)),
        (
            compiled_decode._StepOps,
            "routed_experts",
            timer("routed experts", compiled_decode._StepOps.routed_experts),
        ),
        (type(step), "head", timer("output head", type(step).head)),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, wrapped in patches:
        setattr(owner, name, wrapped)
    try:
        yield totals
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def print_breakdown(step: "CompiledDecodeStep", run: Step, steps: int) -> None:
    """Time `steps` steps of `run` (the compiled step on its cache) with its parts timed, and print
    milliseconds and calls a token for each part, the rest and the whole step."""
    token = torch.zeros((), dtype=torch.long)
    with timed_parts(step) as totals:
        started = time.perf_counter()
        for _ in range(steps):
            token = run(token).argmax()
        whole = time.perf_counter() - started
    print(f"compiled step, {steps} tokens: ms, share and calls a token (parts timed where they run)")
    rest = whole - sum(seconds for seconds, _ in totals.values())
    for part, (seconds, calls) in [*totals.items(), ("rest", (rest, 0)), ("step", (whole, steps))]:
        print(f"  {part:<20} {seconds / steps * 1000:7.2f} {seconds / whole:7.1%} {calls / steps:5.0f}")


def main() -> int:
    from bubo.cli import CACHE_TYPES

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cache-type",
        choices=sorted(CACHE_TYPES),
        default="f16",
        help="KV cache type (default f16, as `bubo serve`'s)",
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="then time the compiled step's parts (see above)"
    )
    args = parser.parse_args()

    from bubo.engine.loaded_model import load_model
    from bubo.engine.runner import runner_for

    if args.model is None:
        from bubo.default_model import default_model_path

        args.model = default_model_path()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    cache = CACHE_TYPES[args.cache_type]
    loaded = load_model(args.model, device=args.device, cache_dtypes=(cache, cache))
    print(f"load (compiled step included): {time.perf_counter() - started:.1f} s")
    model = loaded.model
    compiled = runner_for(model).decode_step(model.new_cache(max_len=2))
    max_len = args.prompt_tokens + (args.rounds + 2) * args.steps + 1
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
        if args.breakdown and compiled is not None:
            print_breakdown(compiled, paths["compiled"], args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
