"""benchmarks/bench_decode_step.py --breakdown: the compiled decode step's parts timed where they run,
the step's results untouched by the timers, and the engine left as it was."""

import contextlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from bubo.engine import compiled_decode
from bubo.engine.compiled_decode import CompiledDecodeStep
from bubo.engine.loaded_model import LoadedModel
from bubo.engine.runner import runner_for
from bubo.model import quantized_linear
from bubo.model.decoder import Decoder
from tests.engine.test_compiled_decode import _moe_model

ROOT = Path(__file__).resolve().parents[2]
DENSE_PARTS = {"inputs", "layer graphs", "attention", "KV cache writes", "output head"}


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_decode_step", ROOT / "benchmarks/bench_decode_step.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@torch.inference_mode()
def _steps(model: Decoder, step: CompiledDecodeStep, bench: ModuleType | None) -> tuple[list, dict]:
    """Logits of 3 greedy steps after a short prompt, and the parts' [seconds, calls] when `bench` times
    them (else empty)."""
    cache = model.new_cache(max_len=16)
    model(torch.tensor([[3, 17, 42, 7]]), cache, last_only=True)
    token, logits = torch.tensor(5), []
    with bench.timed_parts(step) if bench is not None else contextlib.nullcontext({}) as totals:
        for _ in range(3):
            logits.append(step(token, cache))
            token = logits[-1].argmax()
    return logits, totals


def _originals() -> list:
    return [
        CompiledDecodeStep.run_layer,
        CompiledDecodeStep.attention,
        compiled_decode._store,
        compiled_decode._StepOps.routed_experts,
        CompiledDecodeStep.run_inputs,
        CompiledDecodeStep.head,
    ]


def test_breakdown_times_every_part_of_the_default_model_step(
    smollm2: LoadedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    bench, model = _bench(), smollm2.model
    step = runner_for(model).decode_step(model.new_cache(max_len=2))
    assert step is not None
    originals = _originals()
    expected, _ = _steps(model, step, None)
    got, totals = _steps(model, step, bench)
    assert _originals() == originals  # every wrapper taken off again
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert set(totals) == DENSE_PARTS and all(seconds > 0 for seconds, _ in totals.values())
    layers = len(model.layers)
    # A step: the inputs' graph, each layer's graph with its attention and cache write inside, then the
    # head's graph.
    calls = {"inputs": 3, "layer graphs": 3 * layers, "output head": 3, "attention": 3 * layers}
    assert {part: totals[part][1] for part in calls} == calls
    assert totals["KV cache writes"][1] == 3 * layers

    cache = model.new_cache(max_len=8)
    with torch.inference_mode():
        bench.print_breakdown(step, lambda token: step(token, cache), 2)
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:22].strip(): [float(v.rstrip("%")) for v in line[22:].split()] for line in lines[1:]}
    assert set(rows) == DENSE_PARTS | {"rest", "step"}
    ms = {part: row[0] for part, row in rows.items()}
    assert sum(v for part, v in ms.items() if part != "step") == pytest.approx(ms["step"], abs=0.02)
    assert rows["step"][1:] == [100.0, 1] and rows["attention"][2] == len(model.layers)


def test_breakdown_times_the_routed_experts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime_options: Callable[..., None]
) -> None:
    """Experts left in the file's blocks (--no-pack-experts) run through the step's routed-experts op,
    which the breakdown times apart (packed ones are gathered inside the layer's graph)."""
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    runtime_options(pack_experts=False)
    model = _moe_model(tmp_path / "moe.gguf")
    step = CompiledDecodeStep(model)
    expected, _ = _steps(model, step, None)
    got, totals = _steps(model, step, _bench())
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert set(totals) == DENSE_PARTS | {"routed experts"} and totals["routed experts"][0] > 0
    layers = len(model.layers)
    # A step: each layer's graph, its routed experts run inside it, then the output head.
    calls = {"layer graphs": 3 * layers, "output head": 3, "routed experts": 3 * layers}
    assert {part: totals[part][1] for part in calls} == calls
