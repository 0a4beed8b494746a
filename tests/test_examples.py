"""The examples/ scripts run as a user runs them, on the default model (loaded once for the session)."""

import runpy
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

import bubo
from bubo.api import Model
from bubo.engine.loaded_model import LoadedModel

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_logit_lens_prints_each_layers_guess(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The session's model stands in for the script's own load (and outlives the script's `with`).
    monkeypatch.setattr(bubo, "load", lambda path=None: Model(smollm2))
    monkeypatch.setattr(Model, "close", lambda self: None)
    monkeypatch.setattr(
        sys, "argv", ["logit_lens.py", "--prompt", "The capital of France is", "--top-k", "2"]
    )
    runpy.run_path(str(EXAMPLES / "logit_lens.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("logit lens of SmolLM2-135M-Instruct")
    rows = lines[1:]
    assert [row.split()[1] for row in rows] == [str(i) for i in range(smollm2.config.num_layers)]
    # Early layers guess punctuation; the last one the answer, as the model itself does.
    assert "' Paris'" in rows[-1].split("%")[0]
    assert "' Paris'" not in rows[0]


def _run_example(name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [name, *argv])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")


def test_router_heatmap_draws_each_layers_routing(
    tiny_moe_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "routing.png"
    argv = ["--model", str(tiny_moe_path), "--out", str(out), "--max-tokens", "4", "--cell", "10"]
    _run_example("router_heatmap.py", argv, monkeypatch)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(f"-> {out} (2 x 8)")
    shares = [[float(cell.rstrip("%")) for cell in line.split()[3::2]] for line in lines[1:]]
    assert len(shares) == 2 and all(row == sorted(row, reverse=True) for row in shares)
    busiest = [int(line.split()[2]) for line in lines[1:]]
    with Image.open(out) as image:
        assert image.height == 18 + 2 * 10
        # The hottest cell of the map, the busiest expert of the layer with the largest share, is yellow.
        top = max(range(2), key=lambda r: shares[r][0])
        assert image.getpixel((90 + busiest[top] * 10 + 5, 18 + top * 10 + 5)) == (253, 231, 37)
    _run_example("router_heatmap.py", [*argv, "--layer", "1"], monkeypatch)
    per_token = capsys.readouterr().out.splitlines()
    assert per_token[0].startswith("layer 1: router weight per token") and len(per_token) > 5
    # Two experts a token, whose weights add up to 1 (the router renormalises its top-k).
    for row in per_token[1:]:
        weights = [float(cell.rstrip("%")) for cell in row.split()[-3::2]]
        assert len(weights) == 2 and abs(sum(weights) - 100) < 0.2


def test_steering_moves_the_answer_both_ways(
    smollm2: LoadedModel,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    runtime_options: Callable[..., None],
) -> None:
    runtime_options(compile_decode=False)  # the steered answers run eagerly: so does the plain one here
    monkeypatch.setattr(bubo, "load", lambda path=None: Model(smollm2))
    monkeypatch.setattr(Model, "close", lambda self: None)

    _run_example("steering.py", ["--max-tokens", "8"], monkeypatch)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("steering layer 6 of SmolLM2-135M-Instruct")
    answers = {line.split(":")[0]: line.split(":", 1)[1].strip() for line in lines[1:]}
    assert set(answers) == {"plain", "toward", "away"}
    assert all(text.startswith("I think dogs are ") for text in answers.values())
    assert len(set(answers.values())) == 3
