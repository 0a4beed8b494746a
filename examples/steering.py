"""Steering by activation addition: push a generation toward one side of a contrast.

The direction is the difference of the residual after a layer between two contrasting prompts (at their
last position, where each has read its whole prompt), as in Turner et al., "Activation Addition"
(2023). That direction, scaled, is added to the residual after the same layer at every position and
step of a generation (`model.trace(steer={layer: vector})`, bubo/model/trace.py). Runs in seconds on
the default model (SmolLM2-135M-Instruct):

    python examples/steering.py --positive " I love" --negative " I hate" --prompt "I think dogs are"
"""

import argparse

import torch

import bubo


def direction(model: bubo.Model, positive: str, negative: str, layer: int) -> torch.Tensor:
    """The residual after `layer` at the last position of `positive` minus that of `negative` [hidden]."""
    ends = []
    for text in (positive, negative):
        with model.trace(sites=["residual"], layers=[layer]) as trace:
            model.forward(model.tokenizer.encode(text))
        (residual,) = trace["residual", layer]
        ends.append(residual[0, -1])
    return ends[0] - ends[1]


def steered(model: bubo.Model, prompt: str, layer: int, vector: torch.Tensor, max_tokens: int) -> str:
    with model.trace(sites=[], steer={layer: vector}):
        return model.generate(prompt, max_tokens=max_tokens, temperature=0).content_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--prompt", default="I think dogs are")
    parser.add_argument("--positive", default=" I love")
    parser.add_argument("--negative", default=" I hate")
    parser.add_argument("--layer", type=int, default=6, help="the layer whose residual is steered")
    parser.add_argument("--coefficient", type=float, default=0.5, help="how far to push")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    with bubo.load(args.model) as model:
        vector = args.coefficient * direction(model, args.positive, args.negative, args.layer)
        plain = model.generate(args.prompt, max_tokens=args.max_tokens, temperature=0).content_text
        print(
            f"steering layer {args.layer} of {model.path.name} by {args.coefficient} x "
            f"({args.positive!r} - {args.negative!r}), norm {vector.norm():.1f}"
        )
        print(f"plain:   {args.prompt}{plain}")
        print(f"toward:  {args.prompt}{steered(model, args.prompt, args.layer, vector, args.max_tokens)}")
        print(f"away:    {args.prompt}{steered(model, args.prompt, args.layer, -vector, args.max_tokens)}")


if __name__ == "__main__":
    main()
