"""One thread runs the model with the process's thread count; the slots' own threads keep to one
(bubo/engine/compute_threads.py)."""

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from bubo.engine.compute_threads import use_one_thread
from bubo.engine.loaded_model import LoadedModel
from bubo.engine.request import Finished, GenerationRequest
from bubo.engine.sampler import SamplingParams
from bubo.engine.slot_pool import SlotPool


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _in_thread(work: Any) -> Any:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    thread.join()
    return out[0]


def test_use_one_thread_keeps_that_thread_alone_to_one(two_threads: None) -> None:
    def one() -> int:
        use_one_thread()
        torch.randn(1 << 20).add_(1)  # big enough for a parallel region, were there a team
        return torch.get_num_threads()

    assert _in_thread(one) == 1
    assert _in_thread(torch.get_num_threads) == 2  # other threads keep the process's count
    assert torch.get_num_threads() == 2


class _Recording:
    """The model, noting the thread of every forward pass."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.threads: set[str] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.threads.add(threading.current_thread().name)
        return self._model(*args, **kwargs)

    def hidden(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.threads.add(threading.current_thread().name)
        return self._model.hidden(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_with_several_slots_every_pass_runs_on_the_compute_thread(
    tiny_llama: LoadedModel, two_threads: None
) -> None:
    model = _Recording(tiny_llama.model)
    pool = SlotPool(model, tiny_llama.tokenizer, 128, parallel=2)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def one(text: str) -> Finished:
        ids = tiny_llama.tokenizer.encode(text)
        async for event in pool.run(GenerationRequest("t", text, ids, params, cache_prompt=False)):
            if isinstance(event, Finished):
                return event
        raise AssertionError("no result")

    async def both() -> list[Finished]:
        return list(await asyncio.gather(one("hello there"), one("a longer prompt, to prefill")))

    results = asyncio.run(both())
    assert [r.result.completion_tokens for r in results] == [6, 6]
    assert len(model.threads) == 1 and model.threads.pop().startswith("bubo-compute")
    # The slots' threads sample and mask on one thread of their own.
    assert {slot._executor.submit(torch.get_num_threads).result() for slot in pool.slots} == {1}


def test_a_single_slot_runs_the_model_on_its_own_thread(tiny_llama: LoadedModel, two_threads: None) -> None:
    pool = SlotPool(tiny_llama.model, tiny_llama.tokenizer, 128, parallel=1)
    assert pool.batcher is None
    assert pool.slots[0]._executor.submit(torch.get_num_threads).result() == 2
