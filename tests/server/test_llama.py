"""The llama-server dialect over HTTP: /completion (JSON and SSE), /apply-template, /props, /slots."""

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bubo.engine.loaded_model import LoadedModel
from tests.server.live_server import GATED_TEXT as TEXT
from tests.server.live_server import GatedModel, LiveServer, serve_loaded

MODEL_ID = "tiny-llama-01b"


def script_ids(loaded: LoadedModel) -> list[int]:
    return loaded.tokenizer.encode(TEXT, add_bos=False, parse_special=False)


def idle_slot(gated_client: httpx.Client) -> dict[str, Any]:
    """/slots once the slot is idle: it counts a request as processing until its worker thread is
    done, which can be a moment after the answer went out."""
    deadline = time.monotonic() + 5
    while (slot := gated_client.get("/slots").json()[0])["is_processing"]:
        assert time.monotonic() < deadline, "the slot never became idle"
        time.sleep(0.01)
    return slot


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    """The `data:` payloads of an SSE body, in order."""
    for line in lines:
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


# POST /completion


def test_completion_runs_to_eos(
    gated_client: httpx.Client, gated_server: LiveServer, tiny_llama: LoadedModel
) -> None:
    response = gated_client.post("/completion", json={"prompt": "Say it:"})
    assert response.status_code == 200
    body = response.json()
    prompt_ids = gated_server.state.tokenize("Say it:")
    # The end token counts as a predicted token, as in llama-server, though it adds no text.
    predicted = len(script_ids(tiny_llama)) + 1
    assert body["content"] == TEXT
    assert body["stop"] is True
    assert body["stop_type"] == "eos"
    assert body["stopped_eos"] is True and body["stopped_word"] is False and body["stopped_limit"] is False
    assert body["stopping_word"] == ""
    assert body["truncated"] is False
    assert body["model"] == MODEL_ID
    assert body["prompt"] == "Say it:"
    assert body["tokens_evaluated"] == len(prompt_ids)
    assert body["tokens_predicted"] == predicted
    assert body["timings"]["predicted_n"] == predicted
    assert body["timings"]["prompt_n"] == len(prompt_ids) - body["tokens_cached"]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == predicted
    settings = body["generation_settings"]
    assert settings["n_ctx"] == 512
    assert settings["n_predict"] == 64
    assert settings["temperature"] == 0.0
    assert settings["stream"] is False
    assert isinstance(settings["seed_cur"], int)


def test_completion_stop_word(gated_client: httpx.Client) -> None:
    body = gated_client.post("/completion", json={"prompt": "Say it:", "stop": ["world"]}).json()
    assert body["content"] == "Hello "
    assert body["stop_type"] == "word"
    assert body["stopping_word"] == "world"
    assert body["stopped_word"] is True
    assert body["generation_settings"]["stop"] == ["world"]


def test_completion_limit(gated_client: httpx.Client, tiny_llama: LoadedModel) -> None:
    body = gated_client.post("/completion", json={"prompt": "Say it:", "n_predict": 3}).json()
    assert body["content"] == tiny_llama.tokenizer.decode(script_ids(tiny_llama)[:3])
    assert body["stop_type"] == "limit"
    assert body["stopped_limit"] is True
    assert body["tokens_predicted"] == 3
    assert body["generation_settings"]["n_predict"] == 3


def test_completion_token_prompt(gated_client: httpx.Client, tiny_llama: LoadedModel) -> None:
    ids = tiny_llama.tokenizer.encode("Token prompt", add_bos=False)
    body = gated_client.post("/completion", json={"prompt": ids, "n_predict": 2}).json()
    assert body["prompt"] == "Token prompt"
    assert body["tokens_evaluated"] == len(ids)


def test_completion_mixed_prompt(gated_client: httpx.Client, tiny_llama: LoadedModel) -> None:
    # llama-server's mixed prompt: token ids and strings make one prompt, each string tokenized in place.
    tokenizer = tiny_llama.tokenizer
    head, tail = tokenizer.encode("Mixed", add_bos=False), tokenizer.encode(" prompt", add_bos=False)
    body = gated_client.post("/completion", json={"prompt": [*head, " and", *tail], "n_predict": 2}).json()
    assert body["prompt"] == "Mixed and prompt"
    assert body["tokens_evaluated"] == len(head) + len(tokenizer.encode(" and", add_bos=False)) + len(tail)
    first = gated_client.post("/completion", json={"prompt": ["Mixed", *tail], "n_predict": 2}).json()
    assert first["tokens_evaluated"] == len(tokenizer.encode("Mixed")) + len(tail)  # BOS as the file says


