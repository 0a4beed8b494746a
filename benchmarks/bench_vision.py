"""Time the vision tower at the released Qwen3.5 size (27 blocks of width 1152, 16 heads, patch 16,
merge 2) on random weights: Bubo's VisionTower against transformers' Qwen3_5VisionModel on the same
weights and the same pixels, interleaved, medians over the repeats; and Bubo's output against the
reference's (max |delta| relative to the output's scale). Needs transformers (the bench extra).

    python benchmarks/bench_vision.py --sizes 256x256 512x512 --repeats 3 --threads 2
"""

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import Qwen3_5VisionConfig, Qwen3_5VisionModel

from bubo.vision.loader import load_vision_tower

RELEASED_TOWER = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 2304,
    "out_hidden_size": 2048,
    "hidden_act": "gelu_pytorch_tanh",
}


def _checkpoint(reference: Qwen3_5VisionModel, folder: Path) -> Path:
    (folder / "config.json").write_text(json.dumps({"vision_config": RELEASED_TOWER}))
    state = {"model.visual." + name: t.contiguous() for name, t in reference.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=["256x256", "512x512"], help="WIDTHxHEIGHT images")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    config = Qwen3_5VisionConfig(**RELEASED_TOWER)
    config._attn_implementation = "sdpa"
    reference = Qwen3_5VisionModel(config).eval()  # transformers' random init: enough for timing
    with tempfile.TemporaryDirectory() as folder:
        tower = load_vision_tower(_checkpoint(reference, Path(folder)), dtype=torch.float32, device="cpu")

    print(f"threads {args.threads}, repeats {args.repeats}, released-size tower (27 x 1152), fp32")
    print("image      patches  tokens  bubo s (median)  transformers s (median)  max|d|/max|ref|")
    rng = np.random.default_rng(0)
    for size in args.sizes:
        width, height = (int(x) for x in size.split("x"))
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        patches = tower.preprocess(image)
        grid = torch.tensor([patches.grid])
        bubo_times, reference_times = [], []
        for _ in range(args.repeats):  # interleaved, so load on the shared cores hits both alike
            bubo_times.append(_seconds(partial(tower.encode, patches)))
            with torch.no_grad():
                reference_times.append(_seconds(partial(reference, patches.pixels, grid)))
        ours = tower.encode(patches)
        with torch.no_grad():
            expected = reference(patches.pixels, grid).pooler_output
        error = ((ours - expected).abs().max() / expected.abs().max()).item()
        print(
            f"{size:<10} {patches.pixels.shape[0]:>7}  {ours.shape[0]:>6}  "
            f"{statistics.median(bubo_times):>15.2f}  {statistics.median(reference_times):>23.2f}  {error:>15.1e}"
        )


if __name__ == "__main__":
    main()
