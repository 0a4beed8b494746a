"""The slot's prompt cache: which tokens its KV/state cache holds, how much of a new prompt can be
reused, and snapshots of the states that cannot be rewound.

Attention KV can be cut back to any prefix. A Gated DeltaNet state (and qwen4exp's indexer tails and
n-gram history) folds every position into a fixed-size memory, so a hybrid model's cache can only be
kept whole or restored to a snapshot taken at that position. Snapshots are taken while a prompt's
prefill runs, at the end of every message turn (after each end-of-turn token: an agent's next request
resends the same history plus a new turn, and templates that drop past reasoning rewrite the history
only after the last user turn) and every `interval` tokens, within a count and byte budget; a new
prompt resumes from the longest snapshot that lies inside the prefix it shares with the cache.

Prompts are compared as sequences of keys: token ids, and at image positions the image's digest
(bubo/engine/prompt_images.py), so an image is reused only when its bytes are the same.

The report says what happened (the same fields /debug/cache shows): `cache_miss_reason` is "empty"
(nothing cached), "prefix_mismatch" (the prompt differs from the cache before any reusable point),
"no_snapshot" (a recurrent state, and no snapshot inside the shared prefix), "evicted" (there was one,
but the budget dropped it, or another slot took the KV blocks) or "disabled"; `cache_diverged_at` is the first token where prompt and cache
differ; `cache_history_rewritten` is true when that token lies in what the previous request generated
(the template re-rendered the previous answer, e.g. without its reasoning).
"""

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from bubo.engine.request import CacheReport
from bubo.model.state import CacheSnapshot, KVCache

__all__ = ["PromptCache", "SnapshotPolicy", "common_prefix"]


def common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class SnapshotPolicy:
    """How many state snapshots a hybrid cache keeps and where it takes them (README, prompt cache):
    `max_snapshots` and `max_bytes` bound them (the oldest go first); a prompt snapshots its last
    `turn_ends` turn ends and every `interval` tokens; 0 snapshots turns them off."""

    max_snapshots: int = 16
    max_bytes: int = 2 << 30
    interval: int = 1024
    # Every stop in a prefill costs a forward pass (whose fixed cost, reading all weights, dominates
    # short segments), so a prompt snapshots only its last few turn ends: in a growing chat the
    # earlier ones were taken by earlier requests, and a history rewritten by the template diverges
    # after the last user turn.
    turn_ends: int = 2


