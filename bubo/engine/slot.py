"""The session slot: one sequence of model state that requests take turns on (llama-server's slot).

Requests queue in arrival order on an asyncio lock; the one holding it runs `generate` in a worker
thread (torch releases the GIL in its kernels, so the event loop keeps serving health checks and
streams meanwhile) and hands events back through an asyncio queue. A consumer that stops listening
sets a flag that `generate` checks before every forward pass, so a client that disconnects stops its
generation within one token; the lock is released only when the worker thread is done with the cache.

The cache is kept between requests: a new prompt that starts with tokens already in the cache
reuses them (a growing chat history is computed once). A cache with recurrent state (Gated DeltaNet)
cannot be cut back, so it is reused only when the new prompt extends everything it holds.
"""

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from bubo.engine.batcher import BatchedModel, DecodeBatcher
from bubo.engine.compute_threads import use_one_thread
from bubo.engine.generate import GenerationResult, Model, Tokenizer, generate
from bubo.engine.output import OutputStream
from bubo.engine.probes import probe_tokens
from bubo.engine.prompt_cache import PromptCache, SnapshotPolicy
from bubo.engine.prompt_images import PromptVision, VisionEncoder
from bubo.engine.prompt_logprobs import prompt_logprobs
from bubo.engine.prompt_progress import ProgressReporter
from bubo.engine.request import CacheReport, Finished, GenerationRequest, OutputDelta, OutputEvent, Usage
from bubo.engine.sampler import SamplingParams
from bubo.engine.speculative import Drafter
from bubo.model.block_pool import BlockPool

__all__ = ["DeviceLostError", "SessionSlot", "SlotStats"]

log = logging.getLogger(__name__)

# Messages with which CUDA reports a context that is gone for good (after these every later call
# fails too, so the process can only report itself broken).
_DEVICE_LOST_MARKERS = (
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "uncorrectable ecc error",
    "device lost",
    "cuda error: unknown error",
    "no cuda gpus are available",
)


class DeviceLostError(RuntimeError):
    """The accelerator's context is gone; nothing can run on it any more."""


def is_device_lost(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, DeviceLostError) or any(marker in text for marker in _DEVICE_LOST_MARKERS)


@dataclass
class SlotStats:
    """Running totals for /metrics (llama-server's `llamacpp:` names map onto these)."""

    prompt_tokens_total: int = 0
    prompt_tokens_cached_total: int = 0  # prompt tokens a cache held, so not computed
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    predicted_seconds_total: float = 0.0
    decode_tokens_total: int = 0
    decode_passes_total: int = 0
    draft_tokens_total: int = 0
    draft_accepted_total: int = 0
    draft_verify_steps_total: int = 0
    requests_total: int = 0
    requests_processing: int = 0
    requests_deferred: int = 0
    requests_deferred_total: int = 0
    images_encoded_total: int = 0  # images run through the vision tower (not those the cache had)


