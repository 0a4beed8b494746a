"""A real Bubo server on a loopback port, run in a background thread, for tests that talk HTTP to it
(raw sockets, httpx, the openai and anthropic SDKs), plus a scripted model for exact outputs."""

import asyncio
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import httpx
import torch
from aiohttp import web

from bubo.engine.loaded_model import LoadedModel
from bubo.server.app import create_runner
from bubo.server.memory_guard import MemoryProbe
from bubo.server.settings import ServerSettings
from bubo.server.state import ServerState


class LiveServer:
    """`create_app` served by aiohttp's runner (as `bubo serve` does) on 127.0.0.1 and a free port."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="live-server")
        self.port = 0

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = create_runner(self.state)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())

    def start(self) -> "LiveServer":
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("the test server did not start")
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 60.0, process: subprocess.Popen | None = None) -> bool:
    """Poll `url`/ready until it answers 200 (a server process starting up); False at the timeout, or as
    soon as `process` (the server's, where given) has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (process is None or process.poll() is None):
        try:
            if httpx.get(url + "/ready").status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return False


def serve_loaded(
    loaded: LoadedModel | None, memory_probe: MemoryProbe | None = None, **settings: Any
) -> LiveServer:
    """A started server for `loaded` (None: one that is still loading, forever)."""
    path = loaded.path if loaded is not None else settings.pop("model_path")
    state = ServerState(ServerSettings(model_path=path, **settings), memory_probe=memory_probe)
    if loaded is not None:
        state.attach(loaded)
    return LiveServer(state).start()


class _ScriptCache:
    """Just enough of KVCache for the scripted model: a length, and the position the script restarts at."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self.script_start = 0

    @property
    def can_rewind(self) -> bool:
        return True

    def truncate(self, n: int) -> None:
        self.length = n

    def reset(self) -> None:
        """Hold nothing (KVCache.reset: a request that asked not to be cached)."""
        self.length = 0

    def reserve(self, n: int) -> bool:
        return self.length + n <= self.max_len

    @property
    def tables(self) -> list[list[int]]:
        return [[]]  # no KV blocks: nothing is stored

    @property
    def blocks(self) -> int:
        return 0


class ScriptedModel:
    """A stand-in decoder whose next token follows a fixed script, whatever the prompt: the script
    restarts on every forward of more than one token (a prefill) and on every forward that starts
    before the previous answer did (a prompt cache rewound to one token short), so each request
    replays it. After the script it emits `after`. Each forward sleeps `delay` seconds, for tests
    that need a generation to be running."""

    def __init__(self, config: Any, script: Sequence[int], after: int, delay: float = 0.0) -> None:
        self.config = config
        self.script = list(script)
        self.after = after
        self.delay = delay
        self.device = torch.device("cpu")
        self.forwards = 0

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> _ScriptCache:
        return _ScriptCache(max_len or self.config.context_length)

    def __call__(self, tokens: torch.Tensor, cache: _ScriptCache, last_only: bool = False) -> torch.Tensor:
        self.forwards += 1
        if self.delay:
            time.sleep(self.delay)
        steps = tokens.shape[1]
        cache.length += steps
        # A new prompt: a prefill, a first forward, or one that starts before the last answer did (the
        # prompt cache rewound into the previous prompt and feeds the one token that differs).
        if steps > 1 or cache.length - steps <= 0 or cache.length - steps < cache.script_start:
            cache.script_start = cache.length
        index = cache.length - cache.script_start
        token = self.script[index] if index < len(self.script) else self.after
        logits = torch.full((1, 1 if last_only else steps, self.config.vocab_size), -10.0)
        logits[0, -1, token] = 10.0
        return logits


def scripted(
    loaded: LoadedModel, text: str, *, end: str = "<|im_end|>", special: bool = False, delay: float = 0.0
) -> LoadedModel:
    """`loaded` with its decoder replaced by one that writes `text` and then `end` (`delay` s per forward)."""
    tokenizer = loaded.tokenizer
    script = tokenizer.encode(text, add_bos=False, parse_special=special)
    end_id = tokenizer.token_to_id(end)
    assert end_id is not None
    return replace(loaded, model=ScriptedModel(loaded.config, script, end_id, delay))


GATED_TEXT = "Hello world. Goodbye."


class GatedModel:
    """Wraps a decoder so that every one-token forward (a decode step) waits for `gate`: a request
    that has sent its first piece of text then stays in progress until the test opens the gate."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config
        self.device = model.device
        self.gate = threading.Event()
        self.gate.set()

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> Any:
        return self.model.new_cache(batch, max_len)

    def __call__(self, tokens: torch.Tensor, cache: Any, last_only: bool = False) -> torch.Tensor:
        if tokens.shape[1] == 1:
            assert self.gate.wait(30), "the test never opened the gate"
        return self.model(tokens, cache, last_only)
