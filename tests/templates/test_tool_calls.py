"""The streaming tool-call parser: both formats, tags split anywhere, typed XML values, malformed calls
returned verbatim, and calls rendered by the real templates parsed back."""

import json
import random
import re
from pathlib import Path

import pytest

from bubo.templates.chat_template import ChatTemplate
from bubo.templates.reasoning import ReasoningSplitter
from bubo.templates.tool_calls import (
    TextPiece,
    ToolCall,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallFormat,
    ToolCallParser,
    ToolCallStart,
    ToolEvent,
    tool_call_format,
)

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"


def _tool(name: str, **properties: str) -> dict:
    schema = {"type": "object", "properties": {key: {"type": kind} for key, kind in properties.items()}}
    return {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}


WEATHER = _tool("get_weather", city="string", days="integer")
TYPED = _tool(
    "typed",
    text="string",
    count="integer",
    ratio="number",
    flag="boolean",
    options="object",
    items="array",
    nothing="null",
)
TOOLS = [WEATHER, TYPED]


def parse(
    pieces: list[str], fmt: ToolCallFormat = "json", tools: list[dict] | None = None, *, parallel: bool = True
) -> list[ToolEvent]:
    """The events of one output, with adjacent text pieces merged and call ids blanked out."""
    parser = ToolCallParser(fmt, tools, parallel=parallel)
    events: list[ToolEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.flush()
    merged: list[ToolEvent] = []
    for event in events:
        if isinstance(event, ToolCallStart):
            assert re.fullmatch(r"call_[a-z0-9]{24}", event.id)
            event = ToolCallStart(event.index, "", event.name)
        if isinstance(event, TextPiece) and merged and isinstance(merged[-1], TextPiece):
            merged[-1] = TextPiece(merged[-1].text + event.text)
        elif not (isinstance(event, TextPiece) and not event.text):
            merged.append(event)
    _check_calls(merged)
    return merged


def _check_calls(events: list[ToolEvent]) -> None:
    """Every call is Start, fragments, End, and the fragments join to the compact arguments JSON."""
    fragments: dict[int, str] = {}
    for event in events:
        if isinstance(event, ToolCallArguments):
            fragments[event.index] = fragments.get(event.index, "") + event.fragment
        if isinstance(event, ToolCallEnd):
            assert fragments[event.index] == event.arguments
            assert json.dumps(json.loads(event.arguments), ensure_ascii=False) == event.arguments


def calls(events: list[ToolEvent]) -> list[tuple[str, dict]]:
    names = {event.index: event.name for event in events if isinstance(event, ToolCallStart)}
    return [(names[e.index], json.loads(e.arguments)) for e in events if isinstance(e, ToolCallEnd)]


def text(events: list[ToolEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, TextPiece))


def chunkings(output: str) -> list[list[str]]:
    """The whole output, one character at a time, every two-way split, and seeded random chunkings."""
    ways = [[output], list(output)]
    ways += [[output[:at], output[at:]] for at in range(1, len(output))]
    rng = random.Random(1234)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(output)), min(len(output) - 1, rng.randint(1, 12))))
        ways.append([output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)], strict=True)])
    return ways


JSON_OUTPUT = (
    "Let me check both.\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich </tool_call>"}}\n</tool_call>'
)
XML_OUTPUT = (
    "Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nA </tool_call> B\n</parameter>\n"
    "</function>\n</tool_call>\nDone."
)


@pytest.mark.parametrize(
    ("fmt", "output", "expected"),
    [
        (
            "json",
            JSON_OUTPUT,
            [
                TextPiece("Let me check both."),
                ToolCallStart(0, "", "get_weather"),
                ToolCallArguments(0, '{"city": "Paris"'),
                ToolCallArguments(0, ', "days": 3}'),
                ToolCallEnd(0, '{"city": "Paris", "days": 3}'),
                ToolCallStart(1, "", "get_weather"),
                ToolCallArguments(1, '{"city": "Zürich </tool_call>"}'),
                ToolCallEnd(1, '{"city": "Zürich </tool_call>"}'),
            ],
        ),
        (
            "xml",
            XML_OUTPUT,
            [
                TextPiece("Checking."),
                ToolCallStart(0, "", "get_weather"),
                ToolCallArguments(0, '{"city": "Paris"'),
                ToolCallArguments(0, ', "days": 3}'),
                ToolCallEnd(0, '{"city": "Paris", "days": 3}'),
                ToolCallStart(1, "", "get_weather"),
                ToolCallArguments(1, '{"city": "A </tool_call> B"}'),
                ToolCallEnd(1, '{"city": "A </tool_call> B"}'),
                TextPiece("\nDone."),
            ],
        ),
    ],
)
def test_every_chunking_gives_the_same_events(fmt: ToolCallFormat, output: str, expected: list) -> None:
    for pieces in chunkings(output):
        assert parse(pieces, fmt, TOOLS) == expected, pieces


