"""Paged KV storage: the keys and values of every attention layer in fixed-size blocks, shared by the
sequences of one model (vLLM's PagedAttention, Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention").

A sequence holds a table of block ids: it takes a block when it crosses a block boundary and gives
blocks back when it is cut, so a long context needs no single contiguous buffer and slots that hold
short sequences leave the rest of the pool to others. A block may be held by several sequences at
once (a shared prompt prefix); a sequence never writes into a block someone else holds, it copies
it first (copy on write).

Each layer's pool is [kv_heads, num_blocks * block_size, head_dim]: positions of consecutive block
ids are consecutive, so a sequence whose blocks form one run (the common case: a sequence asks for
the block after its last one, and gets it when it is free) is read as a view, with no gather.
"""

import threading
from collections.abc import Callable
from functools import partial

import torch

from bubo.process_memory import lazy_zeros

__all__ = ["DEFAULT_BLOCK_SIZE", "BlockPool", "KVPoolExhaustedError"]

# Positions per block. Small blocks waste less of a sequence's last block and share finer prefixes;
# large blocks keep block tables short. Without a paged-attention kernel a sequence whose blocks are
# scattered is gathered each step, so the pool favours runs (see `take`) over small blocks.
DEFAULT_BLOCK_SIZE = 256


class KVPoolExhaustedError(RuntimeError):
    """Every block of the pool is held."""


class BlockPool:
    """`num_blocks` blocks of `block_size` positions of keys and values for `num_layers` attention layers.

    Reference counts say how many sequences hold each block; a block with none is free. Every method is
    safe to call from the worker threads of several slots at once.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        value_dtype: torch.dtype | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a block pool needs at least one block of at least one position, not "
                f"{num_blocks} x {block_size}"
            )
        shape = (num_kv_heads, num_blocks * block_size, head_dim)
        # On the CPU the pages are only committed as blocks fill (torch.zeros would write them all now).
        lazy = torch.device(device).type == "cpu"
        zeros = lazy_zeros if lazy else partial(torch.zeros, device=device)
        # Keys in `dtype`, values in `value_dtype` (default the same): the storage types, which may be
        # narrower than the compute dtype (`bubo serve --cache-type-k/-v`); readers widen what they read.
        self.keys = [zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [zeros(shape, dtype=value_dtype or dtype) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self._free = set(range(num_blocks))
        # Blocks never taken: with lazily committed pages, the memory the pool can still add to the
        # process's. A block given back stays committed, whatever it is taken for next.
        self._uncommitted = set(range(num_blocks)) if lazy else set()
        self._lock = threading.Lock()
        # Frees blocks held by caches nobody is using right now; True when it freed any.
        self.reclaim: Callable[[], bool] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def uncommitted_blocks(self) -> int:
        """Blocks whose memory is not committed yet (never taken, on the CPU); none on a GPU, where the
        pool took all of its memory when it was made."""
        return len(self._uncommitted)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over every layer's keys and values."""
        return sum(pool[:, : self.block_size].nbytes for pool in (*self.keys, *self.values))

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position takes over every layer's keys and values, in their storage types."""
        return self.bytes_per_block // self.block_size

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold `positions` positions."""
        return -(-positions // self.block_size)

    def take(self, after: int | None = None) -> int:
        """A free block, held once: block `after + 1` when it is free (it extends a run), else the first
        block of the longest free run (room for the sequence to keep extending it). When none is free,
        `reclaim` (set by the slot pool) is asked to give some back first."""
        while True:
            with self._lock:
                if self._free:
                    wanted = None if after is None else after + 1
                    block = wanted if wanted in self._free else self._longest_free_run()
                    self._free.discard(block)
                    self._uncommitted.discard(block)
                    self.refs[block] = 1
                    return block
            if self.reclaim is None or not self.reclaim():
                raise KVPoolExhaustedError(
                    f"the KV cache is full: all {self.num_blocks} blocks of {self.block_size} positions "
                    "are in use"
                )

    def _longest_free_run(self) -> int:
        best, best_length, start, previous = -1, 0, -1, -2
        for block in sorted(self._free):
            if block != previous + 1:
                start = block
            previous = block
            if block - start + 1 > best_length:
                best, best_length = start, block - start + 1
        return best

    def hold(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks` (a sequence sharing them)."""
        with self._lock:
            for block in blocks:
                if self.refs[block] < 1:
                    raise ValueError(f"block {block} is free: only held blocks can be shared")
                self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder fewer for each of `blocks`; a block nobody holds is free again."""
        with self._lock:
            for block in blocks:
                self.refs[block] -= 1
                if self.refs[block] == 0:
                    self._free.add(block)

    def is_shared(self, block: int) -> bool:
        return self.refs[block] > 1

    def copy(self, source: int, target: int, positions: int) -> None:
        """The first `positions` positions of block `source` into block `target`, in every layer."""
        s, t = source * self.block_size, target * self.block_size
        for pool in (*self.keys, *self.values):
            pool[:, t : t + positions] = pool[:, s : s + positions]