class SessionSlot:
    """One slot: the model, its cache of up to `n_ctx` positions, and the queue of requests waiting for it.

    Several slots (`--parallel`, bubo/engine/slot_pool.py) share one block pool for their KV (`pool`) and
    one DecodeBatcher (`batcher`) that runs their decode steps as one batch.
    """

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        n_ctx: int,
        snapshot_policy: SnapshotPolicy | None = None,
        drafter: Drafter | None = None,
        *,
        slot_id: int = 0,
        pool: BlockPool | None = None,
        batcher: DecodeBatcher | None = None,
        vision: VisionEncoder | None = None,
    ) -> None:
        self.id = slot_id
        self.model = model
        self.vision = vision  # the vision tower that encodes a prompt's images; None: text only
        self.drafter = drafter  # speculative decoding (bubo/engine/speculative.py); None: off
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.stats = SlotStats()
        self.device_lost = False
        self.last_cache_report: CacheReport | None = None
        self.last_prompt_tokens = 0
        self.last_request_id: str | None = None
        self.last_params: SamplingParams | None = None  # the sampling settings of the last request run
        self.n_tokens_max = 0  # the most positions the cache has held after a request
        # Allocated up front, as llama-server does: on a GPU the KV memory is taken at start-up, not
        # halfway through a long request (on the CPU the zeroed pages are only touched as they fill).
        cache = model.new_cache(max_len=n_ctx) if pool is None else model.new_cache(max_len=n_ctx, pool=pool)
        self.prompt_cache = PromptCache(cache, tokenizer.stop_ids, snapshot_policy)
        self.batcher = batcher
        self.last_used = 0.0
        # Held by the worker thread while it uses the cache, so another slot that needs blocks evicts this
        # slot's cache only while nobody is using it (SlotPool.reclaim).
        self.cache_lock = threading.Lock()
        self._lock = asyncio.Lock()
        # With a batcher the model runs on its compute thread: this one keeps its own ops to one thread.
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="bubo-slot", initializer=use_one_thread if batcher else None
        )

    @property
    def is_processing(self) -> bool:
        return self.stats.requests_processing > 0

    @property
    def cached_tokens(self) -> int:
        return self.prompt_cache.cache.length

    @property
    def cached_token_ids(self) -> tuple[Hashable, ...]:
        """The tokens whose state the cache holds, in order (image positions by digest)."""
        return tuple(self.prompt_cache.tokens)

    @property
    def can_rewind(self) -> bool:
        """Whether the cache can be cut back to any prefix (False with a recurrent state)."""
        return self.prompt_cache.cache.can_rewind

    async def run(
        self, request: GenerationRequest, on_done: Callable[[], None] | None = None
    ) -> AsyncIterator[OutputEvent]:
        """Wait for the slot, then stream the request's events; closing the iterator cancels it.
        `on_done` is called once the generation is over, whether or not its events have been read yet."""
        if self.device_lost:
            raise DeviceLostError("the accelerator was lost; restart the server")
        if self._lock.locked():
            self.stats.requests_deferred += 1
            self.stats.requests_deferred_total += 1
            try:
                await self._lock.acquire()
            finally:
                self.stats.requests_deferred -= 1
        else:
            await self._lock.acquire()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[OutputEvent | BaseException] = asyncio.Queue()
        cancelled = threading.Event()

        def put(item: OutputEvent | BaseException) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        self.stats.requests_processing += 1
        try:
            worker = loop.run_in_executor(self._executor, self._work, request, put, cancelled)
        except BaseException:
            self.stats.requests_processing -= 1
            self._lock.release()
            raise

        released = False

        def release(_: object = None) -> None:
            nonlocal released
            if not released:
                released = True
                self.stats.requests_processing -= 1
                self._lock.release()
                if on_done is not None:
                    on_done()

        worker.add_done_callback(release)
        try:
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Finished):
                    # Finished is the worker's last event: once it has returned, the slot is free. Freeing
                    # it here rather than in the done callback (which may run a loop turn later) means a
                    # client that reads /slots right after its answer sees it idle.
                    await asyncio.shield(worker)
                    release()
                    yield item
                    return
                yield item
        finally:
            cancelled.set()

    def events(
        self, request: GenerationRequest, cancelled: threading.Event | None = None
    ) -> Iterator[OutputEvent]:
        """The request's events, generated on the calling thread (the Python API's path; `run` runs the
        same in the slot's worker thread for the server). Closing the iterator stops the generation. Prompt
        progress (`return_progress`) comes in order with the rest, once the prefill has run."""
        progress: list[OutputEvent] = []
        for event in self._generate(
            request, threading.Event() if cancelled is None else cancelled, progress.append
        ):
            yield from progress
            progress.clear()
            yield event
        yield from progress

    def _work(
        self,
        request: GenerationRequest,
        put: Callable[[OutputEvent | BaseException], None],
        cancelled: threading.Event,
    ) -> None:
        try:
            for event in self._generate(request, cancelled, put):
                put(event)
        except BaseException as error:  # handed to the request's coroutine, which reports it
            if is_device_lost(error):
                self.device_lost = True
                log.error("request %s: the accelerator was lost: %s", request.request_id, error)
                error = DeviceLostError(str(error))
            put(error)

    def _generate(
        self,
        request: GenerationRequest,
        cancelled: threading.Event,
        send: Callable[[OutputEvent], None],
    ) -> Iterator[OutputEvent]:
        """The request's events; `send` hands over prompt progress as it happens (the prefill yields
        nothing until it ends)."""
        with self.cache_lock:
            try:
                if self.batcher is None:
                    finished = yield from _until_finished(
                        self._generate_with(self.model, request, cancelled, send)
                    )
                else:
                    with self.batcher.member():
                        model = BatchedModel(self.model, self.batcher)
                        finished = yield from _until_finished(
                            self._generate_with(model, request, cancelled, send)
                        )
            finally:
                self.last_used = time.monotonic()
        if request.probe is not None:
            # Once out of the batch: the other slots' decode steps go on between the probe's pieces,
            # which run on the batcher's compute thread, so no other pass ever meets the probe's hooks.
            run = self.batcher.alone if self.batcher is not None else None
            ids = finished.result.token_ids
            probes = probe_tokens(self.model, self.tokenizer, request.prompt_ids, ids, request.probe, run)
            finished = replace(finished, probe=tuple(probes))
        yield finished

    def _vision(self, request: GenerationRequest, device: torch.device) -> PromptVision | None:
        if not request.images:
            return None
        if self.vision is None:
            raise ValueError("a prompt with images needs a vision tower, and this slot has none")
        return PromptVision(self.vision, request.images, len(request.prompt_ids), device)

    def _generate_with(
        self,
        model: Model,
        request: GenerationRequest,
        cancelled: threading.Event,
        send: Callable[[OutputEvent], None],
    ) -> Iterator[OutputEvent]:
        prompt = request.prompt_ids
        scored = (
            () if request.prompt_logprobs is None else prompt_logprobs(model, prompt, request.prompt_logprobs)
        )
        key = request.cache_key
        pc = self.prompt_cache
        report = pc.prepare(key, enabled=request.cache_prompt)
        vision = self._vision(request, model.device)
        # A text prompt's positions are its indices; the previous request may have left an image offset.
        pc.cache.rope_delta = 0
        progress = None
        if request.return_progress:
            progress = ProgressReporter(len(prompt), report.cached_tokens, send)
            progress(report.cached_tokens)

        def run(start: int, end: int) -> None:
            tokens = torch.tensor([prompt[start:end]], device=model.device)
            inputs = vision.chunk(pc.cache, start, end) if vision is not None else None
            # The logits are not wanted: last_only keeps the head to one position ([T, vocab] floats would
            # be a gigabyte for a 1000-token piece with a 248k vocabulary).
            if inputs is None:
                model(tokens, pc.cache, last_only=True)
            else:
                model(tokens, pc.cache, last_only=True, multimodal=inputs)
            if progress is not None:
                progress(end)

        # A hybrid cache snapshots its recurrent states at the prompt's last turn ends (prompt_cache.py).
        started = time.perf_counter()
        with torch.inference_mode():
            pc.prefill(key, run, enabled=request.cache_prompt)
        segments_seconds = time.perf_counter() - started
        self.last_cache_report = report
        self.last_prompt_tokens = len(prompt)
        self.last_request_id = request.request_id
        self.last_params = request.params
        output = OutputStream(
            reasoning=request.reasoning,
            in_reasoning=request.in_reasoning,
            tool_parser=request.tool_parser,
            slot_id=self.id,
        )
        result: GenerationResult | None = None
        running = (
            _RunningUsage(len(prompt), report.cached_tokens, started) if request.timings_per_token else None
        )
        try:
            for event in generate(
                model,
                self.tokenizer,
                prompt,
                request.params,
                cache=pc.cache,
                special=request.special,
                cancelled=cancelled.is_set,
                logprobs=request.logprobs,
                constraints=request.constraints,
                drafter=self.drafter,
                prompt_inputs=None
                if vision is None
                else lambda start, end: vision.chunk(pc.cache, start, end),
                prefill_progress=progress,
            ):
                if isinstance(event, GenerationResult):
                    result = event
                elif running is None:
                    yield from output.feed(event)
                else:
                    running.add(event.token_ids)
                    for out in output.feed(event):
                        yield running.attach(out, output.reasoning_tokens)
        finally:
            # Whatever happened, the cache holds exactly the tokens that went through the model.
            pc.finish(key, result.token_ids if result is not None else [])
            if not request.cache_prompt:
                # Asked not to cache: nothing of this prompt is left for a later request to reuse
                # (whose cached_tokens would tell how much of it that request's prompt shares).
                pc.forget()
            self.stats.images_encoded_total += 0 if vision is None else vision.encoded
            report = replace(report, cache_snapshots=len(pc.snapshots), cache_snapshots_skipped=pc.skipped)
            self.last_cache_report = report
        yield from output.flush()
        assert result is not None
        timings = result.timings
        usage = Usage(
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            cached_tokens=report.cached_tokens,
            reasoning_tokens=output.reasoning_tokens,
            prompt_ms=(segments_seconds + timings.prefill_seconds) * 1000,
            predicted_ms=timings.decode_seconds * 1000,
            draft_tokens=result.draft_tokens,
            draft_accepted=result.draft_accepted,
            cache=report,
        )
        stats = self.stats
        stats.requests_total += 1
        # The prompt tokens computed: the snapshot stops before `generate`, then its prefill (the
        # whole prompt past the cache, unless the request was cancelled part way).
        stats.prompt_tokens_total += result.cached_tokens - report.cached_tokens + timings.prefill_tokens
        stats.prompt_seconds_total += segments_seconds + timings.prefill_seconds
        stats.prompt_tokens_cached_total += report.cached_tokens
        stats.tokens_predicted_total += result.completion_tokens
        stats.predicted_seconds_total += timings.decode_seconds
        stats.decode_tokens_total += timings.decode_tokens
        # A speculative round yields its accepted drafts and one token more for one forward pass.
        stats.decode_passes_total += timings.decode_tokens - result.draft_accepted
        stats.draft_tokens_total += result.draft_tokens
        stats.draft_accepted_total += result.draft_accepted
        stats.draft_verify_steps_total += result.draft_verify_steps
        self.n_tokens_max = max(self.n_tokens_max, self.cached_tokens)
        yield Finished(
            result,
            usage,
            output.reasoning_text,
            output.content_text,
            tuple(output.content_logprobs),
            output.tool_calls,
            self.id,
            tuple(output.tool_call_offsets),
            tuple(scored),
        )


def _until_finished(events: Iterator[OutputEvent]) -> Generator[OutputEvent, None, Finished]:
    """`events` up to the Finished event, which is returned rather than yielded."""
    for event in events:
        if isinstance(event, Finished):
            return event
        yield event
    raise RuntimeError("the generation ended without a result")


class _RunningUsage:
    """A request's usage while it runs (llama-server's timings_per_token): the prompt's time up to the
    first token, and the tokens generated since and their time."""

    def __init__(self, prompt_tokens: int, cached_tokens: int, started: float) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.started = started
        self.first_token_at: float | None = None
        self.generated = 0

    def add(self, token_ids: list[int]) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.generated += len(token_ids)

    def attach(self, event: OutputEvent, reasoning_tokens: int) -> OutputEvent:
        """`event` with the usage so far, when it is a piece of text."""
        if not isinstance(event, OutputDelta) or self.first_token_at is None:
            return event
        usage = Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.generated,
            cached_tokens=self.cached_tokens,
            reasoning_tokens=reasoning_tokens,
            prompt_ms=(self.first_token_at - self.started) * 1000,
            predicted_ms=(time.perf_counter() - self.first_token_at) * 1000,
        )
        return replace(event, usage=usage)
