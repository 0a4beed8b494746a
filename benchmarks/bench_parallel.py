"""Aggregate decode throughput of N concurrent streams on N slots (`--parallel N`) against one stream.

Runs the server's engine without HTTP: a SlotPool of N slots over the default SmolLM2 model (or
`--model`); each prompt first alone, then N requests with different prompts started together, each
generating `--tokens` tokens greedily (end-of-sequence ignored). Prints the single-stream and aggregate
decode tokens/s, how many sequences each batched decode pass carried (1.00 where the compiled CPU step
runs each sequence in turn), and checks every stream's text against the same request run alone.

The model loads in a thread that ends, as `bubo serve` loads it: a thread that ran torch's CPU work
with two OpenMP threads and lives on would slow every parallel region of the model's compute thread
(bubo/engine/compute_threads.py).

    python benchmarks/bench_parallel.py [--parallel 4] [--tokens 64] [--threads 2] [--model FILE]
"""

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bubo.default_model import default_model_path  # noqa: E402
from bubo.engine.loaded_model import LoadedModel, load_model  # noqa: E402
from bubo.engine.request import Finished, GenerationRequest  # noqa: E402
from bubo.engine.sampler import SamplingParams  # noqa: E402
from bubo.engine.slot_pool import SlotPool  # noqa: E402
from bubo.process_memory import configure_cpu_process  # noqa: E402

PROMPTS = [
    "The history of the printing press begins",
    "A good recipe for bread starts with",
    "The three laws of thermodynamics say that",
    "In the early morning the harbour was",
    "Compilers turn source code into",
    "The best way to learn a language is",
    "Mountains form when tectonic plates",
    "A short poem about the sea:",
]


async def _run(pool: SlotPool, loaded: LoadedModel, prompt: str, tokens: int) -> tuple[Finished, float]:
    ids = loaded.tokenizer.encode(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    request = GenerationRequest("bench", prompt, ids, params, cache_prompt=False)
    async for event in pool.run(request):
        if isinstance(event, Finished):
            return event, time.perf_counter()
    raise RuntimeError("no result")


async def _streams(
    pool: SlotPool, loaded: LoadedModel, prompts: list[str], tokens: int
) -> tuple[list[Finished], float]:
    started = time.perf_counter()
    results = await asyncio.gather(*(_run(pool, loaded, prompt, tokens) for prompt in prompts))
    return [r[0] for r in results], max(r[1] for r in results) - started


def _load(path: Path) -> LoadedModel:
    loaded: list[LoadedModel] = []
    thread = threading.Thread(target=lambda: loaded.append(load_model(path)))
    thread.start()
    thread.join()
    return loaded[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    configure_cpu_process()
    torch.set_num_threads(args.threads)
    loaded = _load(args.model or default_model_path())
    print(f"model: {loaded.path.name}, {args.threads} threads, {args.tokens} tokens per stream (greedy)")

    pool = SlotPool(loaded.model, loaded.tokenizer, 1024, parallel=args.parallel)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.parallel)]

    async def measure() -> tuple[list[Finished], list[Finished], float]:
        alone = [(await _streams(pool, loaded, [prompt], args.tokens))[0][0] for prompt in prompts]
        together, wall = await _streams(pool, loaded, prompts, args.tokens)
        return alone, together, wall

    alone, results, wall = asyncio.run(measure())
    single_rate = sum(f.result.timings.decode_tokens for f in alone) / sum(
        f.result.timings.decode_seconds for f in alone
    )
    decoded = sum(f.result.timings.decode_tokens for f in results)
    decode_wall = max(f.result.timings.decode_seconds for f in results)
    same = all(a.result.token_ids == b.result.token_ids for a, b in zip(alone, results, strict=True))
    batcher = pool.batcher
    carried = batcher.rows / batcher.steps if batcher is not None and batcher.steps else 1.0
    print(f"{'streams':>8} {'decode tok/s (aggregate)':>26} {'per stream':>11} {'seqs per pass':>14}")
    print(f"{1:>8} {single_rate:>26.1f} {single_rate:>11.1f} {1.0:>14.2f}")
    aggregate = decoded / decode_wall
    print(f"{args.parallel:>8} {aggregate:>26.1f} {aggregate / args.parallel:>11.1f} {carried:>14.2f}")
    print(f"speed-up {aggregate / single_rate:.2f}x; wall {wall:.1f} s; outputs identical to alone: {same}")


if __name__ == "__main__":
    main()