class PromptCache:
    """A cache and the token ids it holds."""

    def __init__(
        self, cache: KVCache, turn_end_ids: frozenset[int], policy: SnapshotPolicy | None = None
    ) -> None:
        self.cache = cache
        self.turn_end_ids = turn_end_ids
        self.policy = policy or SnapshotPolicy()
        self.tokens: list[Hashable] = []
        self.snapshots: list[CacheSnapshot] = []
        self.skipped = 0
        self._evicted_at: list[int] = []
        self._generated_from = 0
        self._evicted = False

    @property
    def needs_snapshots(self) -> bool:
        return not self.cache.can_rewind and self.policy.max_snapshots > 0

    def prepare(self, prompt: Sequence[Hashable], enabled: bool = True) -> CacheReport:
        """Cut the cache back to the longest reusable prefix of `prompt` and report it."""
        cache, held = self.cache, self.tokens
        self.skipped = 0
        common = common_prefix(held, prompt)
        diverged = common if common < min(len(held), len(prompt)) else None
        # The last prompt token always goes through the model: its logits give the first new token.
        limit = min(common, len(prompt) - 1)
        reason: str | None = None
        if not enabled:
            keep, reason = 0, "disabled"
        elif cache.can_rewind or limit == cache.length:
            keep = limit
        else:
            usable = [s for s in self.snapshots if s.length <= limit]
            keep = max((s.length for s in usable), default=0)
            if keep == 0:
                reason = "evicted" if any(0 < p <= limit for p in self._evicted_at) else "no_snapshot"
        if keep == 0 and reason is None:
            reason = "evicted" if self._evicted else "empty" if not held else "prefix_mismatch"
        self._evicted = False
        self._cut(keep)
        rewritten = diverged is not None and diverged >= self._generated_from > 0
        return CacheReport(
            cache_hit=keep > 0,
            cached_tokens=keep,
            cache_miss_reason=reason,
            cache_snapshots=len(self.snapshots),
            cache_diverged_at=diverged,
            cache_history_rewritten=rewritten,
        )

    def evict(self) -> None:
        """Give everything back (another slot needs the KV blocks); the next request reports "evicted"."""
        self.forget()
        self._evicted = True

    def forget(self) -> None:
        """Hold nothing (a request asked not to be cached): the next request finds the cache empty."""
        self.cache.reset()
        self.tokens, self.snapshots, self._evicted_at = [], [], []

    def adopt_prefix(self, other: "PromptCache", n: int) -> None:
        """Start from the first `n` tokens `other` holds, sharing its KV blocks (caches that can rewind)."""
        self.cache.reset()
        self.cache.share_prefix(other.cache, n)
        self.tokens, self.snapshots, self._evicted_at = list(other.tokens[:n]), [], []
        self._evicted = False

    def _cut(self, keep: int) -> None:
        cache = self.cache
        if keep == cache.length:
            pass
        elif keep == 0 or cache.can_rewind:
            cache.truncate(keep)
        else:
            cache.restore(next(s for s in self.snapshots if s.length == keep))
        # Snapshots past the cut would describe positions about to be overwritten.
        self.snapshots = [s for s in self.snapshots if s.length <= keep]
        self._evicted_at = [p for p in self._evicted_at if p <= keep]
        self.tokens = self.tokens[:keep]

    def snapshot_points(self, prompt: Sequence[Hashable]) -> list[int]:
        """Where to stop the prefill of `prompt` (past what the cache holds) to take snapshots."""
        if not self.needs_snapshots:
            return []
        start, end = self.cache.length, len(prompt) - 1
        turn_ends = sorted(i + 1 for i in range(start, end) if prompt[i] in self.turn_end_ids)
        points = set(turn_ends[-self.policy.turn_ends :] if self.policy.turn_ends > 0 else [])
        interval = self.policy.interval
        if interval > 0:
            points |= set(range((start // interval + 1) * interval, end, interval))
        return sorted(p for p in points if start < p < end)

    def prefill(
        self, prompt: Sequence[Hashable], run: Callable[[int, int], None], enabled: bool = True
    ) -> None:
        """Arrange the snapshots of `prompt`'s prefill; nothing when the request turned caching off.

        A cache whose only unrewindable states are DeltaNet's takes them inside the prefill's one
        forward pass (`KVCache.snapshot_at`; `finish` collects them). Otherwise the prompt is computed
        up to each point with `run` (a forward over positions [start, end) into the cache), a snapshot taken
        at each: every stop then costs a pass over all the weights.
        """
        if not enabled or not self.needs_snapshots:
            return
        points = self.snapshot_points(prompt)
        if self.cache.snapshots_in_forward:
            self.cache.snapshot_at = tuple(points)
            return
        for point in points:
            run(self.cache.length, point)
            self.tokens = list(prompt[:point])
            self._keep(self.cache.snapshot())

    def _keep(self, snapshot: CacheSnapshot) -> None:
        policy = self.policy
        if snapshot.nbytes > policy.max_bytes:
            self.skipped += 1
            return
        self.snapshots.append(snapshot)
        while (
            len(self.snapshots) > policy.max_snapshots
            or sum(s.nbytes for s in self.snapshots) > policy.max_bytes
        ):
            evicted = self.snapshots.pop(0)
            self._evicted_at.append(evicted.length)
            self.skipped += 1

    def finish(self, prompt: Sequence[Hashable], generated: Sequence[int]) -> None:
        """After a generation: the cache holds the prompt and the generated tokens that went through
        the model (all but the last)."""
        self._generated_from = len(prompt)
        if self.needs_snapshots:
            for snapshot in self.cache.taken_snapshots():
                if snapshot.length <= self.cache.length:
                    self._keep(snapshot)
        held = (list(prompt) + list(generated))[: self.cache.length]
        if len(held) != self.cache.length:
            self.cache.truncate(0)
            self.snapshots, held = [], []
        self.tokens = held
