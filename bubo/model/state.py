"""The per-sequence decode state, below the model that reads and advances it: keys and values of each
attention layer in the blocks of a paged pool (`KVCache`), the fixed-size recurrent state of each Gated
DeltaNet layer of a hybrid model (`DeltaNetState`), and qwen4exp's QSA indexer states (`IndexerState`)
and PLE state (`PLEState`)."""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bubo.model.block_pool import DEFAULT_BLOCK_SIZE, BlockPool, KVPoolExhaustedError

__all__ = ["CacheBatch", "CacheSnapshot", "DeltaNetState", "IndexerState", "KVCache", "PLEState"]


@dataclass
class DeltaNetState:
    """What one Gated DeltaNet layer carries from one call to the next, for a batch of sequences.

    conv_state: [B, conv_channels, K-1], the last K-1 pre-conv qkv vectors (oldest first), in the
        activation dtype; zeros stand for the positions before the sequence start, as the
        zero-padded convolution of transformers' prefill assumes.
    recurrent_state: [B, Hv, dk, dv] float32, the delta-rule memory S of each value head.
    """

    conv_state: torch.Tensor
    recurrent_state: torch.Tensor

    @classmethod
    def zeros(
        cls,
        batch: int,
        conv_channels: int,
        conv_kernel: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> "DeltaNetState":
        return cls(
            conv_state=torch.zeros(batch, conv_channels, conv_kernel - 1, dtype=dtype, device=device),
            recurrent_state=torch.zeros(
                batch, num_v_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=device
            ),
        )

    def reset(self) -> None:
        """Back to an empty sequence (the state of a fresh prompt)."""
        self.conv_state.zero_()
        self.recurrent_state.zero_()

    def snapshot(self) -> "DeltaNetState":
        """A copy to come back to: the state cannot be rewound, only restored."""
        return DeltaNetState(self.conv_state.clone(), self.recurrent_state.clone())

    def restore(self, snapshot: "DeltaNetState") -> None:
        self.conv_state.copy_(snapshot.conv_state)
        self.recurrent_state.copy_(snapshot.recurrent_state)


class IndexerState:
    """What one QSA indexer carries from one call to the next, for a batch of sequences.

    block_keys: [B, max_len // r, Di], the compressed key of every complete block (pooled, normed,
        roped), filled up to `num_blocks`. A complete block's key never changes, so it is computed once.
    tail_keys: [B, r - 1, Di], the raw keys of the tokens after the last complete block (`tail_len` of
        them), and tail_cos / tail_sin [r - 1, rope_dim / 2] their rotary angles: the first one ropes
        the block's key once the block completes.
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        head_dim: int,
        compress_ratio: int,
        rope_pairs: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        self.compress_ratio = compress_ratio
        self.block_keys = torch.zeros(batch, max_len // compress_ratio, head_dim, dtype=dtype, device=device)
        self.tail_keys = torch.zeros(batch, compress_ratio - 1, head_dim, dtype=dtype, device=device)
        self.tail_cos = torch.zeros(compress_ratio - 1, rope_pairs, dtype=dtype, device=device)
        self.tail_sin = torch.zeros_like(self.tail_cos)
        self.num_blocks = 0
        self.tail_len = 0

    @property
    def length(self) -> int:
        """Tokens seen so far."""
        return self.num_blocks * self.compress_ratio + self.tail_len

    def reset(self) -> None:
        """Back to an empty sequence."""
        self.num_blocks = 0
        self.tail_len = 0

    def snapshot(self) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What restoring needs: complete blocks never change, so their count is enough; the tail is
        copied."""
        return (
            self.num_blocks,
            self.tail_len,
            self.tail_keys.clone(),
            self.tail_cos.clone(),
            self.tail_sin.clone(),
        )

    def restore(self, snapshot: tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.num_blocks, self.tail_len, keys, cos, sin = snapshot
        self.tail_keys.copy_(keys)
        self.tail_cos.copy_(cos)
        self.tail_sin.copy_(sin)


@dataclass
class PLEState:
    """What the PLE layer carries from one call to the next, for a batch of sequences.

    tokens: [B, n − 1] int64, the last n − 1 token ids, oldest first; EOS before the sequence start.
    conv_state: [B, hc·hidden, (Kp − 1)·n], the last (Kp − 1)·n normalised gated values (oldest
        first), zeros before the sequence start, in the activation dtype.
    eos_token_id: what `tokens` holds before the sequence start.
    """

    tokens: torch.Tensor
    conv_state: torch.Tensor
    eos_token_id: int

    def reset(self) -> None:
        """Back to an empty sequence."""
        self.tokens.fill_(self.eos_token_id)
        self.conv_state.zero_()

    def snapshot(self) -> "PLEState":
        return PLEState(self.tokens.clone(), self.conv_state.clone(), self.eos_token_id)

    def restore(self, snapshot: "PLEState") -> None:
        self.tokens.copy_(snapshot.tokens)
        self.conv_state.copy_(snapshot.conv_state)


@dataclass(frozen=True)
class CacheSnapshot:
    """The states a cache holds at `length` positions that cannot be rewound (DeltaNet, QSA indexer
    tails, the PLE history), copied. Keys and values need no copy: positions before `length` are never
    rewritten while the cache only grows past them."""

    length: int
    recurrent: tuple[Any, ...]
    indexers: tuple[Any, ...]
    ple: Any

    @property
    def nbytes(self) -> int:
        """What the copies take."""
        tensors = [t for r in self.recurrent for t in (r.conv_state, r.recurrent_state)]
        tensors += [t for i in self.indexers for t in i[2:]]
        if self.ple is not None:
            tensors += [self.ple.tokens, self.ple.conv_state]
        return sum(t.numel() * t.element_size() for t in tensors)


class KVCache:
    """The decode state of `batch` sequences that advance together: keys and values of `num_layers`
    attention layers in blocks of a `BlockPool` (one block table per sequence), and `recurrent`
    DeltaNet states (one per recurrent layer, empty for a plain transformer); for qwen4exp also
    `indexers` (one per QSA layer, the compressed block keys) and `ple` (the PLE layer's token and conv
    history). Without a `pool` the cache makes its own, big enough for `max_len` positions per sequence;
    the server's slots share one (bubo/model/block_pool.py).

    `length` positions are filled. During a forward pass every layer writes its T new positions
    at `length` (`update`) or advances its recurrent state; the model then calls `advance(T)` once,
    so all layers of one step see the same offset. Blocks are taken as positions are written and given
    back when the cache is cut.

    A recurrent state folds every position into a fixed-size memory, so it cannot forget the last
    few: a cache holding one can only be truncated to 0 or kept whole (`can_rewind` is False). The
    indexer and PLE states keep no per-position history to cut back to either.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        recurrent: Sequence[DeltaNetState] = (),
        indexers: Sequence["IndexerState"] = (),
        ple: "PLEState | None" = None,
        pool: BlockPool | None = None,
        value_dtype: torch.dtype | None = None,
    ) -> None:
        if pool is None:
            block_size = min(DEFAULT_BLOCK_SIZE, max(max_len, 1))
            blocks = batch * -(-max(max_len, 1) // block_size)
            pool = BlockPool(
                num_layers, num_kv_heads, head_dim, blocks, block_size, dtype, device, value_dtype
            )
        elif pool.num_layers != num_layers:
            raise ValueError(f"a block pool of {pool.num_layers} layers can't hold {num_layers} layers")
        self.pool = pool
        self.batch = batch
        self.device = torch.device(device)
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        # Per row, where its positions lie in the pool: the first one's pool position when the row's blocks
        # form one run, else every position's (an index to gather with); None until asked after a change.
        self._layout: list[int | torch.Tensor | None] = [None] * batch
        self.recurrent = list(recurrent)
        self.indexers = list(indexers)
        self.ple = ple
        self.max_len = max_len
        self.length = 0
        # How far the positions of the tokens after a prompt with images run off their index (the
        # delta of bubo.vision.positions.mrope_positions): a text-only call continues at
        # length + rope_delta. Set by whoever prefilled the images.
        self.rope_delta = 0
        # Positions at which the recurrent states are to be copied during the next forward pass (set by
        # the prompt cache), and the copies made: position -> {recurrent state index: copy}.
        self.snapshot_at: tuple[int, ...] = ()
        self.taken: dict[int, dict[int, DeltaNetState]] = {}

    @property
    def num_layers(self) -> int:
        return self.pool.num_layers

    @property
    def blocks(self) -> int:
        """Blocks this cache holds (shared ones included)."""
        return sum(len(table) for table in self.tables)

    @property
    def can_rewind(self) -> bool:
        """Whether `truncate` accepts any length up to `length`, not only 0 and `length`."""
        return not (self.recurrent or self.indexers or self.ple)

    def reserve(self, n: int) -> bool:
        """Make room for `n` more positions (take blocks, copy a shared block about to be written); False
        when they would pass `max_len` or the pool has no free block."""
        end = self.length + n
        if end > self.max_len:
            return False
        try:
            self._reserve(end)
        except KVPoolExhaustedError:
            return False
        return True

    def _claim(self, end: int) -> None:
        """`_reserve` positions up to `end` for a write, which must not pass `max_len`."""
        if end > self.max_len:
            raise ValueError(
                f"KV cache full: {self.length} + {end - self.length} positions exceed max_len {self.max_len}"
            )
        self._reserve(end)

    def _reserve(self, end: int) -> None:
        pool, size = self.pool, self.pool.block_size
        first = self.length // size  # the block the next write lands in
        for row, table in enumerate(self.tables):
            if first < len(table) and pool.is_shared(table[first]):
                # Copy on write: another sequence holds this block's earlier positions.
                copy = pool.take()
                pool.copy(table[first], copy, self.length - first * size)
                pool.release([table[first]])
                table[first] = copy
                self._layout[row] = None
            while len(table) * size < end:
                table.append(pool.take(after=table[-1] if table else None))
                self._layout[row] = None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [batch, kv_heads, T, head_dim] at positions length..length+T-1 of `layer`;
        return that layer's keys and values for positions 0..length+T-1 (views of the pool when each
        sequence's blocks form one run, gathered copies otherwise)."""
        self.write(layer, k, v)
        return self.read(layer, self.length + k.shape[2])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [batch, kv_heads, T, head_dim] at positions length..length+T-1 of `layer`, for a
        reader that finds them through the block tables itself (the paged-attention kernel)."""
        start, end = self.length, self.length + k.shape[2]
        self._claim(end)
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        k, v = k.to(keys.dtype), v.to(values.dtype)  # narrowed to the storage types (a float16 cache)
        for row in range(self.batch):
            layout = self._row_layout(row)
            if isinstance(layout, int):
                keys[:, layout + start : layout + end] = k[row]
                values[:, layout + start : layout + end] = v[row]
            else:
                keys.index_copy_(1, layout[start:end], k[row])
                values.index_copy_(1, layout[start:end], v[row])

    def single_run(self, end: int) -> int | None:
        """For one sequence whose blocks form one run once positions up to `end` are reserved: the pool
        position of its position 0 (a layer's keys are then `pool.keys[layer][:, run : run + end]`, and a
        decode step can write and read them as plain views, cheaper than `update`); None
        for a batch or scattered blocks. Takes the blocks, as `write` would."""
        if self.batch != 1:
            return None
        self._claim(end)
        layout = self._row_layout(0)
        return layout if isinstance(layout, int) else None

    def read(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [batch, kv_heads, end, head_dim] of positions 0..end-1 (default: `length`)."""
        end = self.length if end is None else end
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        out_k, out_v = [], []
        for row in range(self.batch):
            layout = self._row_layout(row)
            if isinstance(layout, int):
                out_k.append(keys[:, layout : layout + end])
                out_v.append(values[:, layout : layout + end])
            else:
                out_k.append(keys.index_select(1, layout[:end]))
                out_v.append(values.index_select(1, layout[:end]))
        if self.batch == 1:
            return out_k[0].unsqueeze(0), out_v[0].unsqueeze(0)
        return torch.stack(out_k), torch.stack(out_v)

    def _row_layout(self, row: int) -> int | torch.Tensor:
        layout = self._layout[row]
        if layout is None:
            table, size = self.tables[row], self.pool.block_size
            if all(b + 1 == c for b, c in itertools.pairwise(table)):
                layout = table[0] * size if table else 0
            else:
                blocks = torch.tensor(table, dtype=torch.long, device=self.device)
                offsets = torch.arange(size, device=self.device)
                layout = (blocks[:, None] * size + offsets[None, :]).reshape(-1)
            self._layout[row] = layout
        return layout

    def share_prefix(self, source: "KVCache", n: int) -> None:
        """Start from the first `n` positions of `source` (same pool, one sequence each, empty now) by
        holding its blocks rather than copying them; a later write into a shared block copies it."""
        if source.pool is not self.pool or self.batch != 1 or source.batch != 1:
            raise ValueError("only single-sequence caches of one block pool can share blocks")
        if self.length or not self.can_rewind or not 0 <= n <= source.length:
            raise ValueError(f"cannot share {n} positions of a cache of length {source.length} into this one")
        blocks = source.tables[0][: self.pool.blocks_for(n)]
        self.pool.hold(blocks)
        self.tables[0] = list(blocks)
        self._layout[0] = None
        self.length = n

    def _release_beyond(self, n: int) -> None:
        """Give back the blocks past position n."""
        keep = self.pool.blocks_for(n)
        for row, table in enumerate(self.tables):
            if len(table) > keep:
                self.pool.release(table[keep:])
                del table[keep:]
                self._layout[row] = None

    def positions(self, length: int) -> torch.Tensor:
        """The rotary positions [length] of the next `length` tokens (its sequences advance together)."""
        start = self.length + self.rope_delta
        return torch.arange(start, start + length)

    def run_layer(
        self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        """A decoder layer's step on this cache: its own forward (a compiled step's state runs the
        compiled trace of it instead)."""
        return layer(x, cos, sin, self, tokens)

    def run_inputs(
        self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The model's `inputs` (embeddings, rotary cos and sin) for a step on this cache, run as they are
        (a compiled step's state runs a compiled trace of them instead)."""
        return model.inputs(tokens, positions)

    def advance(self, n: int) -> None:
        """Mark n more positions filled (after every layer has written them)."""
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {n} positions exceed max_len {self.max_len}")
        self.length += n

    def truncate(self, n: int) -> None:
        """Keep the first n positions; later writes overwrite the rest."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a KV cache of length {self.length} to {n}")
        if n == 0:
            self.reset()
        elif n != self.length and not self.can_rewind:
            raise ValueError(
                f"cannot truncate a cache with recurrent state from {self.length} to {n} positions: "
                "the state can't be rewound, only reset (truncate to 0) or kept whole"
            )
        self.length = n
        self._release_beyond(n)

    @property
    def snapshots_in_forward(self) -> bool:
        """Whether snapshots can be taken inside a forward pass (`snapshot_at`): true when the only
        states that can't be rewound are DeltaNet ones, which their layers copy at the given
        positions; the QSA indexer tails and the PLE history have no such hook."""
        return not (self.indexers or self.ple)

    def taken_snapshots(self) -> list[CacheSnapshot]:
        """The snapshots the last forward passes took at `snapshot_at`, complete for every layer."""
        out = []
        for position in sorted(self.taken):
            states = self.taken[position]
            if len(states) != len(self.recurrent):
                continue
            recurrent = tuple(states[i] for i in range(len(self.recurrent)))
            out.append(CacheSnapshot(position, recurrent, (), None))
        self.taken = {}
        self.snapshot_at = ()
        return out

    def snapshot(self) -> CacheSnapshot:
        """Copies of the states that cannot be rewound, to `restore` this length later."""
        recurrent = tuple(state.snapshot() for state in self.recurrent)
        indexers = tuple(indexer.snapshot() for indexer in self.indexers)
        ple = self.ple.snapshot() if self.ple is not None else None
        return CacheSnapshot(self.length, recurrent, indexers, ple)

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Back to the length and states of `snapshot`, taken from this cache while it held the same
        first `snapshot.length` positions it holds now (or more of the same)."""
        if snapshot.length > self.length:
            raise ValueError(
                f"cannot restore a snapshot at {snapshot.length} into a cache of length {self.length}"
            )
        for state, saved in zip(self.recurrent, snapshot.recurrent, strict=True):
            state.restore(saved)
        for indexer, saved in zip(self.indexers, snapshot.indexers, strict=True):
            indexer.restore(saved)
        if self.ple is not None:
            self.ple.restore(snapshot.ple)
        self.length = snapshot.length
        self._release_beyond(self.length)

    def reset(self) -> None:
        """Back to an empty sequence, every block given back."""
        self.length = 0
        self._release_beyond(0)
        for state in self.recurrent:
            state.reset()
        for indexer in self.indexers:
            indexer.reset()
        if self.ple is not None:
            self.ple.reset()


class CacheBatch:
    """Independent single-sequence caches whose next tokens run as one batch: the decode steps of
    several slots (bubo/engine/batcher.py). Row i of the batch continues caches[i] at its own length.
    Weights are read once for every row; attention and recurrent steps run per row's cache."""

    def __init__(self, caches: Sequence[KVCache]) -> None:
        if not caches or any(c.batch != 1 for c in caches):
            raise ValueError("a cache batch is one or more single-sequence caches")
        self.caches = list(caches)

    def positions(self, length: int) -> torch.Tensor:
        """Each row's rotary positions [rows, length] for its next tokens."""
        return torch.stack([cache.positions(length) for cache in self.caches])

    def run_layer(
        self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        """A decoder layer's step on every row (`KVCache.run_layer`)."""
        return layer(x, cos, sin, self, tokens)

    def run_inputs(
        self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The model's `inputs` for every row (`KVCache.run_inputs`)."""
        return model.inputs(tokens, positions)

    def advance(self, n: int) -> None:
        for cache in self.caches:
            cache.advance(n)
