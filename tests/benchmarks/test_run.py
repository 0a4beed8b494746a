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
    # What a decoded token reads: every tensor but the embedding table, which has an output head beside it.
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(tiny_llama_path).tensors}
    assert "output.weight" in tensors
    assert report["weight_bytes"] == sum(tensors.values()) - tensors["token_embd.weight"]
    assert report["memory_bandwidth_gb_s"] > 0
    assert report["decode_limit_tps"] == pytest.approx(
        report["memory_bandwidth_gb_s"] * 1e9 / report["weight_bytes"]
    )
    assert "bandwidth limit" in proc.stdout and "bubo" in proc.stdout


SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))

# `python benchmarks/SCRIPT --help` for every script, in one process: sys.path[0] the script's folder as
# Python sets it, the script run as __main__, what it exits with (or the traceback) recorded. Separate
# processes would each import torch and Bubo again, seconds apiece, minutes for the lot.
_HELP_ALL = """
import json, os, runpy, sys, traceback
out, scripts = sys.argv[1], sys.argv[2:]
results = {}
for path in scripts:
    sys.argv, sys.path[0] = [path, "--help"], os.path.dirname(path)
    try:
        runpy.run_path(path, run_name="__main__")
        results[path] = "ok"
    except SystemExit as exit:
        results[path] = "ok" if exit.code in (0, None) else f"exit status {exit.code}"
    except BaseException:
        results[path] = traceback.format_exc()
with open(out, "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def help_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("help") / "results.json"
    paths = [str(ROOT / "benchmarks" / script) for script in SCRIPTS]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _HELP_ALL, str(out), *paths],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {Path(path).name: result for path, result in json.loads(out.read_text()).items()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_script_starts(help_results: dict[str, str], script: str) -> None:
    """Each script imports what it uses and parses its options (`--help`): a renamed helper in a shared
    module (bench_hybrid.py imported bench_generate's `_spawn` after it became `run_engine`) fails here
    rather than on the next person's measurement."""
    assert help_results[script] == "ok", help_results[script]


def test_bandwidth_limit_counts_the_routed_experts_only(tmp_path: Path) -> None:
    from tests.fixtures.gguf_writer import write_gguf
    from tests.model.test_moe import _reference

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from run import weight_bytes
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    reference = _reference()
    path = write_gguf(reference, tmp_path / "moe.gguf")
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    experts = sum(n for name, n in tensors.items() if "_exps." in name)
    others = sum(n for name, n in tensors.items() if "_exps." not in name and name != "token_embd.weight")
    share = reference.config.num_experts_per_tok / reference.config.num_experts
    assert experts > 0 and share == 2 / 8
    assert weight_bytes(path) == int(others + experts * share)
