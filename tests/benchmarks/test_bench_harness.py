"""benchmarks/bench_harness.py: without the harnesses it says so and starts nothing; its tasks are
valid lm-eval task files over well-formed data. (The harness run itself needs lm-eval and guidellm,
benchmark-only tools; what they ask of the server is tested in tests/server/test_clients.py.)"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_harness", ROOT / "benchmarks/bench_harness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_missing_harnesses_are_reported_skipped(tmp_path: Path) -> None:
    # A Python without lm_eval or guidellm: the interpreter with no site packages at all.
    bare = [sys.executable, "-S"]
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {" ".join(bare)} "$@"\n')
    wrapper.chmod(0o755)
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bench_harness.py"),
            "--harness-python",
            str(wrapper),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert "skipped" in report["lm_eval"] and "skipped" in report["guidellm"]
    assert "lm_eval: " in proc.stdout


def test_the_tasks_are_lm_eval_task_files_over_their_data(tmp_path: Path) -> None:
    bench = _bench()
    names = bench.write_tasks(tmp_path)
    configs = [yaml.safe_load(path.read_text()) for path in sorted(tmp_path.glob("*.yaml"))]
    assert sorted(c["task"] for c in configs) == sorted(names)
    for config in configs:
        rows = [
            json.loads(line)
            for line in Path(config["dataset_kwargs"]["data_files"]["test"]).read_text().splitlines()
        ]
        assert len(rows) == len(bench.CAPITALS)
        if config["output_type"] == "multiple_choice":
            assert all(
                row["choices"][row["label"]] == capital
                for row, (_, capital) in zip(rows, bench.CAPITALS, strict=True)
            )
            assert all(len(set(row["choices"])) == 4 for row in rows)
