"""The end of a graceful shutdown: streams still running when the grace period is over are cut short
with an error the client can read (a final SSE error event, or a 503 body), never a dropped socket."""

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

from bubo.server.errors import ApiError

__all__ = ["StreamCutoff"]

T = TypeVar("T")


class StreamCutoff:
    """Once `end_streams` is called, every `next` in progress or to come raises 503 shutting_down."""

    def __init__(self) -> None:
        # Made on first use: the state that owns this may be built outside the event loop.
        self._ended: asyncio.Future[None] | None = None

    def _future(self) -> asyncio.Future[None]:
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        return self._ended

    def end_streams(self) -> None:
        ended = self._future()
        if not ended.done():
            ended.set_result(None)

    async def next(self, events: AsyncIterator[T]) -> T | None:
        """The next event of `events` (None at its end), unless the streams are ended first."""
        ended = self._future()
        if ended.done():
            raise self._error()
        step = asyncio.ensure_future(anext(events, None))
        try:
            await asyncio.wait({step, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not step.done():
                # Cancelled (the client left) or cut off: stop the step before the caller closes
                # `events`, which cannot be closed while a step of it is running.
                step.cancel()
                await asyncio.wait({step})
        if step.cancelled():
            raise self._error()
        return step.result()

    @staticmethod
    def _error() -> ApiError:
        return ApiError(
            503,
            "shutting_down",
            "the server is shutting down: this request was still running when its grace period ended",
        )
