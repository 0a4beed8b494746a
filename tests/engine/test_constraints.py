"""Constrained generation: JSON schemas and tool-call grammars through llguidance, reasoning left free
before the grammar applies, and reasoning budgets that close the block. On the tiny random llama (its
output is noise, so whatever it writes under a grammar comes from the mask) and on scripted models."""

import json
from dataclasses import replace

import jsonschema
import pytest
import torch

from bubo.engine.constraints import GrammarConstraint, ReasoningBudget, ReasoningTracker
from bubo.engine.generate import GenerationResult, TextDelta, generate
from bubo.engine.grammar import GrammarError, GrammarMatcher, json_schema_grammar, lark_grammar
from bubo.engine.loaded_model import LoadedModel
from bubo.engine.sampler import SamplingParams
from bubo.engine.tool_grammar import tool_call_grammar
from bubo.templates.tool_calls import ToolCallParser
from tests.server.live_server import ScriptedModel

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def run(
    loaded: LoadedModel, prompt: str, params: SamplingParams, constraints: list, model=None
) -> GenerationResult:
    tokenizer = loaded.tokenizer
    events = generate(
        model or loaded.model, tokenizer, tokenizer.encode(prompt), params, constraints=constraints
    )
    return next(e for e in events if isinstance(e, GenerationResult))


def grammar_constraint(
    loaded: LoadedModel, grammar: str, *, reasoning: bool = False, in_reasoning: bool = False
):
    matcher = GrammarMatcher(grammar, loaded.tokenizer, loaded.config.vocab_size)
    tracker = ReasoningTracker(loaded.tokenizer, reasoning=reasoning, in_reasoning=in_reasoning)
    return GrammarConstraint(matcher, tracker)


@pytest.mark.parametrize("seed", range(4))
def test_sampled_output_of_a_random_model_validates(tiny_llama: LoadedModel, seed: int) -> None:
    constraint = grammar_constraint(tiny_llama, json_schema_grammar(SCHEMA))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=200)
    result = run(tiny_llama, "<|im_start|>user\nJSON<|im_end|>\n", params, [constraint])
    assert result.stop_reason == "eos"
    jsonschema.validate(json.loads(result.text), SCHEMA)


@pytest.mark.parametrize(
    "schema", [{"type": "objectx"}, {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}]
)
def test_an_invalid_schema_is_a_grammar_error(schema: dict) -> None:
    with pytest.raises(GrammarError):
        json_schema_grammar(schema)


@pytest.mark.parametrize("fmt", ["json", "xml"])
def test_a_forced_tool_call_parses_and_validates(tiny_llama: LoadedModel, fmt: str) -> None:
    grammar = lark_grammar(tool_call_grammar(fmt, TOOLS, parallel=False))
    constraint = grammar_constraint(tiny_llama, grammar)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=300)
    result = run(tiny_llama, "call", params, [constraint])
    parser = ToolCallParser(fmt, TOOLS)
    parser.feed(result.text)
    parser.flush()
    [call] = parser.calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])


def scripted(loaded: LoadedModel, text: str) -> ScriptedModel:
    script = loaded.tokenizer.encode(text, add_bos=False, parse_special=False)
    return ScriptedModel(loaded.config, script, loaded.tokenizer.token_to_id("<|im_end|>"))


def test_reasoning_is_free_then_the_answer_follows_the_grammar(tiny_llama: LoadedModel) -> None:
    """A model that thinks first: the mask lets the reasoning through, then holds the answer to the
    grammar (here the scripted answer fits it, so it comes out unchanged)."""
    text = '<think>\nany {not json} text</think>{"name": "Al", "age": 3}'
    constraint = grammar_constraint(tiny_llama, json_schema_grammar(SCHEMA), reasoning=True)
    result = run(
        tiny_llama, "go", SamplingParams(temperature=0.0), [constraint], model=scripted(tiny_llama, text)
    )
    assert result.text == text and result.stop_reason == "eos"


def test_without_reasoning_the_grammar_overrides_the_model(tiny_llama: LoadedModel) -> None:
    """A model that would write prose: under the grammar it cannot, and the output is the schema's."""
    constraint = grammar_constraint(tiny_llama, json_schema_grammar(SCHEMA))
    model = scripted(tiny_llama, "Sure! Here is some prose.")
    result = run(tiny_llama, "go", SamplingParams(temperature=0.0, max_tokens=300), [constraint], model=model)
    jsonschema.validate(json.loads(result.text), SCHEMA)


def test_a_reasoning_budget_closes_the_block(tiny_llama: LoadedModel) -> None:
    tokenizer = tiny_llama.tokenizer
    text = "<think>\n" + "thinking " * 40 + "</think>\n\nanswer"
    tracker = ReasoningTracker(tokenizer, reasoning=True, in_reasoning=False)
    budget = ReasoningBudget(tokenizer, 12, tracker)
    model = scripted(tiny_llama, text)
    params = SamplingParams(temperature=0.0, max_tokens=60)
    pieces = [
        e
        for e in generate(model, tokenizer, tokenizer.encode("go"), params, constraints=[budget])
        if isinstance(e, TextDelta)
    ]
    output = "".join(p.text for p in pieces)
    _, closed, rest = output.partition("</think>")
    assert closed and budget.spent == 12
    # 12 reasoning tokens after the opening tag, then the forced "\n</think>\n\n".
    opening = len(tokenizer.encode("<think>", add_bos=False))
    ids = [t for p in pieces for t in p.token_ids]
    forced = tokenizer.encode("\n</think>\n\n", add_bos=False)
    assert ids[opening + 12 : opening + 12 + len(forced)] == forced
    assert rest.startswith("\n\n")


