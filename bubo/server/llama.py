"""The llama-server dialect: POST /completion, POST /apply-template, GET /props and GET /slots.

Field names follow llama.cpp's server (tools/server/README.md). /completion needs no model name and
streams bare `data: {...}` events, the last one with `"stop": true` and the full statistics; unlike
the OpenAI routes it ends without `data: [DONE]`, as llama-server's own /completion does.
"""

import math
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

from aiohttp import web

import bubo
from bubo.engine.chat_request import chat_request
from bubo.engine.generate import TokenLogprob
from bubo.engine.output_format import output_constraint, output_schema
from bubo.engine.request import Finished, GenerationRequest, OutputDelta, PromptProgress
from bubo.engine.sampler import SamplingParams
from bubo.engine.slot import SessionSlot
from bubo.server.errors import ApiError, bad_field, error_body
from bubo.server.fields import Body, bias_text_tokens, read_json, sampling_params
from bubo.server.keys import REQUEST_ID, STATE
from bubo.server.probe_fields import probe_json, with_probe
from bubo.server.sse import EventStream
from bubo.server.state import ServerState
from bubo.server.stream_extras import delta_timings, progress_json, with_stream_extras
from bubo.server.usage import openai_usage, timings

__all__ = ["routes"]

BUILD_INFO = f"bubo-{bubo.__version__}"

# GenerationResult.stop_reason -> llama-server's stop_type. A full context is a limit too.
_STOP_TYPES = {
    "eos": "eos",
    "stop_string": "word",
    "max_tokens": "limit",
    "context": "limit",
    "cancelled": "none",
}


def _params_json(params: SamplingParams) -> dict[str, Any]:
    """Sampling parameters under llama-server's names (-1 for "unset", logit_bias as [id, bias] pairs
    with false for a ban, since JSON has no infinity)."""
    limit = -1 if params.max_tokens is None else params.max_tokens
    return {
        "n_predict": limit,
        "max_tokens": limit,
        "seed": -1 if params.seed is None else params.seed,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repeat_last_n": params.repeat_last_n,
        "repeat_penalty": params.repeat_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "logit_bias": [[t, False if b == -math.inf else b] for t, b in sorted(params.logit_bias.items())],
        "stop": list(params.stop),
        "ignore_eos": params.ignore_eos,
        "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
    }


