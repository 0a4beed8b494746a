"""Prefill time of short prompts, one eager forward pass beside one compiled decode step per token
(bubo/engine/compiled_decode.py): the measurement behind the runner's SHORT_PROMPT_TOKENS. Both paths run
in one process, interleaved, on the same random token ids; each figure is the best of `--rounds`.

    python benchmarks/bench_short_prefill.py                          # default model, 2 threads
    python benchmarks/bench_short_prefill.py --model FILE --threads 1 --tokens 1 8 16 32
"""

import argparse
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 12, 16, 24, 32, 48])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    from bubo.process_memory import configure_cpu_process

    configure_cpu_process()
    from bubo.default_model import default_model_path
    from bubo.engine.loaded_model import load_model
    from bubo.engine.runner import SHORT_PROMPT_TOKENS, runner_for

    torch.set_num_threads(args.threads)
    model = load_model(args.model or default_model_path(), dtype=torch.float32).model
    step = runner_for(model).decode_step(model.new_cache(max_len=8))
    if step is None:
        print("no compiled decode step covers this model here: every prompt prefills eagerly")
        return 1

    def eager(ids: torch.Tensor) -> float:
        cache = model.new_cache(max_len=ids.shape[1] + 1)
        started = time.perf_counter()
        model(ids, cache, last_only=True)
        return time.perf_counter() - started

    def stepped(ids: torch.Tensor) -> float:
        cache = model.new_cache(max_len=ids.shape[1] + 1)
        started = time.perf_counter()
        for token in ids[0]:
            step(token, cache)
        return time.perf_counter() - started

    print(f"{args.threads} threads; generate steps prompts of up to {SHORT_PROMPT_TOKENS} tokens")
    print(f"{'tokens':>6} {'eager ms':>9} {'stepped ms':>11}")
    with torch.inference_mode():
        for n in args.tokens:
            ids = torch.randint(100, model.config.vocab_size, (1, n))
            times = {"eager": float("inf"), "stepped": float("inf")}
            for _ in range(args.rounds):
                times["eager"] = min(times["eager"], eager(ids))
                times["stepped"] = min(times["stepped"], stepped(ids))
            print(f"{n:>6} {times['eager'] * 1000:>9.0f} {times['stepped'] * 1000:>11.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
