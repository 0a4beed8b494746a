"""Plain decoding that launches each step before reading the previous token back: the device runs step
k+1 while the host waits for token k, checks stops and detokenizes.

A token is drawn on the device and fed to the next step as it is; only the stop checks need its id on the
host. Read with `.item()` that id would wait for everything queued before the read, the next step too
when it is launched first, so the id is copied into pinned host memory behind an event right after the
draw, and the next step is queued after that copy. The step runs ahead of the consumer's decision to
continue: when the consumer stops (a stop token or string, the token limit, a cancel) the cache is cut
back to the positions the consumer asked for, so it ends where plain decoding's would. Worth it where a
step is one cheap launch (a replayed CUDA graph, bubo/engine/graph_decode.py); on the CPU the host runs
the step itself and nothing overlaps.
"""

from collections.abc import Callable, Iterator

import torch

from bubo.engine.token_choice import TokenChooser
from bubo.model.state import KVCache

__all__ = ["run_ahead_tokens"]

Step = Callable[[torch.Tensor, KVCache], torch.Tensor]


class _TokenReadback:
    """A drawn token's id, copied to the host without waiting for work queued after the copy."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._host = torch.zeros(1, dtype=torch.long, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None

    def start(self, token: torch.Tensor) -> None:
        self._host.copy_(token.reshape(1), non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def value(self) -> int:
        if self._copied is not None:
            self._copied.synchronize()
        return int(self._host[0])


def run_ahead_tokens(
    step: Step, cache: KVCache, chooser: TokenChooser, logits: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor]]:
    """The tokens of `generate`'s plain loop, one per step, each with the logits row it was drawn from
    (rows the caller may keep: `step` returns a fresh tensor each call)."""
    readback = _TokenReadback(logits.device)
    # Whether the cache holds a position the consumer has not asked for (cut back when it stops).
    ahead = False
    try:
        while True:
            chosen = chooser.sampler.sample(chooser.allowed(logits))
            readback.start(chosen)
            # No room (the cache's max_len, or no free block): the consumer will stop on "context". A
            # cache that can't be cut back (recurrent state) doesn't run ahead either.
            next_logits = step(chosen, cache) if cache.can_rewind and cache.reserve(1) else None
            ahead = next_logits is not None
            token = readback.value()
            chooser.accept(token)
            yield token, logits
            ahead = False
            logits = next_logits if next_logits is not None else step(chosen, cache)
    finally:
        if ahead:
            cache.truncate(cache.length - 1)
