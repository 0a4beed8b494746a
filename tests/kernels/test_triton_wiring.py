"""The CUDA wiring of the Triton kernels (Attention's paged decode, GatedDeltaNet's delta rule), run on
the CPU through Triton's interpreter by making `use_triton` say yes: a tiny qwen35moe model's logits
over a prompt and batched decode steps on interleaved blocks must match its plain torch paths."""

import pytest
import torch

pytest.importorskip("triton")

from bubo.engine.kv_cache import CacheBatch
from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.model import attention, deltanet
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.fixtures.hybrid_models import tiny_hybrid

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 64, 2], [8, 8, 31], [300, 1, 2, 3, 4, 5, 6]]
STEPS = 3


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    model = tiny_hybrid(
        "qwen35moe", ["linear_attention", "full_attention"] * 2, vocab_size=320, max_position_embeddings=256
    )
    randomize_(model)
    return load_model(write_gguf(model, tmp_path_factory.mktemp("wiring") / "tiny-qwen35moe.gguf"))


def _run(model, batched: bool) -> list[torch.Tensor]:
    """Logits of each prompt, then of STEPS greedy decode steps (as one CacheBatch when `batched`),
    on caches whose blocks interleave in one pool."""
    pool = model.new_block_pool(positions=128, block_size=4)
    caches = [model.new_cache(max_len=40, pool=pool) for _ in PROMPTS]
    logits = []
    with torch.inference_mode():
        for prompt, cache in zip(PROMPTS, caches, strict=True):
            logits.append(model(torch.tensor([prompt]), cache)[0])
        step = torch.tensor([[12], [13], [14]])
        for _ in range(STEPS):
            if batched:
                out = model(step, CacheBatch(caches))
            else:
                out = torch.cat([model(step[i : i + 1], c) for i, c in enumerate(caches)])
            logits.append(out[:, -1])
            step = out[:, -1].argmax(-1, keepdim=True)
    return logits


@pytest.mark.parametrize("batched", [False, True])
def test_the_kernels_give_the_torch_paths_logits(
    hybrid: LoadedModel, batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _run(hybrid.model, batched)
    calls = {"attention": 0, "deltanet": 0}

    def counting(name: str):
        def use(_: torch.Tensor) -> bool:
            calls[name] += 1
            return True

        return use

    monkeypatch.setattr(attention, "use_triton", counting("attention"))
    monkeypatch.setattr(deltanet, "use_triton", counting("deltanet"))
    got = _run(hybrid.model, batched)
    assert calls["attention"] > 0 and calls["deltanet"] > 0
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
