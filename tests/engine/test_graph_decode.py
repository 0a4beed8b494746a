"""The static decode step (bubo/engine/graph_decode.py) against the eager decoder: the same logits over
many steps, across block boundaries, on scattered and shared pools, with tokens sampled on the device;
traced whole by torch.compile(fullgraph=True) (the CPU proof that nothing in it reads back to the host,
which a `.item()` would break); the capture wrapper's buffer updates and fallback with the capture
injected; and, with CUDA, the real CUDA-graph capture and replay."""

import gc
import logging
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.utils._pytree as pytree
from gguf import GGMLQuantizationType as Q
from torch._dynamo.backends.registry import lookup_backend
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._python_dispatch import TorchDispatchMode

from bubo.engine import graph_decode
from bubo.engine.generate import GenerationResult, generate
from bubo.engine.graph_decode import (
    GraphDecodeStep,
    StepInputs,
    UnsupportedGraphModelError,
    check_supported,
    masked_attention,
    paged_attention,
    static_decode_step,
)
from bubo.engine.runner import runner_for
from bubo.engine.sampler import Sampler, SamplingParams
from bubo.engine.token_choice import TokenChooser
from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model import moe
from bubo.model.decoder import Decoder
from bubo.model.loader import load_decoder
from bubo.model.state import KVCache
from bubo.model.step_ops import layer_in_compiled_step
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.fixtures.hybrid_models import tiny_hybrid
from tests.model.test_decoder import CASES

# Float32 rounding: the static step attends over the whole padded table under a mask (the softmax sums
# run over more, zero-weighted, terms in another order) where the eager step attends over the length.
LOGIT_TOLERANCE = 1e-4
PROMPT = torch.tensor([[3, 17, 42, 7, 99]])
# Past two block boundaries of the 4-position blocks used here.
STEPS = 12
BLOCK_SIZE = 4

Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(name: str, path: Path, device: str = "cpu", quantize: dict | None = None) -> Decoder:
    reference = CASES[name]()
    randomize_(reference, seed=5)
    file = GGUFFile(write_gguf(reference, path, quantize=quantize))
    return load_decoder(file, config_from_gguf(file), dtype=torch.float32, device=device)