def test_completion_with_n_predict_0_evaluates_the_prompt_into_the_cache(
    gated_client: httpx.Client, gated_server: LiveServer
) -> None:
    # llama-server's cache warming: the prompt runs, nothing is generated, and a request that extends
    # the prompt finds it cached.
    prompt = "Warm the cache with this prompt, then extend it"
    body = gated_client.post("/completion", json={"prompt": prompt, "n_predict": 0}).json()
    prompt_ids = gated_server.state.tokenize(prompt)
    assert body["content"] == "" and body["tokens_predicted"] == 0 and body["stopped_limit"] is True
    assert body["tokens_evaluated"] == len(prompt_ids) and body["timings"]["prompt_n"] == len(prompt_ids)
    follow = gated_client.post("/completion", json={"prompt": prompt + " now", "n_predict": 1}).json()
    assert follow["timings"]["cache_n"] >= len(prompt_ids) - 1
    streamed = gated_client.post("/completion", json={"prompt": prompt, "n_predict": 0, "stream": True})
    chunks = [
        json.loads(line[len("data: ") :]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    assert [c["stop"] for c in chunks] == [True] and chunks[0]["tokens_predicted"] == 0


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        ({"prompt": "x", "n_predict": -2}, 400, "invalid_value"),
        ({"n_predict": 4}, 400, "invalid_value"),
        ({"prompt": [1, 99999]}, 400, "invalid_value"),
        ({"prompt": [1, "x", -3]}, 400, "invalid_value"),
        ({"prompt": [1, "x", True]}, 400, "invalid_value"),
        ({"prompt": ["one", "two"]}, 400, "unsupported_n"),
        ({"prompt": "x", "model": "nope"}, 404, "model_not_found"),
    ],
)
def test_completion_errors(
    gated_client: httpx.Client, payload: dict[str, Any], status: int, code: str
) -> None:
    response = gated_client.post("/completion", json=payload)
    assert response.status_code == status
    assert response.json()["error"]["code"] == code


def test_completion_accepts_served_names(gated_client: httpx.Client) -> None:
    for name in ("bubo", MODEL_ID):
        body = gated_client.post(
            "/completion", json={"prompt": "Say it:", "model": name, "n_predict": 1}
        ).json()
        assert body["model"] == name


