"""llama-server's prompt progress reports: how much of a prompt has been computed, for a client that
shows a long prompt's progress (`return_progress`)."""

import time
from collections.abc import Callable

from bubo.engine.request import PromptProgress

__all__ = ["ProgressReporter"]


class ProgressReporter:
    """Sends one PromptProgress for each new count of computed prompt positions it is told: the first
    (the cached prefix, nothing computed yet) and then only counts that grew, up to `total`."""

    def __init__(self, total: int, cached: int, send: Callable[[PromptProgress], None]) -> None:
        self.total = total
        self.cached = cached
        self._send = send
        self._started = time.perf_counter()
        self._last: int | None = None

    def __call__(self, processed: int) -> None:
        processed = min(processed, self.total)
        if self._last is not None and processed <= self._last:
            return
        self._last = processed
        elapsed_ms = (time.perf_counter() - self._started) * 1000
        self._send(PromptProgress(self.total, self.cached, processed, elapsed_ms))
