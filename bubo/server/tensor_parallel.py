"""`bubo serve --tensor-parallel N`: the model split over N processes of one torch.distributed group
(gloo on the CPU, NCCL on CUDA, one GPU a rank), rank 0 serving HTTP and scheduling, the others
following its steps (bubo/engine/tensor_parallel_steps.py).

Under torchrun (RANK and WORLD_SIZE set; read here and nowhere else) every rank runs the same command
and joins torchrun's group; otherwise this process is rank 0 and starts the other N - 1 itself
(torch.multiprocessing, spawned), on this machine, over a loopback port.

This module imports the model code only inside its functions: a spawned follower's first import is this
module, and a CPU process is configured before the model code is imported (bubo.process_memory).
"""

import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bubo.options import RuntimeOptions, current_options, use_options
from bubo.process_memory import configure_cpu_process

if TYPE_CHECKING:
    from bubo.server.settings import ServerSettings
    from bubo.server.state import ServerState

__all__ = ["rank_device", "start_ranks", "stop_ranks"]

log = logging.getLogger(__name__)

# A follower waits in a broadcast for rank 0's next step for as long as the server sits idle.
IDLE_TIMEOUT = timedelta(days=365)
# The followers this process started, joined once rank 0 has sent them home.
_spawned: list[BaseProcess] = []
_PR_SET_PDEATHSIG = 1
FOLLOWER_EXIT_SECONDS = 30


def rank_device(device: str, local_rank: int) -> str:
    """The device of the rank `local_rank` on its machine: its own GPU on CUDA, the CPU shared."""
    return f"cuda:{local_rank}" if device.split(":")[0] == "cuda" else device


def _join(device: str, rank: int, world: int, init_method: str | None = None) -> None:
    """Join the group as `rank`, over NCCL from the rank's own GPU (made the current one, where NCCL and
    every kernel launch look) or over gloo on the CPU."""
    backend = "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        backend = "nccl"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=IDLE_TIMEOUT
    )


def start_ranks(
    settings: "ServerSettings", world: int, environ: Mapping[str, str] = os.environ
) -> "ServerSettings | None":
    """Form the group of `world` ranks. Rank 0 gets back its settings (`tensor_parallel`, its device and,
    on the CPU, its share of the threads); a follower rank under torchrun follows until rank 0 stops it,
    then gets None. ValueError, before any rank starts, when the model's heads don't divide over them."""
    from bubo.gguf.config import config_from_gguf
    from bubo.gguf.reader import GGUFFile
    from bubo.model.tensor_parallel import check_split

    with GGUFFile(settings.model_path) as file:
        check_split(config_from_gguf(file), world)
    cpu = settings.device.split(":")[0] != "cuda"
    # Ranks on one machine share its cores: by default each takes its share, not all of them.
    threads = settings.threads or (max(1, (os.cpu_count() or 1) // world) if cpu else None)
    if "RANK" in environ and "WORLD_SIZE" in environ:
        rank, size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        if size != world:
            raise ValueError(f"--tensor-parallel {world} under torchrun with WORLD_SIZE={size}")
        device = rank_device(settings.device, int(environ.get("LOCAL_RANK", rank)))
        _join(device, rank, world)  # torchrun's MASTER_ADDR / MASTER_PORT
        if rank:
            _follow(rank, world, settings, device, threads)
            return None
    else:
        port = _free_port()
        context = mp.get_context("spawn")
        for rank in range(1, world):
            context.Process(
                target=_spawned_follower,
                args=(
                    rank,
                    world,
                    port,
                    settings,
                    rank_device(settings.device, rank),
                    threads,
                    current_options(),
                ),
                name=f"bubo-tensor-parallel-{rank}",
                daemon=True,
            ).start()
        device = rank_device(settings.device, 0)
        _join(device, 0, world, f"tcp://127.0.0.1:{port}")
    from bubo.model.tensor_parallel import TensorParallel

    return replace(settings, tensor_parallel=TensorParallel(0, world), device=device, threads=threads)


def stop_ranks(state: "ServerState") -> None:
    """Rank 0, its serving done: send the followers home and leave the group."""
    loaded = state.loaded
    try:
        if loaded is not None and loaded.step_leader is not None:
            loaded.step_leader.stop()
        dist.destroy_process_group()
    except (RuntimeError, dist.DistError) as error:  # a follower already gone: nothing left to stop
        log.warning("tensor parallel: stopping the other ranks: %s", error)
    for process in _spawned:
        process.join(FOLLOWER_EXIT_SECONDS)
    _spawned.clear()


def _follow(rank: int, world: int, settings: "ServerSettings", device: str, threads: int | None) -> None:
    from bubo.engine.tensor_parallel_steps import follow_file
    from bubo.model.tensor_parallel import TensorParallel

    if threads:
        torch.set_num_threads(threads)
    try:
        follow_file(
            settings.model_path, TensorParallel(rank, world), settings.dtype, device, settings.cache_dtypes
        )
    finally:
        dist.destroy_process_group()


def _spawned_follower(
    rank: int,
    world: int,
    port: int,
    settings: "ServerSettings",
    device: str,
    threads: int | None,
    options: RuntimeOptions,
) -> None:
    """A follower that this process's rank 0 spawned: it ends with rank 0, even one killed outright."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if device.split(":")[0] == "cpu":
        configure_cpu_process()
    use_options(options)  # rank 0's flags: the same weight layouts and precisions on every rank
    _join(device, rank, world, f"tcp://127.0.0.1:{port}")
    _follow(rank, world, settings, device, threads)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
