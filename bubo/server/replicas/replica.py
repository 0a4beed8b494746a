"""One replica: a whole Bubo server (bubo/server/app.py) on a loopback port of the replica's own, and
`forward`, which the ingress calls through its deployment handle to have that server answer a request.
Everything a single server does (dialects, API keys, limits, prompt cache, /metrics) stays its own."""

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Mapping

import aiohttp
from aiohttp import web
from ray import serve

from bubo.options import RuntimeOptions, use_options
from bubo.process_memory import configure_cpu_process
from bubo.server.app import create_runner
from bubo.server.replicas.forwarding import Forwarded, Head
from bubo.server.settings import ServerSettings
from bubo.server.state import ServerState

__all__ = ["REPLICA_HEADER", "BuboReplica"]

# Names the replica that answered, on every answer that passes the ingress.
REPLICA_HEADER = "x-bubo-replica"
# The largest server-sent event passed on (a Responses stream's last event holds the whole answer).
EVENT_LIMIT = 256 << 20
# Headers that belong to one connection, not to the request or answer (RFC 9110 7.6.1), and those the
# HTTP client sets or undoes itself.
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
    }
)


def end_to_end(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The headers of a request or answer less the hop-by-hop ones."""
    return tuple((name, value) for name, value in headers.items() if name.lower() not in HOP_HEADERS)


class BuboReplica:
    """The replica deployment's class (the app builder makes it a deployment)."""

    async def __init__(self, settings: ServerSettings, options: RuntimeOptions) -> None:
        if settings.device.split(":")[0] == "cpu":
            configure_cpu_process()
        use_options(options)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # The replica's server listens on loopback only: it is reached through the ingress, which is
        # where the operator's host and port are.
        self.state = ServerState(dataclasses.replace(settings, host="127.0.0.1", port=0))
        self.state.preflight()
        self.runner = create_runner(self.state)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.base = f"http://127.0.0.1:{port}"
        # No timeout of its own: a long generation is the server's to bound (its stall and shutdown
        # limits), and a client that leaves cancels the call, which closes this connection.
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        # Ready (for Ray Serve: this constructor returns) once the model is loaded.
        await asyncio.get_running_loop().run_in_executor(None, self.state.load)

    async def forward(self, request: Forwarded) -> AsyncIterator[Head | bytes]:
        """The server's answer: its Head, then its body: one item a server-sent event for a stream,
        else the whole body."""
        async with self.session.request(
            request.method,
            self.base + request.path_qs,
            headers=list(request.headers),
            data=request.body or None,
            allow_redirects=False,
        ) as response:
            head = Head(response.status, end_to_end(response.headers), self.replica_id)
            yield head
            if not head.is_stream:
                yield await response.read()
                return
            # Whole events, so that the ingress can end a stream cut short with an event of its own.
            while event := await response.content.readuntil(b"\n\n", max_size=EVENT_LIMIT):
                yield event

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose model failed or whose device was lost is unhealthy,
        and Serve replaces it."""
        if self.state.load_error is not None:
            raise RuntimeError(f"the model failed to load: {self.state.load_error}")
        if self.state.device_lost:
            raise RuntimeError("the device was lost")

    async def __del__(self) -> None:
        await self.session.close()
        await self.runner.cleanup()
