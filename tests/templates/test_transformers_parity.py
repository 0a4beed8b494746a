"""Bubo's ChatTemplate against transformers' own `apply_chat_template`, live.

The goldens in tests/fixtures/chat_templates/golden pin 32 recorded cases. This file widens that: every
fixture template is rendered for a grid of conversations (plain chat, multi-turn, tool calls with object
and JSON-string arguments, one and two tool results, reasoning in history and in the last turn, content
as text parts) and of options (generation prompt off, enable_thinking on/off, preserve_thinking,
reasoning_effort, a custom date_string, tools, documents), once by transformers (the reference, 5.24)
and once by Bubo. The two texts must be equal byte for byte, or both renderers must fail: a template
that raises under transformers must raise ChatTemplateError under Bubo, so a request that transformers
would refuse is never silently served with a different prompt.

The ChatML fallback (bubo/templates/chatml.jinja, used for GGUF files without a template) is checked at
the end, for plain chats and for the Hermes/Qwen tool-calling layout.
"""

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest

from bubo.templates.chat_template import ChatTemplate, ChatTemplateError

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
FALLBACK = Path(__file__).resolve().parent.parent.parent / "bubo" / "templates" / "chatml.jinja"
# Every real template, plus Bubo's own fallback: it too must mean the same to transformers.
PARITY_TEMPLATES = [*sorted(TEMPLATES.glob("*.jinja")), FALLBACK]
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}

Message = dict[str, Any]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer", "minimum": 1},
                    "safe": {"type": "boolean"},
                },
                "required": ["query"],
            },
        },
    },
]

DOCUMENTS: list[dict[str, str]] = [
    {"title": "Owls", "text": "Bubo bubo is the Eurasian eagle-owl."},
    {"title": "Weather", "text": "It rains a lot in Bergen."},
]

SYSTEM: Message = {"role": "system", "content": "You are a terse assistant."}
WEATHER_ARGS = {"city": "Zürich", "unit": "celsius"}
SEARCH_ARGS = {"query": "eagle owl <size>", "limit": 3, "safe": True}


def _call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_exchange(arguments_as_json: bool) -> list[Message]:
    args = json.dumps(WEATHER_ARGS, ensure_ascii=False) if arguments_as_json else WEATHER_ARGS
    return [
        SYSTEM,
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("call_1", "get_weather", args)]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
        {"role": "assistant", "content": "21 °C and clear."},
        {"role": "user", "content": "Thanks!"},
    ]