def test_a_budget_that_is_not_reached_changes_nothing(tiny_llama: LoadedModel) -> None:
    tokenizer = tiny_llama.tokenizer
    text = "<think>\nshort</think>\n\nanswer"
    tracker = ReasoningTracker(tokenizer, reasoning=True, in_reasoning=False)
    result = run(
        tiny_llama,
        "go",
        SamplingParams(temperature=0.0),
        [ReasoningBudget(tokenizer, 500, tracker)],
        model=scripted(tiny_llama, text),
    )
    assert result.text == text


def test_the_tracker_follows_an_opened_block(tiny_llama: LoadedModel) -> None:
    tokenizer = tiny_llama.tokenizer
    tracker = ReasoningTracker(tokenizer, reasoning=True, in_reasoning=True)
    for token in tokenizer.encode("thinking</think>", add_bos=False):
        assert tracker.phase == "reasoning"
        tracker.accept(token)
    assert tracker.phase == "answer"
    undecided = ReasoningTracker(tokenizer, reasoning=True, in_reasoning=False)
    for token in tokenizer.encode("  plain", add_bos=False):
        undecided.accept(token)
    assert undecided.phase == "answer"


def test_masked_logits_keep_the_models_log_probabilities(tiny_llama: LoadedModel) -> None:
    """Constraints change what is drawn, not what the model reports: logprobs come from raw logits."""
    constraint = grammar_constraint(tiny_llama, json_schema_grammar(SCHEMA))
    tokenizer = tiny_llama.tokenizer
    events = list(
        generate(
            tiny_llama.model,
            tokenizer,
            tokenizer.encode("x"),
            SamplingParams(temperature=0.0, max_tokens=3),
            logprobs=0,
            constraints=[constraint],
        )
    )
    first = next(e for e in events if isinstance(e, TextDelta)).logprobs[0]
    with torch.inference_mode():
        logits = tiny_llama.model(
            torch.tensor([tokenizer.encode("x")]), tiny_llama.model.new_cache(max_len=8), last_only=True
        )[0, -1]
    assert first.logprob == pytest.approx(float(logits.log_softmax(-1)[first.token_id]), abs=1e-5)
    assert replace(first, top=()) == first


def _accepts(loaded: LoadedModel, grammar: str, text: str) -> bool:
    """Whether the grammar takes all of `text` and may end there."""
    matcher = GrammarMatcher(grammar, loaded.tokenizer, loaded.config.vocab_size)
    tokens = loaded.tokenizer.encode(text, add_bos=False, parse_special=False)
    return all(matcher.consume(t) for t in tokens) and bool(matcher.allowed()[loaded.tokenizer.eos_id])


LISTED = {"type": "object", "properties": {"a": {"type": "boolean"}}}


@pytest.mark.parametrize(
    ("schema", "text", "accepted"),
    [
        (LISTED, '{"a": true}', True),
        (LISTED, '{"a": true, "b": 1}', False),
        ({"type": "array", "items": LISTED}, '[{"a": true, "b": 1}]', False),
        ({"$defs": {"x": LISTED}, "$ref": "#/$defs/x"}, '{"b": 1}', False),
        ({**LISTED, "additionalProperties": True}, '{"a": true, "b": 1}', True),
        ({**LISTED, "additionalProperties": {"type": "integer"}}, '{"a": true, "b": 1}', True),
        ({**LISTED, "patternProperties": {"^b": {}}}, '{"a": true, "b": 1}', True),
        ({"type": "object"}, '{"a": true, "b": 1}', True),
        # allOf members each list part of the object: closing them would leave no key possible.
        ({"allOf": [LISTED, {"properties": {"b": {"type": "integer"}}}]}, '{"a": true, "b": 1}', True),
    ],
)
def test_an_object_that_lists_its_properties_takes_no_others_unless_it_says_so(
    tiny_llama: LoadedModel, schema: dict, text: str, accepted: bool
) -> None:
    assert _accepts(tiny_llama, json_schema_grammar(schema), text) is accepted


def test_a_forced_calls_arguments_take_no_properties_the_schema_does_not_list(
    tiny_llama: LoadedModel,
) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": LISTED}}]
    grammar = lark_grammar(tool_call_grammar("json", tools, parallel=False))
    call = '<tool_call>\n{"name": "f", "arguments": {"a": true%s}}\n</tool_call>'
    assert _accepts(tiny_llama, grammar, call % "")
    assert not _accepts(tiny_llama, grammar, call % ', "b": 1')
