"""The server's slots (`--parallel N`): which slot a request runs on, the queue when all are busy, and
the KV blocks they share.

All slots keep their KV in one block pool (bubo/model/block_pool.py): `kv_tokens` positions, by
default a whole context per slot; with fewer, one slot can still use the whole context while the
others are short. Their decode steps run as one batch
(bubo/engine/batcher.py). A request goes to:

1. an idle slot whose cached tokens the prompt extends (a conversation continues where it is held);
2. otherwise, for models whose cache can be cut back anywhere, the idle slot used least recently — and
   if another idle slot shares a longer prefix with the prompt (a common system prompt, or the same
   conversation with its last answer re-rendered), the chosen slot starts from that prefix by sharing
   its blocks, so both conversations stay cached;
3. for hybrid models (a recurrent state can only resume from a snapshot of its own) the idle slot
   sharing the longest prefix.

When every slot is busy requests wait in arrival order. When the pool runs out of blocks, the caches
of idle slots are given back, least recently used first.
"""

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import fields

from bubo.engine.batcher import DecodeBatcher
from bubo.engine.generate import Model, Tokenizer
from bubo.engine.prompt_cache import SnapshotPolicy, common_prefix
from bubo.engine.prompt_images import VisionEncoder
from bubo.engine.request import GenerationRequest, OutputEvent
from bubo.engine.slot import DeviceLostError, SessionSlot, SlotStats
from bubo.engine.speculative import Drafter
from bubo.model.block_pool import DEFAULT_BLOCK_SIZE

__all__ = ["SlotPool"]


