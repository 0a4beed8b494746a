"""The tokenizer over HTTP, so that clients and evaluation harnesses count and split text with the
server's own tokenizer: POST /tokenize and /detokenize in llama-server's shapes and in vLLM's, and
vLLM's GET /tokenizer_info (what lm-eval's remote tokenizer reads).

The two servers share the paths and differ in their fields: a /tokenize body with `content` is
llama-server's (`add_special`, `parse_special`, `with_pieces`; answered {"tokens"}), one with `prompt`
or `messages` is vLLM's (`add_special_tokens`, `return_token_strs`; answered {"count",
"max_model_len", "tokens", "token_strs"}). A /detokenize body is {"tokens"} in both, so its answer
carries the text under both names: llama-server's `content` and vLLM's `prompt`.
"""

from typing import Any

from aiohttp import web

from bubo.engine.chat_request import chat_request
from bubo.server.errors import bad_field
from bubo.server.fields import Body, read_json
from bubo.server.keys import STATE
from bubo.server.state import ServerState

__all__ = ["routes"]


def _piece(raw: bytes) -> str | list[int]:
    """llama-server's `piece`: the token's text, or its bytes where they are not whole UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _llama_tokenize(state: ServerState, body: Body) -> dict[str, Any]:
    tokenizer = state.require_ready().tokenizer
    content = body.string("content")
    if content is None:
        raise bad_field("content", "is required: the text to tokenize")
    ids = tokenizer.encode(
        content,
        add_bos=None if body.boolean("add_special") else False,
        parse_special=body.boolean("parse_special", True),
    )
    if body.boolean("with_pieces"):
        return {"tokens": [{"id": i, "piece": _piece(tokenizer.token_bytes(i))} for i in ids]}
    return {"tokens": ids}


def _vllm_tokenize(state: ServerState, body: Body) -> dict[str, Any]:
    tokenizer = state.require_ready().tokenizer
    state.resolve_model(body.raw("model"), required=False)
    if "messages" in body:
        # A chat is counted as the template renders it; its special tokens are in the text already.
        text = state.render(chat_request(body))
        add_special = body.boolean("add_special_tokens", False)
    else:
        text = body.string("prompt")
        if text is None:
            raise bad_field(
                "prompt",
                "is required: the text to tokenize (or messages, a chat; or content, llama-server's form)",
            )
        add_special = body.boolean("add_special_tokens", True)
    ids = tokenizer.encode(text, add_bos=None if add_special else False)
    strings = None
    if body.boolean("return_token_strs"):
        strings = [tokenizer.token_bytes(i).decode("utf-8", errors="replace") for i in ids]
    return {"count": len(ids), "max_model_len": state.n_ctx, "tokens": ids, "token_strs": strings}


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    state.require_ready()
    work = _llama_tokenize if "content" in body else _vllm_tokenize
    return web.json_response(await state.prompt_work(body.size, work, state, body))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    tokenizer = state.require_ready().tokenizer
    state.resolve_model(body.raw("model"), required=False)
    ids = body.array("tokens", [])
    assert ids is not None
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < tokenizer.vocab_size for i in ids):
        raise bad_field("tokens", f"must be token ids: integers in [0, {tokenizer.vocab_size})")
    text = tokenizer.decode(ids)
    return web.json_response({"content": text, "prompt": text})


async def tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's tokenizer facts: the special tokens as text, the chat template, the context size."""
    state = request.app[STATE]
    tokenizer = state.require_ready().tokenizer
    assert state.template is not None

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.decode([token_id])

    return web.json_response(
        {
            "tokenizer_class": "bubo.GGUFTokenizer",
            "bos_token": text(tokenizer.bos_id),
            "eos_token": text(tokenizer.eos_id),
            "pad_token": None,
            "chat_template": state.template.source,
            "model_max_length": state.n_ctx,
        }
    )


def routes() -> list[web.RouteDef]:
    return [
        web.post("/tokenize", tokenize),
        web.post("/detokenize", detokenize),
        web.get("/tokenizer_info", tokenizer_info),
    ]
