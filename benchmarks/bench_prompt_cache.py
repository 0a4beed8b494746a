"""Time to first token of a growing multi-turn chat, with and without the prompt cache.

Replays a 10-turn conversation through the session slot (the server's engine, without HTTP): each
turn appends a user message of ~60 tokens to the history, renders it with the model's chat template,
generates 16 tokens greedily and appends the answer. Each turn is run with the cache (the slot keeps
what the previous turn computed, and for a hybrid model resumes from the recurrent-state snapshot at
the last turn end) and without (`cache_prompt: false`, the whole prompt recomputed), and the greedy
answers are compared. Models: the default SmolLM2 (dense: KV cut back to the shared prefix) and
bench_hybrid.py's tiny qwen35moe (Gated DeltaNet: snapshots).

    python benchmarks/bench_prompt_cache.py [--threads 2] [--turns 10]
"""

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_hybrid import write_qwen35moe  # noqa: E402

from bubo.default_model import default_model_path  # noqa: E402
from bubo.engine.loaded_model import LoadedModel, load_model  # noqa: E402
from bubo.engine.request import Finished, GenerationRequest  # noqa: E402
from bubo.engine.sampler import SamplingParams  # noqa: E402
from bubo.engine.slot import SessionSlot  # noqa: E402
from bubo.templates.chat_template import ChatTemplate  # noqa: E402

USER_TURN = (
    "Turn {i}: here is more context about the project. The parser reads the file, the loader maps "
    "the tensors, and the engine runs the layers one after another. What should I look at next?"
)


def _template(loaded: LoadedModel) -> ChatTemplate:
    source = loaded.file.metadata.get("tokenizer.chat_template")
    return ChatTemplate(source) if isinstance(source, str) else ChatTemplate.fallback()


async def _turn(slot: SessionSlot, loaded: LoadedModel, text: str, cache: bool) -> Finished:
    ids = loaded.tokenizer.encode(text)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    request = GenerationRequest("bench", text, ids, params, cache_prompt=cache)
    async for event in slot.run(request):
        if isinstance(event, Finished):
            return event
    raise RuntimeError("no result")


async def replay(loaded: LoadedModel, turns: int) -> list[tuple[int, float, float, int, bool]]:
    """Per turn: (prompt tokens, TTFT cached s, TTFT uncached s, cached tokens, same answer)."""
    template = _template(loaded)
    cached_slot = SessionSlot(loaded.model, loaded.tokenizer, loaded.config.context_length)
    cold_slot = SessionSlot(loaded.model, loaded.tokenizer, loaded.config.context_length)
    history: list[dict[str, str]] = [{"role": "system", "content": "You are a concise assistant."}]
    rows = []
    for i in range(1, turns + 1):
        history.append({"role": "user", "content": USER_TURN.format(i=i)})
        text = template.render(history)
        warm = await _turn(cached_slot, loaded, text, cache=True)
        cold = await _turn(cold_slot, loaded, text, cache=False)
        rows.append(
            (
                warm.usage.prompt_tokens,
                warm.usage.prompt_ms / 1000,
                cold.usage.prompt_ms / 1000,
                warm.usage.cached_tokens,
                warm.content_text == cold.content_text,
            )
        )
        history.append({"role": "assistant", "content": warm.content_text})
    return rows


def _print(name: str, rows: list[tuple[int, float, float, int, bool]]) -> None:
    print(f"\n{name}")
    print(
        f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT cache s':>13} {'TTFT no cache s':>16} {'speed-up':>9} {'same answer':>12}"
    )
    for i, (tokens, warm, cold, cached, same) in enumerate(rows, 1):
        print(f"{i:>4} {tokens:>7} {cached:>7} {warm:>13.3f} {cold:>16.3f} {cold / warm:>8.1f}x {same!s:>12}")
    total_warm, total_cold = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(
        f"total TTFT: {total_warm:.2f} s with the cache, {total_cold:.2f} s without ({total_cold / total_warm:.1f}x)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    smollm2 = load_model(default_model_path())
    _print(
        f"SmolLM2-135M-Instruct Q4_1 (dense), {args.threads} threads",
        asyncio.run(replay(smollm2, args.turns)),
    )
    with tempfile.TemporaryDirectory() as tmp:
        hybrid = load_model(write_qwen35moe(Path(tmp) / "tiny-qwen35moe.gguf"))
        rows = asyncio.run(replay(hybrid, args.turns))
        _print(f"tiny qwen35moe (Gated DeltaNet hybrid, 137 MB), {args.threads} threads", rows)
        hybrid.file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