class _Completion:
    """What every chunk and the final body of one /completion answer share. `return_tokens` puts the
    generated token ids in the final body (a stream's chunks always carry theirs, as llama-server's do)."""

    def __init__(
        self,
        state: ServerState,
        model: str,
        generation: GenerationRequest,
        stream: bool,
        return_tokens: bool = False,
    ) -> None:
        self.state = state
        self.model = model
        self.generation = generation
        self.stream = stream
        self.return_tokens = return_tokens
        self.predicted = 0  # tokens streamed so far

    def chunk(self, event: OutputDelta | PromptProgress) -> dict[str, Any]:
        """A stream's chunk for a piece of text or a prompt progress report."""
        if isinstance(event, PromptProgress):
            text, tokens, slot_id, extra = "", (), 0, {"prompt_progress": progress_json(event)}
        else:
            self.predicted += len(event.token_ids)
            text, tokens, slot_id, extra = event.text, event.token_ids, event.slot_id, delta_timings(event)
        return {
            "index": 0,
            "content": text,
            "tokens": list(tokens),
            "id_slot": slot_id,
            "stop": False,
            "tokens_predicted": self.predicted,
            "tokens_evaluated": len(self.generation.prompt_ids),
            **extra,
        }

    def probabilities(self, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """llama-server's completion_probabilities: each token's id, text, bytes and log probability,
        with its top alternatives in the same shape."""
        return [
            {**self._token(lp.token_id, lp.logprob), "top_logprobs": [self._token(i, v) for i, v in lp.top]}
            for lp in logprobs
        ]

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self.state.require_ready().tokenizer.token_bytes(token_id)
        text = raw.decode("utf-8", errors="replace")
        return {"id": token_id, "token": text, "bytes": list(raw), "logprob": logprob}

    def final(self, finished: Finished, content: str) -> dict[str, Any]:
        result = finished.result
        usage = finished.usage
        # The tokens whose text the answer is: an end token ends it without text.
        tokens = result.token_ids[:-1] if result.stop_token_id is not None else result.token_ids
        settings = {
            "n_ctx": self.state.n_ctx,
            "model": self.model,
            **_params_json(self.generation.params),
            "seed_cur": result.seed,
            "stream": self.stream,
        }
        return {
            "index": 0,
            "content": content,
            "tokens": list(tokens) if self.return_tokens and not self.stream else [],
            "id_slot": finished.slot_id,
            "stop": True,
            "model": self.model,
            "tokens_predicted": usage.completion_tokens,
            "tokens_evaluated": usage.prompt_tokens,
            "tokens_cached": usage.cached_tokens,
            "truncated": result.stop_reason == "context",
            "stop_type": _STOP_TYPES[result.stop_reason],
            "stopping_word": result.stop_string or "",
            "stopped_eos": result.stop_reason == "eos",
            "stopped_word": result.stop_reason == "stop_string",
            "stopped_limit": result.stop_reason in ("max_tokens", "context"),
            "has_new_line": "\n" in finished.content_text,
            "generation_settings": settings,
            "prompt": self.generation.prompt,
            "timings": timings(usage),
            "usage": openai_usage(usage),
            **probe_json(finished),
        }


async def completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    loaded = state.require_ready()
    model = state.resolve_model(body.raw("model"), required=False)
    text, ids = await state.prompt_work(body.size, state.completion_prompt, _prompt(body.raw("prompt")))
    stream = body.boolean("stream")
    return_tokens = body.boolean("return_tokens")
    fields = _response_fields(body)
    # n_probs > 0: each token's log probability and that many alternatives (completion_probabilities).
    n_probs = body.integer("n_probs", minimum=0, maximum=20) or None
    if body.boolean("post_sampling_probs"):
        raise ApiError(
            400,
            "unsupported_value",
            "post_sampling_probs: only the model's own log probabilities are reported (leave it false)",
            param="post_sampling_probs",
        )
    # n_predict 0 evaluates the prompt into the slot's cache and generates nothing (llama-server's way to
    # warm the cache for a prompt that requests will extend).
    params = sampling_params(
        body,
        state.settings.defaults,
        loaded.tokenizer.vocab_size,
        limit_fields=("n_predict", "max_tokens"),
        limit_minimum=0,
        tokenize=bias_text_tokens(loaded.tokenizer),
    )
    # llama-server's ways to constrain a completion: `json_schema`, `grammar` (GBNF) or an OpenAI-style
    # `response_format`; at most one.
    schema = output_schema(body.object("response_format") or {"type": "text"}, "response_format")
    grammar = await state.compile_constraint(output_constraint(body, schema))
    generation = state.request(
        text, ids, params, logprobs=n_probs, grammar=grammar, cache_prompt=body.boolean("cache_prompt", True)
    )
    generation = with_probe(with_stream_extras(generation, body, stream), body, state)
    answer = _Completion(state, model, generation, stream, return_tokens)
    if stream:
        return await _stream(request, state, answer)
    finished = await state.complete(generation)
    reply = answer.final(finished, finished.content_text)
    if n_probs:
        reply["completion_probabilities"] = answer.probabilities(finished.content_logprobs)
    if fields:
        reply = _picked(reply, fields)
    return web.json_response(reply, headers={"x-request-id": request[REQUEST_ID]})


def _prompt(prompt: Any) -> Any:
    """llama-server's prompt object {"prompt_string": ...} (with `multimodal_data` for images, which
    /completion does not take) as its text; any other prompt as given."""
    if not isinstance(prompt, dict):
        return prompt
    if prompt.get("multimodal_data"):
        raise ApiError(
            400,
            "unsupported_content",
            "prompt.multimodal_data: /completion takes text; send images to /v1/chat/completions",
            param="prompt",
        )
    text = prompt.get("prompt_string")
    if not isinstance(text, str):
        raise bad_field("prompt.prompt_string", "must be a string")
    return text


def _response_fields(body: Body) -> list[str]:
    """llama-server's `response_fields`: the only fields the answer keeps, "a/b" naming b inside a."""
    fields = body.array("response_fields") or []
    if not all(isinstance(name, str) and name for name in fields):
        raise bad_field("response_fields", "must be an array of field names")
    return fields


def _picked(reply: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """The `fields` of `reply` that it has, each under its name as given ("generation_settings/n_predict"
    as one key), as llama-server answers with response_fields."""
    picked = {}
    for name in fields:
        value: Any = reply
        for part in name.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            picked[name] = value
    return picked


async def _stream(request: web.Request, state: ServerState, answer: _Completion) -> web.StreamResponse:
    async with aclosing(state.stream(answer.generation)) as events:
        # Waiting for the first event lets a failure before any output (a device loss) be a plain error.
        first = await anext(events)
        sse = EventStream(request, request[REQUEST_ID])
        await sse.start()
        try:
            event = first
            while event is not None:
                if isinstance(event, OutputDelta | PromptProgress):
                    chunk = answer.chunk(event)
                    if isinstance(event, OutputDelta) and answer.generation.logprobs:
                        chunk["completion_probabilities"] = answer.probabilities(event.logprobs)
                    await sse.send(chunk)
                elif isinstance(event, Finished):
                    # The text went out in the chunks before; the last one carries only the statistics.
                    await sse.send(answer.final(event, ""))
                    break
                event = await anext(events, None)
        except ApiError as error:
            await sse.send(error_body(error, anthropic=False, request_id=request[REQUEST_ID]))
        except ConnectionResetError:
            return sse.response
        return await sse.finish()


async def apply_template(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    state.require_ready()
    state.resolve_model(body.raw("model"), required=False)
    prompt = await state.prompt_work(body.size, state.render, chat_request(body))
    return web.json_response({"prompt": prompt})


def _model_info(state: ServerState) -> dict[str, Any]:
    loaded = state.require_ready()
    config = loaded.config
    return {
        "architecture": config.architecture,
        "n_params": sum(tensor.n_elements for tensor in loaded.file.tensors.values()),
        "size": loaded.path.stat().st_size,
        "n_vocab": config.vocab_size,
        "n_ctx_train": config.context_length,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_head_kv": config.num_kv_heads,
        "n_expert": config.num_experts,
        "n_expert_used": config.num_experts_per_tok,
    }


def _slot_json(state: ServerState, slot: SessionSlot) -> dict[str, Any]:
    assert state.slots is not None
    processing = slot.is_processing
    if state.settings.cache_isolation != "shared":
        # Isolated caches: what a slot holds is another client's (its prompt's length, its id, its
        # stop strings), so only the slot itself is shown.
        return {
            "id": slot.id,
            "n_ctx": slot.n_ctx,
            "speculative": slot.drafter is not None,
            "is_processing": processing,
            "state": 1 if processing else 0,
            "n_prompt_tokens": 0,
            "n_cached_tokens": 0,
            "n_kv_blocks": 0,
            "n_deferred": state.slots.stats.requests_deferred,
            "last_request_id": None,
            "params": _params_json(state.settings.defaults),
        }
    return {
        "id": slot.id,
        "n_ctx": slot.n_ctx,
        "speculative": slot.drafter is not None,
        "is_processing": processing,
        # The older llama-server field: 0 idle, 1 processing.
        "state": 1 if processing else 0,
        "n_prompt_tokens": slot.last_prompt_tokens,
        "n_cached_tokens": slot.cached_tokens,
        "n_kv_blocks": slot.prompt_cache.cache.blocks,
        # Requests wait for the first free slot, not for a particular one: each slot shows the queue.
        "n_deferred": state.slots.stats.requests_deferred,
        "last_request_id": slot.last_request_id,
        # As llama-server: the settings of the slot's current or last request (the defaults before one).
        "params": _params_json(slot.last_params or state.settings.defaults),
    }


async def props(request: web.Request) -> web.Response:
    state = request.app[STATE]
    loaded = state.require_ready()
    state.resolve_model(request.query.get("model"), required=False)
    assert state.template is not None and state.slots is not None
    slot = _slot_json(state, state.slots.slots[0])
    return web.json_response(
        {
            "model": state.model_id,
            "model_alias": state.model_id,
            "served_model_names": state.served_ids,
            "model_path": str(loaded.path),
            "template": state.template.source,
            "chat_template": state.template.source,
            "model_info": _model_info(state),
            "default_generation_settings": {
                "id": slot["id"],
                "n_ctx": slot["n_ctx"],
                "speculative": slot["speculative"],
                "is_processing": slot["is_processing"],
                "params": _params_json(state.settings.defaults),
            },
            "total_slots": len(state.slots.slots),
            "modalities": {"vision": state.tower is not None, "audio": False},
            "build_info": BUILD_INFO,
        }
    )


async def slots(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_ready()
    assert state.slots is not None
    return web.json_response([_slot_json(state, slot) for slot in state.slots.slots])


def routes() -> list[web.RouteDef]:
    return [
        web.post("/completion", completion),
        web.post("/apply-template", apply_template),
        web.get("/props", props),
        web.get("/slots", slots),
        web.get("/v1/slots", slots),
    ]