MALFORMED = [
    ("json", '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>'),
    ("json", '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call> ok'),
    ("json", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),
    ("json", '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>'),
    ("json", '<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call>'),
    ("json", '<tool_call>\n{"name": "get_weather", "arguments": {"days": NaN}}\n</tool_call>'),
    ("json", "Use a <tool_call> tag, then close it with </tool_call>, like so."),
    ("json", "Tags: <tool_call>, <tool_call>{oops</tool_call> and more"),
    ("xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"),
    ("xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"),
    ("xml", "<tool_call>\n<function=nope>\n</function>\n</tool_call>"),
    ("xml", "<tool_call>\n<function=>\n</function>\n</tool_call>"),
    ("xml", "<tool_call>\n<function=get_weather>\nstray\n</function>\n</tool_call>"),
    ("xml", "In XML the <function=name> tag opens a call and <tool_call> wraps it"),
    ("xml", "Call <function=get_weather> with the city.\n</function>"),
]


@pytest.mark.parametrize(("fmt", "output"), MALFORMED)
def test_malformed_calls_come_back_as_the_exact_text(fmt: ToolCallFormat, output: str) -> None:
    for pieces in [[output], list(output)]:
        assert parse(pieces, fmt, TOOLS) == [TextPiece(output)]


UNFINISHED = [
    ("json", 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "Hi"),
    ("json", '<tool_call>\n{"name": "get_', ""),
    ("json", "Tags: <tool_call>, and <tool_", "Tags: <tool_call>, and"),
    ("xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>", ""),
    ("xml", "Checking.\n<function=get_weather>\n<parameter=ci", "Checking."),
]


@pytest.mark.parametrize(("fmt", "output", "answer"), UNFINISHED)
def test_a_call_the_output_ends_inside_is_dropped(fmt: ToolCallFormat, output: str, answer: str) -> None:
    # The token limit cuts a call short: its markup is no answer text, and it is no call.
    for pieces in chunkings(output):
        assert text(parse(pieces, fmt, TOOLS)) == answer, pieces


def test_an_unfinished_call_after_a_complete_one_is_dropped() -> None:
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for pieces in chunkings(f'{first}\n<tool_call>\n{{"name":'):
        events = parse(pieces, "json", TOOLS)
        assert calls(events) == [("get_weather", {"city": "Oslo"})]
        assert text(events) == ""


def test_a_malformed_call_does_not_hide_a_good_one_after_it() -> None:
    bad = '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for pieces in chunkings(f"{bad}\n{good}"):
        events = parse(pieces, "json", TOOLS)
        assert events[0] == TextPiece(bad)
        assert calls(events) == [("get_weather", {"city": "Oslo"})]


def test_prose_tag_then_a_real_call() -> None:
    output = 'See <tool_call>x<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    for pieces in chunkings(output):
        events = parse(pieces)
        assert events[0] == TextPiece("See <tool_call>x")
        assert calls(events) == [("a", {})]


def test_plain_text_streams_out_at_once() -> None:
    parser = ToolCallParser("json")
    assert parser.feed("Hello, wor") == [TextPiece("Hello, wor")]
    assert parser.feed("ld <to") == [TextPiece("ld")]
    assert parser.feed("ol>") == [TextPiece(" <tool>")]
    assert parser.feed("\n\n") == []
    assert parser.flush() == [TextPiece("\n\n")]


def test_a_call_is_emitted_as_soon_as_it_closes() -> None:
    parser = ToolCallParser("json")
    assert parser.feed('<tool_call>{"name": "a", "arguments": {"k": 1}}') == []
    events = parser.feed("</tool_call>")
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArguments, ToolCallEnd]
    assert parser.calls == [ToolCall(events[0].id, "a", '{"k": 1}')]


def test_text_after_the_calls_keeps_its_blank_line_but_trailing_whitespace_goes() -> None:
    call = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    assert text(parse([f"{call}\n\nAll done.\n"])) == "\n\nAll done.\n"
    assert parse([f"\n{call}\n\n"]) == [
        ToolCallStart(0, "", "a"),
        ToolCallArguments(0, "{}"),
        ToolCallEnd(0, "{}"),
    ]


def test_arguments_as_a_json_string_are_normalized() -> None:
    output = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\":\\"Lyon\\",\\"days\\":2}"}\n</tool_call>'
    events = parse([output], "json", TOOLS)
    assert events[-1] == ToolCallEnd(0, '{"city": "Lyon", "days": 2}')


def test_without_tools_any_name_is_a_call() -> None:
    output = '<tool_call>{"name": "anything", "arguments": {"x": [1, {"y": null}]}}</tool_call>'
    assert calls(parse([output])) == [("anything", {"x": [1, {"y": None}]})]


