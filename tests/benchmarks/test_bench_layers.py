"""benchmarks/bench_layers.py --cpu-small: every layer kind timed, and the bytes it reports per decode
token equal to what the tensor shapes and the UD-Q4_K_XL types add up to."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

ROOT = Path(__file__).resolve().parents[2]
T = GGMLQuantizationType


def _nbytes(rows: int, width: int, kind: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[kind]
    return rows * width // block * size


def test_cpu_small_run_reports_every_kind(tmp_path: Path) -> None:
    out = tmp_path / "layers.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bench_layers.py"),
            "--cpu-small",
            "--prompts",
            "24,40",
            "--decode-steps",
            "2",
            "--layers-per-kind",
            "1",
            "--bandwidth-gbs",
            "10",
            "--json",
            str(out),
            "--profile",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "whole model" in proc.stdout
    report = json.loads(out.read_text())
    assert report["small"] and report["bandwidth_gbs"] == 10
    assert [run["prompt_tokens"] for run in report["runs"]] == [24, 40]
    assert "warm-up pass" in proc.stdout
    for run in report["runs"]:
        # On the CPU the profile sees no device kernels, only the step's wall time.
        assert run["decode_kernels"]["layers"] == 3 and run["decode_kernels"]["wall_s"] > 0
        assert run["decode_kernels"]["kernel_launches"] == 0
        assert set(run["kinds"]) == {"deltanet", "qsa", "attention"}
        for kind in run["kinds"].values():
            assert all(t > 0 for t in (*kind["decode_s"].values(), *kind["prefill_s"].values()))
            assert kind["decode_s"]["layer"] > kind["decode_s"]["mixer"]

        # The tiny sizes (hidden 256; DeltaNet 2 key / 4 value heads of 64; attention 4 heads of 64, 2 KV
        # heads; 8 experts of 64, top 2, a shared one of 64; 4 streams of rank 32; vocab 512), float32.
        h, f4 = 256, 4
        deltanet = run["kinds"]["deltanet"]["bytes_per_token"]
        assert deltanet["mixer_weights"] == (
            _nbytes(512, h, T.Q5_K)  # attn_qkv
            + _nbytes(256, h, T.Q5_K)  # attn_gate
            + _nbytes(h, 256, T.Q6_K)  # ssm_out
            + 2 * 4 * h * f4  # ssm_beta, ssm_alpha
            + 512 * 4 * f4  # ssm_conv1d
            + 2 * 4 * f4  # ssm_a, ssm_dt
            + 64 * f4  # ssm_norm
        )
        assert deltanet["cache"] == 2 * (4 * 64 * 64 * f4 + 512 * 3 * f4)
        expert = _nbytes(64, h, T.Q4_K) * 2 + _nbytes(h, 64, T.Q5_0)
        shared = 2 * _nbytes(64, h, T.Q8_0) + _nbytes(h, 64, T.Q8_0) + h * f4
        assert deltanet["moe_weights"] == 8 * h * f4 + shared + 2 * expert
        hc = 2 * (4 * h * f4 + _nbytes(32, 4 * h, T.Q8_0) + _nbytes(4 * h, 32, T.Q8_0) + 4 * 4 * h * f4)
        assert deltanet["hc_weights"] == hc

        context = run["decode_context"]
        assert context == run["prompt_tokens"] + 3
        assert run["kinds"]["attention"]["bytes_per_token"]["cache"] == 2 * context * 2 * 64 * f4
        # The torch QSA path reads every key and value, plus the indexer's key of each complete block.
        qsa_cache = 2 * context * 2 * 64 * f4 + context // 4 * 32 * f4
        assert run["kinds"]["qsa"]["bytes_per_token"]["cache"] == qsa_cache
        model = run["model"]
        assert model["decode_s_per_token"] == pytest.approx(
            36 * run["kinds"]["deltanet"]["decode_s"]["layer"]
            + 12 * run["kinds"]["qsa"]["decode_s"]["layer"]
            + run["head"]["decode_s"]
        )
        assert run["head"]["bytes_per_token"] == _nbytes(512, h, T.Q6_K)
