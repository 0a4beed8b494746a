"""The CUDA wiring of the Triton kernels (Attention's and QSA's paged decode, GatedDeltaNet's delta
rule), run on the CPU through Triton's interpreter by making `triton_enabled` say yes: tiny qwen35moe and
qwen4exp models' logits over a prompt and decode steps (batched, on interleaved blocks; past the QSA
budget) must match their plain torch paths."""

import pytest
import torch

pytest.importorskip("triton")

from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.model import attention, deltanet, indexed_attention
from bubo.model.state import CacheBatch
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.fixtures.hybrid_models import tiny_hybrid
from tests.fixtures.qwen4exp_gguf import TINY_QWEN4EXP_CONFIG, write_qwen4exp_gguf

# On a CUDA machine the kernels compile for the GPU and the model runs there; elsewhere both paths run
# on the CPU, the kernels in the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 64, 2], [8, 8, 31], [300, 1, 2, 3, 4, 5, 6]]
STEPS = 3


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    model = tiny_hybrid(
        "qwen35moe", ["linear_attention", "full_attention"] * 2, vocab_size=320, max_position_embeddings=256
    )
    randomize_(model)
    path = write_gguf(model, tmp_path_factory.mktemp("wiring") / "tiny-qwen35moe.gguf")
    return load_model(path, device=DEVICE)


def _run(model) -> list[torch.Tensor]:
    """Logits of each prompt, then of STEPS greedy decode steps (row by row, then as one CacheBatch, in
    turn), on caches whose blocks interleave in one pool."""
    pool = model.new_block_pool(positions=128, block_size=4)
    caches = [model.new_cache(max_len=40, pool=pool) for _ in PROMPTS]
    logits = []
    with torch.inference_mode():
        for prompt, cache in zip(PROMPTS, caches, strict=True):
            logits.append(model(torch.tensor([prompt]), cache)[0])
        step = torch.tensor([[12], [13], [14]])
        for step_index in range(STEPS):
            if step_index % 2:
                out = model(step, CacheBatch(caches))
            else:
                out = torch.cat([model(step[i : i + 1], c) for i, c in enumerate(caches)])
            logits.append(out[:, -1])
            step = out[:, -1].argmax(-1, keepdim=True)
    return logits


def _set_triton(monkeypatch: pytest.MonkeyPatch, on: bool, *modules) -> dict[str, int]:
    """Make each module's `triton_enabled` answer `on`, counting the calls per module."""
    calls = {}
    for module in modules:
        name = module.__name__
        calls[name] = 0

        def use(_: torch.device, name: str = name) -> bool:
            calls[name] += 1
            return on

        monkeypatch.setattr(module, "triton_enabled", use)
    return calls


def test_the_kernels_give_the_torch_paths_logits(
    hybrid: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_triton(monkeypatch, False, attention, deltanet)
    expected = _run(hybrid.model)
    calls = _set_triton(monkeypatch, True, attention, deltanet)
    got = _run(hybrid.model)
    assert all(calls.values())
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


def test_qsa_decode_reads_the_selected_positions(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qwen4exp (spec 7.1's config: budget 2 blocks of 4, so queries past position 11 select): a
    20-token prompt then 6 greedy steps, kernels against torch."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    reference = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**TINY_QWEN4EXP_CONFIG))
    randomize_(reference)
    path = write_qwen4exp_gguf(reference, tmp_path_factory.mktemp("qsa") / "model.gguf")
    model = load_model(path, device=DEVICE).model
    prompt = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(4))

    def run() -> list[torch.Tensor]:
        cache = model.new_cache(max_len=32)
        with torch.inference_mode():
            logits = [model(prompt, cache)[0, -1]]
            for _ in range(6):
                logits.append(model(logits[-1].argmax().view(1, 1), cache)[0, -1])
        return logits

    _set_triton(monkeypatch, False, indexed_attention, deltanet)
    expected = run()
    calls = _set_triton(monkeypatch, True, indexed_attention, deltanet)
    got = run()
    assert all(calls.values())
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
