"""`bubo serve --tensor-parallel 2` as a user starts it: rank 0 serves and spawns rank 1 (gloo, on this
machine), and a conversation gets the same greedy replies and cached-token counts as from the whole
model served in one process; SIGTERM stops both ranks. The model is a tiny Qwen3.5 (Gated DeltaNet and
gated attention layers), so the prompt cache goes back to recurrent-state snapshots, which rank 1 must
have taken at the same positions as rank 0."""

import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from bubo import cli
from bubo.engine.loaded_model import load_model
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.fixtures.hybrid_models import tiny_hybrid
from tests.server.live_server import free_port, serve_loaded, wait_ready

BUBO = [sys.executable, "-m", "bubo"]
SYSTEM = {"role": "system", "content": "You answer in one short sentence, always politely and with care."}


def _conversation(url: str) -> list[tuple[str, int, int]]:
    """A chat of two turns (the second reusing the first's cache), then another chat (the cache cut back
    to the shared system prompt): each reply's text, prompt tokens and cached tokens."""
    out = []
    first = [SYSTEM, {"role": "user", "content": "hello there"}]
    chats = [first, None, [SYSTEM, {"role": "user", "content": "something else"}]]
    for messages in chats:
        if messages is None:
            messages = [
                *first,
                {"role": "assistant", "content": out[0][0]},
                {"role": "user", "content": "and?"},
            ]
        body = {"model": "bubo", "messages": messages, "max_tokens": 8, "temperature": 0}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        usage = reply["usage"]
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        out.append((reply["choices"][0]["message"]["content"], usage["prompt_tokens"], cached))
    return out


@pytest.fixture(scope="module")
def qwen35_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_hybrid("qwen35", ["linear_attention", "full_attention"] * 2, max_position_embeddings=512)
    randomize_(model)
    return write_gguf(model, tmp_path_factory.mktemp("tensor-parallel") / "Tiny-Qwen35.gguf")


@pytest.mark.usefixtures("one_thread")
def test_two_ranks_serve_what_one_process_serves(qwen35_path: Path) -> None:
    server = serve_loaded(load_model(qwen35_path))
    try:
        expected = _conversation(server.url)
    finally:
        server.stop()
    assert expected[1][2] > 0 and expected[2][2] > 0  # the second turn and the other chat reuse the cache

    port = free_port()
    command = [*BUBO, "serve", "--model", str(qwen35_path), "--port", str(port), "--threads", "1"]
    # A float32 KV cache, as the whole model's above (load_model's default).
    command += ["--cache-type-k", "f32", "--cache-type-v", "f32", "--tensor-parallel", "2"]
    # The ranks' stderr to a file, not a pipe: nothing they write can block them.
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stderr=log, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            ready = wait_ready(url, timeout=240, process=process)
            if ready:
                assert _conversation(url) == expected
                process.send_signal(signal.SIGTERM)
                assert process.wait(30) == 0
        finally:
            process.kill()
            process.wait()
            log.seek(0)
            stderr = log.read()
    assert ready, f"rank 0 exited or was not ready in 240 s; the ranks' stderr:\n{stderr[-4000:]}"
    assert "tensor parallel" in stderr  # the plan says why the split model decodes eagerly


@pytest.mark.usefixtures("runtime_options")  # `bubo serve` installs its options: put back after
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--tensor-parallel", "3"], "2 KV heads can't be split evenly over 3 ranks"),
        (["--tensor-parallel", "2", "--parallel", "2"], "--parallel"),
    ],
)
def test_what_a_split_cannot_run_is_one_line_before_any_rank_starts(
    qwen35_path: Path, flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", "--model", str(qwen35_path), *flags]) == 1
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) == 1 and named in stderr, stderr
    assert "listening" not in stderr
