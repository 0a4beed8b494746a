"""An expert-routing heat map: which experts each mixture-of-experts layer sends a text's tokens to.

The model continues the prompt, then the prompt and its continuation run once more through the model
under a trace of the routers (`model.trace(sites=["router"])`, bubo/model/trace.py). Each cell is the
share of the router weight a layer gave an expert over the text's tokens (rows: layers, columns:
experts); with `--layer` the rows are the tokens of that one layer instead. The PNG is drawn with Pillow
(a dependency of Bubo). Needs a mixture-of-experts GGUF (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, ...):

    python examples/router_heatmap.py --model Qwen3-30B-A3B-Q4_K_M.gguf --out routing.png
"""

import argparse

import torch
from PIL import Image, ImageDraw

import bubo

# Dark blue through green to yellow (viridis' ends and middle): low to high.
_COLOURS = ((68, 1, 84), (33, 145, 140), (253, 231, 37))
_LABEL_WIDTH, _TITLE_HEIGHT = 90, 18


def routing(model: bubo.Model, ids: list[int]) -> dict[int, torch.Tensor]:
    """Per mixture-of-experts layer, the router weight each position gave each expert [positions, experts]
    (0 where the expert was not among its top-k)."""
    with model.trace(sites=["router"]) as trace:
        model.forward(ids)
    maps = {}
    for layer in sorted({layer for name, layer in trace.names() if name == "router_experts"}):
        experts, weights = trace["router_experts", layer][0][0], trace["router_weights", layer][0][0]
        grid = torch.zeros(len(ids), model.config.num_experts)
        maps[layer] = grid.scatter_(1, experts, weights.float())
    return maps


def heat_map(rows: torch.Tensor, labels: list[str], title: str, cell: int) -> Image.Image:
    """`rows` [rows, columns] of values >= 0 as coloured cells (scaled to the largest), labelled rows."""
    top = float(rows.max()) or 1.0
    height, width = rows.shape
    title_width = int(ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(title)) + 8
    size = (max(_LABEL_WIDTH + width * cell, title_width), _TITLE_HEIGHT + height * cell)
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    draw.text((4, 2), title, fill="black")
    for r in range(height):
        draw.text((4, _TITLE_HEIGHT + r * cell), labels[r][:14], fill="black")
        for c in range(width):
            x, y = _LABEL_WIDTH + c * cell, _TITLE_HEIGHT + r * cell
            draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=colour(float(rows[r, c]) / top))
    return image


def colour(value: float) -> tuple[int, int, int]:
    """`value` in [0, 1] on the colour scale."""
    position = min(max(value, 0.0), 1.0) * (len(_COLOURS) - 1)
    low = min(int(position), len(_COLOURS) - 2)
    t = position - low
    a, b = _COLOURS[low], _COLOURS[low + 1]
    return (round(a[0] + (b[0] - a[0]) * t), round(a[1] + (b[1] - a[1]) * t), round(a[2] + (b[2] - a[2]) * t))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a mixture-of-experts GGUF file")
    parser.add_argument("--prompt", default="The three primary colours are")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens generated after the prompt")
    parser.add_argument("--layer", type=int, default=None, help="one layer, a row per token")
    parser.add_argument("--out", default="routing.png")
    parser.add_argument("--cell", type=int, default=12, help="pixels per cell")
    args = parser.parse_args()
    with bubo.load(args.model) as model:
        if not model.config.num_experts:
            parser.error(f"{model.path.name} has no mixture-of-experts layers")
        ids = model.tokenizer.encode(args.prompt)
        ids += model.generate(ids, max_tokens=args.max_tokens, temperature=0).result.token_ids
        maps = routing(model, ids)
        if args.layer is not None:
            if args.layer not in maps:
                parser.error(f"layer {args.layer} is not a mixture-of-experts layer: one of {sorted(maps)}")
            rows = maps[args.layer]
            labels = [repr(model.tokenizer.decode([token]))[1:-1] for token in ids]
            title = f"layer {args.layer}: router weight per token (rows) and expert 0-{rows.shape[1] - 1}"
        else:
            rows = torch.stack([grid.sum(0) / len(ids) for grid in maps.values()])
            labels = [f"layer {layer}" for layer in maps]
            title = (
                f"share of router weight per layer and expert 0-{rows.shape[1] - 1} over {len(ids)} tokens"
            )
        heat_map(rows, labels, title, args.cell).save(args.out)
        print(f"{title} -> {args.out} ({rows.shape[0]} x {rows.shape[1]})")
        for label, row in zip(labels, rows, strict=True):
            busiest = row.topk(min(3, int((row > 0).sum())))  # the busiest experts, up to 3
            cells = "  ".join(
                f"{e:>3} {w:5.1%}"
                for e, w in zip(busiest.indices.tolist(), busiest.values.tolist(), strict=True)
            )
            print(f"{label:>14}  {cells}")


if __name__ == "__main__":
    main()
