"""Compiled kernels kept on disk, so that the next process loads them instead of tracing them again.

Inductor's own caches key a graph on the graph itself, so every load of a model first traces each of
its kernels (make_fx on fake tensors) and then hashes the graph to find it: most of a load with warm
caches went to that. Bubo knows what a kernel's
graph is made from before tracing it: the function's code (all of it is Bubo's source), the values
its closure holds (a layer's plan, a quantization format, a dtype), the layout of its arguments, and
the inductor options and machine it is compiled for. `KernelStore` names a compiled kernel by those
and keeps inductor's standalone artifact of it (`torch._inductor.standalone_compile`) under that
name: the next load reads it back, tracing nothing.

A name covers a function of a `bubo.` module whose closure holds only plain data (numbers, strings,
enums, dtypes, tuples, dataclasses of those, other such functions); anything else is compiled as
before and not stored. What else a kernel's function reads while tracing must be fixed for a version
of the code and a machine: module constants, Bubo's options and `TORCHINDUCTOR_*` settings (in the name). Each
version of Bubo's source (all its files, hashed as the package is imported) has a directory of its
own; those of other versions untouched for a week are removed. `--kernel-cache DIR` sets the store's
place (by default `bubo-kernels` in inductor's cache directory), `--kernel-cache off` turns it off.
"""

import dataclasses
import enum
import functools
import hashlib
import json
import logging
import os
import shutil
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._inductor import CompiledArtifact
from torch._inductor.codecache import write_atomic
from torch.utils import _pytree as pytree

from bubo.options import current_options

__all__ = ["KernelStore", "kernel_store"]

log = logging.getLogger(__name__)

_STALE_SECONDS = 7 * 24 * 3600


class _Undescribable(Exception):
    """A value whose content a name can't capture: the kernel is not stored."""


def _describe(value: Any) -> Any:
    """`value` as plain data that determines it: what a closure contributes to a kernel's name."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, enum.Enum):
        return (type(value).__qualname__, value.name)
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, tuple | list):
        return [_describe(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [(f.name, _describe(getattr(value, f.name))) for f in dataclasses.fields(value)]
        return (type(value).__module__, type(value).__qualname__, fields)
    if isinstance(value, types.FunctionType) and value.__module__.startswith("bubo."):
        cells = [_describe(cell.cell_contents) for cell in value.__closure__ or ()]
        defaults = _describe(value.__defaults__)
        keywords = _describe(sorted((value.__kwdefaults__ or {}).items()))
        return (value.__module__, value.__qualname__, cells, defaults, keywords)
    raise _Undescribable(type(value).__qualname__)


def _source_hash() -> str:
    """A hash of every Python file of the bubo package: a stored kernel is of this code only."""
    digest = hashlib.sha256()
    root = Path(__file__).parents[1]
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# Taken as the package is imported (~3 ms), not at the first kernel: source edited while a process
# runs would otherwise name the kernels of the code it loaded before.
_SOURCE = _source_hash()


@functools.cache
def _machine() -> tuple:
    """What the generated code depends on besides the graph and Bubo's options: torch, the vector ISA
    inductor picked, inductor's settings from the environment."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("TORCHINDUCTOR_"))
    return (torch.__version__, str(pick_vec_isa()), settings)


class KernelStore:
    """Compiled kernels under `root`, one directory per version of Bubo's source."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._pruned = False
        self._said_unwritable = False

    def name(
        self, fn: Callable[..., Any], layout: tuple, options: dict, args: tuple[torch.Tensor, ...]
    ) -> str | None:
        """The name of `fn` compiled with `options` for arguments laid out as `layout`, or None where it
        can't be named (a function from outside Bubo, a closure of other things, arguments off the CPU)."""
        if any(a.device.type != "cpu" for a in args):
            return None
        try:
            described = _describe(fn)  # refuses a function from outside Bubo, as anything it can't name
        except _Undescribable as error:
            log.debug("%s is not stored: it is or holds a %s", fn.__qualname__, error)
            return None
        # Bubo's options too: one read while tracing (bf16 prefill) would otherwise go unseen.
        runtime = current_options().changed(kernel_cache="")
        text = repr((described, layout, sorted(options.items()), runtime, _machine()))
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def load(self, name: str, options: dict) -> tuple[CompiledArtifact, pytree.TreeSpec] | None:
        """The kernel stored as `name` and the structure of its outputs (a loaded artifact returns them as
        a flat list), or None where there is none or it won't load (then removed)."""
        artifact, outputs = self._paths(name)
        if not (artifact.is_file() and outputs.is_file()):
            return None
        try:
            spec = pytree.treespec_loads(json.loads(outputs.read_text())["outputs"])
            # The artifact holds the generated source; its compiled library is found in inductor's
            # cache by a hash that covers the compiler flags these options set (FMA contraction):
            # loaded without them, every fused kernel would be built again, and differently.
            with torch._inductor.config.patch(options):
                compiled = torch._inductor.CompiledArtifact.load(path=str(artifact), format="binary")
        except Exception as error:  # another torch, a file cut short: compile it again
            log.warning("stored kernel %s did not load (%s); compiling it again", name, error)
            artifact.unlink(missing_ok=True)
            outputs.unlink(missing_ok=True)
            return None
        return compiled, spec

    def save(self, name: str, artifact: CompiledArtifact, outputs: pytree.TreeSpec) -> None:
        """Keep inductor's `artifact`, whose graph's outputs are structured as `outputs`, as `name`; a store
        that can't be written is skipped."""
        artifact_path, outputs_path = self._paths(name)
        try:
            outputs_path.parent.mkdir(parents=True, exist_ok=True)
            self._prune()
            write_atomic(str(outputs_path), json.dumps({"outputs": pytree.treespec_dumps(outputs)}))
            artifact.save(path=str(artifact_path), format="binary")
        except Exception as error:  # a read-only or full disk, an artifact inductor can't serialize
            level = logging.DEBUG if self._said_unwritable else logging.WARNING
            log.log(level, "compiled kernel %s not stored in %s (%s)", name, self.root, error)
            self._said_unwritable = True

    def _paths(self, name: str) -> tuple[Path, Path]:
        directory = self.root / _SOURCE
        return directory / f"{name}.bin", directory / f"{name}.json"

    def _prune(self) -> None:
        """Remove, once a process, the directories of other source versions untouched for a week."""
        if self._pruned:
            return
        self._pruned = True
        now = time.time()
        for directory in self.root.iterdir():
            if directory.name != _SOURCE and now - directory.stat().st_mtime > _STALE_SECONDS:
                shutil.rmtree(directory, ignore_errors=True)


def kernel_store() -> KernelStore | None:
    """The process's store (`RuntimeOptions.kernel_cache`, --kernel-cache), or None where it is off."""
    return _store_at(current_options().kernel_cache)


@functools.cache
def _store_at(setting: str) -> KernelStore | None:
    if setting == "off":
        return None
    if setting:
        return KernelStore(Path(setting))
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return KernelStore(Path(cache_dir()) / "bubo-kernels")
