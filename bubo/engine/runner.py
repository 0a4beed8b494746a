"""The runner: the one place that decides which path each kind of step of a model takes, and says why.

A model's steps run one of three ways: eager (the Decoder's own forward, op by op), compiled (on the
CPU: `CompiledDecodeStep`, bubo/engine/compiled_decode.py) or captured (on CUDA: `GraphDecodeStep`, a
CUDA graph of the decode step, bubo/engine/graph_decode.py). The kinds of step are a prompt's prefill, a
decode step of one sequence, a batch of several sequences' decode steps (`--parallel`), and a
speculative round's verify pass. Which path a kind takes follows from the model (its device, compute
dtype, weight layouts and layer kinds), the runtime options (bubo/options.py), and for one step the cache
(one sequence, and no recurrent-state snapshot wanted inside the step). Everything that runs steps (the
generation loop, the batcher, speculative decoding, the load) asks the model's `Runner` here, and
`Runner.plan` reports the choice per kind with its reason: `bubo serve` and `bubo generate --stats`
print it at load.
"""

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Literal

import torch

from bubo.engine.compiled_decode import CompiledDecodeStep, UnsupportedModelError
from bubo.engine.graph_decode import (
    GraphDecodeStep,
    UnsupportedGraphModelError,
    masked_attention,
    paged_attention,
)
from bubo.engine.thread_governor import ThreadGovernor
from bubo.kernels.int8_matvec import matvec_plan
from bubo.kernels.triton_support import triton_enabled
from bubo.model.decoder import Decoder
from bubo.model.quantized_linear import MATVEC_ROWS, has_packed_weights
from bubo.model.state import KVCache
from bubo.model.tensor_parallel import SHARDED_REASON, shard_of
from bubo.model.trace import TRACED_REASON, is_traced
from bubo.options import current_options

__all__ = ["PathChoice", "Plan", "Runner", "runner_for"]

log = logging.getLogger(__name__)

# Prompts (or uncached prompt suffixes: a chat's new turn) of up to this many tokens go through the
# compiled decode step one token at a time instead of one eager forward pass: the eager pass pays a fixed
# cost of op dispatch before its matvecs (and past MATVEC_ROWS tokens unpacks every weight for GEMMs);
# benchmarks/bench_short_prefill.py measures where the two cross.
SHORT_PROMPT_TOKENS = 8

Path = Literal["eager", "compiled", "cuda-graph"]


