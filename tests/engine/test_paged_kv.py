"""Paged KV (bubo/model/block_pool.py, KVCache's block tables) and batched decode across caches
(CacheBatch, bubo/engine/batcher.py), checked against the same model run through a private cache one
sequence at a time — which tests/model/test_decoder.py checks against transformers."""

import itertools
import threading
from pathlib import Path

import pytest
import torch

from bubo.engine.batcher import BatchedModel, DecodeBatcher
from bubo.engine.generate import GenerationResult, generate
from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.engine.sampler import SamplingParams
from bubo.model.block_pool import BlockPool, KVPoolExhaustedError
from bubo.model.state import CacheBatch
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.fixtures.hybrid_models import tiny_hybrid

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 64, 2], [8, 8, 31], [300, 1, 2, 3, 4, 5, 6]]


@pytest.fixture(scope="module")
def llama(tiny_llama_path: Path) -> LoadedModel:
    return load_model(tiny_llama_path)


@pytest.fixture(scope="module")
def llama_f16(tiny_llama_path: Path) -> LoadedModel:
    """The tiny llama with a float16 KV cache (`bubo serve`'s default): blocks written narrowed."""
    return load_model(tiny_llama_path, cache_dtypes=(torch.float16, torch.float16))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    model = tiny_hybrid(
        "qwen35moe", ["linear_attention", "full_attention"] * 2, vocab_size=320, max_position_embeddings=256
    )
    randomize_(model)
    return load_model(write_gguf(model, tmp_path_factory.mktemp("paged") / "tiny-qwen35moe.gguf"))


def _reference(model, tokens: list[int]) -> torch.Tensor:
    """Logits of every position, computed in one pass through a private cache."""
    with torch.inference_mode():
        return model(torch.tensor([tokens]), model.new_cache(max_len=64))[0]


@pytest.mark.parametrize("which", ["llama", "llama_f16"])
def test_sequences_whose_blocks_interleave_get_the_same_logits(
    which: str, request: pytest.FixtureRequest
) -> None:
    model = request.getfixturevalue(which).model
    pool = model.new_block_pool(positions=64, block_size=4)
    caches = [model.new_cache(max_len=32, pool=pool) for _ in range(2)]
    tokens = [PROMPTS[0] + [1, 2, 3, 4, 5, 6], [9] * 3 + PROMPTS[2] + [7, 7, 7, 7, 7, 7]]
    got: list[list[torch.Tensor]] = [[], []]
    with torch.inference_mode():
        # Three tokens at a time, alternating: the two caches take blocks turn about.
        for start in range(0, 16, 3):
            for i, cache in enumerate(caches):
                chunk = tokens[i][start : start + 3]
                got[i].append(model(torch.tensor([chunk]), cache)[0])
    for i, cache in enumerate(caches):
        table = cache.tables[0]
        assert any(b + 1 != c for b, c in itertools.pairwise(table)), "blocks should interleave"
        # float16 keys of a 3-token chunk's projection can round one half-ulp away from the one-pass's.
        tolerance = 1e-5 if which == "llama" else 1e-4
        torch.testing.assert_close(
            torch.cat(got[i]), _reference(model, tokens[i]), atol=tolerance, rtol=tolerance
        )


