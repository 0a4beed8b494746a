"""GET /metrics (and /v1/metrics): Prometheus text under llama-server's `llamacpp:` names.

A custom collector reads the slot's running totals (`SlotStats`) when it is scraped, so nothing on the
request path updates Prometheus objects. Each app gets its own registry rather than the process-wide
default one: tests run several servers in one process, and each must report only its own slot.
Before the model is loaded (and after a device loss) the route answers 503 like every other route
that needs the model, so a scraper sees the target as down rather than as an idle server.
"""

import weakref
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from bubo.server.keys import STATE
from bubo.server.state import ServerState

__all__ = ["SlotCollector", "routes"]


class SlotCollector:
    """The slots' statistics as llama-server names them, read at scrape time."""

    def __init__(self, state: ServerState) -> None:
        # A weak reference: the registry lives in a table keyed by the state and must not keep it alive.
        self._state = weakref.ref(state)

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        slots = state.slots if state is not None else None
        if slots is None:
            return
        stats = slots.stats
        decode_passes, decode_steps = slots.decode_steps
        cached = sum(slot.cached_tokens for slot in slots.slots)
        pool = slots.pool

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            # prometheus-client takes the name without `_total` and writes the suffix back itself.
            return CounterMetricFamily(name.removesuffix("_total"), documentation, value=value)

        def rate(tokens: int, seconds: float) -> float:
            return tokens / seconds if seconds > 0 else 0.0

        yield counter(
            "llamacpp:prompt_tokens_total", "Number of prompt tokens processed.", stats.prompt_tokens_total
        )
        yield counter(
            "llamacpp:prompt_tokens_cached_total",
            "Number of prompt tokens a prompt cache held (not computed).",
            stats.prompt_tokens_cached_total,
        )
        yield counter(
            "llamacpp:prompt_seconds_total", "Prompt process time in seconds.", stats.prompt_seconds_total
        )
        yield GaugeMetricFamily(
            "llamacpp:prompt_tokens_seconds",
            "Average prompt throughput in tokens/s.",
            value=rate(stats.prompt_tokens_total, stats.prompt_seconds_total),
        )
        yield counter(
            "llamacpp:tokens_predicted_total",
            "Number of generation tokens processed.",
            stats.tokens_predicted_total,
        )
        yield counter(
            "llamacpp:tokens_predicted_seconds_total",
            "Predict process time in seconds.",
            stats.predicted_seconds_total,
        )
        # Decode time covers every generated token but the first (that one ends the prompt phase).
        yield GaugeMetricFamily(
            "llamacpp:predicted_tokens_seconds",
            "Average generation throughput in tokens/s.",
            value=rate(stats.decode_tokens_total, stats.predicted_seconds_total),
        )
        # With --parallel the decode steps of busy slots run as one pass: a pass carries several steps.
        yield counter("llamacpp:n_decode_total", "Total number of decode calls.", decode_passes)
        yield GaugeMetricFamily(
            "llamacpp:n_busy_slots_per_decode",
            "Average number of busy slots per decode call.",
            value=decode_steps / decode_passes if decode_passes else 0.0,
        )
        yield counter(
            "bubo_requests_total",
            "Requests that ran on a slot (answered, stopped, or cut short by a client going away).",
            stats.requests_total,
        )
        yield GaugeMetricFamily(
            "llamacpp:requests_processing", "Number of requests processing.", value=stats.requests_processing
        )
        yield GaugeMetricFamily(
            "llamacpp:requests_deferred", "Number of requests deferred.", value=stats.requests_deferred
        )
        yield counter(
            "bubo_requests_deferred_total",
            "Requests that waited for a free slot (llamacpp:requests_deferred is how many wait now).",
            stats.requests_deferred_total,
        )
        yield counter(
            "bubo_images_encoded_total",
            "Images run through the vision tower (not those a prompt cache already held).",
            stats.images_encoded_total,
        )
        # The share of the KV pool's blocks held; a model without a block pool holds its positions.
        if pool is not None:
            used = 1 - pool.free_blocks / pool.num_blocks
        else:
            used = cached / (slots.n_ctx * len(slots.slots)) if slots.n_ctx else 0.0
        yield GaugeMetricFamily(
            "llamacpp:kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.", value=used
        )
        yield GaugeMetricFamily("llamacpp:kv_cache_tokens", "KV-cache tokens.", value=cached)
        yield GaugeMetricFamily(
            "llamacpp:n_tokens_max",
            "Largest observed n_tokens: the most positions a slot's cache has held.",
            value=max(slot.n_tokens_max for slot in slots.slots),
        )
        yield counter(
            "llamacpp:spec_decode_num_draft_tokens_total",
            "Total draft tokens generated (0 when spec-decode is off).",
            stats.draft_tokens_total,
        )
        yield counter(
            "llamacpp:spec_decode_num_accepted_tokens_total",
            "Total draft tokens accepted by the target model (0 when spec-decode is off).",
            stats.draft_accepted_total,
        )
        # The same counts under llama-server's newer names, with the verify passes and the two ratios.
        steps = stats.draft_verify_steps_total
        yield counter("llamacpp:draft_tokens_total", "Draft tokens proposed.", stats.draft_tokens_total)
        yield counter(
            "llamacpp:draft_tokens_accepted_total", "Draft tokens accepted.", stats.draft_accepted_total
        )
        yield counter("llamacpp:draft_verify_steps_total", "Verify passes that checked a draft.", steps)
        yield GaugeMetricFamily(
            "llamacpp:draft_acceptance_rate",
            "Accepted draft tokens per proposed one.",
            value=rate(stats.draft_accepted_total, stats.draft_tokens_total),
        )
        yield GaugeMetricFamily(
            "llamacpp:draft_mean_accept_len",
            "Tokens each verify pass yields: its accepted drafts and the one it samples.",
            value=1 + stats.draft_accepted_total / steps if steps else 0.0,
        )


_registries: "weakref.WeakKeyDictionary[ServerState, CollectorRegistry]" = weakref.WeakKeyDictionary()


def registry_for(state: ServerState) -> CollectorRegistry:
    """The registry of one server, made on its first scrape."""
    registry = _registries.get(state)
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SlotCollector(state))
        _registries[state] = registry
    return registry


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_ready()
    # llama-server's header, so that a scraper can tell a restarted server (counters back to zero).
    headers = {"Content-Type": CONTENT_TYPE_LATEST, "Process-Start-Time-Unix": str(state.created)}
    return web.Response(body=generate_latest(registry_for(state)), headers=headers)


def routes() -> list[web.RouteDef]:
    return [web.get("/metrics", metrics), web.get("/v1/metrics", metrics)]