def _run_as_is(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A capture that runs the step as `capture_cuda_graph`'s warm-up does, then replays by running it
    again: what a graph replay computes."""
    for _ in range(graph_decode.WARM_UP_RUNS):
        run()
    return run


def _without_host_reads(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """A dynamo backend that refuses a graph reading a device value back to the host: a `.item()` or
    `.tolist()` (dynamo keeps them in the graph, as values of unbacked symbols) or an op whose output
    shape depends on values (nonzero, unique: unbacked sizes, where every shape is otherwise static);
    else runs the graph through AOT autograd (functionalised, like a compile would)."""
    for node in graph.graph.nodes:
        if node.op == "call_method" and node.target in ("item", "tolist"):
            raise AssertionError(f"a host read in the step: {node.format_node()}")
        symbolic = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)
        values = [v for v in pytree.tree_leaves(node.meta.get("example_value")) if isinstance(v, symbolic)]
        if any(free_unbacked_symbols(v) for v in values):
            raise AssertionError(f"a value read back from the device in the step: {node.format_node()}")
    return lookup_backend("aot_eager")(graph, example_inputs)


def _compiled_whole(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A capture by dynamo: the whole step must be one graph (fullgraph: a Python branch on a tensor's
    value raises) of fixed shapes with no host read in it."""
    return torch.compile(run, fullgraph=True, dynamic=False, backend=_without_host_reads)


def _cache(model: Decoder, max_len: int = 32) -> KVCache:
    return model.new_cache(max_len=max_len, pool=model.new_block_pool(64, block_size=BLOCK_SIZE))


def _sampling_chooser(model: Decoder) -> TokenChooser:
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    vocab = model.config.vocab_size
    return TokenChooser(Sampler(params, vocab_size=vocab, device=model.device, history=PROMPT[0].tolist()))


@torch.inference_mode()
def _compare(
    model: Decoder,
    step: Callable[[torch.Tensor, KVCache], torch.Tensor],
    cache: KVCache,
    sample: bool,
    steps: int = STEPS,
) -> int:
    """Prefill the prompt into `cache` and an eager one, then decode `steps` tokens chosen on the device
    from the step's logits (sampled, or greedy) and fed to both. Returns how many distinct tokens ran."""
    eager_cache = model.new_cache(max_len=cache.max_len)
    eager = model(PROMPT, eager_cache, last_only=True)[0, -1]
    logits = model(PROMPT, cache, last_only=True)[0, -1]
    chooser = _sampling_chooser(model) if sample else None
    tokens = set()
    for _ in range(steps):
        token = chooser.pick_on_device(logits)[1] if chooser is not None else logits.argmax()
        assert token.device == model.device
        tokens.add(int(token))
        eager = model(token.view(1, 1), eager_cache)[0, -1]
        logits = step(token, cache)
        assert logits.dtype == torch.float32 and logits.shape == eager.shape
        assert (logits - eager).abs().max().item() <= LOGIT_TOLERANCE
    assert cache.length == eager_cache.length == PROMPT.shape[1] + steps
    return len(tokens)


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-bias", "qwen3-qk-norm"])
def test_static_step_matches_the_eager_step(name: str, tmp_path: Path) -> None:
    model = _model(name, tmp_path / f"{name}.gguf")
    step = GraphDecodeStep(model, masked_attention, capture=_run_as_is)
    assert _compare(model, step, _cache(model), sample=True) > 1


def test_static_step_over_a_float16_cache(tmp_path: Path) -> None:
    """`bubo serve`'s default float16 KV cache: the static step writes the new keys and values narrowed
    and attends over them widened, as the eager decoder does."""
    model = _model("qwen3-qk-norm", tmp_path / "qwen3.gguf")
    model.cache_dtypes = (torch.float16, torch.float16)
    cache = _cache(model)
    assert cache.pool.keys[0].dtype == cache.pool.values[0].dtype == torch.float16
    step = GraphDecodeStep(model, masked_attention, capture=_run_as_is)
    assert _compare(model, step, cache, sample=True) > 1


_QUANTIZED = {"blk.*.attn_q.weight": Q.Q4_0, "blk.*.ffn_down.weight": Q.Q8_0, "output.weight": Q.Q8_0}


def test_quantized_weights(tmp_path: Path) -> None:
    """QuantizedLinear's own forward in the step, watched for host reads."""
    model = _model("qwen2-bias", tmp_path / "quantized.gguf", quantize=_QUANTIZED)
    _compare(model, GraphDecodeStep(model, masked_attention, capture=_watched), _cache(model), sample=False)


def test_scattered_blocks_and_a_second_cache_on_the_same_pool(tmp_path: Path) -> None:
    """Blocks that are not one run; then another cache of the same pool (a server's next slot) and one
    of another pool: one capture per cache, replayed for all of its steps."""
    model = _model("llama-tied", tmp_path / "llama.gguf")
    pool = model.new_block_pool(128, block_size=2)
    held = [pool.take() for _ in range(pool.num_blocks)]
    pool.release(held[1::2])  # the caches can only get every other block
    captures = []

    def counted(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        captures.append(run)
        return run

    step = GraphDecodeStep(model, masked_attention, capture=counted)
    first = model.new_cache(max_len=24, pool=pool)
    assert first.reserve(8)
    assert any(b + 1 != c for b, c in zip(first.tables[0], first.tables[0][1:], strict=False))
    _compare(model, step, first, sample=False)
    assert len(captures) == 1 and step.captured(first)
    second = model.new_cache(max_len=24, pool=pool)
    _compare(model, step, second, sample=True)
    assert len(captures) == 2 and step.captured(second)
    _compare(model, step, _cache(model), sample=False)
    assert len(captures) == 3


def test_step_traces_as_one_graph_of_static_shapes(tmp_path: Path) -> None:
    """The CPU proof of capture safety: dynamo traces the whole step as one graph (fullgraph: a host
    read or value-dependent branch would raise) and never recompiles as the position, length and table
    change; the compiled step still matches the eager one."""
    model = _model("qwen3-qk-norm", tmp_path / "qwen3.gguf")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        step = GraphDecodeStep(model, masked_attention, capture=_compiled_whole)
        _compare(model, step, _cache(model), sample=True)


class _HostReadWatch(TorchDispatchMode):
    """Raises on every op run under it that hands a device value to the host (`.item()`, `int()`,
    `bool()` of a tensor, a Python branch on one) or sizes its output by the values (nonzero, unique,
    masked_select, bincount): the ops a CUDA graph capture refuses. `.tolist()` reads CPU memory
    without an op, so it is patched to raise while the watch is on."""

    READS = frozenset(
        {
            torch.ops.aten._local_scalar_dense,
            torch.ops.aten.item,  # what inference mode dispatches in its place
            torch.ops.aten.is_nonzero,
            torch.ops.aten.nonzero,
            torch.ops.aten._unique2,
            torch.ops.aten.unique_dim,
            torch.ops.aten.unique_consecutive,
            torch.ops.aten.masked_select,
            torch.ops.aten.bincount,
        }
    )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.READS:
            raise AssertionError(f"a host read in the step: {func}")
        return func(*args, **(kwargs or {}))


def _watched(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`_run_as_is` with the step run under `_HostReadWatch` every time (the warm-up runs too)."""

    def tolist(self: torch.Tensor) -> list:
        raise AssertionError("a host read in the step: Tensor.tolist")

    def replay() -> torch.Tensor:
        with _HostReadWatch(), mock.patch.object(torch.Tensor, "tolist", tolist):
            return run()

    return _run_as_is(replay)


def test_the_step_reads_nothing_back_while_it_runs(tmp_path: Path) -> None:
    """The same proof at run time, for everything the step executes (a read whose value goes unused
    included, which a trace drops)."""
    model = _model("qwen2-bias", tmp_path / "qwen2.gguf")
    _compare(model, GraphDecodeStep(model, masked_attention, capture=_watched), _cache(model), sample=True)


# Host reads a step might be given, each feeding a Python number into the step's output (one that is
# never used: a trace drops it, the watch still sees it run).
def _item(x: torch.Tensor) -> float:
    return x.item()


def _tolist(x: torch.Tensor) -> float:
    return x.tolist()[0]


def _branch(x: torch.Tensor) -> float:
    return 1.0 if x > 3 else 2.0


def _nonzero(x: torch.Tensor) -> float:
    return x.nonzero().shape[0]


def _unused_item(x: torch.Tensor) -> float:
    x.item()
    return 1.0


def _step_with_a_host_read(
    model: Decoder, sync: Callable[[torch.Tensor], float], capture: Capture
) -> Callable[[], torch.Tensor]:
    """The static step of `model` (after a prompt) with `sync` of the length added to its attention, as
    `capture` makes it runnable."""
    cache = _cache(model)

    def attend_with_sync(*args: object) -> torch.Tensor:
        inputs = args[3]
        assert isinstance(inputs, StepInputs)
        return masked_attention(*args) * sync(inputs.length)  # type: ignore[arg-type]

    model(PROMPT, cache)
    assert cache.reserve(1)
    inputs = StepInputs.allocate(cache.pool.num_blocks, model.device)
    inputs.load(torch.tensor(5), cache)
    with layer_in_compiled_step():
        captured = capture(
            lambda: static_decode_step(model, cache.pool, cache.recurrent, inputs, attend_with_sync)
        )

    def run() -> torch.Tensor:
        with layer_in_compiled_step():  # as GraphDecodeStep runs its captured step
            return captured()

    return run


SYNCS = [_item, _tolist, _branch, _nonzero]


@pytest.mark.parametrize("sync", SYNCS, ids=lambda f: f.__name__.strip("_"))
@torch.inference_mode()
def test_a_host_read_in_the_step_fails_the_trace(
    sync: Callable[[torch.Tensor], float], tmp_path: Path
) -> None:
    torch._dynamo.reset()
    traced = _step_with_a_host_read(_model("llama-tied", tmp_path / "llama.gguf"), sync, _compiled_whole)
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed)):
        traced()


@pytest.mark.parametrize("sync", [*SYNCS, _unused_item], ids=lambda f: f.__name__.strip("_"))
@torch.inference_mode()
def test_a_host_read_in_the_step_fails_the_watch(
    sync: Callable[[torch.Tensor], float], tmp_path: Path
) -> None:
    model = _model("llama-tied", tmp_path / "llama.gguf")
    with pytest.raises(AssertionError, match="a host read in the step"):
        _step_with_a_host_read(model, sync, _watched)()


def test_inputs_are_loaded_in_place(tmp_path: Path) -> None:
    """A graph reads its inputs' addresses: `load` must update the same tensors, never rebind them."""
    model = _model("llama-tied", tmp_path / "llama.gguf")
    cache = _cache(model)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4, 5, 6]]), cache)
    cache.rope_delta = 3
    assert cache.reserve(1)
    inputs = StepInputs.allocate(cache.pool.num_blocks, model.device)
    addresses = [
        t.data_ptr() for t in (inputs.token, inputs.position, inputs.length, inputs.slot, inputs.table)
    ]
    inputs.load(torch.tensor(9), cache)
    table = cache.tables[0]
    assert [
        t.data_ptr() for t in (inputs.token, inputs.position, inputs.length, inputs.slot, inputs.table)
    ] == (addresses)
    assert (int(inputs.token), int(inputs.position), int(inputs.length)) == (9, 6 + 3, 7)
    assert int(inputs.slot) == table[6 // BLOCK_SIZE] * BLOCK_SIZE + 6 % BLOCK_SIZE
    assert inputs.table[0].tolist() == table + [0] * (cache.pool.num_blocks - len(table))


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_a_failed_capture_decodes_eagerly_and_warns_once(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The capture fails after its warm-up runs (which advanced a hybrid's DeltaNet states): the token
    is decoded eagerly from the states as they were, and every later one too, with one warning."""
    model = _model("llama-tied", tmp_path / "llama.gguf") if kind == "dense" else _hybrid(tmp_path / "h.gguf")
    attempts = []

    def failing(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        attempts.append(run)
        _run_as_is(run)
        raise RuntimeError("operation not permitted when stream is capturing")

    step = GraphDecodeStep(model, masked_attention, capture=failing)
    with caplog.at_level(logging.WARNING, logger=graph_decode.__name__):
        _compare(model, step, _cache(model), sample=False)
    assert len(attempts) == 1 and step.failed
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "decoding eagerly" in caplog.records[0].getMessage()


def test_triton_paged_attention_in_the_step(tmp_path: Path) -> None:
    """The attention CUDA runs (the paged kernel, lengths and table on the device), here in Triton's
    interpreter on CPU tensors."""
    pytest.importorskip("triton")
    from bubo.kernels.triton_quant import interpreting

    if not interpreting():
        pytest.skip("a CPU model runs the Triton kernels only in triton's interpreter (TRITON_INTERPRET=1)")
    model = _model("qwen2-bias", tmp_path / "qwen2.gguf")
    _compare(model, GraphDecodeStep(model, paged_attention, capture=_run_as_is), _cache(model), sample=True)


def test_a_step_does_not_keep_its_model_alive(tmp_path: Path) -> None:
    """`graph_step_for` keys its steps weakly by model: a step (and its captured graph) holding the
    model would keep a replaced model's weights allocated for the life of the process."""
    model = _model("llama-tied", tmp_path / "llama.gguf")
    step = GraphDecodeStep(model, masked_attention, capture=_run_as_is)
    _compare(model, step, _cache(model), sample=False)
    freed = weakref.ref(model)
    del model
    gc.collect()
    assert freed() is None
    with pytest.raises(ReferenceError):
        _ = step.model


def _moe_model(path: Path, quantize: dict | None, device: str = "cpu") -> Decoder:
    from tests.model.test_moe import _reference

    file = GGUFFile(write_gguf(_reference(), path, quantize=quantize))
    return load_decoder(file, config_from_gguf(file), dtype=torch.float32, device=device)


def test_mixture_of_experts_in_the_fused_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen3moe with quantized experts in the fused Triton MoE kernel, which takes one token's routed
    expert ids on the device (run here by triton's interpreter, the eager step through it too)."""
    pytest.importorskip("triton")
    from bubo.kernels.triton_quant import interpreting
    from tests.model.test_moe import _EXPERTS_Q

    if not interpreting():
        pytest.skip("a CPU model runs the Triton kernels only in triton's interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setattr(moe, "triton_enabled", lambda device: True)
    monkeypatch.setattr(graph_decode, "triton_enabled", lambda device: True)
    model = _moe_model(tmp_path / "moe-q.gguf", _EXPERTS_Q)
    # Few steps: the interpreter takes seconds a step.
    step = GraphDecodeStep(model, masked_attention, capture=_run_as_is)
    _compare(model, step, _cache(model), sample=False, steps=3)


def _hybrid(path: Path, arch: str = "qwen35", quantize: dict | None = None, device: str = "cpu") -> Decoder:
    reference = tiny_hybrid(arch, ["linear_attention", "full_attention", "linear_attention"])
    randomize_(reference, seed=1)
    file = GGUFFile(write_gguf(reference, path, quantize=quantize))
    return load_decoder(file, config_from_gguf(file), dtype=torch.float32, device=device)


def test_hybrid_deltanet_and_gated_attention(tmp_path: Path) -> None:
    """A hybrid model: DeltaNet layers advance the cache's recurrent states in place, the gated
    attention layer writes the pool; watched for host reads."""
    model = _hybrid(tmp_path / "hybrid.gguf")
    step = GraphDecodeStep(model, masked_attention, capture=_watched)
    _compare(model, step, _cache(model), sample=True)


def test_hybrid_traces_as_one_graph(tmp_path: Path) -> None:
    model = _hybrid(tmp_path / "hybrid.gguf")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        step = GraphDecodeStep(model, masked_attention, capture=_compiled_whole)
        _compare(model, step, _cache(model), sample=False, steps=6)


def test_models_the_step_does_not_cover(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedGraphModelError):
        check_supported(torch.nn.Linear(2, 2))
    # Experts in the host loop (float, or not on CUDA) read the routed ids back.
    with pytest.raises(UnsupportedGraphModelError, match="SparseMoE"):
        check_supported(_moe_model(tmp_path / "moe.gguf", None))


def test_graph_steps_are_for_cuda_models_and_can_be_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime_options
) -> None:
    model = _model("llama-tied", tmp_path / "llama.gguf")
    assert (
        runner_for(model).graph_step(model.new_cache(max_len=8)) is None
    )  # a CPU model has its compiled step
    assert runner_for(model).plan.decode.path == "eager"


def _greedy_tokens(model: Decoder, count: int) -> list[int]:
    tokenizer = _Bytes()
    params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)
    result = list(generate(model, tokenizer, PROMPT[0].tolist(), params))[-1]
    assert isinstance(result, GenerationResult)
    return result.token_ids


class _Bytes:
    """Token i is the byte i % 256."""

    stop_ids: frozenset[int] = frozenset()

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id % 256])

    def is_special(self, token_id: int) -> bool:
        return False


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(params=["float", "quantized"])
def cuda_model(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Decoder]:
    """A tiny qwen3 on CUDA: float weights (torch matmuls), or some quantized (the Triton GEMV kernels)."""
    quantize = _QUANTIZED if request.param == "quantized" else None
    yield _model("qwen3-qk-norm", tmp_path / "qwen3.gguf", device="cuda", quantize=quantize)
    torch.cuda.synchronize()


@cuda
def test_cuda_graph_replay_matches_eager(cuda_model: Decoder) -> None:
    """Captured once, then replayed with every later token's inputs loaded; the replays (and the loads
    before them) under CUDA's sync debug mode, which raises on any synchronising call."""
    step = runner_for(cuda_model).graph_step(_cache(cuda_model))
    assert step is not None

    def strict(token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if not step.captured(cache):
            return step(token, cache)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(token, cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    _compare(cuda_model, strict, _cache(cuda_model), sample=True)
    assert not step.failed


@cuda
def test_cuda_graph_replay_over_a_float16_cache(tmp_path: Path) -> None:
    """The server's default float16 KV cache under a float32 model on CUDA: the Triton paged kernel reads
    the narrowed pool inside the captured graph."""
    model = _model("qwen3-qk-norm", tmp_path / "qwen3.gguf", device="cuda")
    model.cache_dtypes = (torch.float16, torch.float16)
    step = runner_for(model).graph_step(_cache(model))
    assert step is not None
    _compare(model, step, _cache(model), sample=True)
    assert not step.failed


@cuda
def test_cuda_graph_replay_with_fused_experts(tmp_path: Path) -> None:
    from tests.model.test_moe import _EXPERTS_Q

    model = _moe_model(tmp_path / "moe-q.gguf", _EXPERTS_Q, device="cuda")
    step = runner_for(model).graph_step(_cache(model))
    assert step is not None
    _compare(model, step, _cache(model), sample=True)
    assert not step.failed


@cuda
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_cuda_graph_replay_hybrid(arch: str, tmp_path: Path) -> None:
    """DeltaNet layers (the fused recurrent kernel), gated attention and, for qwen35moe, quantized
    experts in the fused MoE kernel: the flagship's layer kinds at toy size."""
    from tests.model.test_moe import _EXPERTS_Q

    model = _hybrid(tmp_path / f"{arch}.gguf", arch, _EXPERTS_Q if arch == "qwen35moe" else None, "cuda")
    step = runner_for(model).graph_step(_cache(model))
    assert step is not None
    _compare(model, step, _cache(model), sample=True)
    assert not step.failed


@cuda
def test_cuda_generate_with_and_without_graphs(
    cuda_model: Decoder, monkeypatch: pytest.MonkeyPatch, runtime_options
) -> None:
    graphed = _greedy_tokens(cuda_model, STEPS)
    runtime_options(cuda_graphs=False)
    assert _greedy_tokens(cuda_model, STEPS) == graphed


def test_the_step_runs_the_layers_own_math(tmp_path: Path) -> None:
    """One forward: the captured step is the model's own forward, so a test double of a piece of a layer's
    math (every layer's norm before its feed-forward, the compiled step's test uses the same) changes its
    logits exactly as the eager forward's."""
    from tests.engine.test_compiled_decode import scale_the_feed_forward_norms

    model = _model("qwen3-qk-norm", tmp_path / "qwen3.gguf")
    scale_the_feed_forward_norms(model, PROMPT)
    _compare(model, GraphDecodeStep(model, masked_attention, capture=_run_as_is), _cache(model), sample=False)
