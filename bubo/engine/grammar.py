"""Grammars for constrained decoding, compiled by llguidance.

llguidance (Microsoft's Rust grammar engine behind `guidance`, also used by llama.cpp and vLLM) takes
a JSON schema or a Lark grammar and, at every step, computes which tokens of the vocabulary may come
next. It was chosen over xgrammar because it computes a mask in well under a millisecond without a
per-schema precompilation step (agents send a different schema with every request), it accepts
any vocabulary given as token bytes (Bubo builds its tokenizer from GGUF metadata, not from a Hugging
Face tokenizer), its Lark dialect embeds JSON schemas (`%json {...}`), which is what a forced tool call
in a model's own format needs, and it ships CPU wheels with no torch or CUDA build dependency.
"""

import json
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

__all__ = [
    "JSON_LAYOUT",
    "GrammarError",
    "GrammarMatcher",
    "closed_objects",
    "gbnf_grammar",
    "json_schema_grammar",
    "lark_grammar",
]


class GrammarError(ValueError):
    """The schema or grammar cannot be compiled; the message says what is wrong."""


class Vocabulary(Protocol):
    """What llguidance needs from bubo.model.tokenizer.Tokenizer."""

    bos_id: int | None
    eos_id: int | None
    stop_ids: frozenset[int]
    vocab_size: int

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]: ...


class _TokenizerView:
    """A tokenizer as llguidance's TokenizerWrapper reads it: every token's bytes, special tokens
    marked with a leading 0xFF byte (llguidance's convention, so grammar text never matches them)."""

    def __init__(self, tokenizer: Vocabulary, n_vocab: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        size = tokenizer.vocab_size
        self.tokens = [
            (b"\xff" if tokenizer.is_special(i) else b"") + tokenizer.token_bytes(i) for i in range(size)
        ] + [b""] * max(0, n_vocab - size)
        self.special_token_ids = [i for i in range(size) if tokenizer.is_special(i)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_bos=False, parse_special=False)


# Building llguidance's token trie takes ~0.5 s for a 50k vocabulary: once per tokenizer.
_LL_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict[int, llguidance.LLTokenizer]]" = (
    weakref.WeakKeyDictionary()
)


def _ll_tokenizer(tokenizer: Vocabulary, n_vocab: int) -> llguidance.LLTokenizer:
    per_size = _LL_TOKENIZERS.setdefault(tokenizer, {})
    if n_vocab not in per_size:
        wrapper = llguidance.TokenizerWrapper(_TokenizerView(tokenizer, n_vocab))
        per_size[n_vocab] = llguidance.LLTokenizer(
            wrapper, n_vocab=n_vocab, eos_token=sorted(tokenizer.stop_ids)
        )
    return per_size[n_vocab]


# Conventional spacing and no free whitespace: small models otherwise fill the slack with newlines (or,
# in a forced tool call, pad it with whitespace until max_tokens runs out). Also read from a schema's
# own "x-guidance" key, which is how tool_grammar.py applies it to the JSON inside its Lark grammars.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# Where closed_objects looks for nested schemas: maps of them, lists of them, and single ones.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_SINGLES = ("items", "additionalProperties", "contains")


def closed_objects(schema: Any) -> Any:
    """`schema` with every object that lists its `properties` and says nothing of others closed
    (`additionalProperties: false`), nested ones too, as vLLM's and llama-server's grammars read a
    schema. JSON Schema allows extra keys by default, and a small model given that freedom adds keys
    until it runs out of tokens. An object that allows others (`additionalProperties`,
    `patternProperties` or `unevaluatedProperties` given) or lists no properties stays open, and so
    do the members of an `allOf`, which each list only part of the object's properties."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in _SCHEMA_SINGLES:
        if isinstance(out.get(key), Mapping):
            out[key] = closed_objects(out[key])
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_closed_inside(sub) for sub in out["allOf"]]
    opened = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if isinstance(out.get("properties"), Mapping) and not any(key in out for key in opened):
        out["additionalProperties"] = False
    return out


def _closed_inside(schema: Any) -> Any:
    """`schema`'s nested objects closed, itself left as it is (an `allOf` member)."""
    if not isinstance(schema, Mapping):
        return schema
    closed = closed_objects(schema)
    if "additionalProperties" not in schema:
        closed.pop("additionalProperties", None)
    return closed


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    """A grammar for JSON text valid against `schema`, its objects closed (`closed_objects`);
    GrammarError when the schema is not one."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(closed_objects(schema)), defaults=JSON_LAYOUT
        )
    except ValueError as error:
        raise GrammarError(str(error)) from None
    return _checked(grammar)


def lark_grammar(source: str) -> str:
    return _checked(llguidance.LLMatcher.grammar_from_lark(source))


def gbnf_grammar(source: str) -> str:
    """A llama.cpp GBNF grammar (llama-server's `grammar` field), translated to Lark by llguidance."""
    try:
        lark = gbnf_to_lark(source)
    except Exception as error:  # the translator raises bare Exceptions for syntax errors
        raise GrammarError(f"not a GBNF grammar: {error}") from None
    return lark_grammar(lark)


def _checked(grammar: str) -> str:
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(problem)
    return grammar


class GrammarMatcher:
    """One generation's position in a grammar: the allowed-token mask now, and the tokens consumed."""

    def __init__(self, grammar: str, tokenizer: Vocabulary, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.vocab_size = tokenizer.vocab_size
        self._matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer, n_vocab), grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        # A grammar that no text can begin (each way to start needs itself: `root ::= root "a"`, the
        # schema {"$ref": "#"}) fails at its first mask, and the answer would end at once, empty.
        self._matcher.compute_logit_bias()
        if self._matcher.is_error():
            raise GrammarError("no text matches it: every way to begin it needs itself, without end")

    def allowed(self) -> torch.Tensor:
        """A bool [n_vocab] tensor, True for the tokens that may come next (the stop tokens once the
        grammar is complete)."""
        bias = self._matcher.compute_logit_bias()
        return torch.frombuffer(bytearray(bias), dtype=torch.uint8)[: self.n_vocab].bool()

    def accepts(self, token_id: int) -> bool:
        """Whether the grammar allows `token_id` next (without consuming it)."""
        return self._matcher.validate_tokens([token_id]) == 1

    def consume(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar did not allow it."""
        return self._matcher.consume_token(token_id)

    def rollback(self, n: int) -> None:
        self._matcher.rollback(n)

    @property
    def failed(self) -> bool:
        return self._matcher.is_error()
