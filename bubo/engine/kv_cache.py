"""A preallocated decode state: keys and values for max_len positions per attention layer, the
fixed-size recurrent state of each Gated DeltaNet layer of a hybrid model, and qwen4exp's QSA
indexer states and PLE state."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from bubo.model.deltanet import DeltaNetState

if TYPE_CHECKING:  # these modules import KVCache themselves
    from bubo.model.indexed_attention import IndexerState
    from bubo.model.ngram_embedding import PLEState

__all__ = ["CacheSnapshot", "KVCache"]


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
    """Keys and values of `num_layers` attention layers, each [batch, num_kv_heads, max_len, head_dim],
    and `recurrent` DeltaNet states (one per recurrent layer, empty for a plain transformer); for
    qwen4exp also `indexers` (one per QSA layer, the compressed block keys) and `ple` (the PLE layer's
    token and conv history). Everything is sized up front and reset together.

    `length` positions are filled. During a forward pass every layer writes its T new positions
    at `length` (`update`) or advances its recurrent state; the model then calls `advance(T)` once,
    so all layers of one step see the same offset.

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
    ) -> None:
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.recurrent = list(recurrent)
        self.indexers = list(indexers)
        self.ple = ple
        self.max_len = max_len
        self.length = 0
        # Positions at which the recurrent states are to be copied during the next forward pass (set by
        # the prompt cache), and the copies made: position -> {recurrent state index: copy}.
        self.snapshot_at: tuple[int, ...] = ()
        self.taken: dict[int, dict[int, DeltaNetState]] = {}

    @property
    def can_rewind(self) -> bool:
        """Whether `truncate` accepts any length up to `length`, not only 0 and `length`."""
        return not (self.recurrent or self.indexers or self.ple)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [batch, kv_heads, T, head_dim] at positions length..length+T-1 of `layer`;
        return that layer's keys and values for positions 0..length+T-1 (views, no copy)."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KV cache full: {self.length} + {k.shape[2]} positions exceed max_len {self.max_len}"
            )
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

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

    def reset(self) -> None:
        """Back to an empty sequence."""
        self.length = 0
        for state in self.recurrent:
            state.reset()
        for indexer in self.indexers:
            indexer.reset()
        if self.ple is not None:
            self.ple.reset()