def test_a_shared_prefix_is_held_not_copied_and_copied_on_write(llama: LoadedModel) -> None:
    model = llama.model
    pool = model.new_block_pool(positions=64, block_size=4)
    first, second = (model.new_cache(max_len=32, pool=pool) for _ in range(2))
    prefix = PROMPTS[0]  # 10 tokens: two full blocks and half of a third
    with torch.inference_mode():
        model(torch.tensor([prefix]), first)
        second.share_prefix(first, len(prefix))
        assert second.tables[0] == first.tables[0]
        assert all(pool.refs[b] == 2 for b in first.tables[0])
        free_before = pool.free_blocks
        a = model(torch.tensor([[4, 5]]), first)[0]
        b = model(torch.tensor([[6, 7, 8]]), second)[0]
    # The half-filled third block was copied by the first writer (the second then holds the original
    # alone); the full ones stay shared. The second's third token opens a fourth block.
    assert first.tables[0][:2] == second.tables[0][:2] and first.tables[0][2] != second.tables[0][2]
    assert pool.free_blocks == free_before - 2
    torch.testing.assert_close(a, _reference(model, [*prefix, 4, 5])[-2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b, _reference(model, [*prefix, 6, 7, 8])[-3:], atol=1e-5, rtol=1e-5)


def test_cutting_a_cache_gives_its_blocks_back(llama: LoadedModel) -> None:
    model = llama.model
    pool = model.new_block_pool(positions=32, block_size=4)
    cache = model.new_cache(max_len=32, pool=pool)
    with torch.inference_mode():
        model(torch.tensor([PROMPTS[0]]), cache)
    assert cache.blocks == 3 and pool.free_blocks == 5
    cache.truncate(5)
    assert cache.blocks == 2 and pool.free_blocks == 6
    cache.reset()
    assert cache.blocks == 0 and pool.free_blocks == 8


def test_a_full_pool_refuses_room_and_asks_to_reclaim(llama: LoadedModel) -> None:
    model = llama.model
    pool = model.new_block_pool(positions=8, block_size=4)
    hog, other = (model.new_cache(max_len=32, pool=pool) for _ in range(2))
    with torch.inference_mode():
        model(torch.tensor([PROMPTS[0][:8]]), hog)
    assert pool.free_blocks == 0
    assert not other.reserve(1)
    with pytest.raises(KVPoolExhaustedError, match="KV cache is full"), torch.inference_mode():
        model(torch.tensor([[1]]), other)
    pool.reclaim = lambda: (hog.reset(), True)[1]
    assert other.reserve(3) and other.blocks == 1 and hog.blocks == 0


def test_a_single_run_is_found_only_where_the_blocks_follow_each_other(llama: LoadedModel) -> None:
    model = llama.model
    pool = model.new_block_pool(positions=32, block_size=4)
    first, second = (model.new_cache(max_len=16, pool=pool) for _ in range(2))
    assert first.single_run(5) == 0 and first.blocks == 2  # takes the blocks, as a write would
    assert second.single_run(4) == 8  # the blocks after the first cache's
    assert first.single_run(9) is None  # its third block comes after the second cache's: not one run
    with pytest.raises(ValueError, match="KV cache full"):
        first.single_run(17)
    assert model.new_cache(max_len=8, batch=2).single_run(1) is None


def test_blocks_are_taken_to_extend_runs() -> None:
    pool = BlockPool(1, 1, 2, num_blocks=8, block_size=2, dtype=torch.float32, device="cpu")
    a = [pool.take() for _ in range(3)]
    assert a == [0, 1, 2]
    pool.release([1])
    assert pool.take(after=2) == 3  # the block after the caller's last one
    assert pool.take() == 4  # not the lone free block 1: the start of the longest free run (4..7)
    assert pool.take(after=0) == 1


def test_only_blocks_never_taken_are_uncommitted() -> None:
    # On the CPU a block's pages take memory when first written; given back, they stay taken.
    pool = BlockPool(1, 1, 2, num_blocks=4, block_size=2, dtype=torch.float32, device="cpu")
    held = [pool.take(), pool.take()]
    assert pool.uncommitted_blocks == 2
    pool.release(held)
    assert [pool.take(), pool.take()] == held
    assert pool.uncommitted_blocks == 2


@pytest.mark.parametrize("which", ["llama", "llama_f16", "hybrid"])
def test_a_batch_of_caches_decodes_as_each_alone(which: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(which).model
    assert model.supports_cache_batch
    pool = model.new_block_pool(positions=128, block_size=4)
    caches = [model.new_cache(max_len=40, pool=pool) for _ in PROMPTS]
    alone = [model.new_cache(max_len=40) for _ in PROMPTS]
    with torch.inference_mode():
        for prompt, cache, solo in zip(PROMPTS, caches, alone, strict=True):
            model(torch.tensor([prompt]), cache)
            model(torch.tensor([prompt]), solo)
        step = torch.tensor([[12], [13], [14]])
        for _ in range(3):
            batched = model(step, CacheBatch(caches))
            single = torch.cat([model(step[i : i + 1], solo) for i, solo in enumerate(alone)])
            # The same float32 math in another summation order: oneDNN picks its GEMM kernel by row count,
            # and on an AMX Xeon one 64-wide product of 3 rows differs from the same rows alone by ~6e-6.
            torch.testing.assert_close(batched, single, atol=1e-4, rtol=1e-4)
            step = batched[:, -1].argmax(-1, keepdim=True)
    assert [c.length for c in caches] == [len(p) + 3 for p in PROMPTS]


@pytest.mark.parametrize("which", ["llama", "hybrid"])
def test_concurrent_generations_through_the_batcher_match_sequential_ones(
    which: str, request: pytest.FixtureRequest
) -> None:
    loaded = request.getfixturevalue(which)
    model, tokenizer = loaded.model, loaded.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(m, prompt: list[int]) -> list[int]:
        result = [e for e in generate(m, tokenizer, prompt, params) if isinstance(e, GenerationResult)]
        return result[0].token_ids

    expected = [run(model, p) for p in PROMPTS]
    batcher = DecodeBatcher(model)
    got: dict[int, list[int]] = {}
    start = threading.Barrier(len(PROMPTS))

    def worker(i: int) -> None:
        start.wait()
        with batcher.member():
            got[i] = run(BatchedModel(model, batcher), PROMPTS[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(len(PROMPTS))] == expected
    assert batcher.steps > 0 and batcher.rows > batcher.steps  # some steps did carry several sequences


def test_a_failure_before_the_pass_reaches_every_waiting_call(
    tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fails while a batch is being put together (here choosing its compiled step), every call in
    it gets the error: none is left waiting, which would hang its generation and the process's exit."""
    model = tiny_llama.model
    batcher = DecodeBatcher(model)

    def broken(self: DecodeBatcher, batch: list) -> dict:
        raise RuntimeError("no step for you")

    monkeypatch.setattr(DecodeBatcher, "_compiled_steps", broken)
    errors: dict[int, BaseException] = {}
    start = threading.Barrier(2)

    def worker(i: int) -> None:
        cache = model.new_cache(max_len=8)
        start.wait()
        with batcher.member():
            try:
                batcher.call("forward", torch.tensor([[5 + i]]), cache, True)
            except RuntimeError as error:
                errors[i] = error

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert sorted(errors) == [0, 1] and all("no step for you" in str(e) for e in errors.values())
