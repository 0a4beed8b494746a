"""Rank 0 leads, the other ranks follow: every forward pass of a model split by tensor parallelism
(bubo/model/tensor_parallel.py) runs on all ranks at once, with the same tokens and caches in step.

Rank 0 schedules as if it ran the model alone. `StepLeader` hooks its Decoder: before each forward it
broadcasts the step (which of its caches, where each stands, the tokens) over torch.distributed, and the
followers (`follow`) run the same forward on their shards. A follower keeps a mirror of each of rank 0's
caches, holding the local KV heads and recurrent states, and brings it to where rank 0's cache stands
before the step: cut back (a rewind, a reset, a prompt-cache truncation), or back to a recurrent-state
snapshot it took at the same position in an earlier step (the prompt cache's turn ends: where rank 0's
step asked for snapshots, or at the end of each prompt pass where the states have no hook for them). What rank 0 did
between two steps is read from its cache at the next one, so no other cache operation is mirrored.

The step on the wire, all int64: a header [op, payload length], then the payload
[last_only, whether the caches are a CacheBatch, number of caches, per cache (id, length, batch, max_len, rope_delta, number of snapshot
positions, the positions...), number of freed caches, their ids..., rows, columns, the tokens...]. After
it every rank says whether it can run the step (an all-reduce of 1 or 0), so a follower that can't bring
its mirror into step fails rank 0's forward with an error instead of leaving the ranks out of step.

Only forward passes are mirrored: steps that read hidden states (batched slots' decode, an MTP drafter)
and image inputs do not run sharded.
"""

import logging
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bubo.engine.slot import DeviceLostError
from bubo.gguf.config import config_from_gguf
from bubo.gguf.model_config import ModelConfig
from bubo.gguf.reader import GGUFFile
from bubo.model.decoder import Decoder
from bubo.model.load_progress import LoadProgress
from bubo.model.loader import load_decoder
from bubo.model.quantized_linear import packing_deferred
from bubo.model.state import CacheBatch, CacheSnapshot, KVCache
from bubo.model.tensor_parallel import TensorParallel, shard_decoder
from bubo.process_memory import trim_heap

__all__ = ["StepLeader", "StepOutOfSyncError", "follow", "follow_file", "load_shard"]

log = logging.getLogger(__name__)

_STOP, _FORWARD = 0, 1
# Snapshots a follower keeps per cache, newest first kept: more than the prompt cache keeps per slot.
MAX_SNAPSHOTS = 64


class StepOutOfSyncError(RuntimeError):
    """A follower rank could not bring its cache to where rank 0's stands for this step."""


@dataclass(frozen=True)
class _CacheState:
    id: int
    length: int
    batch: int
    max_len: int
    rope_delta: int
    snapshot_at: tuple[int, ...]


@dataclass(frozen=True)
class _Step:
    last_only: bool
    batched: bool  # a CacheBatch (several sequences' steps as rows), even of one cache
    caches: list[_CacheState]
    freed: list[int]
    tokens: torch.Tensor

    def encode(self) -> list[int]:
        out = [int(self.last_only), int(self.batched), len(self.caches)]
        for c in self.caches:
            out += [c.id, c.length, c.batch, c.max_len, c.rope_delta, len(c.snapshot_at), *c.snapshot_at]
        out += [len(self.freed), *self.freed, *self.tokens.shape, *self.tokens.flatten().tolist()]
        return out

    @classmethod
    def decode(cls, values: list[int]) -> "_Step":
        last_only, batched, count = bool(values[0]), bool(values[1]), values[2]
        at, caches = 3, []
        for _ in range(count):
            id_, length, batch, max_len, rope_delta, snaps = values[at : at + 6]
            caches.append(
                _CacheState(id_, length, batch, max_len, rope_delta, tuple(values[at + 6 : at + 6 + snaps]))
            )
            at += 6 + snaps
        freed = values[at + 1 : at + 1 + values[at]]
        at += 1 + values[at]
        rows, columns = values[at : at + 2]
        tokens = torch.tensor(values[at + 2 :], dtype=torch.long).view(rows, columns)
        return cls(last_only, batched, caches, freed, tokens)


