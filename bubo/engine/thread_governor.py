"""How many threads the model's steps run on, chosen by timing them while they run.

A workstation is never idle. When another process keeps the cores busy, every OpenMP parallel region of
a step waits at its barrier for a thread the OS has descheduled: on two shared cores, a decode step on
two threads then ran ten times slower than on one (benchmarks/RESULTS.md, 2026-12-06), while on an
idle machine two threads are the faster. No setting fixed at start is right for both, so the governor
measures: it times the steps at the thread count in use and, now and then, a few steps at the other
count (one thread, or all of them), and keeps whichever is faster. A probe comes after `FIRST_INTERVAL`
steps or `FIRST_SECONDS` of them, whichever is first (slow steps are the ones worth questioning soon);
one that loses makes the next wait twice as long (up to `MAX_INTERVAL` steps), and a probe step far
slower than the steps before it is cut short after that one step, so probing costs little in a steady
state either way.

The compiled kernels read the thread count as they run (bubo/kernels/compiled.py: `cpp.dynamic_threads`),
so a change takes effect at the next step without compiling anything.
"""

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["ThreadGovernor"]

# Steps timed at the thread count in use (their median is what a probe is compared with), and how many
# of them a probe needs first.
WINDOW = 8
MIN_SAMPLES = 4
# Steps a probe runs at the other count, unless its first is far slower (ABORT times the median).
PROBE_STEPS = 3
ABORT = 1.5
# A probe switches only when it is clearly faster: this fraction of the current median or less.
SWITCH = 0.85
# Steps between probes: at first, and at most (doubled after each probe that did not switch).
FIRST_INTERVAL = 32
MAX_INTERVAL = 512
# The same in seconds of steps (doubled with the steps' interval).
FIRST_SECONDS = 1.0


class ThreadGovernor:
    """For one thread that runs a model's steps: `with governor.step():` around each step sets torch's
    thread count for it (the calling thread's) and times it. `threads` is the most it uses; with one there
    is nothing to choose."""

    def __init__(
        self,
        threads: int,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.most = max(1, threads)
        self.threads = self.most  # the count in use
        self.switches = 0
        self._set_threads = set_threads
        self._clock = clock
        self._window: deque[float] = deque(maxlen=WINDOW)
        self._interval = FIRST_INTERVAL
        self._until_probe = FIRST_INTERVAL
        self._probe_at: float | None = None  # the clock reading after which a probe is due
        self._probe: list[float] | None = None  # the probe's step times while one runs
        self._applied = 0

    @property
    def _other(self) -> int:
        return 1 if self.threads > 1 else self.most

    def settle(self) -> None:
        """Run what comes next (a prefill, a verify pass: work of another size, not timed) on the count in
        use."""
        if self.most > 1 and self._applied != self.threads:
            self._set_threads(self.threads)
            self._applied = self.threads

    @contextmanager
    def step(self) -> Iterator[None]:
        if self.most == 1:
            yield
            return
        probing = self._probe is not None
        wanted = self._other if probing else self.threads
        if wanted != self._applied:
            self._set_threads(wanted)
            self._applied = wanted
        started = self._clock()
        yield
        ended = self._clock()
        if self._probe_at is None:
            self._probe_at = started + FIRST_SECONDS
        self._record(ended - started, probing, ended)

    def _record(self, seconds: float, probing: bool, now: float) -> None:
        if not probing:
            self._window.append(seconds)
            self._until_probe -= 1
            due = self._until_probe <= 0 or (self._probe_at is not None and now >= self._probe_at)
            if due and len(self._window) >= MIN_SAMPLES:
                self._probe = []
            return
        assert self._probe is not None
        self._probe.append(seconds)
        current = statistics.median(self._window)
        if len(self._probe) == 1 and seconds > ABORT * current:
            self._end_probe(switch=False)
        elif len(self._probe) == PROBE_STEPS:
            self._end_probe(switch=statistics.median(self._probe) <= SWITCH * current)
        if self._probe is None:
            self._probe_at = now + FIRST_SECONDS * self._interval / FIRST_INTERVAL

    def _end_probe(self, switch: bool) -> None:
        assert self._probe is not None
        if switch:
            self.threads = self._other
            self.switches += 1
            self._window.clear()
            self._window.extend(self._probe)
            self._interval = FIRST_INTERVAL
        else:
            self._interval = min(2 * self._interval, MAX_INTERVAL)
        self._until_probe = self._interval
        self._probe = None