CONVERSATIONS: dict[str, list[Message]] = {
    "system_user": [SYSTEM, {"role": "user", "content": "Hi there"}],
    "user_only": [{"role": "user", "content": "Hi there"}],
    "multi_turn": [
        SYSTEM,
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And times 3?"},
    ],
    "tool_call_object_args": _tool_exchange(arguments_as_json=False),
    "tool_call_string_args": _tool_exchange(arguments_as_json=True),
    "two_tool_results": [
        SYSTEM,
        {"role": "user", "content": "Weather in Zürich, and search for eagle owls."},
        {
            "role": "assistant",
            "content": "Checking both.",
            "tool_calls": [
                _call("call_1", "get_weather", WEATHER_ARGS),
                _call("call_2", "search", SEARCH_ARGS),
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 °C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Bubo bubo: up to 75 cm."},
    ],
    "tool_call_null_content": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "get_weather", WEATHER_ARGS)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 °C"},
    ],
    "reasoning_in_history": [
        SYSTEM,
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4.", "reasoning_content": "Two plus two is four."},
        {"role": "user", "content": "And times 3?"},
    ],
    "reasoning_last_turn": [
        SYSTEM,
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4.", "reasoning_content": "Two plus two is four."},
        {"role": "user", "content": "And times 3?"},
        {"role": "assistant", "content": "12.", "reasoning_content": "Four times three is twelve."},
    ],
    "reasoning_aliases": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning": "Greet back.", "thinking": "Be kind."},
        {"role": "user", "content": "Bye"},
    ],
    "text_parts": [
        {"role": "system", "content": [{"type": "text", "text": "You are a terse assistant."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ],
}

# (name, render options): each conversation is rendered under every one of these.
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("default", {"add_generation_prompt": True}),
    ("no_generation_prompt", {"add_generation_prompt": False}),
    ("thinking_on", {"add_generation_prompt": True, "enable_thinking": True}),
    ("thinking_off", {"add_generation_prompt": True, "enable_thinking": False}),
    ("preserve_thinking", {"add_generation_prompt": True, "preserve_thinking": True}),
    ("reasoning_effort_low", {"add_generation_prompt": True, "reasoning_effort": "low"}),
    ("date_string", {"add_generation_prompt": True, "date_string": "01 Jan 2030"}),
    ("tools", {"add_generation_prompt": True, "tools": TOOLS}),
    ("tools_thinking_off", {"add_generation_prompt": True, "tools": TOOLS, "enable_thinking": False}),
    ("documents", {"add_generation_prompt": True, "documents": DOCUMENTS}),
]


@functools.cache
def _hf_tokenizer(source: str) -> Any:
    """A one-word tokenizer that carries `source`: only its chat-template machinery is exercised."""
    vocab = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=vocab, chat_template=source, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _render_hf(source: str, messages: list[Message], options: dict[str, Any]) -> str | Exception:
    """transformers' rendering, or the exception it raised (the template's own, or a Python error)."""
    options = copy.deepcopy(options)
    try:
        return _hf_tokenizer(source).apply_chat_template(
            copy.deepcopy(messages),
            tools=options.pop("tools", None),
            documents=options.pop("documents", None),
            tokenize=False,
            **options,
        )
    except Exception as error:  # the template decides what it raises; any failure counts as "fails"
        return error


def _render_bubo(template: ChatTemplate, messages: list[Message], options: dict[str, Any]) -> str | Exception:
    """Bubo's rendering, or the ChatTemplateError it raised (any other exception propagates: a bug)."""
    try:
        return template.render(copy.deepcopy(messages), **copy.deepcopy(options))
    except ChatTemplateError as error:
        return error


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("path", PARITY_TEMPLATES, ids=lambda p: p.stem)
def test_renders_like_transformers(path: Path, conversation: str) -> None:
    """Every option variant of one (template, conversation) pair: same bytes, or both fail."""
    source = path.read_text()
    template = ChatTemplate(source, SPECIAL_TOKENS)
    messages = CONVERSATIONS[conversation]
    mismatches = []
    for variant, options in VARIANTS:
        expected = _render_hf(source, messages, options)
        actual = _render_bubo(template, messages, options)
        if isinstance(expected, Exception) or isinstance(actual, Exception):
            if not (isinstance(expected, Exception) and isinstance(actual, Exception)):
                mismatches.append(f"{variant}: transformers -> {expected!r}\n  bubo -> {actual!r}")
        elif expected != actual:
            mismatches.append(f"{variant}:\n--- transformers\n{expected}\n--- bubo\n{actual}")
    assert not mismatches, "\n\n".join(mismatches)


# Small templates that probe the environment itself rather than a model's format: globals, the
# namespace's attribute guard, message preprocessing (seen whole through `tojson`), undefined variables.
PROBES: dict[str, str] = {
    "messages_tojson": "{{ messages | tojson }}",
    "tojson_options": "{{ messages[-1] | tojson(indent=2, sort_keys=True) }}",
    "tools_and_documents": "{{ tools | tojson }}|{{ documents | tojson }}|{{ add_generation_prompt }}",
    "special_tokens": "{{ bos_token }}|{{ eos_token }}",
    "undefined": "{{ nope }}|{{ nope is defined }}|{{ enable_thinking | default('unset') }}",
    "dict_global": "{{ dict(a=1, b=[2]) | tojson }}{{ dict.fromkeys(['x']) | tojson }}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "namespace_underscore_init": "{% set ns = namespace(_x=1) %}{{ ns._x }}",
    "namespace_underscore_set": "{% set ns = namespace(x=1) %}{% set ns._y = 2 %}{{ ns.x }}",
    "loop_controls": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.role }}{% endfor %}",
    "generation_tag": "{% for m in messages %}{% generation %}{{ m.role }}{% endgeneration %}{% endfor %}",
    "strftime_now": "{{ strftime_now('%Y') }}",
    "raise_exception": "{{ raise_exception('refused') }}",
    "python_string_of_values": "{{ messages | map(attribute='role') | list | string }}{{ true | string }}",
    "sandbox_mutation": "{% set _ = messages.append(1) %}",
}

PROBE_CONVERSATIONS: dict[str, list[Message]] = {
    **{name: CONVERSATIONS[name] for name in ("system_user", "two_tool_results", "reasoning_last_turn")},
    "reasoning_keys_mixed": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "a", "reasoning": "r", "thinking": "t"},
        {"role": "assistant", "content": "b", "reasoning_content": "rc", "thinking": "t2"},
        {"role": "assistant", "content": None, "reasoning_content": None, "reasoning": "only"},
    ],
    "empty": [],
}


@pytest.mark.parametrize("conversation", sorted(PROBE_CONVERSATIONS))
@pytest.mark.parametrize("probe", sorted(PROBES))
def test_environment_matches_transformers(probe: str, conversation: str) -> None:
    """The sandbox environment and the message preprocessing, probed directly: same bytes, or both fail."""
    source = PROBES[probe]
    messages = PROBE_CONVERSATIONS[conversation]
    template = ChatTemplate(source, SPECIAL_TOKENS)
    for options in (
        {"add_generation_prompt": True},
        {"add_generation_prompt": False, "tools": TOOLS, "documents": DOCUMENTS, "enable_thinking": False},
    ):
        expected = _render_hf(source, messages, options)
        actual = _render_bubo(template, messages, options)
        if isinstance(expected, Exception):
            assert isinstance(actual, Exception), (
                f"transformers raised {expected!r}, bubo rendered {actual!r}"
            )
        else:
            assert actual == expected


