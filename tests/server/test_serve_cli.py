"""`bubo serve` as a user starts it: a real process, its port, its exit codes and one-line errors."""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.live_server import free_port, wait_ready

BUBO = [sys.executable, "-m", "bubo"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BUBO, "serve", *args], capture_output=True, text=True, timeout=120)


def test_a_missing_model_file_is_one_line(tmp_path: Path) -> None:
    result = _run("--model", str(tmp_path / "absent.gguf"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"bubo: error: model file not found: {tmp_path / 'absent.gguf'}"
    ]


def test_a_file_that_is_not_gguf_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("just text, not a model")
    result = _run("--model", str(path))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bubo: error:") and "Traceback" not in result.stderr


def test_replicas_must_be_at_least_one(tiny_llama_path: Path) -> None:
    result = _run("--model", str(tiny_llama_path), "--replicas", "0")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["bubo: error: --replicas must be at least 1, got 0"]


def test_debug_hooks_refuse_a_non_loopback_host(tiny_llama_path: Path) -> None:
    result = _run("--model", str(tiny_llama_path), "--debug-hooks", "--host", "0.0.0.0")
    assert result.returncode == 1
    assert "--debug-hooks needs a loopback --host" in result.stderr


@pytest.mark.parametrize("which", ["absent", "the model itself"])
def test_a_bad_mmproj_is_one_line_before_the_port_opens(
    tiny_llama_path: Path, tmp_path: Path, which: str
) -> None:
    mmproj = tmp_path / "absent.gguf" if which == "absent" else tiny_llama_path
    port = free_port()
    result = _run("--model", str(tiny_llama_path), "--mmproj", str(mmproj), "--port", str(port))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--mmproj" in lines[0], result.stderr
    assert "listening" not in result.stderr


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--n-predict", "0"),
        ("--temp", "nan"),
        ("--port", "70000"),
        ("--shutdown-grace", "nan"),
        ("--parallel", "0"),
        ("--header-timeout", "nan"),
        ("--max-connections", "0"),
        ("--cache-isolation", "key"),  # without --api-key
    ],
)
def test_bad_flags_are_one_line(tiny_llama_path: Path, flag: str, value: str) -> None:
    result = _run("--model", str(tiny_llama_path), flag, value)
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1


def test_serve_answers_then_stops_cleanly(tiny_llama_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [
            *BUBO,
            "serve",
            "--model",
            str(tiny_llama_path),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--temp",
            "0",
            "-n",
            "3",
            "--log-format",
            "json",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        assert httpx.get(url + "/ready").json() == {"status": "ready", "model": "tiny"}
        response = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello"})
        reply = response.json()
        assert reply["usage"]["completion_tokens"] == 3  # -n 3 is the default limit
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        process.kill()
        stderr = process.stderr.read() if process.stderr else ""
    assert f"listening on {url}" in stderr and "ready: serving 'tiny'" in stderr
    # --log-format json: the request log's line for the completion, as one JSON object.
    logged = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    [line] = [entry for entry in logged if entry.get("path") == "/v1/completions"]
    assert line["logger"] == "bubo.requests" and line["status"] == 200 and line["method"] == "POST"
    assert (line["prompt_tokens"], line["completion_tokens"]) == (reply["usage"]["prompt_tokens"], 3)
    assert line["request_id"] == response.headers["x-request-id"] and line["ms"] > 0
    # The lifecycle lines follow the format too.
    lifecycle = [entry["message"] for entry in logged if entry["logger"] == "bubo.server"]
    assert (
        lifecycle[0].startswith(f"listening on {url}")
        and "ready: serving 'tiny' (also as 'bubo')" in lifecycle
    )
    # Without a terminal, the load is told in lines: the weights, then the compiling.
    loading = [entry["message"] for entry in logged if entry["logger"] == "bubo.load"]
    assert any(m.startswith("loading and repacking weights: ") for m in loading), loading
    assert any(m.startswith("compiling the decode step") and "done in" in m for m in loading), loading


def test_cache_type_flags_set_the_kv_pool(tiny_llama_path: Path) -> None:
    """`-ctk` / `-ctv` (llama-server's names) choose the pool's storage types; f16 by default."""
    for flags, expected in (
        ((), ("float16", "float16")),
        (("-ctk", "bf16", "-ctv", "f32"), ("bfloat16", "float32")),
    ):
        port = free_port()
        process = subprocess.Popen(
            [*BUBO, "serve", "--model", str(tiny_llama_path), "--port", str(port), "--debug-hooks", *flags],
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            assert wait_ready(url)
            reply = httpx.post(url + "/completion", json={"prompt": "hello", "n_predict": 2}, timeout=60)
            assert reply.status_code == 200
            pool = httpx.get(url + "/debug/cache").json()["kv_pool"]
            assert (pool["key_dtype"], pool["value_dtype"]) == expected
        finally:
            process.kill()
            process.wait(30)
    refused = _run("--model", str(tiny_llama_path), "-ctk", "q4_0")
    assert refused.returncode == 2 and "invalid choice: 'q4_0'" in refused.stderr


def test_a_port_in_use_is_one_line(tiny_llama_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run("--model", str(tiny_llama_path), "--port", str(port))
    assert result.returncode == 1
    assert (
        result.stderr.strip().splitlines()[-1].startswith(f"bubo: error: cannot listen on 127.0.0.1:{port}")
    )


def test_models_reports_the_context_size_while_the_model_loads(tiny_llama_path: Path) -> None:
    port = free_port()
    # `bubo serve`, its model load never ending.
    program = (
        "import sys, threading; from bubo.server.state import ServerState; "
        "ServerState.load = lambda self: threading.Event().wait(); "
        "from bubo.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    args = ["serve", "--model", str(tiny_llama_path), "--port", str(port), "--ctx-size", "100"]
    process = subprocess.Popen([sys.executable, "-c", program, *args], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                models = httpx.get(url + "/v1/models")
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert httpx.get(url + "/ready").status_code == 503
        for entry in models.json()["data"]:
            assert entry["context_length"] == entry["max_model_len"] == entry["meta"]["n_ctx"] == 100
    finally:
        process.kill()
        process.wait(30)
