"""The public Python API (bubo/api.py): the README's example runs as written, `forward` on explicit state
agrees with itself and with `generate`, and bad arguments are refused with a message."""

import contextlib
import io
import json
import re
from pathlib import Path

import httpx
import pytest
import torch

import bubo
from bubo.api import Model
from bubo.engine.loaded_model import LoadedModel
from bubo.engine.request import Finished, OutputDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from bubo.engine.request_error import RequestError
from tests.server.live_server import scripted, serve_loaded

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_api_example_runs(smollm2_path: Path) -> None:
    """The README's Python API section, its examples run in order exactly as a user would paste them."""
    section = README.read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    examples = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(examples) == 2
    printed = io.StringIO()
    names: dict = {}
    with contextlib.redirect_stdout(printed):
        for example in examples:
            exec(compile(example, "README.md", "exec"), names)
    text = printed.getvalue()
    assert "plan for llama on cpu:" in text
    assert " Paris" in text  # the greedy answer, and the token `forward` picks
    assert 'tool_calls get_weather {"city": "Paris"}' in text  # the forced call, parsed
    assert json.loads(text.strip().splitlines()[-1]) == {"capital": "Paris"}  # the JSON answer


@pytest.fixture
def model(tiny_llama: LoadedModel) -> Model:
    return Model(tiny_llama, ctx_size=64)


def test_forward_continues_its_state(model: Model) -> None:
    ids = [3, 17, 42, 7, 99, 5]
    whole = model.forward(ids)
    state = model.new_state()
    first = model.forward(ids[:4], state)
    rest = model.forward(ids[4:], state)
    assert whole.dtype == torch.float32 and whole.shape == (6, model.config.vocab_size)
    assert state.length == 6
    torch.testing.assert_close(torch.cat([first, rest]), whole, rtol=1e-5, atol=1e-5)


def test_forward_agrees_with_greedy_generate(model: Model) -> None:
    ids = [3, 17, 42, 7, 99]
    logits = model.forward(ids)
    answer = model.generate(ids, max_tokens=3, temperature=0)
    assert isinstance(answer, Finished)
    assert answer.result.token_ids[0] == int(logits[-1].argmax())
    assert answer.usage.prompt_tokens == 5 and answer.usage.completion_tokens == 3


def test_generate_streams_the_events_it_returns(model: Model) -> None:
    whole = model.generate("hello", max_tokens=6, temperature=0, ignore_eos=True)
    events = list(model.generate("hello", max_tokens=6, temperature=0, ignore_eos=True, stream=True))
    assert isinstance(events[-1], Finished) and all(isinstance(e, OutputDelta) for e in events[:-1])
    assert "".join(e.text for e in events[:-1]) == whole.content_text == events[-1].content_text
    # The second call continued the first's prompt: the slot's prompt cache served it.
    assert events[-1].usage.cached_tokens > 0


def test_one_generation_at_a_time(model: Model) -> None:
    first = model.generate("hello", max_tokens=4, temperature=0, stream=True)
    next(first)
    with pytest.raises(RuntimeError, match="generating already"):
        model.generate("hello", max_tokens=4)
    first.close()
    assert isinstance(model.generate("hello", max_tokens=2), Finished)