@dataclass(frozen=True)
class PathChoice:
    """How one kind of step runs, and why."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


@dataclass(frozen=True)
class Plan:
    """The path of each kind of step for one model."""

    architecture: str
    device: str
    prefill: PathChoice
    decode: PathChoice
    batch: PathChoice
    verify: PathChoice
    matvecs: str = ""  # on the CPU: which quantized matvecs run (bubo/kernels/int8_matvec.py)

    def lines(self) -> list[str]:
        lines = [
            f"plan for {self.architecture} on {self.device}:",
            f"  prefill: {self.prefill}",
            f"  decode:  {self.decode}",
            f"  batch:   {self.batch}",
            f"  verify:  {self.verify}",
        ]
        return [*lines, f"  matvecs: {self.matvecs}"] if self.matvecs else lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


class Runner:
    """Builds a model's fast step once and hands it out for each step it covers (None: run eagerly).
    The options are read at each choice, so turning a path off takes effect at the next step."""

    def __init__(self, model: Decoder) -> None:
        self._model = weakref.ref(model)
        # The fast step once built, or why the model has none; None: not tried yet.
        self._fast: CompiledDecodeStep | GraphDecodeStep | str | None = None
        # Whether its weights were repacked for the compiled matvecs (fixed at load; a walk of every module).
        self._packed: bool | None = None
        self._governor: ThreadGovernor | None = None

    @property
    def model(self) -> Decoder:
        model = self._model()
        if model is None:
            raise ReferenceError("the model of this runner was freed")
        return model

    # Building

    def _why_eager(self) -> str:
        """Why the model decodes eagerly now, or "" when its fast step runs."""
        model, options = self.model, current_options()
        if is_traced(model):
            # The fast steps run the layers' math outside the modules, where no hook sees it.
            return TRACED_REASON
        if shard_of(model) is not None:
            return SHARDED_REASON
        if model.device.type == "cpu" and not options.compile_decode:
            return "compiled decode turned off by --no-compile-decode"
        if model.device.type == "cuda" and not options.cuda_graphs:
            return "CUDA graphs turned off by --no-cuda-graphs"
        if model.device.type not in ("cpu", "cuda"):
            return f"no fast step on {model.device.type}"
        if model.device.type == "cpu" and not self._has_packed_weights():
            # Only repacked weights make the eager step slow (small float models run it in
            # microseconds): not worth a compile, which the many tiny test models would each pay.
            return "no repacked quantized weights: the eager step is already cheap"
        fast = self._build()
        return fast if isinstance(fast, str) else ""

    def _has_packed_weights(self) -> bool:
        if self._packed is None:
            self._packed = has_packed_weights(self.model)
        return self._packed

    def _build(self) -> CompiledDecodeStep | GraphDecodeStep | str:
        """The model's fast step (the compiled step on a CPU, the captured one on CUDA), built once, or
        why it has none."""
        if self._fast is None:
            model = self.model
            try:
                if model.device.type == "cpu":
                    self._fast = CompiledDecodeStep(model)
                else:
                    attend = paged_attention if triton_enabled(model.device) else masked_attention
                    self._fast = GraphDecodeStep(model, attend)
            except (UnsupportedModelError, UnsupportedGraphModelError) as reason:
                kind = "compiled" if model.device.type == "cpu" else "captured"
                self._fast = f"the {kind} step does not cover it: {reason}"
                log.info("decoding %s eagerly: %s", model.config.architecture, reason)
        return self._fast

    def _compiled(self) -> CompiledDecodeStep | None:
        # No reason to run eagerly means the fast step was built (`_why_eager` built it).
        return self._fast if not self._why_eager() and isinstance(self._fast, CompiledDecodeStep) else None

    def _graph(self) -> GraphDecodeStep | None:
        return self._fast if not self._why_eager() and isinstance(self._fast, GraphDecodeStep) else None

    def prepare(self) -> None:
        """Build the model's fast step and compile it now (seconds to a minute on a cold inductor cache)
        rather than on a first request; where the model decodes eagerly on the CPU, run one eager step so
        that what it compiles on first use (a narrower cache's attention kernel, a mixture of experts'
        one-token graph) is compiled now too."""
        model = self.model
        compiled = self._compiled()
        if compiled is not None:
            started = time.perf_counter()
            compiled.warm_up()
            log.info("compiled decode step ready in %.1f s", time.perf_counter() - started)
        elif model.device.type == "cpu" and (
            model.cache_dtypes != (model.dtype, model.dtype) or self._has_packed_weights()
        ):
            with torch.inference_mode():
                model(torch.zeros(1, 1, dtype=torch.long, device=model.device), model.new_cache(max_len=2))

    def prepare_passes(self, tokens: int) -> None:
        """`prepare`, with the compiled step's passes of 2 .. `tokens` tokens of one sequence compiled too
        (a verify pass), where the model has one. Run it on the thread that will run the passes
        (bubo/engine/compute_threads.py)."""
        compiled = self._compiled()
        if compiled is not None:
            compiled.warm_up()
            for count in range(2, tokens + 1):
                compiled.warm_up(count)

    def prepare_batches(self, rows: int) -> None:
        """`prepare`, with the compiled step's batched passes of 2 .. `rows` sequences compiled too, where
        the model has one that batches; on the thread that will run them, as `prepare_passes`."""
        compiled = self._compiled()
        if compiled is not None:
            compiled.warm_up()
            if compiled.model.supports_cache_batch:
                for count in range(2, rows + 1):
                    compiled.warm_up_batch(count)

    # Choosing

    @property
    def governor(self) -> ThreadGovernor | None:
        """The thread governor of the thread that runs this model's steps, on a CPU with several threads
        and adaptive threads on (bubo/engine/thread_governor.py); None: steps run as they are."""
        model = self.model
        if model.device.type != "cpu" or not current_options().adaptive_threads:
            return None
        if self._governor is None:
            self._governor = ThreadGovernor(torch.get_num_threads())
        return self._governor

    def decode_step(self, cache: object) -> CompiledDecodeStep | None:
        """The compiled step for a step of `cache` (also a few tokens of a verify pass, or a short
        prompt), or None: run it eagerly. It needs one sequence's KVCache with no recurrent-state
        snapshot wanted inside the step (the prompt cache's turn ends, a rollback point)."""
        return self._compiled() if _one_sequence(cache) else None

    def graph_step(self, cache: object) -> GraphDecodeStep | None:
        """The captured CUDA step for the next token of `cache`, or None (same conditions as
        `decode_step`)."""
        return self._graph() if _one_sequence(cache) else None

    def prefill_step(self, cache: object, tokens: int, images: bool) -> CompiledDecodeStep | None:
        """The compiled step to run a prompt of `tokens` tokens through one token at a time, or None:
        one eager forward pass (long prompts, prompts with images)."""
        if images or tokens > SHORT_PROMPT_TOKENS:
            return None
        return self.decode_step(cache)

    def verify_step(self, cache: object, needs_hidden: bool) -> CompiledDecodeStep | None:
        """The compiled step for a speculative round's verify pass, or None: eager. A drafter that reads
        the model's hidden states (the MTP block) needs the eager pass, which returns them."""
        return None if needs_hidden else self.decode_step(cache)

    def batch_steps(self, caches: list[object]) -> CompiledDecodeStep | None:
        """The compiled step to run one token of each of `caches` as the rows of one pass, or None: one
        eager batched pass over a CacheBatch."""
        if not caches or len(caches) > MATVEC_ROWS or not all(_one_sequence(c) for c in caches):
            return None
        compiled = self._compiled()
        return compiled if compiled is not None and compiled.model.supports_cache_batch else None

    # Reporting

    @property
    def plan(self) -> Plan:
        model = self.model
        why_eager = self._why_eager()
        if not why_eager and model.device.type == "cpu":
            decode = PathChoice("compiled", "each layer's forward traced into one inductor graph")
            batch = PathChoice("compiled", f"up to {MATVEC_ROWS} sequences as the rows of one pass")
            verify = PathChoice("compiled", "one pass over a round's tokens; eager for an MTP drafter")
            prefill = PathChoice(
                "eager", f"chunked prompt passes; prompts of up to {SHORT_PROMPT_TOKENS} tokens compiled"
            )
        elif not why_eager:
            decode = PathChoice("cuda-graph", "captured on a cache's first token, replayed after")
            batch = PathChoice("eager", "a batched pass over the sequences' caches")
            verify = PathChoice("eager", "the captured step runs one token")
            prefill = PathChoice("eager", "chunked prompt passes")
        elif why_eager == TRACED_REASON:
            decode = batch = verify = prefill = PathChoice("eager", why_eager)
        else:
            decode = PathChoice("eager", why_eager)
            batch = PathChoice("eager", "a batched pass over the sequences' caches")
            verify = PathChoice("eager", "one pass over a round's tokens")
            prefill = PathChoice("eager", "chunked prompt passes")
        recurrent = any(getattr(layer.attention, "deltanet", None) is not None for layer in model.layers)
        if recurrent and not why_eager:
            decode = PathChoice(decode.path, decode.reason + "; eager where a snapshot falls in the step")
        matvecs = matvec_plan() if model.device.type == "cpu" else ""
        return Plan(model.config.architecture, model.device.type, prefill, decode, batch, verify, matvecs)


def _one_sequence(cache: object) -> bool:
    return isinstance(cache, KVCache) and cache.batch == 1 and not cache.snapshot_at


_runners: "weakref.WeakKeyDictionary[torch.nn.Module, Runner]" = weakref.WeakKeyDictionary()


def runner_for(model: object) -> Runner:
    """The runner of `model` (one per model; made on first use). Anything that isn't a Decoder (a
    batching wrapper, a test double of the Model protocol) gets the runner that always says eager."""
    if not isinstance(model, Decoder):
        return _EAGER
    runner = _runners.get(model)
    if runner is None:
        runner = _runners[model] = Runner(model)
    return runner


class _EagerRunner(Runner):
    """For models without fast steps (a batching wrapper, test doubles of the Model protocol): every
    step eager, and no thread governor (a batching wrapper's steps run, and are governed, on the
    batcher's compute thread). It holds no model: one serves them all."""

    def __init__(self) -> None:
        """Holds no model, so `Runner`'s state is never set: every choice stops at `_why_eager`."""

    @property
    def governor(self) -> ThreadGovernor | None:
        return None

    def _why_eager(self) -> str:
        return "not a Decoder"

    def prepare(self) -> None:
        return None

    @property
    def plan(self) -> Plan:
        eager = PathChoice("eager", self._why_eager())
        return Plan("a stand-in model", "cpu", eager, eager, eager, eager)


_EAGER = _EagerRunner()