def _broadcast(values: list[int] | None, length: int, tp: TensorParallel, device: torch.device) -> list[int]:
    """Rank 0's `values` on every rank (`length` of them)."""
    t = torch.tensor(values, dtype=torch.long, device=device) if values is not None else None
    if t is None:
        t = torch.empty(length, dtype=torch.long, device=device)
    dist.broadcast(t, src=0, group=tp.group)
    return t.tolist()


def _all_ready(ready: bool, tp: TensorParallel, device: torch.device) -> bool:
    flag = torch.tensor([int(ready)], dtype=torch.long, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=tp.group)
    return bool(flag.item())


class StepLeader:
    """Rank 0's side: broadcasts each forward pass of `model` to the followers before it runs.

    A forward pass holds a lock from its broadcast to its last all-reduce, so that `stop`, from another
    thread (the server's, at shutdown), never slips its own broadcast between a step's collectives."""

    def __init__(self, model: Decoder, tp: TensorParallel) -> None:
        self.model = model
        self.tp = tp
        self._ids: weakref.WeakKeyDictionary[KVCache, int] = weakref.WeakKeyDictionary()
        self._freed: list[int] = []  # appended to by finalizers, on whichever thread frees a cache
        self._last_id = 0
        self._lock = threading.Lock()
        self._stopped = False
        self._hooks = (
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, always_call=True),
        )

    def _id(self, cache: KVCache) -> int:
        id_ = self._ids.get(cache)
        if id_ is None:
            self._last_id += 1
            id_ = self._ids[cache] = self._last_id
            # The follower drops its mirror with the next step once rank 0's cache is gone.
            weakref.finalize(cache, self._freed.append, id_)
        return id_

    def _before_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Released by _after_forward, which torch calls also when the step (or this hook) raises.
        self._lock.acquire()
        self._lead(args, kwargs)

    def _after_forward(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        self._lock.release()

    def _lead(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._stopped:
            raise RuntimeError("the tensor-parallel ranks were stopped")
        bound = dict(zip(("tokens", "cache", "last_only", "multimodal"), args, strict=False)) | kwargs
        if bound.get("multimodal") is not None:
            raise ValueError("image inputs don't run tensor parallel")
        cache = bound["cache"]
        caches = cache.caches if isinstance(cache, CacheBatch) else [cache]
        states = [
            _CacheState(self._id(c), c.length, c.batch, c.max_len, c.rope_delta, tuple(c.snapshot_at))
            for c in caches
        ]
        freed, self._freed[:] = list(self._freed), []
        last_only = bool(bound.get("last_only", False))
        step = _Step(last_only, isinstance(cache, CacheBatch), states, freed, bound["tokens"].cpu())
        values = step.encode()
        device = self.model.device
        try:
            _broadcast([_FORWARD, len(values)], 2, self.tp, device)
            _broadcast(values, len(values), self.tp, device)
            ready = _all_ready(True, self.tp, device)
        except (RuntimeError, dist.DistError) as error:
            # A follower gone (its process ended, its machine unreachable): no step can run any more,
            # which the server reports as it does a lost GPU.
            raise DeviceLostError(f"a tensor-parallel rank is gone: {error}") from error
        if not ready:
            raise StepOutOfSyncError(
                "a tensor-parallel rank could not bring its cache to this step's position "
                "(a prompt-cache operation the followers don't mirror)"
            )

    def stop(self) -> None:
        """Send the followers home (`follow` returns), once the step in flight if any has ended; forward
        passes after it fail."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                _broadcast([_STOP, 0], 2, self.tp, self.model.device)


class _Mirror:
    """A follower's copy of one of rank 0's caches, and the snapshots its forward passes took."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.snapshots: dict[int, CacheSnapshot] = {}

    def sync(self, state: _CacheState) -> bool:
        """Bring the cache to `state`'s position; False where it can't (rank 0 got there some other way)."""
        cache = self.cache
        if cache.length > state.length:
            if state.length == 0 or cache.can_rewind:
                cache.truncate(state.length)
            elif state.length in self.snapshots:
                cache.restore(self.snapshots[state.length])
            else:
                return False
        if cache.length != state.length:
            return False
        self.snapshots = {p: s for p, s in self.snapshots.items() if p <= state.length}
        cache.rope_delta = state.rope_delta
        cache.snapshot_at = state.snapshot_at
        return True

    def keep_snapshots(self, tokens: int) -> None:
        """Keep the snapshots the step took (`snapshot_at`); where the cache's states have no such hook
        (qwen4exp's indexer and n-gram states), a snapshot after each pass of several tokens: rank 0's
        prompt cache snapshots such a cache between prompt passes, so it goes back only to their ends."""
        cache = self.cache
        for snapshot in cache.taken_snapshots():
            self.snapshots[snapshot.length] = snapshot
        if tokens > 1 and not cache.can_rewind and not cache.snapshots_in_forward:
            self.snapshots[cache.length] = cache.snapshot()
        for position in sorted(self.snapshots)[:-MAX_SNAPSHOTS]:
            del self.snapshots[position]


def follow(model: Decoder, tp: TensorParallel) -> None:
    """A follower rank's loop: run each step rank 0 broadcasts on this rank's shard of the model, until
    rank 0 says stop (`StepLeader.stop`)."""
    device = model.device
    mirrors: dict[int, _Mirror] = {}
    while True:
        op, size = _broadcast(None, 2, tp, device)
        if op == _STOP:
            return
        step = _Step.decode(_broadcast(None, size, tp, device))
        for id_ in step.freed:
            mirrors.pop(id_, None)
        used = []
        for state in step.caches:
            mirror = mirrors.get(state.id)
            if mirror is None:
                mirror = mirrors[state.id] = _Mirror(
                    model.new_cache(batch=state.batch, max_len=state.max_len)
                )
            used.append(mirror)
        ready = all(m.sync(s) for m, s in zip(used, step.caches, strict=True))
        if not _all_ready(ready, tp, device):
            if not ready:
                log.warning("tensor parallel: rank %d's cache is out of step with rank 0's", tp.rank)
            continue
        caches = [m.cache for m in used]
        cache = CacheBatch(caches) if step.batched else caches[0]
        try:
            with torch.inference_mode():
                model(step.tokens.to(device), cache, last_only=step.last_only)
        except ValueError as error:
            # Rank 0 meets the same error at the same point of the same step (a full cache, say).
            log.warning("tensor parallel: rank %d's step failed as rank 0's does: %s", tp.rank, error)
        for mirror in used:
            mirror.keep_snapshots(step.tokens.shape[1])


def follow_file(
    path: str | Path,
    tp: TensorParallel,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    cache_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
) -> None:
    """A follower rank from start to end: load the GGUF file at `path`, keep this rank's shard (on
    `device`) and `follow` rank 0, which loads the same file with the same settings (`load_model`)."""
    with GGUFFile(path) as file:
        model = load_shard(file, config_from_gguf(file), tp, dtype, device)
        if cache_dtypes is not None:
            model.cache_dtypes = cache_dtypes
        follow(model, tp)


def load_shard(
    file: GGUFFile,
    config: ModelConfig,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device | str,
    progress: bool | LoadProgress = False,
) -> Decoder:
    """This rank's shard of the model `config` describes in `file`: loaded whole on the CPU without packing
    (the file's blocks are a memory map, which costs nothing until read), then split onto `device`
    (bubo/model/tensor_parallel.py), where only the shard's matrices are packed."""
    with packing_deferred():
        model = load_decoder(file, config, dtype=dtype, device="cpu", progress=progress)
    shard_decoder(model, tp, device)
    # Packing the shard read its blocks through the map: only what is still read comes back.
    file.release_pages()
    if torch.device(device).type == "cpu":
        trim_heap()
    return model
