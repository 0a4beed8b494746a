"""Starting servers for the benchmarks that compare them: a free port, and waiting until one is ready."""

import socket
import subprocess
import time

import httpx

__all__ = ["free_port", "wait_ready"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 600) -> None:
    """Until `url` (a server's readiness route) answers 200; RuntimeError when `server` exits first or
    `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} was not ready within {timeout:g} s")
