"""Continuous batching of decode steps: the one-token forward passes of several slots' generations run
as one batched pass (iteration-level scheduling, Orca: Yu et al., OSDI 2022).

Each slot generates in its own worker thread with the plain per-sequence loop (bubo/engine/generate.py)
and calls the model through a `BatchedModel`. A call waits until every slot that is generating has
either submitted its next forward or finished; then the batcher's compute thread runs them all: the
single-token steps together, over a CacheBatch (the weights, which dominate a decode step, are read
once for all of them), anything else (a prefill, a multi-token verify) on its own. A slot that is busy
between forwards (sampling, a grammar mask) only delays the batch, it never blocks it for good: a
generation that ends leaves the batcher, and the remaining calls run.

One compute thread runs every pass, and the slots' threads keep their own torch ops to one thread: on
the CPU a second OpenMP team slows every parallel region (bubo/engine/compute_threads.py). There, where
the compiled decode step covers the model (bubo/engine/compiled_decode.py), the single-token steps of
up to MATVEC_ROWS sequences run through it as the rows of one pass (`CompiledDecodeStep.batch`: each
matvec expands the weights' codes once for all rows, each row attends over its own cache) rather than
as an eager batched pass, which dispatches its glue op by op (on the default model that dispatch alone
costs more than a whole compiled step). The passes of 2 .. min(slots, MATVEC_ROWS) rows are compiled
when the batcher is made (`prepare`).
"""

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from bubo.engine.compiled_decode import CompiledDecodeStep
from bubo.engine.runner import runner_for
from bubo.model.quantized_linear import MATVEC_ROWS
from bubo.model.state import CacheBatch, KVCache

__all__ = ["BatchedModel", "DecodeBatcher"]

_T = TypeVar("_T")


@dataclass(eq=False)  # compared by identity: a call is one request to run
class _Call:
    method: str  # "forward" or "hidden"
    tokens: torch.Tensor
    cache: Any
    last_only: bool
    multimodal: Any = None  # a prefill chunk's image inputs (bubo/engine/prompt_images.py)
    done: bool = False
    result: torch.Tensor | None = None
    error: BaseException | None = None
    batchable: bool = field(init=False)

    def __post_init__(self) -> None:
        cache = self.cache
        # One token of one sequence, without image inputs (a snapshot wanted inside a pass can't fall
        # within a single step).
        self.batchable = (
            tuple(self.tokens.shape) == (1, 1)
            and isinstance(cache, KVCache)
            and cache.batch == 1
            and self.multimodal is None
        )


