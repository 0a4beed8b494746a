"""Server-sent events: `event: NAME` (where the dialect names its events), `data: JSON`, a blank line."""

import asyncio
import json
import logging
from typing import Any

from aiohttp import web

from bubo.server.keys import STATE

__all__ = ["EventStream"]

log = logging.getLogger("bubo.server")


class EventStream:
    """One SSE response. `send` raises ConnectionResetError once the client has gone, or when it has
    taken none of the stream for --stream-stall-timeout seconds: the connection is then cut, so a client
    that stops reading holds neither the connection nor the events waiting for it."""

    def __init__(self, request: web.Request, request_id: str) -> None:
        self.request = request
        self.request_id = request_id
        self.stall_timeout = request.app[STATE].settings.stream_stall_timeout
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                "x-request-id": request_id,
            },
        )

    async def start(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, data: Any, event: str | None = None) -> None:
        payload = (
            data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        )
        head = f"event: {event}\n" if event else ""
        await self._bounded(self.response.write(f"{head}data: {payload}\n\n".encode()))

    async def finish(self) -> web.StreamResponse:
        await self._bounded(self.response.write_eof())
        return self.response

    async def _bounded(self, write: Any) -> None:
        # A write waits only while the socket's buffers are full, that is while the client takes nothing.
        try:
            async with asyncio.timeout(self.stall_timeout):
                await write
        except TimeoutError:
            log.warning(
                "request %s: the client took none of its stream for %g s; the connection is cut",
                self.request_id,
                self.stall_timeout,
            )
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            raise ConnectionResetError("the client stopped reading the stream") from None