def test_completion_stream(gated_client: httpx.Client, tiny_llama: LoadedModel) -> None:
    with gated_client.stream("POST", "/completion", json={"prompt": "Say it:", "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = list(sse_events(response.iter_lines()))
    # llama-server's /completion stream has no [DONE] sentinel: the chunk with stop true is the end.
    assert "[DONE]" not in payloads
    chunks = [json.loads(p) for p in payloads]
    *pieces, last = chunks
    assert pieces and all(c["stop"] is False and set(c) >= {"content", "index"} for c in pieces)
    assert "".join(c["content"] for c in pieces) == TEXT
    assert last["stop"] is True
    assert last["content"] == ""
    assert last["stop_type"] == "eos"
    assert last["tokens_predicted"] == len(script_ids(tiny_llama)) + 1
    assert last["generation_settings"]["stream"] is True
    assert last["timings"]["predicted_n"] == last["tokens_predicted"]
    assert last["usage"]["completion_tokens"] == last["tokens_predicted"]


# POST /apply-template

CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
RENDERED = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_apply_template(gated_client: httpx.Client) -> None:
    # No model is needed, and stream is ignored: the answer is one JSON object.
    response = gated_client.post("/apply-template", json={**CHAT, "stream": True})
    assert response.status_code == 200
    assert response.json() == {"prompt": RENDERED}


def test_apply_template_is_what_generation_uses(gated_client: httpx.Client, gated_server: LiveServer) -> None:
    prompt = gated_client.post("/apply-template", json=CHAT).json()["prompt"]
    chat = gated_client.post("/v1/chat/completions", json={**CHAT, "model": "bubo", "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(gated_server.state.tokenize(prompt))


@pytest.mark.parametrize(
    "switch",
    [{"add_generation_prompt": False}, {"chat_template_kwargs": {"add_generation_prompt": False}}],
)
def test_apply_template_without_the_generation_prompt(gated_client: httpx.Client, switch: dict) -> None:
    # llama-server takes the field at the top level; chat_template_kwargs reach the template too.
    response = gated_client.post("/apply-template", json={**CHAT, **switch})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": RENDERED.removesuffix("<|im_start|>assistant\n")}
    opened = gated_client.post("/apply-template", json={**CHAT, "add_generation_prompt": True})
    assert opened.json() == {"prompt": RENDERED}


def test_apply_template_continues_a_final_assistant_message_without_the_generation_prompt(
    gated_client: httpx.Client,
) -> None:
    messages = [*CHAT["messages"], {"role": "assistant", "content": "Hello"}]
    for flag in (True, False):
        body = {"messages": messages, "add_generation_prompt": flag}
        prompt = gated_client.post("/apply-template", json=body).json()["prompt"]
        assert prompt == RENDERED + "Hello", flag


def test_apply_template_refuses_a_contradictory_generation_prompt(gated_client: httpx.Client) -> None:
    both = {"add_generation_prompt": True, "chat_template_kwargs": {"add_generation_prompt": False}}
    conflict = gated_client.post("/apply-template", json={**CHAT, **both})
    assert conflict.status_code == 400
    assert conflict.json()["error"]["code"] == "conflicting_fields"
    for switch in ({"add_generation_prompt": "no"}, {"chat_template_kwargs": {"add_generation_prompt": 0}}):
        invalid = gated_client.post("/apply-template", json={**CHAT, **switch})
        assert invalid.status_code == 400, switch
        assert invalid.json()["error"]["code"] == "invalid_value"


def test_apply_template_errors(gated_client: httpx.Client) -> None:
    missing = gated_client.post("/apply-template", json={})
    assert missing.status_code == 400
    assert missing.json()["error"]["code"] == "missing_messages"
    unknown = gated_client.post("/apply-template", json={**CHAT, "model": "nope"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"


# GET /props


def test_props(gated_client: httpx.Client, tiny_llama: LoadedModel) -> None:
    response = gated_client.get("/props")
    assert response.status_code == 200
    props = response.json()
    assert props["model"] == MODEL_ID
    assert props["model_alias"] == MODEL_ID
    assert props["model_path"] == str(tiny_llama.path)
    template = tiny_llama.file.metadata["tokenizer.chat_template"]
    assert props["template"] == props["chat_template"] == template
    info = props["model_info"]
    assert info["architecture"] == "llama"
    assert info["n_vocab"] == 320
    assert info["n_ctx_train"] == 512
    assert info["n_embd"] == 64
    assert info["n_layer"] == 2
    assert info["n_head"] == 4 and info["n_head_kv"] == 2
    assert info["n_params"] == sum(t.n_elements for t in tiny_llama.file.tensors.values()) > 0
    assert info["size"] == tiny_llama.path.stat().st_size
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 512
    params = settings["params"]
    assert params["temperature"] == 0.0
    assert params["n_predict"] == 64
    assert params["seed"] == -1
    assert (params["top_k"], params["top_p"], params["min_p"]) == (40, 0.95, 0.05)
    assert params["repeat_penalty"] == 1.0
    assert props["total_slots"] == 1
    assert props["build_info"].startswith("bubo-")


def test_slots_show_the_last_requests_settings_and_props_the_defaults(gated_client: httpx.Client) -> None:
    gated_client.post(
        "/completion", json={"prompt": "Say it:", "n_predict": 2, "top_k": 5, "temperature": 0.5}
    )
    params = gated_client.get("/slots").json()[0]["params"]
    assert (params["top_k"], params["temperature"], params["n_predict"]) == (5, 0.5, 2)
    defaults = gated_client.get("/props").json()["default_generation_settings"]["params"]
    assert (defaults["top_k"], defaults["temperature"], defaults["n_predict"]) == (40, 0.0, 64)


def test_props_model_query(gated_client: httpx.Client) -> None:
    for name in ("bubo", MODEL_ID):
        response = gated_client.get("/props", params={"model": name})
        assert response.status_code == 200
        assert response.json()["model"] == MODEL_ID
    unknown = gated_client.get("/props", params={"model": "nope"})
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert error["code"] == "model_not_found"
    assert error["type"] == "invalid_request_error"
    assert MODEL_ID in error["message"]


# GET /slots


def test_slots_idle(gated_client: httpx.Client) -> None:
    reply = gated_client.post("/completion", json={"prompt": "A longer prompt here", "n_predict": 4})
    done = reply.json()
    idle_slot(gated_client)
    for path in ("/slots", "/v1/slots"):
        response = gated_client.get(path)
        assert response.status_code == 200
        [slot] = response.json()
        assert slot["id"] == 0
        assert slot["n_ctx"] == 512
        assert slot["is_processing"] is False
        assert slot["state"] == 0
        assert slot["n_prompt_tokens"] == done["tokens_evaluated"]
        # Four tokens were sampled; the last one never went through the model.
        assert slot["n_cached_tokens"] == done["tokens_evaluated"] + 3
        # The id the client saw in x-request-id, not an internal one.
        assert slot["last_request_id"] == reply.headers["x-request-id"]
        assert slot["last_request_id"].startswith("req_")
    named = gated_client.post(
        "/completion", json={"prompt": "Again", "n_predict": 2}, headers={"x-request-id": "client-7"}
    )
    assert named.headers["x-request-id"] == "client-7"
    idle_slot(gated_client)
    assert gated_client.get("/slots").json()[0]["last_request_id"] == "client-7"


def test_slots_while_processing(
    gated_client: httpx.Client, gated_server: LiveServer, gated: GatedModel
) -> None:
    gated.gate.clear()
    try:
        with gated_client.stream(
            "POST", "/completion", json={"prompt": "Busy now:", "stream": True}
        ) as response:
            lines = response.iter_lines()
            first = json.loads(next(sse_events(lines)))
            assert first["stop"] is False
            with httpx.Client(base_url=gated_server.url, timeout=10) as other:
                [slot] = other.get("/slots").json()
            assert slot["is_processing"] is True
            assert slot["state"] == 1
            assert slot["n_prompt_tokens"] == len(gated_server.state.tokenize("Busy now:"))
            gated.gate.set()
            last = json.loads(list(sse_events(lines))[-1])
            assert last["stop"] is True
    finally:
        gated.gate.set()
    assert idle_slot(gated_client)["state"] == 0


def test_not_ready(tiny_llama: LoadedModel) -> None:
    loading = serve_loaded(None, model_path=tiny_llama.path)
    try:
        with httpx.Client(base_url=loading.url, timeout=10) as c:
            for method, path in (("GET", "/props"), ("GET", "/slots"), ("POST", "/completion")):
                response = c.request(method, path, json={"prompt": "x"} if method == "POST" else None)
                assert response.status_code == 503, path
                assert response.json()["error"]["code"] == "not_ready"
    finally:
        loading.stop()


def test_completion_follows_a_gbnf_grammar(tiny_server: LiveServer) -> None:
    """The tiny model writes noise; the grammar alone decides what can come out."""
    grammar = 'root ::= answer " " number\nanswer ::= "yes" | "no"\nnumber ::= [1-9] [0-9]?'
    for seed in range(3):
        body = {"prompt": "Decide:", "grammar": grammar, "n_predict": 20, "temperature": 1.0, "seed": seed}
        reply = httpx.post(tiny_server.url + "/completion", json=body).json()
        answer, number = reply["content"].split(" ")
        assert answer in ("yes", "no") and 1 <= int(number) <= 99
        assert reply["stop_type"] == "eos"


def test_completion_follows_a_json_schema(tiny_server: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    reply = httpx.post(
        tiny_server.url + "/completion",
        json={"prompt": "x", "json_schema": schema, "temperature": 1.0, "seed": 1},
    ).json()
    assert isinstance(json.loads(reply["content"])["ok"], bool)


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"grammar": "root ::= ("}, "invalid_grammar", "grammar"),
        ({"json_schema": {"type": "nope"}}, "invalid_schema", "json_schema"),
        # No text matches these: each way to begin them needs themselves.
        ({"grammar": 'root ::= root "a"'}, "invalid_grammar", "grammar"),
        ({"json_schema": {"$ref": "#"}}, "invalid_schema", "json_schema"),
        ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "conflicting_fields", "grammar"),
    ],
)
def test_completion_constraint_errors(tiny_server: LiveServer, body: dict, code: str, param: str) -> None:
    response = httpx.post(tiny_server.url + "/completion", json={"prompt": "x", **body})
    assert response.status_code == 400
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == (code, param)