class DecodeBatcher:
    """Gathers the forward passes of the generations that are `member`s and runs them together."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._cond = threading.Condition()
        self._members = 0
        self._pending: list[_Call] = []
        self.steps = 0  # batched passes run, and the sequences they carried (for /metrics)
        self.rows = 0
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bubo-compute")

    @contextmanager
    def member(self) -> Iterator[None]:
        """While inside, the calling thread's generation takes part: others wait for its next call."""
        with self._cond:
            self._members += 1
        try:
            yield
        finally:
            with self._cond:
                self._members -= 1
                ready = self._take_if_ready()
            self._run(ready)

    def call(
        self, method: str, tokens: torch.Tensor, cache: Any, last_only: bool, multimodal: Any = None
    ) -> torch.Tensor:
        """The model's `method` on (tokens, cache), run when every member has a call in."""
        call = _Call(method, tokens, cache, last_only, multimodal)
        with self._cond:
            self._pending.append(call)
            ready = self._take_if_ready()
        self._run(ready)
        with self._cond:
            while not call.done:
                self._cond.wait()
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    def alone(self, work: Callable[[], _T]) -> _T:
        """`work()` on the compute thread, between batched passes: no other pass runs meanwhile (a probe's
        traced pass, bubo/engine/probes.py, whose hooks must see only its own)."""
        return self._compute.submit(work).result()

    def _take_if_ready(self) -> list[_Call]:
        # Outside a member (a lone call), or when every member has submitted: run what's pending.
        if self._pending and len(self._pending) >= self._members:
            ready, self._pending = self._pending, []
            return ready
        return []

    def _run(self, calls: list[_Call]) -> None:
        """Run `calls` on the compute thread, and wait for them."""
        if calls:
            self._compute.submit(self._execute, calls).result()

    def _execute(self, calls: list[_Call]) -> None:
        # Every call is answered, whatever fails on the way (its error then reaches its thread): a call
        # left waiting would hang its generation and, at exit, the process.
        failure: BaseException | None = None
        try:
            self._execute_calls(calls)
        except BaseException as error:
            failure = error
            raise
        finally:
            with self._cond:
                for call in calls:
                    if not call.done:
                        call.error = (
                            call.error or failure or RuntimeError("the batched forward pass did not run")
                        )
                        call.done = True
                self._cond.notify_all()

    def _execute_calls(self, calls: list[_Call]) -> None:
        batch = [c for c in calls if c.batchable and c.cache.reserve(1)]
        steps = self._compiled_steps(batch)
        if steps or len(batch) < 2 or not getattr(self.model, "supports_cache_batch", False):
            batch = []
        # The decode passes' thread count follows their timings (bubo/engine/thread_governor.py); a
        # prefill or verify pass runs on the count they chose.
        governor = runner_for(self.model).governor

        def governed(decode: bool) -> AbstractContextManager[None]:
            if governor is None:
                return nullcontext()
            if not decode:
                governor.settle()
                return nullcontext()
            return governor.step()

        if steps or batch:
            with governed(decode=True):
                if steps:
                    self._run_steps(steps)
                if batch:
                    self._run_batch(batch)
        for call in calls:
            if call not in batch and call not in steps:
                with governed(decode=call.batchable):
                    self._run_one(call)

    def _compiled_steps(self, batch: list[_Call]) -> dict[_Call, CompiledDecodeStep]:
        """The compiled decode step for each call of `batch`, when every one is a forward pass it covers
        and there are at most MATVEC_ROWS of them; else none (the batch runs as one pass)."""
        if any(c.method != "forward" for c in batch):
            return {}
        step = runner_for(self.model).batch_steps([c.cache for c in batch])
        return {} if step is None else dict.fromkeys(batch, step)

    def prepare(self, rows: int) -> None:
        """Compile the compiled step's passes of 2 .. `rows` rows (where the step covers the model), so
        that the first batches of a first burst of requests don't wait for them. On the compute thread,
        as every pass: torch's CPU work on another thread would leave it an OpenMP team of its own."""

        self._compute.submit(runner_for(self.model).prepare_batches, min(rows, MATVEC_ROWS)).result()

    def _run_steps(self, steps: dict[_Call, CompiledDecodeStep]) -> None:
        """The single-token calls through the model's compiled step: one call alone, several as the rows
        of one pass."""
        calls = list(steps)
        step = steps[calls[0]]
        try:
            with torch.inference_mode():
                if len(calls) == 1:
                    logits = step(calls[0].tokens.view(()), calls[0].cache)[None]
                else:
                    logits = step.batch(
                        torch.cat([c.tokens.view(1) for c in calls]), [c.cache for c in calls]
                    )
                    self.steps += 1
                    self.rows += len(calls)
            for call, row in zip(calls, logits, strict=True):
                call.result = row.view(1, 1, -1)
        except BaseException as error:  # handed to the threads that made the calls
            for call in calls:
                call.error = error
        for call in calls:
            call.done = True

    def _run_one(self, call: _Call) -> None:
        run = self.model if call.method == "forward" else self.model.hidden
        try:
            with torch.inference_mode():
                images = {} if call.multimodal is None else {"multimodal": call.multimodal}
                call.result = run(call.tokens, call.cache, last_only=call.last_only, **images)
        except BaseException as error:  # handed to the thread that made the call
            call.error = error
        call.done = True

    def _run_batch(self, calls: list[_Call]) -> None:
        tokens = torch.cat([c.tokens for c in calls])
        # "hidden" and "forward" rows share the pass; the head runs only for the rows that want logits.
        try:
            with torch.inference_mode():
                hidden = self.model.hidden(tokens, CacheBatch([c.cache for c in calls]))
                wants_logits = [i for i, c in enumerate(calls) if c.method == "forward"]
                logits = self.model.output(hidden[wants_logits]).float() if wants_logits else None
        except BaseException as error:
            for call in calls:
                call.error, call.done = error, True
            return
        self.steps += 1
        self.rows += len(calls)
        for i, call in enumerate(calls):
            if call.method == "forward":
                assert logits is not None
                call.result = logits[wants_logits.index(i)].unsqueeze(0)
            else:
                call.result = hidden[i : i + 1]
            call.done = True


class BatchedModel:
    """A model whose forward passes (and `hidden`) go through a DecodeBatcher; everything else is the
    model's own."""

    def __init__(self, model: Any, batcher: DecodeBatcher) -> None:
        self._model = model
        self._batcher = batcher

    def __call__(
        self, tokens: torch.Tensor, cache: Any, last_only: bool = False, multimodal: Any = None
    ) -> torch.Tensor:
        return self._batcher.call("forward", tokens, cache, last_only, multimodal)

    def hidden(
        self, tokens: torch.Tensor, cache: Any, last_only: bool = False, multimodal: Any = None
    ) -> torch.Tensor:
        return self._batcher.call("hidden", tokens, cache, last_only, multimodal)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