@pytest.mark.parametrize(
    ("prompt", "fields", "message"),
    [
        ("", {}, "empty"),
        ([10**9], {}, "token ids must be in"),
        ([1] * 64, {}, "context holds 64"),
        ("hi", {"top_p": 0.0}, "top_p"),
    ],
)
def test_generate_refuses_bad_input(model: Model, prompt: object, fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model.generate(prompt, **fields)


def test_generate_refuses_unknown_sampling_fields(model: Model) -> None:
    with pytest.raises(TypeError, match="temprature"):
        model.generate("hi", temprature=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"dtype": "float64"}, ValueError, "dtype"),
        ({"cache_type": "q8"}, ValueError, "cache_type"),
        ({"ctx_size": 1}, ValueError, "ctx_size"),
        ({"threads": 0}, ValueError, "threads"),
    ],
)
def test_load_refuses_bad_arguments(tiny_llama_path: Path, kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        bubo.load(tiny_llama_path, **kwargs)


def test_load_refuses_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model file not found"):
        bubo.load(tmp_path / "absent.gguf")
    with pytest.raises(FileNotFoundError, match="not a file"):
        bubo.load(tmp_path)


def test_load_with_options_and_context(tiny_llama_path: Path, runtime_options) -> None:
    runtime_options()  # the options in force are put back after the test
    with bubo.load(tiny_llama_path, ctx_size=32, options=bubo.RuntimeOptions(compile_decode=False)) as model:
        assert model.ctx_size == 32
        assert model.plan.decode.path == "eager"
        assert "--no-compile-decode" in model.plan.decode.reason
        assert model.generate("hi", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_trace_sees_the_prefill_and_every_decode_step(model: Model) -> None:
    ids = [3, 17, 42, 7, 99]
    with model.trace(sites=["residual", "logit_lens", "attention_probs"], layers=[0, 1]) as trace:
        assert model.plan.decode.reason.startswith("traced")
        answer = model.generate(ids, max_tokens=4, temperature=0, ignore_eos=True)
    assert not model.plan.decode.reason.startswith("traced")
    # The whole prompt in one pass, then a pass per generated token but the last.
    assert [(s.start, s.tokens) for s in trace.steps] == [(0, 5), (5, 1), (6, 1), (7, 1)]
    assert trace.tokens("residual", 0).shape == (1, 8, model.config.hidden_size)
    # The last layer's lens at each decode step picked the token the generation chose next.
    picks = [int(lens[0, -1].argmax()) for lens in trace["logit_lens", 1]]
    assert picks == answer.result.token_ids
    # The prompt's last-position pass through the last layer ran one query: so do its weights.
    assert [p.shape[2:] for p in trace["attention_probs", 1]] == [(1, 5), (1, 6), (1, 7), (1, 8)]
    assert [p.shape[2:] for p in trace["attention_probs", 0]] == [(5, 5), (1, 6), (1, 7), (1, 8)]


def test_a_steered_generation_leaves_no_trace_behind(model: Model) -> None:
    ids = [3, 17, 42, 7, 99]
    plain = model.generate(ids, max_tokens=6, temperature=0, ignore_eos=True).result.token_ids
    direction = 20 * torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with model.trace(sites=[]) as trace:
        trace.add("residual", direction, layers=[0])
        steered = model.generate(ids, max_tokens=6, temperature=0, ignore_eos=True)
    assert steered.result.token_ids != plain
    assert steered.usage.cached_tokens == 0  # the traced prompt was computed whole
    # The steered prompt cache is dropped: the same request is the unsteered answer again.
    again = model.generate(ids, max_tokens=6, temperature=0, ignore_eos=True)
    assert again.result.token_ids == plain


def test_steering_toward_a_token_makes_the_model_say_it(model: Model) -> None:
    """`steer` adds a vector to the last layer's residual at every step: along a token's row of the output
    head (through the final norm's gains) the greedy answer becomes that token, against it the token
    the model chose unsteered is never chosen."""
    ids, last = [3, 17, 42, 7, 99], len(model.decoder.layers) - 1
    plain = model.generate(ids, max_tokens=4, temperature=0, ignore_eos=True).result.token_ids
    target = next(t for t in range(10, model.config.vocab_size) if t not in plain)
    hidden = model.config.hidden_size
    with torch.inference_mode():
        head = model.decoder.output(torch.eye(hidden)).float()  # [hidden, vocab]: the head's rows
        gains = model.decoder.norm(torch.eye(hidden)).diagonal()
    toward = head[:, target] * gains
    with model.trace(sites=[], steer={last: 50 * toward / toward.norm()}):
        steered = model.generate(ids, max_tokens=4, temperature=0, ignore_eos=True).result.token_ids
    assert steered == [target] * 4
    away = head[:, plain[0]] * gains
    with model.trace(sites=["logit_lens"], layers=[last], steer={last: -50 * away / away.norm()}) as trace:
        avoided = model.generate(ids, max_tokens=4, temperature=0, ignore_eos=True).result.token_ids
    assert plain[0] not in avoided
    lens = trace.tokens("logit_lens", last)[0]
    assert (lens[:, plain[0]] < lens.median(dim=-1).values).all()


def test_trace_keywords_patch_and_ablate(model: Model) -> None:
    """`patch` reproduces the donor run's logits; `ablate_experts` is refused on a model without experts."""
    ids, donor_ids = [3, 17, 42, 7, 99], [5, 6, 7, 8, 9]
    with model.trace(sites=["residual"], layers=[0]) as donor:
        donor_logits = model.forward(donor_ids)
    with model.trace(sites=[], patch={0: donor}):
        torch.testing.assert_close(model.forward(ids), donor_logits, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="layer 0 has no router site"), model.trace(ablate_experts={0: [1]}):
        pass


def test_no_trace_while_generating(model: Model) -> None:
    running = model.generate("hello", max_tokens=4, stream=True)
    next(running)
    with pytest.raises(RuntimeError, match="finish or close that generation"), model.trace():
        pass
    running.close()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


# Exact activations: with the int8 matvecs a repeated prompt's last position, rerun from the prompt cache
# through the decode step, gets other logits than the fresh prompt's float GEMM gave it, and this small
# model's greedy answer to this question changes with them ("L'Étoile, la Marseillaise", as llama.cpp's
# int8 activations answer "L'Étoile, la Cit"), so the two calls below would disagree.
@pytest.mark.usefixtures("float_matvecs")
def test_chat_answers_as_the_default_model_does(smollm2: LoadedModel) -> None:
    model = Model(smollm2, ctx_size=256)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = model.chat(question, max_tokens=12, temperature=0)
    assert "Paris" in reply.text
    assert reply.finish_reason == "stop" and reply.reasoning == "" and reply.tool_calls == ()
    events = list(model.chat(question, max_tokens=12, temperature=0, stream=True))
    assert all(isinstance(e, OutputDelta) and e.channel == "content" for e in events[:-1])
    assert "".join(e.text for e in events[:-1]) == reply.text == events[-1].content_text
    # The chat template's prompt, rendered as the server renders it, and cached between the two calls.
    assert events[-1].usage.cached_tokens > 0


def test_chat_splits_off_the_reasoning_and_keeps_its_budget(qwen3_template_llama: LoadedModel) -> None:
    # A stand-in that thinks for 100 words (500 tokens of the byte-level vocabulary), then answers;
    # reasoning_effort "minimal" allows 256 tokens.
    model = Model(scripted(qwen3_template_llama, "<think>\n" + "step " * 100 + "</think>\n\nanswer"))
    free = model.chat(ASK, max_tokens=700)
    assert free.reasoning.split() == ["step"] * 100 and free.text == "answer"
    events = list(model.chat(ASK, reasoning_effort="minimal", max_tokens=700, stream=True))
    channels = [e.channel for e in events if isinstance(e, OutputDelta)]
    assert channels == sorted(channels, reverse=True) and channels[-1] == "content"  # reasoning first
    capped = events[-1]
    assert isinstance(capped, Finished)
    assert capped.reasoning_text.count("step") < 100 and capped.content_text
    assert capped.usage.reasoning_tokens >= 256


def test_a_forced_tool_call_is_parsed(long_llama: LoadedModel) -> None:
    # The forcing grammar makes even the tiny random model write a well-formed call (the tools prompt
    # takes ~540 tokens of its byte-level vocabulary: the 4096-token context holds it).
    model = Model(long_llama)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = model.chat(ASK, tools=[WEATHER], tool_choice=choice, max_tokens=200, temperature=0)
    assert reply.finish_reason == "tool_calls"
    (call,) = reply.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome", "Oslo")
    events = list(
        model.chat(ASK, tools=[WEATHER], tool_choice=choice, max_tokens=200, temperature=0, stream=True)
    )
    kinds = [type(e) for e in events if not isinstance(e, OutputDelta)]
    assert kinds == [ToolCallStart, *[ToolCallArguments] * (len(kinds) - 3), ToolCallEnd, Finished]
    streamed = "".join(e.fragment for e in events if isinstance(e, ToolCallArguments))
    assert json.loads(streamed) == json.loads(call.arguments)


def test_chat_is_prepared_as_the_server_prepares_it(long_llama: LoadedModel) -> None:
    # The same arguments to Model.chat and to /v1/chat/completions: the same prompt and the same answer,
    # a call held to the same forcing grammar.
    arguments = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 200}
    reply = Model(long_llama).chat(**arguments, temperature=0, parallel_tool_calls=False)
    server = serve_loaded(long_llama)
    try:
        body = {"model": "bubo", **arguments, "temperature": 0, "parallel_tool_calls": False}
        answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    finally:
        server.stop()
    (call,) = answer["choices"][0]["message"]["tool_calls"]
    assert answer["usage"]["prompt_tokens"] == reply.usage.prompt_tokens
    assert answer["choices"][0]["finish_reason"] == reply.finish_reason == "tool_calls"
    assert (call["function"]["name"], call["function"]["arguments"]) == (
        reply.tool_calls[0].name,
        reply.tool_calls[0].arguments,
    )


def test_a_json_schema_answer_is_valid_json(model: Model) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    reply = model.chat(
        ASK,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        max_tokens=40,
        temperature=0,
    )
    value = json.loads(reply.text)
    assert reply.finish_reason == "stop"
    assert set(value) == {"answer"} and 0 <= value["answer"] <= 99


@pytest.mark.parametrize(
    ("arguments", "param", "code", "message"),
    [
        ({"messages": []}, "messages", "missing_messages", "messages is required"),
        ({"tool_choice": "required"}, "tool_choice", "invalid_value", '"required" needs tools'),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice.function.name",
            "invalid_value",
            "'get_time' is not one of the tools",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value", "got 'yaml'"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "invalid_value", "must be one of off"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "conflicting_fields",
            "cannot both be asked for",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "data:,"}]}]},
            "messages[0].content",
            "unsupported_content",
            "takes text only",
        ),
        (
            {"messages": [{"role": "user", "content": "hi " * 80}]},
            None,
            "context_length_exceeded",
            "holds 64",
        ),
        ({"top_p": 0.0}, None, "invalid_value", "top_p must be in"),
    ],
)
def test_chat_refuses_bad_arguments(
    model: Model, arguments: dict, param: str, code: str, message: str
) -> None:
    with pytest.raises(RequestError, match=re.escape(message)) as refused:
        model.chat(**{"messages": ASK, **arguments})
    assert isinstance(refused.value, ValueError)
    assert (refused.value.param, refused.value.code) == (param, code)
