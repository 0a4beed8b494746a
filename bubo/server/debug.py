"""Debug hooks for research inspection: the rendered prompt, the prompt cache, the effective settings.

app.py adds these routes only with --debug-hooks, and the CLI allows that flag only on a loopback
address: they show the prompt text and the server's configuration, which a public port should not.
"""

import math
import platform
from dataclasses import asdict

import torch
from aiohttp import web

import bubo
from bubo.engine.chat_request import chat_request
from bubo.server.fields import read_json
from bubo.server.keys import STATE

__all__ = ["routes"]


async def prompt(request: web.Request) -> web.Response:
    """A chat-completions body rendered and tokenized exactly as generation would, without generating."""
    state = request.app[STATE]
    body = await read_json(request)
    state.require_ready()
    state.resolve_model(body.raw("model"), required=False)
    rendered = await state.prompt_work(body.size, state.render_prompt, chat_request(body))
    return web.json_response(
        {
            "prompt": rendered.text,
            "tokens": rendered.ids,
            "n_tokens": len(rendered.ids),
            "reasoning": rendered.reasoning,
            "in_reasoning": rendered.in_reasoning,
        }
    )


async def cache(request: web.Request) -> web.Response:
    """Each slot's prompt cache, the last request's cache report (as its usage.gufo.options) and the
    KV block pool the slots share."""
    state = request.app[STATE]
    state.require_ready()
    slots = state.slots
    assert slots is not None
    last = slots.last_slot
    report = last.last_cache_report
    pool = slots.pool
    return web.json_response(
        {
            "n_ctx": slots.n_ctx,
            "cached_tokens": last.cached_tokens,
            "can_rewind": last.can_rewind,
            "is_processing": last.is_processing,
            "last_request_id": last.last_request_id,
            "last_prompt_tokens": last.last_prompt_tokens,
            "last_cache_report": report.as_dict() if report is not None else None,
            # A hybrid model's recurrent-state snapshots: the positions it can resume from.
            "snapshots": [{"position": s.length, "bytes": s.nbytes} for s in last.prompt_cache.snapshots],
            "snapshot_policy": asdict(last.prompt_cache.policy),
            "slots": [
                {
                    "id": slot.id,
                    "cached_tokens": slot.cached_tokens,
                    "is_processing": slot.is_processing,
                    "kv_blocks": slot.prompt_cache.cache.tables[0] if slot.prompt_cache.cache.tables else [],
                    "snapshots": [s.length for s in slot.prompt_cache.snapshots],
                }
                for slot in slots.slots
            ],
            "kv_pool": None
            if pool is None
            else {
                "block_size": pool.block_size,
                "blocks": pool.num_blocks,
                "free_blocks": pool.free_blocks,
                "shared_blocks": sum(1 for r in pool.refs if r > 1),
                "bytes_per_block": pool.bytes_per_block,
                "key_dtype": str(pool.keys[0].dtype).removeprefix("torch.") if pool.keys else None,
                "value_dtype": str(pool.values[0].dtype).removeprefix("torch.") if pool.values else None,
            },
        }
    )


async def settings(request: web.Request) -> web.Response:
    """The settings in effect. The API key itself is never shown, only whether one is set."""
    state = request.app[STATE]
    s = state.settings
    defaults = asdict(s.defaults)
    # JSON has no infinity: a banned token (-inf bias) is written as false, as in llama-server's lists.
    defaults["logit_bias"] = [
        [token, False if bias == -math.inf else bias] for token, bias in sorted(s.defaults.logit_bias.items())
    ]
    return web.json_response(
        {
            "host": s.host,
            "port": s.port,
            "model_path": str(s.model_path),
            "model_id": state.model_id,
            "served_ids": state.served_ids,
            "ready": state.ready,
            "ctx_size": s.ctx_size,
            "parallel": s.parallel,
            "n_ctx": state.context_length,
            "dtype": str(s.dtype).removeprefix("torch."),
            "device": s.device,
            "threads": s.threads,
            "torch_threads": state.model_threads,
            "max_body_mb": s.max_body_mb,
            "api_key_set": s.api_key is not None,
            "debug_hooks": s.debug_hooks,
            "sampling_defaults": defaults,
            "versions": {
                "bubo": bubo.__version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
        }
    )


def routes() -> list[web.RouteDef]:
    return [
        web.post("/debug/prompt", prompt),
        web.get("/debug/cache", cache),
        web.get("/debug/settings", settings),
    ]
