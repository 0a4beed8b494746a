"""Server-sent events: `event: NAME` (where the dialect names its events), `data: JSON`, a blank line."""

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import Any, NoReturn

from aiohttp import web

from bubo.server.keys import STATE

__all__ = ["EventStream"]

log = logging.getLogger("bubo.server")


class EventStream:
    """One SSE response. `send` raises ConnectionResetError once the client has gone, or when it has
    taken nothing of the stream for --stream-stall-timeout seconds: the connection is then cut, so a
    client that stops reading holds neither the connection nor the events waiting for it."""

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

    async def _bounded(self, write: Awaitable[None]) -> None:
        # A write waits only while the socket's buffers are full. It is given up on once the buffer
        # has not gone down for the stall timeout: a slow reader still taking the stream keeps it.
        task = asyncio.ensure_future(write)
        transport = self.request.transport
        step = min(self.stall_timeout / 4, 1.0)
        held = transport.get_write_buffer_size() if transport is not None else 0
        stalled = 0.0
        try:
            while not (await asyncio.wait({task}, timeout=step))[0]:
                size = transport.get_write_buffer_size() if transport is not None else 0
                stalled = stalled + step if size >= held else 0.0
                held = size
                if stalled >= self.stall_timeout:
                    self._cut()
        finally:
            if not task.done():
                task.cancel()
        task.result()

    def _cut(self) -> NoReturn:
        log.warning(
            "request %s: the client took none of its stream for %g s; the connection is cut",
            self.request_id,
            self.stall_timeout,
        )
        transport = self.request.transport
        if transport is not None:
            transport.abort()
        raise ConnectionResetError("the client stopped reading the stream")
