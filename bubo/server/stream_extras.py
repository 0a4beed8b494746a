"""llama-server's stream extras, which its own /completion and its OpenAI routes take alike:
`return_progress` (prompt_progress reports while the prompt is computed) and `timings_per_token` (the
timings so far on every piece of text)."""

from dataclasses import replace
from typing import Any

from bubo.engine.request import GenerationRequest, OutputDelta, PromptProgress
from bubo.server.fields import Body
from bubo.server.usage import timings

__all__ = ["delta_timings", "progress_json", "with_stream_extras"]


def with_stream_extras(generation: GenerationRequest, body: Body, stream: bool) -> GenerationRequest:
    """`generation` with the extras the body asks for; a whole-body answer has nowhere to put them."""
    progress = body.boolean("return_progress")
    per_token = body.boolean("timings_per_token")
    if not stream:
        return generation
    return replace(generation, return_progress=progress, timings_per_token=per_token)


def progress_json(event: PromptProgress) -> dict[str, Any]:
    """llama-server's prompt_progress object."""
    return {
        "total": event.total,
        "cache": event.cached,
        "processed": event.processed,
        "time_ms": event.elapsed_ms,
    }


def delta_timings(event: OutputDelta) -> dict[str, Any]:
    """{"timings": ...} for a piece of text that carries the usage so far, else nothing."""
    return {} if event.usage is None else {"timings": timings(event.usage)}