def test_the_grid_exercises_both_outcomes() -> None:
    """Guard against a vacuous grid: transformers must succeed on most cases and fail on a few (e.g.
    JSON-string arguments under Qwen3.5's `|items`), so both branches of the comparison are exercised."""
    outcomes = [
        isinstance(_render_hf(path.read_text(), CONVERSATIONS[name], options), Exception)
        for path in PARITY_TEMPLATES
        for name in ("tool_call_string_args", "system_user")
        for _, options in VARIANTS[:1]
    ]
    assert any(outcomes) and not all(outcomes)


# The ChatML fallback. Its message layout is Qwen2.5-Instruct's (the Hermes tool-calling format), so
# where Qwen2.5 adds nothing of its own (its default system prompt, its tool instructions) the two render
# the same bytes; the tool listing and the call/result blocks are compared against it directly.

QWEN25 = TEMPLATES / "Qwen2.5-Instruct.jinja"


def _fallback(messages: list[Message], **options: Any) -> str:
    return ChatTemplate.fallback(SPECIAL_TOKENS).render(copy.deepcopy(messages), **options)


def _qwen25(messages: list[Message], **options: Any) -> str:
    return ChatTemplate(QWEN25.read_text(), SPECIAL_TOKENS).render(copy.deepcopy(messages), **options)


def test_fallback_plain_chat_is_chatml() -> None:
    """Without tools the fallback is plain ChatML: no system turn is invented."""
    assert _fallback(CONVERSATIONS["multi_turn"]) == (
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd times 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert _fallback(CONVERSATIONS["user_only"], add_generation_prompt=False) == (
        "<|im_start|>user\nHi there<|im_end|>\n"
    )
    assert _fallback(CONVERSATIONS["text_parts"]) == _fallback(CONVERSATIONS["system_user"])


def test_fallback_with_tools_lists_them_in_the_system_turn() -> None:
    """With tools, the system turn keeps the system message, then lists each tool as one JSON line inside
    <tools></tools> (the same lines as Qwen2.5) and shows the <tool_call> answer format."""
    text = _fallback(CONVERSATIONS["system_user"], tools=TOOLS)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nYou are a terse assistant.\n\n# Tools\n\n")
    listing = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    qwen_listing = _qwen25(CONVERSATIONS["system_user"], tools=TOOLS).split("<tools>\n", 1)[1]
    assert listing == qwen_listing.split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in listing.split("\n")] == TOOLS
    assert system.endswith(
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    assert rest == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    # No system message: the tools turn stands alone, with no invented persona.
    alone = _fallback(CONVERSATIONS["user_only"], tools=TOOLS)
    assert alone.startswith("<|im_start|>system\n# Tools\n\n")
    assert alone.split("<|im_end|>\n", 1)[1] == rest


@pytest.mark.parametrize("conversation", ["tool_call_object_args", "two_tool_results"])
def test_fallback_tool_exchange_matches_qwen25(conversation: str) -> None:
    """A conversation with tool calls and results: assistant calls become <tool_call> JSON blocks and
    consecutive results share one user turn of <tool_response> blocks, byte for byte as Qwen2.5 writes
    them; with tools given, everything after the system turn is the same too."""
    messages = CONVERSATIONS[conversation]
    assert _fallback(messages) == _qwen25(messages)
    with_tools, qwen = _fallback(messages, tools=TOOLS), _qwen25(messages, tools=TOOLS)
    assert with_tools.split("<|im_end|>\n", 1)[1] == qwen.split("<|im_end|>\n", 1)[1]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}\n</tool_call>'
    assert call in with_tools
    assert "<|im_start|>user\n<tool_response>\n" in with_tools


def test_fallback_json_string_arguments_are_inserted_as_they_are() -> None:
    """Arguments given as a JSON string (the OpenAI wire form) render exactly like the same arguments given
    as an object, as in Qwen3's template. (Qwen2.5 would `tojson` the string a second time, printing an
    escaped string the model never saw in training; the fallback deliberately does not.)"""
    for tools in (None, TOOLS):
        assert _fallback(CONVERSATIONS["tool_call_string_args"], tools=tools) == _fallback(
            CONVERSATIONS["tool_call_object_args"], tools=tools
        )


def test_fallback_tool_call_without_content() -> None:
    """`content: null` next to tool calls (what OpenAI clients send) renders the calls alone."""
    text = _fallback(CONVERSATIONS["tool_call_null_content"], add_generation_prompt=False)
    assert text == (
        "<|im_start|>user\nWeather?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Zürich", "unit": "celsius"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n21 °C\n</tool_response><|im_end|>\n"
    )
