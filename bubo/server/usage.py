"""The usage and timing blocks the dialects share, from the neutral `Usage`.

`timings` uses llama-server's field names; the OpenAI `usage` adds llama-server's speed fields, the
MTP draft counts (0 where nothing was drafted) and `gufo`, Bubo's prompt-cache report.
"""

from typing import Any

from bubo.engine.request import Usage

__all__ = ["gufo", "openai_usage", "timings"]


def timings(usage: Usage) -> dict[str, Any]:
    prompt_n = usage.prompt_tokens - usage.cached_tokens
    return {
        "cache_n": usage.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": usage.prompt_ms,
        "prompt_per_token_ms": usage.prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": usage.prompt_per_second,
        "predicted_n": usage.completion_tokens,
        "predicted_ms": usage.predicted_ms,
        "predicted_per_token_ms": usage.predicted_ms / usage.decode_tokens if usage.decode_tokens else 0.0,
        "predicted_per_second": usage.predicted_per_second,
        "draft_n": usage.draft_tokens,
        "draft_n_accepted": usage.draft_accepted,
    }


def gufo(usage: Usage) -> dict[str, Any]:
    return {"options": usage.cache.as_dict()}


def openai_usage(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {
            "reasoning_tokens": usage.reasoning_tokens,
            "accepted_prediction_tokens": usage.draft_accepted,
            "rejected_prediction_tokens": usage.draft_tokens - usage.draft_accepted,
        },
        "prompt_tokens_per_second": usage.prompt_per_second,
        "completion_tokens_per_second": usage.predicted_per_second,
        "draft_tokens": usage.draft_tokens,
        "draft_tokens_accepted": usage.draft_accepted,
        "gufo": gufo(usage),
    }