def test_parallel_false_keeps_only_the_first_call() -> None:
    first = '<tool_call>\n{"name": "a", "arguments": {"n": 1}}\n</tool_call>'
    second = '<tool_call>\n{"name": "b", "arguments": {"n": 2}}\n</tool_call>'
    for pieces in chunkings(f"{first}\n{second}"):
        events = parse(pieces, parallel=False)
        assert calls(events) == [("a", {"n": 1})]
        assert text(events) == f"\n{second}"


def test_ids_are_fresh_and_indexes_count_up() -> None:
    one = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    parser = ToolCallParser("json")
    starts = [e for e in parser.feed(one * 3) if isinstance(e, ToolCallStart)]
    other = [e for e in ToolCallParser("json").feed(one) if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == [0, 1, 2]
    assert len({s.id for s in starts + other}) == 4
    assert [c.id for c in parser.calls] == [s.id for s in starts]


def _xml(name: str, **values: str) -> str:
    params = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in values.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_xml_values_are_typed_by_the_schema_in_written_order() -> None:
    output = _xml(
        "typed",
        unknown="[1, 2]",
        text="line one\n  line two\n",
        count="42",
        ratio="2.5",
        flag="True",
        options='{"a": {"b": null}}',
        items='["x", 1]',
        nothing="None",
        word="hello world",
    )
    events = parse(list(output), "xml", TOOLS)
    end = events[-1]
    assert isinstance(end, ToolCallEnd)
    assert list(json.loads(end.arguments).items()) == [
        ("unknown", [1, 2]),
        ("text", "line one\n  line two\n"),
        ("count", 42),
        ("ratio", 2.5),
        ("flag", True),
        ("options", {"a": {"b": None}}),
        ("items", ["x", 1]),
        ("nothing", None),
        ("word", "hello world"),
    ]
    assert len([e for e in events if isinstance(e, ToolCallArguments)]) == 9


def test_xml_string_parameters_stay_strings_and_bad_numbers_fall_back() -> None:
    output = _xml("typed", text="123", count="many", flag="false")
    assert calls(parse([output], "xml", TOOLS)) == [
        ("typed", {"text": "123", "count": "many", "flag": False})
    ]


def test_xml_without_schema_parses_json_or_keeps_text() -> None:
    output = _xml("free", a="7", b="true", c="Paris", d='"quoted"')
    assert calls(parse([output], "xml")) == [("free", {"a": 7, "b": True, "c": "Paris", "d": "quoted"})]


def test_xml_call_without_the_tool_call_wrapper() -> None:
    output = "Sure.\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\nThere."
    for pieces in chunkings(output):
        events = parse(pieces, "xml", TOOLS)
        assert calls(events) == [("get_weather", {"city": "Rome"})]
        assert text(events) == "Sure.\nThere."


@pytest.mark.parametrize("path", sorted(TEMPLATES.glob("*.jinja")), ids=lambda p: p.stem)
def test_format_detection_on_the_shipped_templates(path: Path) -> None:
    xml = {"Qwen3-Coder", "Qwen3.5", "Qwen3.6"}
    assert tool_call_format(path.read_text()) == ("xml" if path.stem in xml else "json")


ROUND_TRIP_ARGUMENTS = [
    ("get_weather", {"city": "São Paulo", "days": 3}),
    (
        "typed",
        {
            "text": "first line\n\nsecond <b>line</b>",
            "count": -7,
            "ratio": 0.25,
            "flag": False,
            "options": {"deep": [1, {"x": "y"}]},
            "items": ["a", "b"],
        },
    ),
]


@pytest.mark.parametrize(
    "name", ["Qwen3", "Qwen3.5", "Qwen3.6", "Qwen3-Coder", "Qwen2.5-Instruct", "Qwen3-Next-Instruct"]
)
def test_calls_rendered_by_the_template_parse_back(name: str) -> None:
    source = (TEMPLATES / f"{name}.jinja").read_text()
    tool_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(ROUND_TRIP_ARGUMENTS)
    ]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking it up.", "tool_calls": tool_calls},
    ]
    prompt = ChatTemplate(source).render(messages, tools=TOOLS, add_generation_prompt=False)
    turn = prompt.rsplit("<|im_start|>assistant\n", 1)[1].split("<|im_end|>")[0]
    splitter = ReasoningSplitter()
    content = "".join(
        piece for channel, piece in splitter.feed(turn) + splitter.flush() if channel == "content"
    )
    for pieces in chunkings(content)[:25]:
        events = parse(pieces, tool_call_format(source), TOOLS)
        assert text(events) == "Looking it up."
        assert calls(events) == ROUND_TRIP_ARGUMENTS
