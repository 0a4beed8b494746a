"""The grammars a request's answer is held to, compiled for one model's vocabulary: a JSON schema, a
GBNF grammar, and the grammar that forces a tool call in the model's own call format.

Compiling costs what the grammar asks for, not what the request weighs (a 26 KB GBNF of 1000 chained
rules takes 1.1 s, the first grammar 0.3 s more for the vocabulary's token trie); the server therefore
runs these off its event loop. A grammar that does not compile is the request's fault: RequestError
invalid_schema or invalid_grammar, saying what is wrong.
"""

from collections.abc import Mapping
from typing import Any

from bubo.engine.chat_request import ChatRequest
from bubo.engine.constraints import GrammarConstraint, ReasoningBudget, ReasoningTracker
from bubo.engine.grammar import (
    GrammarError,
    GrammarMatcher,
    Vocabulary,
    gbnf_grammar,
    json_schema_grammar,
    lark_grammar,
)
from bubo.engine.output_format import OutputConstraint
from bubo.engine.request_error import RequestError
from bubo.engine.token_choice import TokenConstraint
from bubo.engine.tool_grammar import tool_call_grammar
from bubo.templates.tool_calls import ToolCallFormat

__all__ = ["GrammarCompiler", "forces_tool_call", "request_constraints"]


class GrammarCompiler:
    """Matchers for one model's vocabulary (`tokenizer`, `vocab_size` rows of logits)."""

    def __init__(self, tokenizer: Vocabulary, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def _matcher(self, grammar: str) -> GrammarMatcher:
        return GrammarMatcher(grammar, self.tokenizer, self.vocab_size)

    def schema(self, schema: Mapping[str, Any], field_name: str) -> GrammarMatcher:
        """A matcher for JSON valid against `schema`, which the request's `field_name` asked for."""
        try:
            return self._matcher(json_schema_grammar(schema))
        except GrammarError as error:
            raise RequestError(
                f"{field_name}: the JSON schema is not usable: {error}",
                param=field_name,
                code="invalid_schema",
            ) from None

    def gbnf(self, source: str, field_name: str = "grammar") -> GrammarMatcher:
        """A matcher for a GBNF grammar (llama-server's `grammar`)."""
        try:
            return self._matcher(gbnf_grammar(source))
        except GrammarError as error:
            raise RequestError(f"{field_name}: {error}", param=field_name, code="invalid_grammar") from None

    def constraint(self, constraint: OutputConstraint | None) -> GrammarMatcher | None:
        """The matcher of an output constraint; None for none."""
        if constraint is None:
            return None
        if constraint.gbnf is not None:
            return self.gbnf(constraint.gbnf, constraint.field)
        assert constraint.schema is not None
        return self.schema(constraint.schema, constraint.field)

    def chat(
        self, chat: ChatRequest, calls: ToolCallFormat, constraint: OutputConstraint | None
    ) -> GrammarMatcher | None:
        """What a chat's answer is held to: a call of its tools in the model's format `calls` where
        tool_choice forces one ("required" or a named function), else its output constraint, if any.
        conflicting_fields when both are asked for."""
        if not forces_tool_call(chat):
            return self.constraint(constraint)
        if constraint is not None:
            raise RequestError(
                f"{constraint.field}: a constrained answer and a forced tool call cannot both be asked for",
                param=constraint.field,
                code="conflicting_fields",
            )
        assert chat.tools
        choice = chat.tool_choice
        try:
            return self._matcher(
                lark_grammar(tool_call_grammar(calls, chat.tools, name=choice.name, parallel=choice.parallel))
            )
        except GrammarError as error:
            # The forcing grammar embeds each tool's parameters schema: a broken one is the request's
            # fault, as it is in response_format.
            raise RequestError(
                f"tools: a tool's parameters schema is not usable: {error}",
                param="tools",
                code="invalid_schema",
            ) from None


def forces_tool_call(chat: ChatRequest) -> bool:
    """Whether the chat's answer must be a call of its tools."""
    return bool(chat.tools) and chat.tool_choice.mode != "none" and chat.tool_choice.forced


def request_constraints(
    tokenizer: Vocabulary,
    *,
    reasoning: bool,
    in_reasoning: bool,
    budget: int | None,
    grammar: GrammarMatcher | None,
) -> tuple[TokenConstraint, ...]:
    """A request's token constraints: its reasoning budget (where the prompt may reason) and its grammar,
    which holds the answer only, after any reasoning."""
    constraints: list[TokenConstraint] = []
    if reasoning and budget is not None:
        tracker = ReasoningTracker(tokenizer, reasoning=reasoning, in_reasoning=in_reasoning)
        constraints.append(ReasoningBudget(tokenizer, budget, tracker))
    if grammar is not None:
        tracker = ReasoningTracker(tokenizer, reasoning=reasoning, in_reasoning=in_reasoning)
        constraints.append(GrammarConstraint(grammar, tracker))
    return tuple(constraints)
