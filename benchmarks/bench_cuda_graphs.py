"""Decode tokens per second of one sequence on CUDA, the eager step beside the step captured as a CUDA
graph (bubo/engine/graph_decode.py), in one process, interleaved; and how far the captured step's
logits are from the eager step's over the first steps of the same greedy tokens.

    python benchmarks/bench_cuda_graphs.py --model FILE              # llama, qwen2/3, qwen3moe, qwen35(moe), qwen3next
    python benchmarks/bench_cuda_graphs.py --model FILE --steps 128 --rounds 5

Models the captured step does not cover (qwen4exp; experts the fused kernel does not read): it says so and stops.
"""

import argparse
import sys
from pathlib import Path

import torch
from bench_decode_step import Step, run_rounds


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check-steps", type=int, default=16, help="steps of the logit comparison")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 1

    from bubo.engine.graph_decode import GraphDecodeStep
    from bubo.engine.loaded_model import load_model
    from bubo.engine.runner import runner_for

    if args.model is None:
        from bubo.default_model import default_model_path

        args.model = default_model_path()
    loaded = load_model(args.model, device="cuda")
    model = loaded.model
    # Each cache runs the comparison, two warm-up steps and every round.
    max_len = args.prompt_tokens + args.check_steps + 2 + args.rounds * args.steps
    prompt = torch.arange(args.prompt_tokens, device="cuda")[None] % model.config.vocab_size

    def prefilled() -> object:
        cache = model.new_cache(max_len=max_len)
        model(prompt, cache, last_only=True)
        return cache

    with torch.inference_mode():
        step = runner_for(model).graph_step(prefilled())
        if not isinstance(step, GraphDecodeStep):
            print(f"no captured step for {model.config.architecture} (see the log): nothing to compare")
            return 1

        eager_cache, graph_cache = prefilled(), prefilled()
        token, worst, same = torch.zeros((), dtype=torch.long, device="cuda"), 0.0, True
        for _ in range(args.check_steps):
            eager = model(token.view(1, 1), eager_cache)[0, -1]
            graphed = step(token, graph_cache)
            worst = max(worst, (eager - graphed).abs().max().item())
            same = same and int(eager.argmax()) == int(graphed.argmax())
            token = eager.argmax()
        print(
            f"captured: {step.captured(graph_cache)}, failed: {step.failed}; over {args.check_steps} steps max |Δlogit| "
            f"{worst:.3g}, greedy tokens {'identical' if same else 'DIFFER'}"
        )

        paths: dict[str, Step] = {
            "eager": lambda t: model(t.view(1, 1), eager_cache)[0, -1],
            "graph": lambda t: step(t, graph_cache),
        }
        run_rounds(paths, args.steps, args.rounds, model.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
