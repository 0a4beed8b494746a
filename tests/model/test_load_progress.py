"""Load progress: periodic lines where there is no terminal, a bar where there is one, and a stage of
unknown length told while it lasts."""

import logging
import time
from pathlib import Path

import pytest
from tqdm import tqdm

from bubo.engine.loaded_model import load_model
from bubo.model.load_progress import LoadProgress


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "bubo.load"]


def test_counted_work_is_a_line_every_interval_and_one_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bubo.load")
    with LoadProgress(bar=False, interval=0.0).counter(4, "weights") as counter:
        for _ in range(4):
            counter.update(1)
    lines = _lines(caplog)
    assert lines[:3] == ["weights: 1/4 (25%)", "weights: 2/4 (50%)", "weights: 3/4 (75%)"]
    assert lines[3].startswith("weights: 4/4 in ") and len(lines) == 4
    caplog.clear()
    with LoadProgress(bar=False, interval=3600).counter(4, "weights") as counter:
        counter.update(4)
    assert [line.split(" in ")[0] for line in _lines(caplog)] == ["weights: 4/4"]


def test_a_terminal_gets_a_bar() -> None:
    with LoadProgress(bar=True).counter(2, "weights") as counter:
        assert isinstance(counter, tqdm)
        counter.update(2)


def test_a_stage_is_told_while_it_lasts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bubo.load")
    with LoadProgress(bar=False, interval=0.05).stage("compiling"):
        time.sleep(0.3)
    lines = _lines(caplog)
    assert lines[0] == "compiling ..." and lines[-1].startswith("compiling: done in ")
    assert any(line.startswith("compiling: still going (") for line in lines[1:-1])


def test_loading_a_model_tells_its_weights_and_its_compiling(
    tiny_llama_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="bubo.load")
    load_model(tiny_llama_path, progress=LoadProgress(bar=False))
    lines = _lines(caplog)
    assert any(line.startswith("loading and repacking weights: ") and " in " in line for line in lines)
    assert any(line.startswith("compiling the decode step") and "done in" in line for line in lines)
