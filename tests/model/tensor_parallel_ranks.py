"""Gloo ranks on this machine running tiny GGUF models split by tensor parallelism, rank 0 leading the
steps (bubo/engine/tensor_parallel_steps.py); and the scenario every model runs, whole or split.

Kept apart from the test module so that the spawned ranks import torch and bubo only, not transformers.
"""

import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bubo.engine.tensor_parallel_steps import StepLeader, follow, load_shard
from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model.decoder import Decoder
from bubo.model.loader import load_decoder
from bubo.model.tensor_parallel import TensorParallel, weight_bytes

PROMPT_LENGTH, STEPS, REWIND = 12, 6, 3
# Where the hybrid models' prefill keeps a recurrent-state snapshot, to go back to.
SNAPSHOT_AT = 8


def load(path: Path) -> Decoder:
    f = GGUFFile(path)
    return load_decoder(f, config_from_gguf(f))


def prompt(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(3))


@torch.inference_mode()
def scenario(model: Decoder) -> dict[str, Any]:
    """A prefill and greedy decode steps; then the cache cut back and the same positions again: a few
    positions back (attention only), or to a snapshot of the recurrent states taken where the prompt
    cache takes them (inside the prefill for DeltaNet states, between prompt passes for qwen4exp's);
    then to zero."""
    tokens = prompt(model.config.vocab_size)
    cache = model.new_cache(max_len=32)
    snapshot = None
    if cache.can_rewind:
        prefill = model(tokens, cache)
    elif cache.snapshots_in_forward:
        cache.snapshot_at = (SNAPSHOT_AT,)
        prefill = model(tokens, cache)
        [snapshot] = cache.taken_snapshots()
    else:
        first = model(tokens[:, :SNAPSHOT_AT], cache)
        snapshot = cache.snapshot()
        prefill = torch.cat([first, model(tokens[:, SNAPSHOT_AT:], cache)], dim=1)
    greedy, steps = [], []
    token = prefill[:, -1].argmax(-1)
    for _ in range(STEPS):
        greedy.append(int(token))
        steps.append(model(token.view(1, 1), cache)[:, -1])
        token = steps[-1].argmax(-1)
    if snapshot is None:
        back = PROMPT_LENGTH - REWIND
        cache.truncate(back)
    else:
        back = SNAPSHOT_AT
        cache.restore(snapshot)
    again = model(tokens[:, back:], cache)[:, -1]
    cache.truncate(0)
    from_zero = model(tokens, cache)[:, -1]
    return {
        "prefill": prefill,
        "decode": torch.cat(steps),
        "greedy": greedy,
        "again": again,
        "from_zero": from_zero,
        "weight_bytes": weight_bytes(model),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_split(paths: list[Path], out: Path, world: int = 2) -> None:
    """Each of `paths` split over `world` gloo ranks; rank r writes out/{stem}.rank{r}.pt (rank 0 the
    scenario's results, the others their weight bytes)."""
    mp.spawn(_rank, args=(world, free_port(), paths, out), nprocs=world, join=True)


def _rank(rank: int, world: int, port: int, paths: list[Path], out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    tp = TensorParallel(rank, world)
    try:
        for path in paths:
            f = GGUFFile(path)
            model = load_shard(f, config_from_gguf(f), tp, torch.float32, "cpu")
            if rank == 0:
                leader = StepLeader(model, tp)
                results = scenario(model)
                leader.stop()
            else:
                follow(model, tp)
                results = {"weight_bytes": weight_bytes(model)}
            torch.save(results, out / f"{path.stem}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()
