"""The compiled CPU decode step (bubo/engine/compiled_decode.py) against the eager decoder it replaces:
the same greedy tokens, logits within float32 rounding, on the tiny test models (float weights, and
quantized weights repacked for the matvecs) and on the default model through `generate`."""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import LlamaConfig, LlamaForCausalLM

from bubo.engine import compiled_decode
from bubo.engine.compiled_decode import CompiledDecodeStep
from bubo.engine.generate import (
    GenerationResult,
    TextDelta,
    TokenLogprob,
    generate,
)
from bubo.engine.loaded_model import LoadedModel
from bubo.engine.request import Finished, GenerationRequest
from bubo.engine.runner import SHORT_PROMPT_TOKENS, runner_for
from bubo.engine.sampler import SamplingParams
from bubo.engine.slot_pool import SlotPool
from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.kernels.compiled import _Kernel
from bubo.model import quantized_linear
from bubo.model.decoder import Decoder
from bubo.model.loader import load_decoder
from bubo.model.state import KVCache
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.fixtures.hybrid_models import tiny_hybrid
from tests.fixtures.qwen4exp_gguf import write_qwen4exp_gguf
from tests.model.test_decoder import CASES

# Float32 rounding: the compiled graphs fuse and reorder the same float32 operations.
LOGIT_TOLERANCE = 1e-4
STEPS = 8