class SlotPool:
    """`parallel` SessionSlots of `n_ctx` positions each over one model, one block pool and one batcher."""

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        n_ctx: int,
        parallel: int = 1,
        snapshot_policy: SnapshotPolicy | None = None,
        kv_tokens: int | None = None,
        new_drafter: Callable[[], Drafter | None] | None = None,
        vision: VisionEncoder | None = None,
    ) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1, not {parallel}")
        self.n_ctx = n_ctx
        self.pool = None
        self.batcher = None
        new_pool = getattr(model, "new_block_pool", None)
        if new_pool is not None:
            # Blocks of 1/32 of the context, 16 to 256 positions: prefixes shared at a fine grain in small
            # contexts, short block tables in large ones.
            block_size = min(max(n_ctx // 32, 16), DEFAULT_BLOCK_SIZE)
            # By default every slot can fill the whole context at once. A smaller `kv_tokens` overcommits
            # (slots that run long take blocks the others then can't have); at least one context's
            # worth, and a spare block per slot for the copy a shared prefix's last block needs.
            positions = max(n_ctx * parallel if kv_tokens is None else kv_tokens, n_ctx)
            self.pool = new_pool(positions + parallel * block_size, block_size)
            self.pool.reclaim = self.reclaim
        if parallel > 1:
            self.batcher = DecodeBatcher(model)
            self.batcher.prepare(parallel)
        self.slots = [
            SessionSlot(
                model,
                tokenizer,
                n_ctx,
                snapshot_policy,
                # A drafter holds its sequence's own state (the MTP block's cache): one per slot.
                new_drafter() if new_drafter is not None else None,
                slot_id=i,
                pool=self.pool,
                batcher=self.batcher,
                vision=vision,
            )
            for i in range(parallel)
        ]
        self._busy: set[int] = set()
        self._waiters: deque[tuple[asyncio.Future[SessionSlot], Sequence[Hashable]]] = deque()
        self._deferred = 0
        self._deferred_total = 0

    @property
    def device_lost(self) -> bool:
        return any(slot.device_lost for slot in self.slots)

    @property
    def stats(self) -> SlotStats:
        """Every slot's totals added up (the queue's counts are the pool's)."""
        total = SlotStats()
        for slot in self.slots:
            for f in fields(SlotStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(slot.stats, f.name))
        total.requests_deferred = self._deferred
        total.requests_deferred_total = self._deferred_total
        return total

    @property
    def available_blocks(self) -> int:
        """KV blocks free, or held by idle slots (given back when needed; shared ones count once each)."""
        if self.pool is None:
            return 0
        idle = {
            b for s in self.slots if s.id not in self._busy for t in s.prompt_cache.cache.tables for b in t
        }
        return self.pool.free_blocks + len(idle)

    @property
    def decode_steps(self) -> tuple[int, int]:
        """Decode forward passes run, and the sequence-steps they carried (one each without batching)."""
        steps = self.stats.decode_passes_total
        if self.batcher is None:
            return steps, steps
        return steps - self.batcher.rows + self.batcher.steps, steps

    @property
    def last_slot(self) -> SessionSlot:
        """The slot that served the latest request (slot 0 before any)."""
        return max(self.slots, key=lambda s: s.last_used)

    async def run(self, request: GenerationRequest) -> AsyncIterator[OutputEvent]:
        """Wait for a slot, then stream the request's events on it; closing the iterator cancels it.
        The slot is free for the next request as soon as the generation is over, not when its events
        have been read: a client that stops reading must not hold it."""
        if self.device_lost:
            raise DeviceLostError("the accelerator was lost; restart the server")
        slot = await self._acquire(request.cache_key)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release(slot)

        try:
            async for event in slot.run(request, on_done=release):
                yield event
        finally:
            release()

    async def _acquire(self, prompt: Sequence[Hashable]) -> SessionSlot:
        if not self._waiters:
            slot = self._choose(prompt)
            if slot is not None:
                self._busy.add(slot.id)
                return slot
        future: asyncio.Future[SessionSlot] = asyncio.get_running_loop().create_future()
        self._waiters.append((future, prompt))
        self._deferred += 1
        self._deferred_total += 1
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release(future.result())  # handed a slot just as the client went away
            raise
        finally:
            self._deferred -= 1
            if (future, prompt) in self._waiters:
                self._waiters.remove((future, prompt))

    def _release(self, slot: SessionSlot) -> None:
        self._busy.discard(slot.id)
        while self._waiters:
            future, prompt = self._waiters.popleft()
            if future.done():
                continue
            chosen = self._choose(prompt)
            if chosen is None:
                self._waiters.appendleft((future, prompt))
                return
            self._busy.add(chosen.id)
            future.set_result(chosen)
            return

    def _choose(self, prompt: Sequence[Hashable]) -> SessionSlot | None:
        idle = [s for s in self.slots if s.id not in self._busy]
        if not idle:
            return None
        shared = {s.id: common_prefix(s.cached_token_ids, prompt) for s in idle}
        extends = [s for s in idle if shared[s.id] and shared[s.id] == len(s.cached_token_ids)]
        if extends:
            return max(extends, key=lambda s: shared[s.id])
        # Of equal prefixes the most recently used (for a rewindable cache another slot is overwritten).
        best = max(idle, key=lambda s: (shared[s.id], s.last_used))
        if not best.can_rewind:
            return best
        target = min(idle, key=lambda s: (len(s.cached_token_ids) > 0, s.last_used))
        if target is not best and shared[best.id] > 0 and self.pool is not None:
            _share(best, target, shared[best.id])
        return target

    def reclaim(self) -> bool:
        """Give back the KV blocks of the least recently used idle slot that holds any (called from a
        worker thread whose slot ran out of blocks); False when there is none."""
        for slot in sorted(self.slots, key=lambda s: s.last_used):
            if not slot.prompt_cache.cache.blocks or not slot.cache_lock.acquire(blocking=False):
                continue
            try:
                slot.prompt_cache.evict()
            finally:
                slot.cache_lock.release()
            slot.last_used = time.monotonic()
            return True
        return False


def _share(source: SessionSlot, target: SessionSlot, n: int) -> None:
    """`target` starts from the first n tokens of idle `source`, holding its blocks. Skipped when either
    cache is in use (a worker reclaiming blocks has it)."""
    if not source.cache_lock.acquire(blocking=False):
        return
    try:
        if not target.cache_lock.acquire(blocking=False):
            return
        try:
            if n <= source.prompt_cache.cache.length:
                target.prompt_cache.adopt_prefix(source.prompt_cache, n)
        finally:
            target.cache_lock.release()
    finally:
        source.cache_lock.release()
