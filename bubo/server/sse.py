"""Server-sent events: `event: NAME` (where the dialect names its events), `data: JSON`, a blank line."""

import json
from typing import Any

from aiohttp import web

__all__ = ["EventStream"]


class EventStream:
    """One SSE response. `send` raises ConnectionResetError once the client has gone."""

    def __init__(self, request: web.Request, request_id: str) -> None:
        self.request = request
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
        await self.response.write(f"{head}data: {payload}\n\n".encode())

    async def finish(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response
