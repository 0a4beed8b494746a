"""Which OS threads run torch's CPU work with a team of threads.

libgomp, the OpenMP runtime of torch's Linux CPU builds, gives every OS thread that opens a parallel
region a team of worker threads of its own, kept while that thread lives. Once it manages more threads
than there are CPUs it stops spinning between regions: a worker sleeps on a futex after ~100 spins, and
the next region wakes it with a system call. A decode step opens a few hundred regions, so two OS threads
with teams on 2 cores made the default model decode about three times slower (even when the second thread
sat idle after one parallel op; kept to one OpenMP thread, it costs nothing).

So one thread runs the model with the process's thread count (the only slot's worker, or with several
slots the batcher's compute thread, bubo/engine/batcher.py), and every other thread that touches torch
keeps its own ops on one thread (`use_one_thread`): sampling, log probabilities, grammar masks.
"""

import ctypes
from collections.abc import Callable

import torch

__all__ = ["use_one_thread"]


def use_one_thread() -> None:
    """Run the calling thread's torch CPU ops on one thread (an OpenMP team of one): call it first thing
    in a thread that must not hold a team of its own (and so must not run the model)."""
    torch.get_num_threads()  # torch sets each thread's OpenMP thread count on its first use: now, not later
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        set_threads(1)


def _omp_set_num_threads() -> Callable[[int], None] | None:
    """libgomp's (or another OpenMP runtime's) omp_set_num_threads, which sets it for the calling thread
    alone; None where torch runs without OpenMP or the symbol can't be reached."""
    try:
        return ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError, TypeError):
        return None
