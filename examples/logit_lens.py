"""A logit-lens table: what each layer of a model would predict next if the model stopped there.

The residual after every layer is read through the model's own final norm and output head
(`model.trace(sites=["logit_lens"])`, bubo/model/trace.py), and the top tokens for the prompt's last
position are printed per layer. Runs in seconds on the default model (SmolLM2-135M-Instruct):

    python examples/logit_lens.py --prompt "The capital of France is"
"""

import argparse

import torch

import bubo


def logit_lens_rows(model: bubo.Model, prompt: str, top_k: int) -> list[tuple[int, list[tuple[str, float]]]]:
    """(layer, [(token text, probability)] * top_k) for the next token after `prompt`, per layer."""
    ids = model.tokenizer.encode(prompt)
    with model.trace(sites=["logit_lens"]) as trace:
        model.forward(ids)
    rows = []
    for layer in range(len(model.decoder.layers)):
        (lens,) = trace["logit_lens", layer]
        probs = torch.softmax(lens[0, -1], dim=-1)
        top = probs.topk(top_k)
        tokens = [model.tokenizer.decode([int(i)]) for i in top.indices]
        rows.append((layer, list(zip(tokens, top.values.tolist(), strict=True))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--top-k", type=int, default=3, help="tokens shown per layer")
    args = parser.parse_args()
    with bubo.load(args.model) as model:
        print(f"logit lens of {model.path.name} for {args.prompt!r} (next token, per layer)")
        for layer, top in logit_lens_rows(model, args.prompt, args.top_k):
            cells = "  ".join(f"{text!r:>14} {p:5.1%}" for text, p in top)
            print(f"layer {layer:>3}  {cells}")


if __name__ == "__main__":
    main()
