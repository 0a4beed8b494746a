"""benchmarks/run.py --quick on the tiny llama: every engine measured or reported skipped, JSON and PNG written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("prefill_tps", "decode_tps", "ttft_s", "peak_rss_mb")


def test_quick_run_writes_the_comparison(tiny_llama_path: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/run.py"),
            "--quick",
            "--model",
            str(tiny_llama_path),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
    assert set(report["engines"]) == {"bubo", "llama.cpp", "transformers", "transformers-bf16"}
    bubo = report["engines"]["bubo"]
    assert all(bubo[key] > 0 for key in FIGURES)
    assert len(bubo["runs"]) == 1
    for figures in report["engines"].values():
        assert "skipped" in figures or all(figures[key] > 0 for key in FIGURES)
    assert report["weight_bytes"] == sum(int(t.n_bytes) for t in gguf.GGUFReader(tiny_llama_path).tensors)
    assert report["memory_bandwidth_gb_s"] > 0
    assert report["decode_limit_tps"] == pytest.approx(
        report["memory_bandwidth_gb_s"] * 1e9 / report["weight_bytes"]
    )
    assert "bandwidth limit" in proc.stdout and "bubo" in proc.stdout
