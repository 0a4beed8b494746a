"""The runner (bubo/engine/runner.py) decides each step's path in one place and says why; the runtime
options (bubo/options.py) switch paths, from the command line or the environment."""

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from bubo.cli import _parser, _runtime_options
from bubo.engine.compiled_decode import CompiledDecodeStep
from bubo.engine.loaded_model import LoadedModel
from bubo.engine.runner import SHORT_PROMPT_TOKENS, runner_for
from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model import quantized_linear
from bubo.model.loader import load_decoder
from bubo.model.trace import TRACED_REASON, Trace
from bubo.options import RuntimeOptions
from tests.fixtures.gguf_writer import write_gguf
from tests.fixtures.hybrid_models import tiny_hybrid


def test_default_model_plan_is_compiled(smollm2: LoadedModel, runtime_options) -> None:
    model = smollm2.model
    runner = runner_for(model)
    plan = runner.plan
    assert (plan.decode.path, plan.batch.path, plan.verify.path) == ("compiled", "compiled", "compiled")
    assert "llama on cpu" in str(plan)
    cache = model.new_cache(max_len=16)
    step = runner.decode_step(cache)
    assert isinstance(step, CompiledDecodeStep)
    assert runner.prefill_step(cache, SHORT_PROMPT_TOKENS, images=False) is step
    assert runner.prefill_step(cache, SHORT_PROMPT_TOKENS + 1, images=False) is None
    assert runner.prefill_step(cache, 1, images=True) is None
    assert runner.verify_step(cache, needs_hidden=True) is None
    assert runner.verify_step(cache, needs_hidden=False) is step
    assert runner.batch_steps([cache, model.new_cache(max_len=16)]) is step
    assert runner.batch_steps([model.new_cache(batch=2, max_len=16)]) is None
    cache.snapshot_at = (4,)  # a recurrent-state snapshot wanted inside the step: eager
    assert runner.decode_step(cache) is None
    assert runner.graph_step(model.new_cache(max_len=16)) is None  # a CPU model has no captured step
    # Turned off, every later choice says eager, with the flag as the reason.
    runtime_options(compile_decode=False)
    assert runner.decode_step(model.new_cache(max_len=16)) is None
    assert runner.plan.decode.path == "eager" and "--no-compile-decode" in runner.plan.decode.reason


def test_a_traced_model_runs_every_step_eagerly(smollm2: LoadedModel) -> None:
    """While a trace is active the compiled step (which no module hook sees) is not handed out, and the
    plan says why; after it the model's compiled step is back."""
    model = smollm2.model
    runner = runner_for(model)
    cache = model.new_cache(max_len=16)
    with Trace(model, sites=["residual"], layers=[0]):
        plan = runner.plan
        assert {choice.path for choice in (plan.prefill, plan.decode, plan.batch, plan.verify)} == {"eager"}
        assert plan.decode.reason == plan.prefill.reason == TRACED_REASON
        assert runner.decode_step(cache) is None
        assert runner.prefill_step(cache, 2, images=False) is None
        assert runner.batch_steps([cache]) is None
    assert isinstance(runner.decode_step(cache), CompiledDecodeStep)
    assert runner.plan.decode.path == "compiled"


def test_float_models_decode_eagerly(tiny_llama: LoadedModel) -> None:
    plan = runner_for(tiny_llama.model).plan
    assert plan.decode.path == "eager" and "no repacked" in plan.decode.reason


def test_a_hybrid_decodes_compiled_and_batches_eagerly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid's single-sequence steps run compiled; a batch of its sequences runs eagerly (their
    recurrent states are per sequence), and the plan says so; a step inside which the prompt cache wants a
    snapshot runs eagerly."""
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    reference = tiny_hybrid("qwen35", ["linear_attention", "full_attention"])
    file = GGUFFile(write_gguf(reference, tmp_path / "hybrid.gguf", quantize={"blk.*.ffn_*.weight": Q.Q8_0}))
    model = load_decoder(file, config_from_gguf(file), dtype=torch.float32)
    runner = runner_for(model)
    plan = runner.plan
    assert plan.decode.path == "compiled" and "snapshot" in plan.decode.reason
    assert plan.batch.path == "eager" and "recurrent" in plan.batch.reason
    cache = model.new_cache(max_len=8)
    assert runner.decode_step(cache) is not None
    assert runner.batch_steps([cache, model.new_cache(max_len=8)]) is None
    cache.snapshot_at = (3,)
    assert runner.decode_step(cache) is None


def test_options_from_the_environment() -> None:
    assert RuntimeOptions.from_environment({}) == RuntimeOptions()
    options = RuntimeOptions.from_environment(
        {
            "BUBO_COMPILE_DECODE": "0",
            "BUBO_CUDA_GRAPHS": "0",
            "BUBO_TRITON": "0",
            "BUBO_TRITON_AUTOTUNE": "0",
            "BUBO_PACK_EXPERTS": "0",
            "BUBO_PREFILL_BF16": "1",
            "BUBO_KERNEL_CACHE": "0",
            "BUBO_ADAPTIVE_THREADS": "0",
        }
    )
    assert options == RuntimeOptions(False, False, False, False, False, "on", "off", False)
    assert RuntimeOptions.from_environment({"BUBO_PREFILL_BF16": "0", "BUBO_KERNEL_CACHE": "/k"}) == (
        RuntimeOptions(prefill_bf16="off", kernel_cache="/k")
    )
    with pytest.raises(ValueError, match="prefill_bf16"):
        RuntimeOptions(prefill_bf16="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_option_has_a_flag(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "BUBO_COMPILE_DECODE",
        "BUBO_PREFILL_BF16",
        "BUBO_KERNEL_CACHE",
        "BUBO_PACK_EXPERTS",
        "BUBO_ADAPTIVE_THREADS",
    ):
        monkeypatch.delenv(name, raising=False)
    extra = ["-p", "x"] if command == "generate" else []
    args = _parser().parse_args([command, *extra])
    assert _runtime_options(args) == RuntimeOptions()
    flags = [
        "--no-compile-decode",
        "--no-cuda-graphs",
        "--no-triton",
        "--no-triton-autotune",
        "--no-pack-experts",
        "--prefill-bf16",
        "on",
        "--kernel-cache",
        "off",
        "--no-adaptive-threads",
    ]
    args = _parser().parse_args([command, *extra, *flags])
    assert _runtime_options(args) == RuntimeOptions(False, False, False, False, False, "on", "off", False)
    # A flag changes the environment's options, which stay where no flag is given.
    monkeypatch.setenv("BUBO_PACK_EXPERTS", "0")
    args = _parser().parse_args([command, *extra, "--prefill-bf16", "off"])
    assert _runtime_options(args) == RuntimeOptions(pack_experts=False, prefill_bf16="off")
