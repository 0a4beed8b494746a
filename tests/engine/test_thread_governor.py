"""The thread governor (bubo/engine/thread_governor.py) keeps the thread count whose steps are faster,
probing the other now and then; a fake clock stands for the machine (steps cost what the thread count in
use costs now), so the choices are checked, not timings."""

import asyncio
import itertools

import pytest
import torch

from bubo.engine.generate import GenerationResult, generate
from bubo.engine.loaded_model import LoadedModel
from bubo.engine.request import Finished, GenerationRequest
from bubo.engine.runner import Runner
from bubo.engine.sampler import SamplingParams
from bubo.engine.slot_pool import SlotPool
from bubo.engine.thread_governor import (
    FIRST_INTERVAL,
    MAX_INTERVAL,
    MIN_SAMPLES,
    PROBE_STEPS,
    WINDOW,
    ThreadGovernor,
)


class Machine:
    """A clock and a thread setting: a step costs `cost[threads]` seconds of the clock."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost = cost
        self.now = 0.0
        self.threads = 0
        self.settings: list[int] = []

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.settings.append(n)

    def clock(self) -> float:
        return self.now

    def run(self, governor: ThreadGovernor, steps: int) -> list[int]:
        """Run `steps` steps; the thread count each ran on."""
        used = []
        for _ in range(steps):
            with governor.step():
                used.append(self.threads)
                self.now += self.cost[self.threads]
        return used


def test_an_idle_machine_keeps_every_thread() -> None:
    machine = Machine({2: 0.010, 1: 0.017})
    governor = ThreadGovernor(2, machine.set_threads, machine.clock)
    used = machine.run(governor, 2000)
    assert governor.threads == 2 and governor.switches == 0
    # Probes of one thread, fewer and fewer: the interval doubles after each that loses.
    probes = [i for i, n in enumerate(used) if n == 1]
    assert probes[0] == max(FIRST_INTERVAL, WINDOW)
    assert len(probes) < 2000 * 0.03
    gaps = [b - a for a, b in itertools.pairwise(probes) if b - a > 1]
    assert gaps == sorted(gaps) and gaps[-1] <= MAX_INTERVAL + PROBE_STEPS


def test_a_busy_neighbour_moves_the_steps_to_one_thread_and_back() -> None:
    machine = Machine({2: 0.100, 1: 0.012})  # two threads wait on each other at every barrier
    governor = ThreadGovernor(2, machine.set_threads, machine.clock)
    machine.run(governor, FIRST_INTERVAL + PROBE_STEPS)
    assert governor.threads == 1 and governor.switches == 1
    used = machine.run(governor, 3000)
    # Probing two threads again costs one slow step each time: the first is far slower, so cut short.
    slow = [i for i, n in enumerate(used) if n == 2]
    assert 0 < len(slow) < 3000 * 0.02
    assert all(b - a > 1 for a, b in itertools.pairwise(slow))
    # The neighbour leaves: two threads are faster again, and the next probe finds it.
    machine.cost = {2: 0.006, 1: 0.012}
    machine.run(governor, MAX_INTERVAL + 2 * WINDOW + PROBE_STEPS)
    assert governor.threads == 2 and governor.switches == 2


def test_one_thread_has_nothing_to_choose() -> None:
    machine = Machine({0: 0.01})  # never set: the count torch has
    governor = ThreadGovernor(1, machine.set_threads, machine.clock)
    machine.run(governor, 200)
    governor.settle()
    assert machine.settings == [] and governor.switches == 0


def test_settle_puts_back_the_count_in_use_after_a_probe() -> None:
    machine = Machine({2: 0.010, 1: 0.5})
    governor = ThreadGovernor(2, machine.set_threads, machine.clock)
    machine.run(governor, FIRST_INTERVAL + 1)  # the last step was the (cut short) probe on one thread
    assert machine.threads == 1
    governor.settle()
    assert machine.threads == 2


def test_generation_steps_go_through_the_governor(
    tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each decode step of `generate` runs inside the model's governor, on the thread count it sets; the
    tokens are those of a run without one."""
    params = SamplingParams(temperature=0.0, max_tokens=FIRST_INTERVAL + 12, ignore_eos=True)
    prompt = [3, 17, 42, 7]

    def tokens() -> list[int]:
        events = generate(tiny_llama.model, tiny_llama.tokenizer, prompt, params)
        (result,) = [e for e in events if isinstance(e, GenerationResult)]
        return result.token_ids

    monkeypatch.setattr(Runner, "governor", property(lambda runner: None))
    plain = tokens()
    cost = {2: 0.100, 1: 0.010}
    applied: list[int] = []
    clock = {"now": 0.0, "reads": 0}

    def set_threads(n: int) -> None:
        applied.append(n)
        torch.set_num_threads(n)

    def step_clock() -> float:
        # Read at a step's start and end: the step costs what its thread count costs.
        clock["reads"] += 1
        now = clock["now"]
        clock["now"] += cost[applied[-1]]
        return now

    governor = ThreadGovernor(2, set_threads, step_clock)
    monkeypatch.setattr(Runner, "governor", property(lambda runner: governor))
    before = torch.get_num_threads()
    try:
        assert tokens() == plain
    finally:
        torch.set_num_threads(before)
    assert clock["reads"] == 2 * (params.max_tokens - 1)  # every decode step after the prompt's
    assert applied[0] == 2 and applied[-1] == 1 and governor.switches == 1


def test_slow_steps_are_questioned_after_a_second_not_after_the_step_interval() -> None:
    machine = Machine({2: 0.5, 1: 0.05})
    governor = ThreadGovernor(2, machine.set_threads, machine.clock)
    used = machine.run(governor, MIN_SAMPLES + PROBE_STEPS)
    assert used == [2] * MIN_SAMPLES + [1] * PROBE_STEPS
    assert governor.threads == 1


def test_batched_decode_passes_go_through_the_governor(
    tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With several slots the batcher's compute thread runs the decode passes: each goes through the
    model's governor (the slots' own threads run none)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reads: list[float] = []

    def clock() -> float:
        reads.append(0.0)
        return 0.001 * len(reads)

    governor = ThreadGovernor(2, lambda n: None, clock)
    monkeypatch.setattr(Runner, "governor", property(lambda runner: governor))

    async def serve() -> list[list[int]]:
        pool = SlotPool(tiny_llama.model, tiny_llama.tokenizer, 64, parallel=2)

        async def one(ids: list[int]) -> list[int]:
            async for event in pool.run(GenerationRequest("t", "", ids, params, cache_prompt=False)):
                if isinstance(event, Finished):
                    return list(event.result.token_ids)
            raise AssertionError("no result")

        return list(await asyncio.gather(one([3, 17, 42]), one([5, 9, 11, 13])))

    results = asyncio.run(serve())
    assert all(len(r) == params.max_tokens for r in results)
    # A clock read at the start and the end of each governed pass: at least one pass per decode step of
    # the longer generation, at most one per step of each.
    passes = len(reads) // 2
    assert params.max_tokens - 1 <= passes <= 2 * (params.max_tokens - 1)
