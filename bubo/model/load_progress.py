"""How a long load shows itself while it repacks the weights and compiles the decode step (a first
start can take a minute or more): a bar on a terminal; elsewhere (a log file, a service manager) a
line every few seconds through logging, so that a wait is never silent and a log stays one line per
event."""

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm

__all__ = ["LoadProgress"]

log = logging.getLogger("bubo.load")


class _PeriodicCounter:
    """A count of done items, told as a line at most every `interval` seconds and once at the end."""

    def __init__(self, total: int, what: str, interval: float) -> None:
        self.total = total
        self.what = what
        self.interval = interval
        self.done = 0
        self.started = self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.interval and self.done < self.total:
            self.last = now
            log.info(
                "%s: %d/%d (%.0f%%)", self.what, self.done, self.total, 100 * self.done / max(self.total, 1)
            )

    def __enter__(self) -> "_PeriodicCounter":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            log.info("%s: %d/%d in %.1f s", self.what, self.done, self.total, time.monotonic() - self.started)


class LoadProgress:
    """A bar for counted work on a terminal (`bar`), else periodic lines; a stage whose length is not
    known ahead (compiling) is told when it starts, every `interval` seconds while it lasts, and when
    it ends."""

    def __init__(self, bar: bool, interval: float = 10.0) -> None:
        self.bar = bar
        self.interval = interval

    def counter(self, total: int, what: str) -> Any:
        """A context manager whose `update(n)` counts `n` of `total` items done."""
        if self.bar:
            return tqdm(total=total, desc=what, unit="tensor")
        return _PeriodicCounter(total, what, self.interval)

    @contextmanager
    def stage(self, what: str) -> Iterator[None]:
        started = time.monotonic()
        log.info("%s ...", what)
        finished = threading.Event()

        def heartbeat() -> None:
            while not finished.wait(self.interval):
                log.info("%s: still going (%.0f s)", what, time.monotonic() - started)

        thread = threading.Thread(target=heartbeat, name="bubo-load-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            finished.set()
            thread.join()
        log.info("%s: done in %.1f s", what, time.monotonic() - started)