@pytest.fixture(autouse=True)
def _every_graph_compiles(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A graph inductor could not build runs as the plain layer, which matches the eager step trivially:
    every comparison here would pass while testing nothing (the DeltaNet layers did, for a cache made
    inside `torch.inference_mode()`)."""
    yield
    assert "could not compile" not in caplog.text


# Every matrix Q4_0, Q5_0, Q5_1 or Q8_0 (packed once the threshold allows it: PackedQ4, PackedQ8 and
# PackedQ8Offset), one float: no row groups. The down projection's format differs between the layers (as
# a Q4_K_M file's: Q4_K or Q6_K), so the two layers trace to two graphs.
_MIXED = {
    "token_embd.weight": Q.Q8_0,
    "output.weight": Q.Q8_0,
    "blk.*.attn_q.weight": Q.Q4_0,
    "blk.*.attn_k.weight": Q.Q5_0,
    "blk.*.attn_v.weight": Q.F16,
    "blk.*.attn_output.weight": Q.Q5_1,
    "blk.*.ffn_gate.weight": Q.Q4_0,
    "blk.*.ffn_up.weight": Q.Q4_0,
    "blk.0.ffn_down.weight": Q.Q4_0,
    "blk.*.ffn_down.weight": Q.Q8_0,
}


def _model(name: str, path: Path, quantize: dict | None = None) -> Decoder:
    reference = CASES[name]()
    randomize_(reference, seed=5)
    file = GGUFFile(write_gguf(reference, path, quantize=quantize))
    return load_decoder(file, config_from_gguf(file), dtype=torch.float32)


@torch.inference_mode()
def _compare(
    model: Decoder,
    step: CompiledDecodeStep,
    cache: KVCache | None = None,
    rtol: float = 0.0,
    prompt: torch.Tensor | None = None,
) -> None:
    """Prefill the same prompt into two caches, then decode greedily: eagerly in one, compiled in the other,
    the logits within LOGIT_TOLERANCE plus `rtol` of the largest."""
    prompt = torch.tensor([[3, 17, 42, 7, 99]]) if prompt is None else prompt
    max_len = prompt.shape[1] + STEPS
    eager_cache = model.new_cache(max_len=max_len)
    compiled_cache = cache if cache is not None else model.new_cache(max_len=max_len)
    eager = model(prompt, eager_cache, last_only=True)[0, -1]
    compiled = model(prompt, compiled_cache, last_only=True)[0, -1]
    for _ in range(STEPS):
        token, other = eager.argmax(), compiled.argmax()
        assert int(token) == int(other)
        eager = model(token.view(1, 1), eager_cache)[0, -1]
        compiled = step(other, compiled_cache)
        assert compiled.dtype == torch.float32 and compiled.shape == eager.shape
        assert (compiled - eager).abs().max().item() <= LOGIT_TOLERANCE + rtol * eager.abs().max().item()
    assert compiled_cache.length == eager_cache.length == prompt.shape[1] + STEPS


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-bias", "qwen3-qk-norm"])
def test_float_models_match_the_eager_step(name: str, tmp_path: Path) -> None:
    model = _model(name, tmp_path / f"{name}.gguf")
    _compare(model, CompiledDecodeStep(model))


def test_packed_quantized_projections_match_the_eager_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tiny model's matrices are below the packing threshold; lowered, they take the matvec path.
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    model = _model("qwen2-bias", tmp_path / "mixed.gguf", quantize=_MIXED)
    q_proj = model.layers[0].attention.q_proj
    assert isinstance(q_proj, quantized_linear.QuantizedLinear) and q_proj.packed is not None
    assert [type(layer.mlp.down.packed).__name__ for layer in model.layers] == ["PackedQ4", "PackedQ8"]
    _compare(model, CompiledDecodeStep(model))


# Every super-block type (random blocks: gguf's numpy code can't quantize to K-quants), q|k|v and gate|up
# grouped, the down projections of the two layers in two types.
_SUPER_BLOCKS = {
    "output.weight": Q.Q6_K,
    "blk.*.attn_[qkv].weight": Q.Q4_K,
    "blk.*.attn_output.weight": Q.Q5_K,
    "blk.*.ffn_gate.weight": Q.Q2_K,
    "blk.*.ffn_up.weight": Q.Q2_K,
    "blk.0.ffn_down.weight": Q.Q3_K,
    "blk.*.ffn_down.weight": Q.IQ4_XS,
}


def test_super_block_projections_match_the_eager_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    sizes = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 300}
    reference = LlamaForCausalLM(
        LlamaConfig(**sizes, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    )
    randomize_(reference, seed=5)  # the embedding and norms (the matrices are random blocks)
    file = GGUFFile(write_gguf(reference, tmp_path / "k.gguf", random_blocks=_SUPER_BLOCKS))
    model = load_decoder(file, config_from_gguf(file), dtype=torch.float32)
    attention, mlp = model.layers[0].attention, model.layers[0].mlp
    assert attention.q_proj.group is not None and mlp.gate.group is not None
    assert [layer.mlp.down.packed.ggml_type for layer in model.layers] == [Q.Q3_K, Q.IQ4_XS]
    # Random blocks make logits of ~1e3 out of sums that mostly cancel: float32 sums in another order
    # differ by 2e-7 to 1e-6 of the largest logit over 8 steps (seeds 0-9; transformers' own initialisation
    # instead of randomize_'s reached 3e-5); a wrong format, tensor or bias would be off by the logits' size.
    _compare(model, CompiledDecodeStep(model), rtol=1e-4)


def test_half_precision_cache_matches_the_eager_step(tmp_path: Path) -> None:
    """A float16 cache (`--cache-type-k/-v f16`, the server's default): the compiled step writes the new
    keys and values narrowed and reads them widened, as the eager decoder does."""
    model = _model("qwen3-qk-norm", tmp_path / "qwen3.gguf")
    model.cache_dtypes = (torch.float16, torch.float16)
    cache = model.new_cache(max_len=32)
    assert cache.pool.keys[0].dtype == cache.pool.values[0].dtype == torch.float16
    _compare(model, CompiledDecodeStep(model), cache)


def test_blocks_that_are_not_one_run(tmp_path: Path) -> None:
    """A cache whose blocks are scattered over a shared pool reads its keys by gathering them."""
    model = _model("llama-tied", tmp_path / "llama.gguf")
    pool = model.new_block_pool(64, block_size=2)
    held = [pool.take() for _ in range(pool.num_blocks)]
    pool.release(held[1::2])  # the cache can only get every other block
    cache = model.new_cache(max_len=32, pool=pool)
    assert cache.reserve(8)
    assert any(b + 1 != c for b, c in zip(cache.tables[0], cache.tables[0][1:], strict=False))
    _compare(model, CompiledDecodeStep(model), cache)


@pytest.mark.parametrize("name", ["llama-tied", "qwen3-qk-norm"])
def test_several_tokens_in_one_step_match_the_eager_pass(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify pass: T tokens at the cache's next positions in one compiled pass give the logits the
    eager decoder gives for them, each position seeing those before it; packed matvecs over T rows."""
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    model = _model(name, tmp_path / f"{name}.gguf", quantize=_MIXED if name == "llama-tied" else None)
    step = CompiledDecodeStep(model)
    prompt = torch.tensor([[3, 17, 42, 7, 99]])
    eager_cache, compiled_cache = model.new_cache(max_len=32), model.new_cache(max_len=32)
    with torch.inference_mode():
        model(prompt, eager_cache, last_only=True)
        model(prompt, compiled_cache, last_only=True)
        for tokens in ([5, 61, 2, 88], [9, 4], [70, 31, 8, 6]):
            expected = model(torch.tensor([tokens]), eager_cache)[0]
            got = step(torch.tensor(tokens), compiled_cache)
            assert got.shape == expected.shape and got.dtype == torch.float32
            assert (got - expected).abs().max().item() <= LOGIT_TOLERANCE
            assert compiled_cache.length == eager_cache.length
        # A rejected draft: the cache is cut back and the next pass writes over the rejected positions.
        eager_cache.truncate(eager_cache.length - 3)
        compiled_cache.truncate(compiled_cache.length - 3)
        expected = model(torch.tensor([[12, 13]]), eager_cache)[0]
        got = step(torch.tensor([12, 13]), compiled_cache)
        assert (got - expected).abs().max().item() <= LOGIT_TOLERANCE


def _compare_batch(
    model: Decoder, step: CompiledDecodeStep, caches: list[KVCache] | None = None, rtol: float = 0.0
) -> None:
    """`batch` over sequences of different lengths against each sequence's own eager steps, within
    LOGIT_TOLERANCE plus `rtol` of the largest logit."""
    prompts = ([3, 17, 42], [8, 1, 5, 66, 9, 12, 30], [7])
    caches = caches or [model.new_cache(max_len=16) for _ in prompts]
    alone = [model.new_cache(max_len=16) for _ in prompts]
    with torch.inference_mode():
        for prompt, a, b in zip(prompts, caches, alone, strict=True):
            model(torch.tensor([prompt]), a, last_only=True)
            model(torch.tensor([prompt]), b, last_only=True)
        for tokens in ([4, 5, 6], [70, 2, 11]):
            got = step.batch(torch.tensor(tokens), caches)
            expected = torch.stack(
                [model(torch.tensor([[t]]), c)[0, -1] for t, c in zip(tokens, alone, strict=True)]
            )
            assert got.shape == expected.shape
            assert (got - expected).abs().max().item() <= LOGIT_TOLERANCE + rtol * expected.abs().max().item()
    assert [c.length for c in caches] == [c.length for c in alone] == [len(p) + 2 for p in prompts]


def test_several_sequences_in_one_step_match_their_own_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`batch`: the next token of several sequences as the rows of one pass, each at its own position
    over its own cache (one of them over scattered blocks), gives each the logits of its own step."""
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    model = _model("qwen3-qk-norm", tmp_path / "qwen3.gguf", quantize={"blk.*": Q.Q4_0})
    step = CompiledDecodeStep(model)
    pool = model.new_block_pool(64, block_size=2)
    held = [pool.take() for _ in range(pool.num_blocks)]
    pool.release(held[1::2])
    caches = [model.new_cache(max_len=16) for _ in range(2)] + [model.new_cache(max_len=16, pool=pool)]
    _compare_batch(model, step, caches)


# A hybrid's DeltaNet input projections, gated attention and feed-forwards packed (Q8_0 once the threshold
# is lowered), the rest float (ssm_out's value-head reorder needs whole blocks of its 16 columns).
_HYBRID_Q = {
    pattern: Q.Q8_0
    for pattern in (
        "blk.*.attn_[qkv].weight",
        "blk.*.attn_output.weight",
        "blk.*.attn_qkv.weight",
        "blk.*.attn_gate.weight",
        "blk.*.ffn_*.weight",
    )
}


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "qwen3next"])
def test_hybrid_models_match_the_eager_step(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hybrid models: DeltaNet layers (their recurrent and convolution states updated in place by the
    graph), gated attention, and for the MoE ones routed experts with a gated shared expert. On the int8
    matvecs (the default): their activations turn the graph's last-bit float differences into whole steps
    of their grid now and then (seen: one logit of qwen3next's second batched step 0.039 off, 1.3% of the
    largest), so logits are held within 2% of the largest and the greedy tokens must agree at every step;
    a wrong state update is off by the logits' own size. (On the float matvecs they agree within 1e-4 of
    the largest, but compiling the float expert and projection graphs took 18 minutes of a 2-core VM.)"""
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    reference = tiny_hybrid(arch, ["linear_attention", "full_attention", "linear_attention"])
    randomize_(reference, seed=1)
    file = GGUFFile(write_gguf(reference, tmp_path / "hybrid.gguf", quantize=_HYBRID_Q))
    model = load_decoder(file, config_from_gguf(file), dtype=torch.float32)
    step = CompiledDecodeStep(model)
    _compare(model, step, rtol=2e-2)
    _compare_batch(model, step, rtol=2e-2)
    # A verify pass's few tokens (the DeltaNet layers' chunked rule, traced for that count).
    eager_cache, compiled_cache = model.new_cache(max_len=16), model.new_cache(max_len=16)
    with torch.inference_mode():
        for cache in (eager_cache, compiled_cache):
            model(torch.tensor([[3, 17, 42, 7]]), cache, last_only=True)
        expected = model(torch.tensor([[5, 61, 2]]), eager_cache)[0]
        got = step(torch.tensor([5, 61, 2]), compiled_cache)
    assert (got - expected).abs().max().item() <= LOGIT_TOLERANCE + 2e-2 * expected.abs().max().item()


class _ScaledNorm(torch.nn.Module):
    """A test double of a layer's RMSNorm whose math differs (an extra scale and its own epsilon)."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = 0.25

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1.5 * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def scale_the_feed_forward_norms(model: Decoder, prompt: torch.Tensor) -> None:
    """Put a `_ScaledNorm` in place of every layer's norm before its feed-forward, after checking that it
    changes the eager forward's logits of `prompt` (else the tests using it would prove nothing)."""
    with torch.inference_mode():
        before = model(prompt, model.new_cache(max_len=prompt.shape[1]))[0, -1]
        for layer in model.layers:
            layer.ffn_norm = _ScaledNorm(layer.ffn_norm)
        after = model(prompt, model.new_cache(max_len=prompt.shape[1]))[0, -1]
    assert (after - before).abs().max().item() > 1e-2


def test_the_step_runs_the_layers_own_math(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One forward: the compiled step traces each layer's own modules, so a change to a piece of a
    layer's math (here every layer's norm before its feed-forward) changes the compiled step's logits
    exactly as the eager forward's."""
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    model = _model("qwen3-qk-norm", tmp_path / "qwen3.gguf", quantize={"blk.*": Q.Q8_0})
    scale_the_feed_forward_norms(model, torch.tensor([[3, 17, 42]]))
    _compare(model, CompiledDecodeStep(model))


def _greedy(loaded: LoadedModel, prompt: str, tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    events = generate(loaded.model, loaded.tokenizer, loaded.tokenizer.encode(prompt), params)
    result = list(events)[-1]
    assert isinstance(result, GenerationResult)
    return result.token_ids


def test_default_model_generates_the_same_tokens(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch, runtime_options
) -> None:
    """The default model's projections are packed: `generate` decodes it compiled, token for token as
    the eager decoder does. On the float matvecs: int8 activations round the last-bit differences between
    the graph's and the eager ops' norms into whole steps of their grid, and the two decodes then part
    after a dozen tokens (the hybrids' compiled steps are compared with them on)."""
    runtime_options(int8_matvec=False)
    assert runner_for(smollm2.model).decode_step(smollm2.model.new_cache(max_len=8)) is not None
    compiled = _greedy(smollm2, "The capital of France is", 24)
    runtime_options(compile_decode=False)
    assert runner_for(smollm2.model).decode_step(smollm2.model.new_cache(max_len=8)) is None
    eager = _greedy(smollm2, "The capital of France is", 24)
    assert compiled == eager
    assert smollm2.tokenizer.decode(compiled).startswith(" Paris")


def test_default_model_logits_match_the_eager_step(smollm2: LoadedModel, runtime_options) -> None:
    runtime_options(int8_matvec=False)  # as above
    step = runner_for(smollm2.model).decode_step(smollm2.model.new_cache(max_len=8))
    assert step is not None
    _compare(smollm2.model, step)


@pytest.fixture
def step_calls(monkeypatch: pytest.MonkeyPatch) -> list[KVCache]:
    """The cache of every compiled decode step run while the test runs, in order (a batch's caches
    together, as one entry)."""
    calls: list = []
    call, batch = CompiledDecodeStep.__call__, CompiledDecodeStep.batch

    def counted(self: CompiledDecodeStep, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        calls.append(cache)
        return call(self, token, cache)

    def counted_batch(self: CompiledDecodeStep, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        calls.append(tuple(caches))
        return batch(self, tokens, caches)

    monkeypatch.setattr(CompiledDecodeStep, "__call__", counted)
    monkeypatch.setattr(CompiledDecodeStep, "batch", counted_batch)
    return calls


def test_short_prompts_prefill_through_the_compiled_step(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch, step_calls: list[KVCache], runtime_options
) -> None:
    """A prompt of up to SHORT_PROMPT_TOKENS runs one compiled step per token (the eager forward costs
    more for so few), a longer one the eager forward; the first token's log probability is the eager
    prefill's either way (on the float matvecs, as above)."""
    runtime_options(int8_matvec=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def first_token(ids: list[int]) -> TokenLogprob:
        events = generate(smollm2.model, smollm2.tokenizer, ids, params, logprobs=0)
        (logprob,) = [p for event in events if isinstance(event, TextDelta) for p in event.logprobs]
        return logprob

    short = smollm2.tokenizer.encode("The capital of France is")
    long = smollm2.tokenizer.encode(" and".join(["The capital of France is Paris"] * 4))
    assert len(short) <= SHORT_PROMPT_TOKENS < len(long)
    stepped = first_token(short)
    assert len(step_calls) == len(short)
    first_token(long)
    assert len(step_calls) == len(short)
    runtime_options(compile_decode=False)
    eager = first_token(short)
    assert stepped.token_id == eager.token_id
    assert abs(stepped.logprob - eager.logprob) <= LOGIT_TOLERANCE


def test_parallel_slots_decode_through_the_compiled_step(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch, step_calls: list[KVCache], runtime_options
) -> None:
    """With several slots (`--parallel`) the decode steps run compiled, the sequences' tokens as the rows
    of one pass, and every stream gets the tokens it gets alone; with compiling off they run as one
    batched eager pass."""
    prompts = [
        " and".join(["The capital of France is Paris"] * 3),
        " and".join(["A good recipe for bread starts with flour"] * 3),
    ]  # longer than SHORT_PROMPT_TOKENS: their prefills are eager, only the decode steps count
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def serve(parallel: int, texts: list[str]) -> tuple[list[list[int]], SlotPool]:
        pool = SlotPool(smollm2.model, smollm2.tokenizer, 256, parallel=parallel)
        step_calls.clear()  # the batcher's warm-up passes (`prepare`)

        async def one(text: str) -> list[int]:
            ids = smollm2.tokenizer.encode(text)
            async for event in pool.run(GenerationRequest("t", text, ids, params, cache_prompt=False)):
                if isinstance(event, Finished):
                    return list(event.result.token_ids)
            raise AssertionError("no result")

        return list(await asyncio.gather(*(one(t) for t in texts))), pool

    alone = [asyncio.run(serve(1, [text]))[0][0] for text in prompts]
    together, pool = asyncio.run(serve(2, prompts))
    assert together == alone
    # Every decode step of both streams, compiled; mostly together (one runs alone while the other's
    # prompt is computed).
    batches = [c for c in step_calls if isinstance(c, tuple)]
    assert sum(len(c) if isinstance(c, tuple) else 1 for c in step_calls) == 2 * (params.max_tokens - 1)
    assert len(batches) >= params.max_tokens // 2 and all(len(c) == 2 for c in batches)
    assert pool.batcher is not None and pool.batcher.steps == len(batches)
    runtime_options(compile_decode=False)
    batched, pool = asyncio.run(serve(2, prompts))
    assert pool.batcher is not None and pool.batcher.steps > 0
    assert [ids[:4] for ids in batched] == [ids[:4] for ids in alone]


def test_a_slot_pool_compiles_its_batched_passes_up_front(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`SlotPool(parallel=N)` compiles the step's passes of 2 .. N sequences (rows [n, 1], other kernels
    than a verify pass's [1, n]) before any request: the first burst of requests doesn't wait for inductor."""
    SlotPool(smollm2.model, smollm2.tokenizer, 64, parallel=3)
    compiled: list[object] = []
    compile_kernel = _Kernel._compile

    def counted(self: _Kernel, args: tuple[torch.Tensor, ...]) -> object:
        compiled.append(self)
        return compile_kernel(self, args)

    monkeypatch.setattr(_Kernel, "_compile", counted)
    model = smollm2.model
    with torch.inference_mode():
        for rows in (2, 3):
            caches = [model.new_cache(max_len=8) for _ in range(rows)]
            step = runner_for(model).batch_steps(caches)
            assert step is not None
            step.batch(torch.arange(rows), caches)
    assert compiled == []


def _moe_model(path: Path) -> Decoder:
    from tests.model.test_moe import PACKED_EXPERTS_Q, _reference

    file = GGUFFile(write_gguf(_reference(), path, quantize=PACKED_EXPERTS_Q))
    return load_decoder(file, config_from_gguf(file), dtype=torch.float32)


def test_mixture_of_experts_matches_the_eager_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen3moe with packed expert stacks: each token's routed experts are gathered from the stacks inside
    the layer's own graph (the routed-experts op never runs), a token at a time and a verify pass's rows."""
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)

    def unexpected(*args: object) -> torch.Tensor:
        raise AssertionError("packed experts went through the routed-experts op")

    monkeypatch.setattr(compiled_decode._StepOps, "routed_experts", unexpected)
    model = _moe_model(tmp_path / "moe.gguf")
    step = CompiledDecodeStep(model)
    _compare(model, step)
    prompt = torch.tensor([[3, 17, 42, 7, 99]])
    eager_cache, compiled_cache = model.new_cache(max_len=32), model.new_cache(max_len=32)
    with torch.inference_mode():
        model(prompt, eager_cache, last_only=True)
        model(prompt, compiled_cache, last_only=True)
        for tokens in ([5, 61, 2, 88], [9, 4]):
            expected = model(torch.tensor([tokens]), eager_cache)[0]
            got = step(torch.tensor(tokens), compiled_cache)
            assert (got - expected).abs().max().item() <= LOGIT_TOLERANCE


def test_experts_not_repacked_match_the_eager_step(tmp_path: Path) -> None:
    """The tiny model's experts are below the packing threshold: the routed-experts op runs the module's
    loop over blocks dequantized per call."""
    model = _moe_model(tmp_path / "moe.gguf")
    _compare(model, CompiledDecodeStep(model))


def test_qwen4exp_matches_the_eager_step(tmp_path: Path) -> None:
    """qwen4exp: hyper-connected layers, DeltaNet and QSA mixers (the latter run eagerly inside the graph),
    the PLE layer's history updated by its graph, routed experts; the QSA budget is passed during the
    steps, so the indexer selects."""
    from tests.model.test_qwen4exp import _load, _reference

    model = _load(write_qwen4exp_gguf(_reference(), tmp_path / "qwen4exp.gguf"))
    step = CompiledDecodeStep(model)
    # Past 8 blocks of 4 (the tiny config's budget): the indexer selects blocks at every step.
    _compare(model, step, prompt=torch.arange(3, 43)[None])
    assert runner_for(model).batch_steps([model.new_cache(max_len=8), model.new_cache(max_len=8)]) is None


def test_step_inputs_graph_embeds_as_the_eager_model(smollm2: LoadedModel) -> None:
    # The step's inputs (token embeddings, rotary angles) run as one compiled graph; the quantized
    # table's rows come out bit for bit as the eager embedding's (gguf's dequantizer), for one token and
    # for a batch's rows at their own positions.
    model = smollm2.model
    assert isinstance(model.embedding, quantized_linear.QuantizedEmbedding)
    step = runner_for(model).decode_step(model.new_cache(max_len=2))
    assert step is not None
    for tokens, positions in (
        (torch.tensor([[17]]), torch.tensor([5])),
        (torch.tensor([[3], [900], [41]]), torch.tensor([[0], [7], [130]])),
    ):
        with torch.inference_mode():
            got = step.run_inputs(tokens, positions)
            expected = model.inputs(tokens, positions)
        assert torch.equal(got[0], expected[0])
        for a, b in zip(got[1:], expected[1:], strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not step._inputs._broken  # compiled, not the plain function
