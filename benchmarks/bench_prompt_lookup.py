"""Prompt-lookup speculative decoding (`--spec-type ngram-simple`) on the default model: decode tokens/s
with and without it, Bubo beside llama.cpp (llama-cpp-python's LlamaPromptLookupDecoding, the same
idea), on a task that repeats its prompt and one that doesn't. Greedy, so every configuration of an
engine must produce the same tokens; the script checks that Bubo's do.

Each configuration runs in turn, `--repeats` times interleaved, and the medians (and best) are printed:
on a shared 2-core machine only figures taken side by side mean anything. First it times what a round
costs: the compiled step's pass over 1 (a plain step) .. max draft + 1 tokens at 500 cached positions.

    python benchmarks/bench_prompt_lookup.py
    python benchmarks/bench_prompt_lookup.py --drafts 1 2 3 --tokens 128 --repeats 5 --no-llama-cpp
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from bubo.default_model import default_model_path  # noqa: E402
from bubo.engine.drafters import prepare_drafting  # noqa: E402
from bubo.engine.generate import GenerationResult, generate  # noqa: E402
from bubo.engine.loaded_model import load_model  # noqa: E402
from bubo.engine.ngram_drafter import DEFAULT_NGRAM_SIZE, NgramDrafter  # noqa: E402
from bubo.engine.runner import runner_for  # noqa: E402
from bubo.engine.sampler import SamplingParams  # noqa: E402

PASSAGE = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
    "the members agreed to increase the funding for the public library by ten percent, to repair the "
    "roof of the town hall before the winter, and to hire two more teachers for the primary school. "
    "The proposal to build a new parking garage was postponed until the spring, when the results of "
    "the traffic study will be available."
)
TASKS = {
    # The answer repeats the prompt: n-gram drafts are mostly right.
    "repeat": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    # The answer is new text: few n-grams recur, few drafts.
    "story": "Write a short story about a fox who learns to fly.",
}


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


Run = Callable[[], tuple[list[int], float, int, int]]  # tokens, decode tok/s, drafted, accepted


def bubo_runs(
    path: Path, drafts: list[int], size_n: int, tokens: int, threads: int
) -> dict[str, dict[str, Run]]:
    torch.set_num_threads(threads)
    loaded = load_model(path)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for draft in drafts:
        prepare_drafting(loaded.model, NgramDrafter(draft, size_n))

    def run(prompt: list[int], draft: int) -> Run:
        def once() -> tuple[list[int], float, int, int]:
            drafter = NgramDrafter(draft, size_n) if draft else None
            result = list(generate(loaded.model, loaded.tokenizer, prompt, params, drafter=drafter))[-1]
            assert isinstance(result, GenerationResult)
            timings = result.timings
            rate = timings.decode_tokens / timings.decode_seconds
            return result.token_ids, rate, result.draft_tokens, result.draft_accepted

        return once

    print_pass_times(loaded.model, max(drafts) + 1)
    runs: dict[str, dict[str, Run]] = {}
    for task, text in TASKS.items():
        prompt = loaded.tokenizer.encode(chat(text), parse_special=True)
        runs[task] = {"bubo": run(prompt, 0)}
        runs[task].update({f"bubo ngram d={d}": run(prompt, d) for d in drafts})
    return runs


def print_pass_times(model: torch.nn.Module, most: int, cached: int = 500, repeats: int = 15) -> None:
    """Milliseconds a compiled pass over 1 .. `most` tokens takes after `cached` positions (medians and
    best of `repeats`, the counts interleaved)."""
    cache = model.new_cache(max_len=cached + most)
    with torch.inference_mode():
        model(torch.arange(cached)[None] % model.config.vocab_size, cache, last_only=True)
        step = runner_for(model).decode_step(cache)
        if step is None:
            print("no compiled step for this model: verify passes run the eager forward")
            return
        times: dict[int, list[float]] = {count: [] for count in range(1, most + 1)}
        for _ in range(repeats):
            for count, values in times.items():
                started = time.perf_counter()
                step(torch.arange(count) if count > 1 else torch.tensor(0), cache)
                values.append((time.perf_counter() - started) * 1000)
                cache.truncate(cached)
    print(f"compiled pass after {cached} positions, ms (median / best of {repeats}):")
    for count, values in times.items():
        print(
            f"  {count} token{'s' if count > 1 else ''}: {statistics.median(values):6.2f} / {min(values):6.2f}"
        )


def llama_cpp_runs(path: Path, drafts: list[int], tokens: int, threads: int) -> dict[str, dict[str, Run]]:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def model(draft: int) -> Llama:
        speculative = {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=draft)} if draft else {}
        return Llama(str(path), n_ctx=2048, n_threads=threads, verbose=False, **speculative)

    models = {draft: model(draft) for draft in [0, *drafts]}

    def run(text: str, draft: int) -> Run:
        llm = models[draft]

        def once() -> tuple[list[int], float, int, int]:
            llm.reset()
            out = []
            started = first = time.perf_counter()
            stream = llm.create_completion(chat(text), max_tokens=tokens, temperature=0.0, stream=True)
            for i, chunk in enumerate(stream):
                if i == 0:
                    first = time.perf_counter()
                out.append(chunk["choices"][0]["text"])
            decoded = max(len(out) - 1, 1)
            elapsed = time.perf_counter() - (first if len(out) > 1 else started)
            return [], decoded / elapsed, 0, 0

        return once

    return {
        task: {("llama.cpp" if not d else f"llama.cpp lookup d={d}"): run(text, d) for d in [0, *drafts]}
        for task, text in TASKS.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 3], help="tokens drafted per round")
    parser.add_argument("--size-n", type=int, default=DEFAULT_NGRAM_SIZE, help="n-gram that must match")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-llama-cpp", action="store_true", help="Bubo only")
    args = parser.parse_args(argv)
    path = args.model or default_model_path()

    runs = bubo_runs(path, args.drafts, args.size_n, args.tokens, args.threads)
    if not args.no_llama_cpp:
        for task, peers in llama_cpp_runs(path, args.drafts, args.tokens, args.threads).items():
            runs[task].update(peers)

    print(
        f"{path.name}, {args.threads} threads, {args.tokens} greedy tokens, medians of {args.repeats} (best)"
    )
    for task, configs in runs.items():
        rates: dict[str, list[float]] = {name: [] for name in configs}
        counts: dict[str, tuple[int, int]] = {}
        reference: list[int] | None = None
        for _ in range(args.repeats):
            for name, once in configs.items():
                ids, rate, drafted, accepted = once()
                rates[name].append(rate)
                counts[name] = (drafted, accepted)
                if name.startswith("bubo"):
                    reference = reference or ids
                    if ids != reference:
                        raise SystemExit(f"{task}: {name} produced other tokens than plain decoding")
        plain = statistics.median(rates["bubo"])
        print(f"\n{task}:")
        for name, values in rates.items():
            drafted, accepted = counts[name]
            kept = f"  drafts kept {accepted}/{drafted}" if drafted else ""
            median = statistics.median(values)
            print(f"  {name:24s} {median:7.1f} tok/s (best {max(values):6.1f})  x{median / plain:4.2f}{kept}")


if __name__ == "__main__":
    main()
