"""The examples/ scripts run as a user runs them, on the default model (loaded once for the session)."""

import runpy
import sys
from pathlib import Path

import pytest

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
